"""The route under load (services.router.policy, issue 48): the side whose predicted first token is
soonest, from the gateways' queues and the workers' rates; the length threshold on an idle
system; and the dispatcher's queue accounting (a prompt leaves its worker's queue at its first
token, or when its attempt ends) with scripted attempts in place of the worker calls."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.router.client import Finished, Tokens
from services.router.dispatch import Dispatcher
from services.router.drains import Drains
from services.router.metrics import GatewayMetrics
from services.router.policy import LengthAwarePolicy
from services.router.workers import PREFILL_QUEUED, StaticWorkers
from shared.api.serving import Prepared
from shared.contract import OFF, ModelSpec, SamplingParams, Stats
from shared.models.text import TextModel
from shared.net.registry import WorkerInfo

MODEL = "m"


def _workers(decode: int = 1, prefill: int = 1) -> StaticWorkers:
    infos = [WorkerInfo(worker_id=f"d{i}", role="decode", address=f"d{i}:1", model=MODEL) for i in range(decode)]
    infos += [WorkerInfo(worker_id=f"p{i}", role="prefill", address=f"p{i}:1", model=MODEL) for i in range(prefill)]
    return StaticWorkers(infos)


def test_an_idle_system_routes_by_length_as_before():
    workers, policy = _workers(), LengthAwarePolicy(local_threshold=1000)
    short = policy.choose(workers, MODEL, 400, 1.0, 16, rates={"d0": 100.0, "p0": 5000.0})
    assert short.kind == "local" and short.reason.startswith("short prompt") and short.predicted_wait_s is None
    long = policy.choose(workers, MODEL, 4000, 1.0, 16)
    assert long.kind == "disaggregated" and long.reason.startswith("long prompt")


def test_a_backed_up_decode_worker_sends_short_prompts_to_the_idle_prefill_worker():
    workers, policy = _workers(), LengthAwarePolicy(local_threshold=1000)
    workers.add_load(PREFILL_QUEUED, "d0", 2000)  # five 400-token prompts waiting in its rounds
    decision = policy.choose(workers, MODEL, 400, 1.0, 16, rates={"d0": 800.0, "p0": 800.0})
    assert (decision.kind, decision.prefill.worker_id, decision.decode.worker_id) == ("disaggregated", "p0", "d0")
    # (0 + 400 + 40 transfer) / 800 on the prefill worker, against (2000 + 400) / 800 here.
    assert decision.predicted_wait_s == pytest.approx(0.55)
    assert "shortest predicted wait" in decision.reason and "p0:1" in decision.reason


def test_busy_prefill_workers_or_a_tiny_uncached_part_keep_the_prompt_local():
    workers, policy = _workers(), LengthAwarePolicy(local_threshold=1000)
    workers.add_load(PREFILL_QUEUED, "d0", 800)
    workers.add_load(PREFILL_QUEUED, "p0", 9000)
    # (9000 + 3000 + 300 transfer) / 1500 there, against (800 + 3000) / 500 here.
    long = policy.choose(workers, MODEL, 3000, 1.0, 16, rates={"d0": 500.0, "p0": 1500.0})
    assert long.kind == "local" and long.predicted_wait_s == pytest.approx((800 + 3000) / 500)
    # The prefill worker is idle but the decode worker holds all but 16 of the prompt's tokens.
    workers.add_load(PREFILL_QUEUED, "p0", -9000)
    held = policy.choose(workers, MODEL, 3000, 1.0, 16, matched={"d0": 2984}, shared=1.0, rates={"d0": 500.0})
    assert held.kind == "local" and held.prefill_cost == pytest.approx(16)


def test_a_rate_not_reported_yet_counts_as_the_slowest_known():
    workers, policy = _workers(), LengthAwarePolicy(local_threshold=1000)
    workers.add_load(PREFILL_QUEUED, "d0", 400)
    # d0 reported 100 tokens/s; p0 has not reported: taken at 100 too, so the queue decides.
    decision = policy.choose(workers, MODEL, 400, 1.0, 16, rates={"d0": 100.0})
    assert decision.kind == "disaggregated" and decision.predicted_wait_s == pytest.approx(4.4)
    # Nothing reported anywhere: queues in prompt tokens against each other.
    assert policy.choose(workers, MODEL, 400, 1.0, 16).kind == "disaggregated"


def test_several_decode_workers_the_shortest_queue_prefills_the_prompt():
    workers, policy = _workers(decode=2, prefill=0), LengthAwarePolicy(local_threshold=1000)
    workers.add_load(PREFILL_QUEUED, "d0", 1200)
    decision = policy.choose(workers, MODEL, 400, 1.0, 16, rates={"d0": 400.0, "d1": 400.0})
    assert (decision.kind, decision.decode.worker_id) == ("local", "d1")
    assert "among decode workers" in decision.reason


class Attempt:
    """A scripted generate_on: before its first token, what the gateway counts in each queue."""

    def __init__(self, workers: StaticWorkers, rate: float):
        self.workers, self.rate, self.queued_before = workers, rate, None

    async def __call__(self, channels, decode, prefill, *_, **__):
        self.queued_before = self.workers.loads(PREFILL_QUEUED)
        yield Tokens([7], Stats(prompt_tokens=3), None, 0, self.rate)
        self.queued_after_first = self.workers.loads(PREFILL_QUEUED)
        yield Tokens([8])
        yield Finished("length", Stats(completion_tokens=2))


def _dispatch(workers: StaticWorkers, attempt, tokens: int = 3):
    text = TextModel(MODEL, None, ModelSpec("llama", 2, 8, 2, 2, 4, 100, 64), ())
    dispatcher = Dispatcher(workers, LengthAwarePolicy(1000), text, GatewayMetrics(), 1, attempt=attempt)
    prepared = Prepared(list(range(1, tokens + 1)), SamplingParams(max_new_tokens=4), OFF, "off", [])

    async def collect():
        events = [event async for event in dispatcher.run(prepared, "r1", time.monotonic() + 30)]
        await asyncio.sleep(0.2)  # the give-backs run in threads
        return events

    return dispatcher, asyncio.run(collect())


def test_a_prompt_is_in_its_workers_queue_until_its_first_token_and_the_rate_is_kept():
    workers = _workers(prefill=0)
    attempt = Attempt(workers, rate=1234.0)
    dispatcher, events = _dispatch(workers, attempt)
    assert attempt.queued_before == {"d0": 3.0}  # the prompt's predicted cost: 3 tokens, pruning off
    assert [e.ids for e in events if isinstance(e, Tokens)] == [[7], [8]]
    assert dispatcher.placement.rates == {"d0": 1234.0}
    assert not any(workers.loads(PREFILL_QUEUED).values())  # out at the first token, nothing left after


def test_an_attempt_that_ends_before_its_first_token_leaves_the_queue_too():
    workers = _workers(prefill=0)

    async def fails_at_once(channels, decode, *_, **__):
        raise asyncio.CancelledError  # the client went away while the prompt waited
        yield  # pragma: no cover -- an async generator

    with pytest.raises(asyncio.CancelledError):
        _dispatch(workers, fails_at_once)
    time.sleep(0.2)
    assert not any(workers.loads(PREFILL_QUEUED).values())


def test_a_queue_that_does_not_move_bounds_its_workers_rate_whatever_it_last_reported(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("services.router.drains.time.monotonic", lambda: clock[0])
    drains = Drains()
    done = drains.placed("p0", ahead=0.0, own=400.0)
    clock[0] += 0.5
    drains.prefilled("p0", done)  # 400 units in 0.5 s
    assert drains.rates({"p0": 5000.0}) == {"p0": 800.0}
    stuck = drains.placed("p0", ahead=0.0, own=400.0)
    clock[0] += 4.0  # no first token for 4 s: the queue drains at 100 a second at most
    assert drains.rates({"p0": 5000.0}) == {"p0": 100.0}
    drains.prefilled("p0", stuck, observe=False)  # it left without a token: no drain observed
    assert drains.rates({"p0": 5000.0, "d0": 300.0}) == {"p0": 800.0, "d0": 300.0}
    assert drains.rates({}) == {"p0": 800.0}


def test_a_prefill_worker_on_the_decode_workers_host_is_not_counted_as_capacity_beside_it():
    infos = [
        WorkerInfo(worker_id="d0", role="decode", address="127.0.0.1:50061", model=MODEL),
        WorkerInfo(worker_id="p0", role="prefill", address="localhost:50071", model=MODEL),
    ]
    workers = StaticWorkers(infos)
    workers.add_load(PREFILL_QUEUED, "d0", 5000)
    rates = {"d0": 800.0, "p0": 800.0}
    # It would take the cores the decode steps run on: the length rule stands (a short prompt here).
    same_host = LengthAwarePolicy(1000).choose(workers, MODEL, 400, 1.0, 16, rates=rates)
    assert same_host.kind == "local" and same_host.reason.startswith("short prompt")
    everywhere = LengthAwarePolicy(1000, by_wait="all").choose(workers, MODEL, 400, 1.0, 16, rates=rates)
    assert everywhere.kind == "disaggregated" and "shortest predicted wait" in everywhere.reason
    off = LengthAwarePolicy(1000, by_wait="off").choose(workers, MODEL, 400, 1.0, 16, rates=rates)
    assert off.kind == "local"
    with pytest.raises(ValueError, match="route_by_wait"):
        LengthAwarePolicy(1000, by_wait="sometimes")
