"""Migration at the gateway with scripted attempts: which failures continue a stream, what a
continuation carries (the choice's tokens so far, its own seed, n 1) and where it goes."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.router.client import Finished, Tokens, UpstreamError, WorkerFailed
from services.router.dispatch import Dispatcher
from services.router.metrics import GatewayMetrics
from services.router.policy import LengthAwarePolicy
from shared.api.serving import Prepared
from shared.contract import OFF, ModelSpec, SamplingParams, Stats
from shared.models.text import TextModel
from shared.net.rpc import DRAINING
from tests.unit.router.test_policy_and_retries import MODEL, _workers


class Script:
    """Attempt k follows plan[k]: {choice: tokens} to send (a choice given as ("finished", tokens)
    also ends), then a failure (code, details) blaming the decode worker, or every choice's end.
    Records what each attempt was given."""

    def __init__(self, *plan):
        self.plan, self.calls = list(plan), []

    async def __call__(self, channels, decode, prefill, ids, pruning, sampling, *_, generated=None, **__):
        sent, failure = self.plan[len(self.calls)]
        self.calls.append({"worker": decode.worker_id, "generated": generated, "sampling": sampling})
        for index, tokens in sent.items():
            ended = isinstance(tokens, tuple)
            for token in tokens[1] if ended else tokens:
                yield Tokens([token], index=index)
            if ended:
                yield Finished("length", Stats(), index)
        if failure is not None:
            code, details = failure
            error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
            raise WorkerFailed(decode, error)
        for index in range(sampling.n):
            if not isinstance(sent.get(index), tuple):
                yield Finished("length", Stats(), index)


def _run(script, sampling: SamplingParams, migration_limit=3, max_tokens=4096, parent=None, decoders=2):
    text = TextModel(MODEL, None, ModelSpec("llama", 2, 8, 2, 2, 4, 100, 64), ())
    metrics = GatewayMetrics()
    dispatcher = Dispatcher(
        _workers(decode=decoders),
        LengthAwarePolicy(1000),
        text,
        metrics,
        1,
        attempt=script,
        migration_limit=migration_limit,
        migration_max_tokens=max_tokens,
    )
    dispatcher.down.probe_every_s = 3600.0  # scripted addresses: a down worker stays down
    prepared = Prepared([1, 2, 3], sampling, OFF, "off", [])

    async def collect():
        return [event async for event in dispatcher.run(prepared, "r1", time.monotonic() + 30, parent)]

    return asyncio.run(collect()), metrics


def _tokens(events, index=0) -> list[int]:
    return [token for e in events if isinstance(e, Tokens) and e.index == index for token in e.ids]


KILLED = (grpc.StatusCode.UNAVAILABLE, "Socket closed")


def test_a_stream_whose_worker_dies_goes_on_elsewhere_from_its_last_token():
    script = Script(({0: [5, 6]}, KILLED), ({0: [7, 8]}, None))
    events, metrics = _run(script, SamplingParams(max_new_tokens=4))
    assert _tokens(events) == [5, 6, 7, 8]  # nothing repeated, nothing lost
    assert [e.reason for e in events if isinstance(e, Finished)] == ["length"]
    assert [call["worker"] for call in script.calls] == ["d0", "d1"]  # not back to the dead one
    assert script.calls[1]["generated"] == [5, 6]
    assert script.calls[1]["sampling"].max_new_tokens == 4  # the same limit: the worker counts the replayed
    assert metrics.migrations.labels("failed")._value.get() == 1
    assert metrics.migrated_tokens._value.get() == 2


def test_each_migration_is_an_event_on_the_request_span():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with provider.get_tracer("test").start_as_current_span("request") as span:
        script = Script(({0: [5, 6]}, KILLED), ({0: [7]}, KILLED), ({0: [8]}, None))
        _run(script, SamplingParams(max_new_tokens=4), parent=trace.set_span_in_context(span), decoders=3)
    [request] = exporter.get_finished_spans()
    events = [dict(event.attributes) for event in request.events if event.name == "migration"]
    assert [(e["lazyserve.migration.tokens"], e["lazyserve.migration.count"]) for e in events] == [(2, 1), (3, 2)]
    assert {e["lazyserve.migration.reason"] for e in events} == {"failed"}
    assert [e["lazyserve.migration.from"] for e in events] == ["d0:1", "d1:1"]


def test_a_drained_stream_is_counted_as_drained():
    script = Script(({0: [5]}, (grpc.StatusCode.UNAVAILABLE, f"{DRAINING}: its grace period ended")), ({0: [6]}, None))
    events, metrics = _run(script, SamplingParams(max_new_tokens=2))
    assert _tokens(events) == [5, 6]
    assert metrics.migrations.labels("drained")._value.get() == 1


def test_choices_migrate_alone_with_their_own_seed_and_tokens():
    sampling = SamplingParams(max_new_tokens=3, n=3, temperature=1.0, seed=40)
    # Choice 1 finished before the failure; choices 0 and 2 go on, each in its own continuation
    # (which answers as choice 0: the gateway puts each back at its index).
    script = Script(({0: [1], 1: ("finished", [2, 3, 4]), 2: [5, 6]}, KILLED), ({0: [7, 8]}, None), ({0: [9]}, None))
    events, _ = _run(script, sampling)
    assert sorted(_tokens(events, 0) + _tokens(events, 2)) == [1, 5, 6, 7, 8, 9]
    assert _tokens(events, 1) == [2, 3, 4]
    assert _tokens(events, 0)[0] == 1 and _tokens(events, 2)[:2] == [5, 6]
    assert sorted(map(len, (_tokens(events, 0), _tokens(events, 2)))) == [3, 3]
    continued = {tuple(call["generated"]): call["sampling"] for call in script.calls[1:]}
    assert set(continued) == {(1,), (5, 6)}
    assert continued[(1,)].n == 1 and continued[(1,)].seed == 40
    assert continued[(5, 6)].n == 1 and continued[(5, 6)].seed == 42
    assert sorted(e.index for e in events if isinstance(e, Finished)) == [0, 1, 2]


def test_past_the_limit_or_the_kept_tokens_the_stream_ends_with_the_error():
    script = Script(({0: [5]}, KILLED), ({0: [6]}, KILLED), ({0: [7]}, None))
    with pytest.raises(UpstreamError, match="not migrated again: it migrated 1 times already"):
        _run(script, SamplingParams(max_new_tokens=8), migration_limit=1)
    with pytest.raises(UpstreamError, match="kept too many tokens"):
        _run(Script(({0: [5, 6, 7]}, KILLED)), SamplingParams(max_new_tokens=8), max_tokens=2)
    with pytest.raises(UpstreamError, match="UNAVAILABLE") as off:
        _run(Script(({0: [5]}, KILLED)), SamplingParams(max_new_tokens=8), migration_limit=0)
    assert "migrated" not in str(off.value)


def test_an_error_of_the_request_itself_does_not_migrate():
    script = Script(({0: [5]}, (grpc.StatusCode.INVALID_ARGUMENT, "bad")), ({0: [6]}, None))
    with pytest.raises(UpstreamError, match="INVALID_ARGUMENT"):
        _run(script, SamplingParams(max_new_tokens=8))
    assert len(script.calls) == 1
