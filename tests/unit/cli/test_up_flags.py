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
