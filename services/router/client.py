"""The one client of the worker services: a request's calls to a prefill and a decode worker.

`generate_on` runs one attempt: with a prefill worker, Prefill (which streams the KV to the decode
worker) then Generate on the transfer; without one, Generate with the prompt, prefilled by the
decode worker. It yields Prefilled (the prefill reply), Tokens as they arrive, and one Finished;
a failed call is a WorkerFailed that names the worker to blame. The dispatcher (routing, retries)
runs it for the gateway; `run_disaggregated` / `run_local` run it to the end for tests and
benchmarks, with the same rules (the first token travels in the prefill reply unless it is a stop
token). Closing the iterator cancels the calls, and the decode worker frees the sequence.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from opentelemetry import context as otel_context
from opentelemetry.trace import SpanKind, Status, StatusCode

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from proto.lazyserve.v1 import lazyserve_pb2_grpc as pb_grpc
from shared.contract import PruneConfig, Sampled, SamplingParams, Stats
from shared.contract.wire import logprobs_from_pb, pruning_to_pb, sampling_to_pb, stats_from_pb
from shared.net.registry import WorkerInfo
from shared.net.rpc import failed_at
from shared.net.telemetry import trace_metadata, tracer
from shared.net.transport import NO_AUTH, InternalAuth


@dataclass
class Prefilled:
    reply: pb.PrefillReply


@dataclass
class Tokens:
    ids: list[int]
    stats: Stats | None = None  # on the decode worker's first response: the prefill's figures
    logprobs: list[Sampled] | None = None  # with sampling.logprobs: one per id
    index: int = 0  # the choice (of sampling.n)
    # With `stats` from a decode worker's local prefill: its recent prefill rate (0: not measured).
    prefill_rate: float = 0.0


@dataclass
class Finished:
    """One choice finished; the attempt ends after every choice's (sampling.n)."""

    reason: str
    stats: Stats
    index: int = 0


class WorkerFailed(Exception):
    """A call to `worker` failed with `error` (which worker decides what a retry avoids)."""

    def __init__(self, worker: WorkerInfo, error: grpc.aio.AioRpcError):
        super().__init__(error.details())
        self.worker, self.error = worker, error


class UpstreamError(Exception):
    """Workers failed the request (503 before the first token; an error event after)."""


class Channels:
    """One channel per worker address, with the stack's internal credentials."""

    def __init__(self, auth: InternalAuth = NO_AUTH):
        self.auth = auth
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = self.auth.aio_channel(address)
        return self._channels[address]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


async def decode_status(channels: Channels, worker: WorkerInfo, timeout: float = 2.0) -> dict:
    """What a decode worker reports of itself (model, dtype, device, threads, batch invariance,
    kernels, load); an error entry if it does not answer in time."""
    stub = pb_grpc.DecodeServiceStub(channels.get(worker.address))
    entry = {"role": worker.role, "address": worker.address, "model": worker.model}
    try:
        status = await stub.Status(pb.StatusRequest(), timeout=timeout, metadata=channels.auth.metadata())
    except grpc.aio.AioRpcError as error:
        return entry | {"error": f"{error.code().name}: {error.details()}"}
    return entry | {
        "dtype": status.dtype,
        "device": status.device,
        "torch_threads": status.torch_threads,
        "batch_invariant": status.batch_invariant,
        "kernels": status.kernels,
        "sequences_active": status.sequences_active,
        "max_sequences": status.max_sequences,
        "bytes_held": status.bytes_held,
        "prefills_waiting": status.prefills_waiting,
        "prefill_rows_per_round": status.prefill_rows_per_round,
        "prefill_rate": status.prefill_rate,
        "prefix_cache": {
            "queried_tokens": status.prefix_queried_tokens,
            "hit_tokens": status.prefix_hit_tokens,
            "bytes_held": status.prefix_bytes_held,
            "budget_bytes": status.prefix_budget_bytes,
            "evictions": status.prefix_evictions,
        },
    }


