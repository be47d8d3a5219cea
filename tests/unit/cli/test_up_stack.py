"""`lazyserve up`'s wait for its children (services.up.Stack): a child that never says READY
fails the start within the timeout even while it prints nothing, one that exits fails it at
once, and a READY line after the first is announced as a restart. Real child processes, each
a small script in place of `lazyserve COMMAND`."""

from __future__ import annotations

import sys
import time

import pytest

from services.up import Stack


def _stack(script: str) -> Stack:
    stack = Stack({})
    stack.program = [sys.executable, "-c", script]  # the child runs: python -c SCRIPT COMMAND
    return stack


def test_a_silent_child_fails_the_start_when_its_time_is_up():
    stack = _stack("import time; time.sleep(60)")
    try:
        child = stack.start("prefill", "prefill-worker", {})
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="prefill did not become ready in 1 s"):
            stack.wait_ready(child, "prefill", 1, timeout=1.0)
        assert time.monotonic() - started < 5
    finally:
        stack.stop(timeout=5)


def test_a_child_that_exits_fails_the_start_at_once_with_its_code():
    stack = _stack("import sys; print('starting', flush=True); sys.exit(3)")
    try:
        child = stack.start("decode-0", "decode-worker", {})
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"decode-0 exited \(3\) before it was ready"):
            stack.wait_ready(child, "decode", 1, timeout=60)
        assert time.monotonic() - started < 10
    finally:
        stack.stop(timeout=5)


def test_the_ready_addresses_and_a_later_ready_line_announces_a_restart(capsys):
    script = (
        "import sys, time\n"
        "print('some other line', flush=True)\n"
        "print('READY prefill 127.0.0.1:1', flush=True)\n"
        "print('READY prefill 127.0.0.1:2', flush=True)\n"
        "time.sleep(0.5)\n"
        "print('READY prefill 127.0.0.1:3', flush=True)\n"
        "time.sleep(60)\n"
    )
    stack = _stack(script)
    try:
        child = stack.start("prefill", "prefill-worker", {})
        assert stack.wait_ready(child, "prefill", 2, timeout=60) == ["127.0.0.1:1", "127.0.0.1:2"]
        deadline = time.monotonic() + 20
        while "RESTARTED prefill" not in capsys.readouterr().out and time.monotonic() < deadline:
            time.sleep(0.05)
        assert time.monotonic() < deadline
    finally:
        stack.stop(timeout=5)
