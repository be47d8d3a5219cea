"""`lazyserve up`'s flags: each one has help text, and the host, key and port flags exist."""

from __future__ import annotations

import argparse

from services.cli import build_parser


def _up() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["up"]


def test_every_up_flag_has_help():
    undocumented = [a.option_strings for a in _up()._actions if a.option_strings and not a.help]
    assert undocumented == []


def test_host_key_and_ports_are_flags():
    flags = {flag for action in _up()._actions for flag in action.option_strings}
    assert {"--host", "--api-key", "--port", "--decode-port", "--prefill-port"} <= flags


def test_prefill_niceness_reaches_the_prefill_settings(monkeypatch):
    """`up --prefill-niceness` becomes `prefill-worker --niceness`, which becomes the setting; the
    environment sets it too, and a value the OS has no meaning for is refused."""
    import pytest
    from pydantic import ValidationError

    from services.cli import PREFILL_OPTIONS
    from services.options import build
    from services.prefill.settings import PrefillSettings

    assert build_parser().parse_args(["up", "--prefill-niceness", "10"]).prefill_niceness == 10
    args = build_parser().parse_args(["prefill-worker", "--niceness", "7"])
    assert build(PrefillSettings, args, PREFILL_OPTIONS).niceness == 7
    assert PrefillSettings().niceness == 0
    monkeypatch.setenv("LAZYSERVE_PREFILL_NICENESS", "12")
    assert PrefillSettings().niceness == 12
    with pytest.raises(ValidationError, match="niceness"):
        PrefillSettings(niceness=20)


def test_batch_invariance_is_off_unless_turned_on(monkeypatch):
    """`--batch-invariant` (or LAZYSERVE_BATCH_INVARIANT=true) reaches each worker's engine
    settings, as `--no-batch-invariant` does; without either it is off."""
    from services.cli import DECODE_OPTIONS
    from services.decode.settings import DecodeSettings
    from services.options import build

    assert build_parser().parse_args(["up", "--no-batch-invariant"]).batch_invariant is False
    assert build_parser().parse_args(["up"]).batch_invariant is None  # unset: the settings decide
    for command in ("decode-worker", "prefill-worker", "run-batch -i a -o b"):
        args = build_parser().parse_args([*command.split(), "--no-batch-invariant"])
        assert args.batch_invariant is False
    args = build_parser().parse_args(["decode-worker", "--no-batch-invariant"])
    assert build(DecodeSettings, args, DECODE_OPTIONS).engine.batch_invariant is False
    args = build_parser().parse_args(["decode-worker", "--batch-invariant"])
    assert build(DecodeSettings, args, DECODE_OPTIONS).engine.batch_invariant is True
    assert DecodeSettings().engine.batch_invariant is False
    monkeypatch.setenv("LAZYSERVE_BATCH_INVARIANT", "true")
    assert DecodeSettings().engine.batch_invariant is True
