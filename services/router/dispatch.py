"""One request through the workers: route, prefill (or not), generate, retry before the first token.

Async (grpc.aio) so the gateway's event loop carries many streams. Yields Tokens as they arrive
and one Finished. A failure before any token was yielded is retried once on other workers; after
that it is raised for the gateway to report. Closing the iterator (a client that went away, a
stop string) cancels the downstream calls, and the decode worker frees the sequence.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from proto.lazyserve.v1 import lazyserve_pb2_grpc as pb_grpc
from services.router.admission import in_background, off_loop
from services.router.metrics import GatewayMetrics
from services.router.policy import Decision, NoWorkerError
from services.router.tracing import annotate_decision
from services.router.workers import DECODE_TOKENS, PREFILL_COST, Workers
from shared.api.serving import Prepared
from shared.contract import Stats
from shared.contract.wire import pruning_to_pb, sampling_to_pb, stats_from_pb
from shared.models.text import TextModel
from shared.net.telemetry import trace_metadata, tracer
from shared.net.transport import NO_AUTH, InternalAuth

log = logging.getLogger(__name__)

# Codes that say the request itself is wrong: retrying elsewhere would fail the same way.
NOT_RETRIED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


@dataclass
class Tokens:
    ids: list[int]


@dataclass
class Finished:
    reason: str
    stats: Stats


class WorkerFailed(Exception):
    """A call to `worker` failed with `error` (which worker decides what a retry avoids)."""

    def __init__(self, worker, error: grpc.aio.AioRpcError):
        super().__init__(error.details())
        self.worker, self.error = worker, error


class UpstreamError(Exception):
    """Workers failed the request (503 before the first token; an error event after)."""


class DeadlineError(Exception):
    """The request deadline passed (504)."""


class Dispatcher:
    def __init__(
        self,
        workers: Workers,
        policy,
        text: TextModel,
        metrics: GatewayMetrics,
        retries: int,
        auth: InternalAuth = NO_AUTH,
    ):
        self.workers, self.policy, self.text, self.metrics, self.retries = workers, policy, text, metrics, retries
        self.auth = auth
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self.auth.aio_channel(address)
        return self._channels[address]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def choose(self, prepared: Prepared, exclude: set[str], parent: otel_context.Context | None = None) -> Decision:
        fraction = prepared.pruning.computed_fraction(self.text.spec.num_layers)
        with tracer.start_as_current_span("route", context=parent) as span:
            decision = self.policy.choose(
                self.workers, self.text.name, len(prepared.ids), fraction, prepared.sampling.max_new_tokens, exclude
            )
            annotate_decision(span, decision, self.policy.name)
        self.metrics.routing.labels(decision.kind, self.policy.name).inc()
        log.debug(
            "route %s: %s (prefill=%s decode=%s, predicted cost %.0f)",
            decision.kind,
            decision.reason,
            decision.prefill and decision.prefill.address,
            decision.decode.address,
            decision.prefill_cost,
        )
        return decision

    async def run(
        self, prepared: Prepared, request_id: str, deadline: float, parent: otel_context.Context | None = None
    ) -> AsyncIterator[Tokens | Finished]:
        exclude: set[str] = set()
        attempt = 0
        while True:
            try:
                # The worker list may come from Redis: a blocking call, kept off the event loop.
                decision = await off_loop(self.choose, prepared, exclude, parent)
            except NoWorkerError:
                if attempt == 0:
                    raise
                raise UpstreamError("the request failed and no other worker is live to retry it") from None
            yield decision  # for the gateway's trace and response headers; not a token
            emitted = False
            await off_loop(self._add_load, decision, +1)  # Redis: in a thread, never on the loop
            try:
                # aclosing: when the consumer leaves early, the attempt's calls are cancelled now,
                # not when the garbage collector finalizes the generator.
                async with aclosing(self._attempt(decision, prepared, request_id, deadline, parent)) as events:
                    async for event in events:
                        emitted = emitted or isinstance(event, Tokens)
                        yield event
                return
            except WorkerFailed as failure:
                error = failure.error
                if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= deadline:
                    raise DeadlineError("the request did not finish before its deadline") from None
                message = f"worker {failure.worker.address} failed: {error.code().name}: {error.details()}"
                if emitted or attempt >= self.retries or error.code() in NOT_RETRIED:
                    raise UpstreamError(message) from None
                log.warning("request %s: %s; retrying on another worker", request_id, message)
                self.metrics.retries.inc()
                exclude.add(failure.worker.worker_id)
                attempt += 1
            finally:
                in_background(self._add_load, decision, -1)  # also while this task is being cancelled

    def _add_load(self, decision: Decision, sign: int) -> None:
        try:
            self.workers.add_load(DECODE_TOKENS, decision.decode.worker_id, sign * decision.decode_tokens)
            if decision.prefill is not None:
                self.workers.add_load(PREFILL_COST, decision.prefill.worker_id, sign * decision.prefill_cost)
        except Exception as error:  # a load counter must not fail a request (Redis blip): logged
            log.warning("load counter update failed: %s", error)

    async def _attempt(self, decision: Decision, prepared: Prepared, request_id: str, deadline: float, parent=None):
        pruning, sampling = pruning_to_pb(prepared.pruning), sampling_to_pb(prepared.sampling)
        decode = pb_grpc.DecodeServiceStub(self._channel(decision.decode.address))
        if decision.prefill is None:
            request = pb.GenerateRequest(
                request_id=request_id,
                prompt=pb.LocalPrompt(prompt_ids=prepared.ids, pruning=pruning, sampling=sampling),
            )
        else:
            transfer_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
            prefill = pb_grpc.PrefillServiceStub(self._channel(decision.prefill.address))
            span = tracer.start_span("prefill", context=parent, kind=SpanKind.CLIENT)
            span.set_attribute("lazyserve.transfer_id", transfer_id)
            span.set_attribute("server.address", decision.prefill.address)
            try:
                reply = await prefill.Prefill(
                    pb.PrefillRequest(
                        transfer_id=transfer_id,
                        decode_address=decision.decode.address,
                        prompt_ids=prepared.ids,
                        pruning=pruning,
                        sampling=sampling,
                    ),
                    timeout=max(deadline - time.monotonic(), 0.001),
                    metadata=trace_metadata(span) + self.auth.metadata(),
                )
                span.set_attribute("lazyserve.kv_bytes_sent", reply.kv_bytes_sent)
                span.set_attribute("lazyserve.aux_bytes_sent", reply.aux_bytes_sent)
                span.set_attribute("lazyserve.stream_bytes", reply.bytes_sent)
            except grpc.aio.AioRpcError as error:
                span.set_status(Status(StatusCode.ERROR, error.details() or error.code().name))
                # The prefill worker names a failed transfer in its message; blame the right side.
                to_decode = "KV transfer to decode worker" in (error.details() or "")
                raise WorkerFailed(decision.decode if to_decode else decision.prefill, error) from None
            finally:
                span.end()
            self.metrics.kv_bytes.inc(reply.bytes_sent)
            if reply.first_token not in prepared.sampling.stop_token_ids:
                yield Tokens([reply.first_token])
            request = pb.GenerateRequest(request_id=request_id, transfer_id=transfer_id)
        span = tracer.start_span("decode", context=parent, kind=SpanKind.CLIENT)
        span.set_attribute("server.address", decision.decode.address)
        call = decode.Generate(
            request,
            timeout=max(deadline - time.monotonic(), 0.001),
            metadata=trace_metadata(span) + self.auth.metadata(),
        )
        try:
            async for response in call:
                if response.token_ids:
                    yield Tokens(list(response.token_ids))
                if response.finish_reason:
                    yield Finished(response.finish_reason, stats_from_pb(response.stats))
                    return
            raise UpstreamError(f"decode worker {decision.decode.address} ended the stream without finishing")
        except grpc.aio.AioRpcError as error:
            span.set_status(Status(StatusCode.ERROR, error.details() or error.code().name))
            raise WorkerFailed(decision.decode, error) from None
        finally:
            call.cancel()  # no-op once finished; frees the sequence when the consumer left early
            span.end()