async def generate_on(
    channels: Channels,
    decode: WorkerInfo,
    prefill: WorkerInfo | None,
    ids: list[int],
    pruning: PruneConfig,
    sampling: SamplingParams,
    request_id: str,
    deadline: float,
    parent: otel_context.Context | None = None,
    cache_salt: str = "",
    token_depths: bool = False,
    generated: list[int] | None = None,
) -> AsyncIterator[Prefilled | Tokens | Finished]:
    """One attempt at a request on these workers (deadline: time.monotonic() based); cache_salt:
    the prefix cache's tenant (the gateway's, from the API key); generated: a migrated choice's
    tokens so far (the worker replays them; a prefill's first token is then not the answer's)."""
    generated = list(generated or ())
    pruning_pb, sampling_pb = pruning_to_pb(pruning), sampling_to_pb(sampling)
    call = _Call(channels, deadline, parent)
    if prefill is None:
        prompt = pb.LocalPrompt(prompt_ids=ids, pruning=pruning_pb, sampling=sampling_pb)
        request = pb.GenerateRequest(
            request_id=request_id,
            prompt=prompt,
            cache_salt=cache_salt,
            return_token_depths=token_depths,
            generated_ids=generated,
        )
    else:
        transfer_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        reply = await call.prefill(
            prefill,
            decode,
            pb.PrefillRequest(
                transfer_id=transfer_id,
                decode_address=decode.address,
                prompt_ids=ids,
                pruning=pruning_pb,
                sampling=sampling_pb,
                cache_salt=cache_salt,
            ),
        )
        yield Prefilled(reply)
        if not generated:
            for event in _first_tokens(reply, sampling):
                yield event
        request = pb.GenerateRequest(
            request_id=request_id,
            transfer_id=transfer_id,
            cache_salt=cache_salt,
            return_token_depths=token_depths,
            generated_ids=generated,
        )
    # aclosing: a consumer that leaves early cancels the Generate call now, not at finalization.
    async with aclosing(call.generate(decode, request, sampling.n)) as events:
        async for event in events:
            yield event


def _first_tokens(reply: pb.PrefillReply, sampling: SamplingParams):
    """The first token of each choice, sampled by the prefill worker. A stop token is not sent:
    Generate then ends that choice at once with "stop"."""
    stats, logprobs = stats_from_pb(reply.stats), [logprobs_from_pb(item) for item in reply.first_logprobs]
    for index, token in enumerate(reply.first_tokens):
        if token not in sampling.stop_token_ids:
            yield Tokens([token], stats, logprobs[index : index + 1] or None, index)


@dataclass
class _Call:
    """What every call of one attempt shares: the channels, the deadline and the trace."""

    channels: Channels
    deadline: float
    parent: otel_context.Context | None

    def _options(self, span) -> dict:
        timeout = max(self.deadline - time.monotonic(), 0.001)
        return {"timeout": timeout, "metadata": trace_metadata(span) + self.channels.auth.metadata()}

    async def prefill(self, prefill: WorkerInfo, decode: WorkerInfo, request: pb.PrefillRequest) -> pb.PrefillReply:
        """Prefill on `prefill`, which streams the KV to `decode`; a failure blames the side that failed."""
        stub = pb_grpc.PrefillServiceStub(self.channels.get(prefill.address))
        span = tracer.start_span("prefill", context=self.parent, kind=SpanKind.CLIENT)
        span.set_attribute("lazyserve.transfer_id", request.transfer_id)
        span.set_attribute("server.address", prefill.address)
        try:
            reply = await stub.Prefill(request, **self._options(span))
            span.set_attribute("lazyserve.kv_bytes_sent", reply.kv_bytes_sent)
            span.set_attribute("lazyserve.aux_bytes_sent", reply.aux_bytes_sent)
            span.set_attribute("lazyserve.stream_bytes", reply.bytes_sent)
            return reply
        except grpc.aio.AioRpcError as error:
            span.set_status(Status(StatusCode.ERROR, error.details() or error.code().name))
            # A prefill worker whose transfer failed names the decode worker (rpc.FAILED_AT).
            raise WorkerFailed(decode if failed_at(error) is not None else prefill, error) from None
        finally:
            span.end()

    async def generate(
        self, decode: WorkerInfo, request: pb.GenerateRequest, choices: int
    ) -> AsyncIterator[Tokens | Finished]:
        """Generate on `decode` until each of the request's `choices` has finished."""
        span = tracer.start_span("decode", context=self.parent, kind=SpanKind.CLIENT)
        span.set_attribute("server.address", decode.address)
        stub = pb_grpc.DecodeServiceStub(self.channels.get(decode.address))
        call = stub.Generate(request, **self._options(span))
        remaining = choices
        try:
            async for response in call:
                logprobs = [logprobs_from_pb(item) for item in response.logprobs] or None
                index = response.index
                if response.finish_reason:
                    if response.token_ids:
                        yield Tokens(list(response.token_ids), None, logprobs, index)
                    yield Finished(response.finish_reason, stats_from_pb(response.stats), index)
                    remaining -= 1
                    if remaining == 0:
                        return
                    continue
                if response.token_ids:
                    stats = stats_from_pb(response.stats) if response.HasField("stats") else None
                    yield Tokens(list(response.token_ids), stats, logprobs, index, response.prefill_rate)
            raise UpstreamError(f"decode worker {decode.address} ended the stream without finishing")
        except grpc.aio.AioRpcError as error:
            span.set_status(Status(StatusCode.ERROR, error.details() or error.code().name))
            raise WorkerFailed(decode, error) from None
        finally:
            call.cancel()  # no-op once finished; frees the sequence when the consumer left early
            span.end()


