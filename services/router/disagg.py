"""Calling the disaggregated pair: prefill on a prefill worker, KV to a decode worker, tokens back.

The router's building block (the gateway, next, adds routing, retries and streaming to clients);
tests and `lazyserve bench disagg` use it directly. Speaks only the proto contract.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from proto.lazyserve.v1 import lazyserve_pb2_grpc as pb_grpc
from shared.contract import PruneConfig, SamplingParams, Stats
from shared.contract.wire import pruning_to_pb, sampling_to_pb, stats_from_pb
from shared.net.transport import NO_AUTH, InternalAuth


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stats: Stats = field(default_factory=Stats)
    ttft_s: float = 0.0  # request sent -> first token known to the caller
    total_s: float = 0.0
    prefill: pb.PrefillReply | None = None  # None when the decode worker prefilled itself


class DecodeClient:
    def __init__(self, address: str, auth: InternalAuth = NO_AUTH):
        self.address = address
        self.channel = auth.channel(address)
        self.stub = pb_grpc.DecodeServiceStub(self.channel)
        self.metadata = auth.metadata()

    def generate(self, request: pb.GenerateRequest, timeout: float | None = None) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def status(self, timeout: float = 5.0) -> pb.WorkerStatus:
        return self.stub.Status(pb.StatusRequest(), timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


class PrefillClient:
    def __init__(self, address: str, auth: InternalAuth = NO_AUTH):
        self.address = address
        self.channel = auth.channel(address)
        self.stub = pb_grpc.PrefillServiceStub(self.channel)
        self.metadata = auth.metadata()

    def prefill(self, request: pb.PrefillRequest, timeout: float | None = None) -> pb.PrefillReply:
        return self.stub.Prefill(request, timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def run_disaggregated(
    prefill: PrefillClient,
    decode: DecodeClient,
    ids: list[int],
    config: PruneConfig,
    params: SamplingParams,
    timeout: float | None = 300.0,
) -> Result:
    """Prefill on `prefill`, KV to `decode`, then generate there; tokens include the first."""
    transfer_id = uuid.uuid4().hex
    start = time.perf_counter()
    reply = prefill.prefill(
        pb.PrefillRequest(
            transfer_id=transfer_id,
            decode_address=decode.address,
            prompt_ids=ids,
            pruning=pruning_to_pb(config),
            sampling=sampling_to_pb(params),
        ),
        timeout=timeout,
    )
    result = Result(ttft_s=time.perf_counter() - start, prefill=reply)
    # The first token may be a stop token; Generate then ends at once with "stop".
    if reply.first_token not in params.stop_token_ids:
        result.tokens.append(reply.first_token)
    _collect(decode.generate(pb.GenerateRequest(request_id=transfer_id, transfer_id=transfer_id), timeout), result)
    result.total_s = time.perf_counter() - start
    return result


def run_local(
    decode: DecodeClient, ids: list[int], config: PruneConfig, params: SamplingParams, timeout: float | None = 300.0
) -> Result:
    """A prompt prefilled by the decode worker itself: no transfer."""
    start = time.perf_counter()
    result = Result()
    request = pb.GenerateRequest(
        request_id=uuid.uuid4().hex,
        prompt=pb.LocalPrompt(prompt_ids=ids, pruning=pruning_to_pb(config), sampling=sampling_to_pb(params)),
    )
    _collect(decode.generate(request, timeout), result, start)
    result.total_s = time.perf_counter() - start
    return result


def _collect(responses: Iterator[pb.GenerateResponse], result: Result, start: float | None = None) -> None:
    for response in responses:
        if response.token_ids and start is not None and not result.ttft_s:
            result.ttft_s = time.perf_counter() - start
        result.tokens.extend(response.token_ids)
        if response.finish_reason:
            result.finish_reason = response.finish_reason
            result.stats = stats_from_pb(response.stats)
