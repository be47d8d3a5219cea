"""The decode engine thread's turn-taking, with generators standing in for sequences (no model)."""

from __future__ import annotations

import itertools
import time

from services.decode.scheduler import DONE, TOKEN, Scheduler, Sequence
from shared.engine import Generation


def _sequence(name: str, tokens) -> Sequence:
    return Sequence(name, (token for token in tokens), Generation())  # a generator, as the engine gives


def _drain(sequence: Sequence, timeout: float = 5.0) -> list:
    items, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        kind, value = sequence.outbox.get(timeout=timeout)
        items.append((kind, value))
        if kind != TOKEN:
            return items
    raise AssertionError("the sequence never finished")


def test_a_reader_that_falls_behind_pauses_only_its_own_sequence():
    scheduler = Scheduler(max_sequences=4, max_unsent=8)
    try:
        endless = _sequence("slow-reader", itertools.count())
        scheduler.submit(endless)
        time.sleep(0.2)
        assert endless.outbox.qsize() == 8  # bounded: not one token more than the cap
        quick = _sequence("quick", range(20))
        scheduler.submit(quick)
        items = _drain(quick)
        assert [v for k, v in items if k == TOKEN] == list(range(20)) and items[-1][0] == DONE
        assert endless.outbox.qsize() == 8
        for _ in range(5):
            endless.outbox.get_nowait()  # the reader catches up a little: its sequence moves again
        time.sleep(0.1)
        assert endless.outbox.qsize() == 8
        endless.cancelled.set()
        assert scheduler.num_active == 1 and _wait(lambda: scheduler.num_active == 0)
    finally:
        scheduler.close()


def test_turns_interleave_and_a_failure_stays_with_its_sequence():
    scheduler = Scheduler(max_sequences=4)
    try:
        def broken():
            yield 1
            raise RuntimeError("boom")

        bad, good = _sequence("bad", broken()), _sequence("good", range(5))
        scheduler.submit(bad)
        scheduler.submit(good)
        assert _drain(bad)[-1][0] == "failed"
        assert [v for k, v in _drain(good) if k == TOKEN] == list(range(5))
    finally:
        scheduler.close()


def _wait(predicate, timeout: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False