# ---------------------------------------------------------------------- to the end, for tests and benchmarks
@dataclass
class Result:
    """The first choice's tokens, finish and stats; `choices` has every choice's tokens."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stats: Stats = field(default_factory=Stats)
    ttft_s: float = 0.0  # request sent -> first token known to the caller
    total_s: float = 0.0
    prefill: pb.PrefillReply | None = None  # None when the decode worker prefilled itself
    logprobs: list[Sampled] = field(default_factory=list)  # with sampling.logprobs
    choices: dict[int, list[int]] = field(default_factory=dict)  # every choice's tokens (sampling.n)


class DecodeClient:
    """Blocking stubs of one decode worker, for status and raw calls (tests, benchmarks, tools)."""

    def __init__(self, address: str, auth: InternalAuth = NO_AUTH):
        self.address, self.auth = address, auth
        self.channel = auth.channel(address)
        self.stub = pb_grpc.DecodeServiceStub(self.channel)
        self.metadata = auth.metadata()

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None):
        """The raw Generate stream (a test's view of the protocol)."""
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def status(self, timeout: float = 5.0) -> pb.WorkerStatus:
        return self.stub.Status(pb.StatusRequest(), timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


class PrefillClient:
    """Where one prefill worker is and how to reach it."""

    def __init__(self, address: str, auth: InternalAuth = NO_AUTH):
        self.address, self.auth = address, auth


def _worker(role: str, address: str) -> WorkerInfo:
    return WorkerInfo(worker_id=f"{role}@{address}", role=role, address=address, model="")


def run_disaggregated(
    prefill: PrefillClient,
    decode: DecodeClient,
    ids: list[int],
    config: PruneConfig,
    params: SamplingParams,
    timeout: float = 300.0,
    generated: list[int] | None = None,
) -> Result:
    """Prefill on one worker, KV to the other, generate there, through generate_on: tokens
    include the first (with `generated`, a continuation's: only those after them). A failed call
    raises that call's grpc error."""
    workers = _worker("decode", decode.address), _worker("prefill", prefill.address)
    return asyncio.run(_run(*workers, ids, config, params, decode.auth, timeout, generated))


def run_local(
    decode: DecodeClient, ids: list[int], config: PruneConfig, params: SamplingParams, timeout: float = 300.0
) -> Result:
    """A prompt prefilled by the decode worker itself: no transfer."""
    return asyncio.run(_run(_worker("decode", decode.address), None, ids, config, params, decode.auth, timeout))


async def _run(decode, prefill, ids, config, params, auth, timeout, generated=None) -> Result:
    channels, result, start = Channels(auth), Result(), time.perf_counter()
    try:
        deadline = time.monotonic() + timeout
        events = generate_on(
            channels, decode, prefill, list(ids), config, params, uuid.uuid4().hex, deadline, generated=generated
        )
        async for event in events:
            if isinstance(event, Prefilled):
                result.prefill = event.reply
            elif isinstance(event, Tokens):
                result.ttft_s = result.ttft_s or time.perf_counter() - start
                result.choices.setdefault(event.index, []).extend(event.ids)
                if event.index == 0:
                    result.tokens.extend(event.ids)
                    result.logprobs.extend(event.logprobs or ())
            elif event.index == 0:
                result.finish_reason, result.stats = event.reason, event.stats
    except WorkerFailed as failure:
        raise failure.error from None
    finally:
        await channels.close()
    result.total_s = time.perf_counter() - start
    return result
