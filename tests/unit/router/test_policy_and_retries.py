"""Routing and retry rules without servers: StaticWorkers, and scripted attempts in place of the
worker calls (client.generate_on) so each failure happens exactly where a rule is about."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.router.client import Finished, Tokens, UpstreamError, WorkerFailed
from services.router.dispatch import DeadlineError, Dispatcher
from services.router.metrics import GatewayMetrics
from services.router.policy import LengthAwarePolicy, NoWorkerError, RoundRobinPolicy
from services.router.workers import DECODE_TOKENS, PREFILL_COST, StaticWorkers
from shared.api.serving import Prepared
from shared.contract import OFF, ModelSpec, SamplingParams, Stats
from shared.models.text import TextModel
from shared.net.registry import WorkerInfo

MODEL = "m"


def _workers(decode: int = 2, prefill: int = 2) -> StaticWorkers:
    infos = [WorkerInfo(worker_id=f"d{i}", role="decode", address=f"d{i}:1", model=MODEL) for i in range(decode)]
    infos += [WorkerInfo(worker_id=f"p{i}", role="prefill", address=f"p{i}:1", model=MODEL) for i in range(prefill)]
    infos.append(WorkerInfo(worker_id="other", role="decode", address="x:1", model="another-model"))
    return StaticWorkers(infos)


def test_short_prompts_stay_local_and_long_ones_go_to_the_least_loaded_pair():
    workers, policy = _workers(), LengthAwarePolicy(local_threshold=1000)
    workers.add_load(DECODE_TOKENS, "d0", 50)
    short = policy.choose(workers, MODEL, 999, 1.0, 16)
    assert (short.kind, short.decode.worker_id) == ("local", "d1")
    workers.add_load(PREFILL_COST, "p0", 5000)
    long = policy.choose(workers, MODEL, 4000, 0.5, 16)
    assert (long.kind, long.prefill.worker_id, long.decode.worker_id, long.prefill_cost) == (
        "disaggregated",
        "p1",
        "d1",
        2000.0,
    )
    assert policy.choose(workers, MODEL, 4000, 0.5, 16, exclude={"p1", "d1"}).prefill.worker_id == "p0"


def test_a_transfer_is_only_planned_between_workers_of_one_dtype():
    """`--dtype auto` differs between hosts with and without bfloat16 instructions; a decode worker
    refuses a transfer in another dtype, so the router never plans one."""
    infos = [
        WorkerInfo(worker_id="d0", role="decode", address="d0:1", model=MODEL, dtype="float32"),
        WorkerInfo(worker_id="p0", role="prefill", address="p0:1", model=MODEL, dtype="bfloat16"),
        WorkerInfo(worker_id="p1", role="prefill", address="p1:1", model=MODEL, dtype="float32"),
    ]
    workers = StaticWorkers(infos)
    workers.add_load(PREFILL_COST, "p1", 10_000)  # the busier one, but the only one that can pair
    decision = LengthAwarePolicy(local_threshold=10).choose(workers, MODEL, 500, 1.0, 4)
    assert (decision.prefill.worker_id, decision.decode.worker_id) == ("p1", "d0")
    alone = LengthAwarePolicy(local_threshold=10).choose(workers, MODEL, 500, 1.0, 4, exclude={"p1"})
    assert alone.prefill is None and alone.reason == "long prompt, but no live prefill worker runs float32"
    round_robin = RoundRobinPolicy()
    assert {round_robin.choose(workers, MODEL, 500, 1.0, 4).prefill.worker_id for _ in range(4)} == {"p1"}
    # Unknown (a static list): anything pairs.
    assert WorkerInfo(role="decode", address="a:1", model=MODEL).can_pair(infos[1])


def test_no_prefill_worker_is_said_and_no_decode_worker_is_refused():
    policy = LengthAwarePolicy(local_threshold=10)
    decision = policy.choose(_workers(prefill=0), MODEL, 500, 1.0, 4)
    assert decision.kind == "local" and "no prefill worker" in decision.reason
    with pytest.raises(NoWorkerError):
        policy.choose(_workers(), MODEL, 5, 1.0, 4, exclude={"d0", "d1"})
    with pytest.raises(NoWorkerError):
        policy.choose(_workers(), "unknown-model", 5, 1.0, 4)


def test_round_robin_takes_turns_whatever_the_load():
    workers, policy = _workers(), RoundRobinPolicy()
    workers.add_load(DECODE_TOKENS, "d0", 1e9)
    picks = [policy.choose(workers, MODEL, 10, 1.0, 4) for _ in range(4)]
    assert [(d.decode.worker_id, d.prefill.worker_id) for d in picks] == [("d0", "p0"), ("d1", "p1")] * 2


# ---------------------------------------------------------------------- retries


def _failure(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=f"scripted {code.name}")


class Script:
    """Attempt n follows plan[n]: tokens to send, then a failure code (blaming the decode worker) or the end."""

    def __init__(self, *plan):
        self.plan, self.calls = list(plan), []

    async def __call__(self, channels, decode, *_, **__):  # client.generate_on's arguments
        tokens, failure = self.plan[len(self.calls)]
        self.calls.append(decode.worker_id)
        for token in tokens:
            yield Tokens([token])
        if failure is not None:
            raise WorkerFailed(decode, _failure(failure))
        yield Finished("length", Stats(completion_tokens=len(tokens)))


def _run(script: Script, retries: int = 1, timeout: float = 30.0, migration_limit: int = 3):
    text = TextModel(MODEL, None, ModelSpec("llama", 2, 8, 2, 2, 4, 100, 64), ())
    policy = LengthAwarePolicy(1000)
    dispatcher = Dispatcher(
        _workers(), policy, text, GatewayMetrics(), retries, attempt=script, migration_limit=migration_limit
    )
    prepared = Prepared([1, 2, 3], SamplingParams(max_new_tokens=4), OFF, "off", [])

    async def collect():
        return [event async for event in dispatcher.run(prepared, "r1", time.monotonic() + timeout)]

    return asyncio.run(collect())


def test_a_failure_before_the_first_token_is_retried_on_another_worker():
    script = Script(([], grpc.StatusCode.UNAVAILABLE), ([7, 8], None))
    events = _run(script)
    assert script.calls == ["d0", "d1"]  # the failed worker is not chosen again
    assert [e.ids for e in events if isinstance(e, Tokens)] == [[7], [8]]
    assert isinstance(events[-1], Finished)


def test_no_retry_after_a_token_was_sent_nor_for_a_bad_request_nor_past_the_budget():
    # After a token, a failed worker's stream migrates (tests/unit/router/test_migration.py), unless off.
    with pytest.raises(UpstreamError, match="UNAVAILABLE"):
        _run(Script(([5], grpc.StatusCode.UNAVAILABLE), ([6], None)), migration_limit=0)
    script = Script(([], grpc.StatusCode.INVALID_ARGUMENT), ([6], None))
    with pytest.raises(UpstreamError, match="INVALID_ARGUMENT"):
        _run(script)
    assert script.calls == ["d0"]
    script = Script(([], grpc.StatusCode.UNAVAILABLE), ([], grpc.StatusCode.UNAVAILABLE), ([6], None))
    with pytest.raises(UpstreamError):
        _run(script, retries=1)
    assert len(script.calls) == 2


def test_a_deadline_is_a_deadline_error_not_a_retry():
    script = Script(([], grpc.StatusCode.DEADLINE_EXCEEDED), ([6], None))
    with pytest.raises(DeadlineError):
        _run(script)
    assert script.calls == ["d0"]
