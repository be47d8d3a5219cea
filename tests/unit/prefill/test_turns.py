"""The prefill worker's turns (services.prefill.worker.Turns): granted in arrival order, a waiter
that gives up lets the ones behind it move up, and no more than its capacity hold at once."""

from __future__ import annotations

import threading
import time

from services.prefill.worker import Turns


def test_turns_are_granted_first_come_first_served():
    turns = Turns(1)
    first = turns.take()
    assert turns.wait(first, timeout=1)
    order, tickets = [], [turns.take() for _ in range(6)]

    def waiter(ticket):
        while not turns.wait(ticket, timeout=0.01):
            pass
        order.append(ticket)
        time.sleep(0.01)
        turns.release()

    # Started in reverse: a semaphore would wake them in any order; the tickets keep arrival order.
    threads = [threading.Thread(target=waiter, args=(ticket,)) for ticket in reversed(tickets)]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    turns.release()
    for thread in threads:
        thread.join(timeout=10)
    assert order == tickets


def test_a_waiter_that_gives_up_lets_the_next_one_in_and_capacity_bounds_the_holders():
    turns = Turns(2)
    a, b, c, d = (turns.take() for _ in range(4))
    assert turns.wait(a, timeout=1) and turns.wait(b, timeout=1)
    assert not turns.wait(c, timeout=0.05)  # two hold already
    turns.give_up(c)
    assert not turns.wait(d, timeout=0.05)
    turns.release()
    assert turns.wait(d, timeout=1)  # c gave up: d is next
    assert not turns.wait(turns.take(), timeout=0.05)
