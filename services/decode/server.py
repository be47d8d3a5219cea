"""The decode worker: a gRPC server that receives KV transfers and generates tokens.

PushKV assembles a transfer (every message validated; a bad stream is refused with
INVALID_ARGUMENT and dropped, and the worker keeps serving). Generate continues a claimed transfer
or prefills a short prompt here, then streams tokens from the engine thread. Transfers and
sequences are freed on completion, on cancellation, and when their lease expires.
"""

from __future__ import annotations

import logging
import queue
import time
import uuid
from collections import deque
from concurrent.futures import Future

import torch
from opentelemetry.trace import SpanKind, Status, StatusCode

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from proto.lazyserve.v1 import lazyserve_pb2_grpc as pb_grpc
from services.decode.budget import PrefillBudget
from services.decode.scheduler import ChoiceCancelled, ChoiceFailed, ChoiceToken, Scheduler, Sequence
from services.decode.settings import DecodeSettings
from services.decode.transfers import TransferTable
from shared.compute import ComputeThread
from shared.contract.wire import logprobs_to_pb, prompt_from_pb
from shared.engine import (
    PrefixReuse,
    PruneConfig,
    Sampled,
    Sampler,
    SamplingParams,
    choice_decodings,
    start_prefill,
)
from shared.engine.grammar import GrammarError
from shared.models.weights import LoadedModel
from shared.net.rpc import (
    DRAINING,
    Cancelled,
    InvalidArgument,
    RunningServer,
    Unavailable,
    make_server,
    start_serving,
)
from shared.net.telemetry import extract_context, tracer
from shared.transfer import FrameError, TransferAssembler, payload_bytes, stats_to_pb, verify_checksum

log = logging.getLogger(__name__)

SERVICE = "lazyserve.v1.DecodeService"


class DecodeServicer(pb_grpc.DecodeServiceServicer):
    def __init__(self, loaded: LoadedModel, settings: DecodeSettings, compute: ComputeThread | None = None):
        self.loaded, self.model = loaded, loaded.engine
        self.transfers = TransferTable(settings.max_transfers, settings.transfer_timeout_s, settings.claim_timeout_s)
        # None: --no-enable-prefix-caching.
        self.prefix = PrefixReuse.configured(loaded.engine, loaded.name, settings.engine)
        self.scheduler = Scheduler(
            self.model,
            settings.max_sequences,
            settings.max_batch_size,
            settings.max_batch_tokens,
            grammars=loaded.grammars,
            prefix=self.prefix,
            compute=compute,
            budget=PrefillBudget(
                settings.max_batch_tokens,
                settings.prefill_growth,
                itl_slo_s=settings.engine.itl_slo_s,
                ttft_slo_s=settings.engine.ttft_slo_s,
            ),
        )
        # For a prompt that names no pruning (the router always names one).
        self.default_pruning = loaded.engine.spec.preset(settings.engine.pruning_preset)
        # OpenMP keeps the count per thread: the engine thread's is the one that computes.
        self.torch_threads = self.scheduler.call(torch.get_num_threads)
        self.draining = False  # set by drain: new transfers and requests are refused

    def drain(self, seconds: float) -> int:
        """Take nothing new, let the running streams go on for up to `seconds`, then end the rest
        with UNAVAILABLE and the DRAINING reason, which the gateway answers by migrating each
        (services.router.dispatch). Returns how many sequences were handed over so."""
        self.draining = True
        deadline = time.monotonic() + seconds
        while self.scheduler.num_active and time.monotonic() < deadline:
            time.sleep(0.05)
        handed = self.scheduler.num_active
        self.scheduler.close(f"{DRAINING}: its grace period of {seconds:g} s ended; the stream goes on elsewhere")
        return handed

    def _check_admitting(self) -> None:
        if self.draining:
            raise Unavailable(f"{DRAINING}: it takes no new request")

    # ------------------------------------------------------------------ PushKV
    def PushKV(self, request_iterator, context):
        with tracer.start_as_current_span("kv_receive", context=extract_context(context), kind=SpanKind.SERVER) as span:
            reply = self._push(request_iterator, context)
            span.set_attribute("lazyserve.transfer_id", reply.transfer_id)
            span.set_attribute("lazyserve.frames", reply.num_frames)
            span.set_attribute("lazyserve.bytes_received", reply.bytes_received)
            return reply

    def _push(self, request_iterator, context):
        spec = self.model.spec
        assembler = TransferAssembler(self.loaded.name, spec, self.model.dtype, self.model.device, spec.max_positions)
        self._check_admitting()
        first = next(request_iterator, None)
        try:
            if first is None or first.WhichOneof("kind") != "header":
                raise FrameError("a transfer must start with its header")
            # Another model, dtype or shape: refused here. The cache it allocates is the engine's work.
            self.scheduler.call(assembler.header, first.header)
        except FrameError:
            self.transfers.count_refused()
            raise
        # From here the table holds the only reference, so an expired lease frees the memory even
        # while this handler waits for a stalled sender's next message.
        transfer = self.transfers.begin(first.header.transfer_id, assembler)
        del assembler
        frames = _FrameJobs(self.scheduler)
        try:
            for message in request_iterator:
                reply = self._receive(transfer, message, frames)
                if reply is not None:
                    return reply
            self.transfers.check_alive(transfer)
            raise FrameError(f"transfer {transfer.transfer_id!r} ended without its end message")
        except BaseException:
            # Refused, expired or cut off: nothing of it stays.
            frames.cancel()
            self.transfers.fail(transfer)
            raise

    def _receive(self, transfer, message: pb.TransferMessage, frames: _FrameJobs) -> pb.PushKVReply | None:
        assembler = transfer.assembler  # taken before the check: the reaper may drop it any time
        self.transfers.check_alive(transfer)
        frames.check()  # a frame refused on the engine thread ends the stream here
        kind = message.WhichOneof("kind")
        if kind == "frame":
            verify_checksum(message.frame)  # here, off the engine thread: it reads every byte
            frames.add(assembler.frame, message.frame, True)
            transfer.bytes_received += sum(payload_bytes(message))
            return None
        if kind == "end":
            frames.wait()
            self.transfers.complete(transfer, self.scheduler.call(assembler.end, message.end))
            return pb.PushKVReply(
                transfer_id=transfer.transfer_id,
                num_frames=assembler.num_frames,
                bytes_received=transfer.bytes_received,
            )
        raise FrameError(f"unexpected {kind or 'empty'} message inside transfer {transfer.transfer_id!r}")

    # ------------------------------------------------------------------ Generate
    def Generate(self, request, context):
        span = tracer.start_span("decode", context=extract_context(context), kind=SpanKind.SERVER)
        span.set_attribute("lazyserve.request_id", request.request_id)
        span.set_attribute("lazyserve.local_prefill", request.WhichOneof("source") == "prompt")
        started: list[Sequence] = []
        try:
            yield from self._generate(request, context, started)
        except Exception as error:
            span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
            raise
        finally:
            if started:
                stats = started[0].generation.stats
                span.set_attribute("gen_ai.usage.input_tokens", stats.prompt_tokens)
                span.set_attribute("gen_ai.usage.output_tokens", stats.completion_tokens)
                span.set_attribute("lazyserve.revived_token_layers", stats.revived_token_layers)
                span.set_attribute("lazyserve.computed_fraction", stats.computed_fraction)
                span.set_attribute("lazyserve.cached_tokens", stats.cached_tokens)
            span.end()

    def _generate(self, request, context, started: list):
        self._check_admitting()
        # The request's setup (a claimed cache's choices, a prefix lookup) is the engine's work.
        sequences = self.scheduler.call(self._start, request)
        started.extend(sequences)
        head = sequences[0]
        context.add_callback(head.cancelled.set)  # runs when the call ends, cancelled or not
        remaining, sent = head.num_choices, set()  # choices not finished; choices that sent a response
        while remaining:
            items = [head.outbox.get()]
            while True:
                try:
                    items.append(head.outbox.get_nowait())
                except queue.Empty:  # send what has been made so far
                    break
            tokens: dict[int, list[Sampled]] = {}
            for item in items:
                index = item.index
                if isinstance(item, ChoiceToken):
                    tokens.setdefault(index, []).append(item.sampled)
                    continue
                if isinstance(item, ChoiceFailed):
                    raise Unavailable(item.message)
                if isinstance(item, ChoiceCancelled):
                    raise Cancelled("generation cancelled")
                response = _response(tokens.pop(index, []), index)
                response.finish_reason = item.reason
                response.stats.CopyFrom(stats_to_pb(head.choices[index].generation.stats))
                sent.add(index)
                remaining -= 1
                yield response
            for index, made in tokens.items():
                response = _response(made, index)
                if index not in sent:  # the prefill's figures, for a caller that stops early (a stop string)
                    response.stats.CopyFrom(stats_to_pb(head.choices[index].generation.stats))
                    response.prefill_rate = self.scheduler.prefill_rate.tokens_per_s
                    sent.add(index)
                yield response

    def _start(self, request: pb.GenerateRequest) -> list[Sequence]:
        sequences = self._sequences(request)
        self.scheduler.submit(*sequences)
        return sequences

    def _sequences(self, request: pb.GenerateRequest) -> list[Sequence]:
        """The request's sequences: one per choice for a transfer; one (whose other choices join
        after its prefill) for a local prompt."""
        request_id = request.request_id or uuid.uuid4().hex
        source = request.WhichOneof("source")
        if source == "transfer_id":
            assembled = self.transfers.claim(request.transfer_id)
            try:
                decodings = choice_decodings(
                    assembled.cache,
                    assembled.config,
                    assembled.params,
                    assembled.prompt_ids,
                    self.loaded.grammars,
                    assembled.prefill_stats,
                )
            except GrammarError as error:
                raise InvalidArgument(f"sampling.grammar: {error}") from None
            decodings[0].depths = request.return_token_depths
            first_tokens = assembled.first_tokens
            if request.generated_ids:  # a continuation: its own tokens so far, not the prefill's first
                replayed = self._replayed(request, assembled.params)
                first_tokens = replayed[:1]
                decodings[0].replay(replayed[1:])  # checked just above
            if self.prefix is not None:  # now, not when it finishes: the next question may come first
                self._remember_transfer(assembled, request.cache_salt)
            return Sequence.resumed(request_id, decodings, first_tokens, assembled.prompt_ids, request.cache_salt)
        if source == "prompt":
            ids, config, params = self._local_request(request.prompt)
            replayed = self._replayed(request, params)
            # A continuation on a worker that is not batch-invariant prefills its answer with the
            # prompt (one pruned prefill, from the prompt's cached layers): its decode steps would
            # not reproduce the first run's bits anyway. Under --batch-invariant each token is
            # replayed as a decode step, so that the continuation is the uninterrupted answer.
            answered = [] if self.model.batch_invariant else replayed
            if answered:
                ids = torch.cat([ids, torch.tensor(answered, dtype=torch.long)])
            if params.grammar is not None:  # checked here: on the engine thread a failure would hit the batch
                try:
                    Sampler(params, grammars=self.loaded.grammars)
                except GrammarError as error:
                    raise InvalidArgument(f"sampling.grammar: {error}") from None
            # Prefilled here, a layer at a time between decode steps, on the engine thread.
            # Room for what is left to generate: the answer so far is in `ids` already.
            reserve = params.max_new_tokens - len(answered)
            run = start_prefill(self.model, ids, config, prefix=self.prefix, salt=request.cache_salt, reserve=reserve)
            sequence = Sequence.local(request_id, run, params, request.cache_salt)
            sequence.depths = request.return_token_depths
            if answered:
                sequence.answered = answered
            else:
                sequence.replayed = replayed
            return [sequence]
        raise InvalidArgument("GenerateRequest needs a transfer_id or a prompt")

    def _replayed(self, request: pb.GenerateRequest, params: SamplingParams) -> list[int]:
        """A continuation's tokens so far, checked before any work (the gateway sends only what
        the failed worker generated; anything else is a caller's error)."""
        tokens = list(request.generated_ids)
        if not tokens:
            return []
        if params.n != 1:
            raise InvalidArgument(f"generated_ids continue one choice; sampling.n is {params.n}")
        if len(tokens) >= params.max_new_tokens:
            raise InvalidArgument(
                f"generated_ids holds {len(tokens)} tokens: nothing is left of max_new_tokens {params.max_new_tokens}"
            )
        if max(tokens) >= self.model.spec.vocab_size:
            raise InvalidArgument(f"generated_ids has a token outside the vocabulary of {self.model.spec.vocab_size}")
        if stops := set(tokens) & set(params.stop_token_ids):
            raise InvalidArgument(f"generated_ids has the stop token {min(stops)}: that choice had finished")
        return tokens

    def _remember_transfer(self, assembled, salt: str) -> None:
        try:
            self.prefix.remember(assembled.cache, assembled.prompt_ids, assembled.config, salt)
        except Exception:  # an optimization: the request goes on without it
            log.exception("caching a transferred prompt failed; the request is not affected")

    def _local_request(self, prompt: pb.LocalPrompt) -> tuple[torch.Tensor, PruneConfig, SamplingParams]:
        pruning = prompt.pruning if prompt.HasField("pruning") else self.default_pruning
        ids, config, params = prompt_from_pb(prompt.prompt_ids, pruning, prompt.sampling, self.model.spec)
        return torch.tensor(ids, dtype=torch.long), config, params

    # ------------------------------------------------------------------ Status
    def Status(self, request, context):
        receiving, ready, transfer_bytes = self.transfers.snapshot()
        counters = self.transfers.counters
        return pb.WorkerStatus(
            model=self.loaded.name,
            transfers_receiving=receiving,
            transfers_ready=ready,
            sequences_active=self.scheduler.num_active,
            max_sequences=self.scheduler.max_sequences,
            bytes_held=transfer_bytes + self.scheduler.bytes_held(),
            transfers_completed=counters.completed,
            transfers_rejected=counters.rejected,
            transfers_expired=counters.expired,
            revived_token_layers=self.scheduler.revived_token_layers,
            dtype=self.model.dtype_name,
            device=str(self.model.device),
            torch_threads=self.torch_threads,
            batch_invariant=self.model.batch_invariant,
            kernels=self.model.kernels,
            prefills_waiting=self.scheduler.prefills_waiting,
            prefill_rows_per_round=self.scheduler.prefill_rows / max(self.scheduler.prefill_rounds, 1),
            prefill_rate=self.scheduler.prefill_rate.tokens_per_s,
            **self._prefix_status(),
        )

    def _prefix_status(self) -> dict:
        if self.prefix is None:
            return {}
        cache = self.prefix.cache
        return {
            "prefix_queried_tokens": self.prefix.queried_tokens,
            "prefix_hit_tokens": self.prefix.hit_tokens,
            "prefix_bytes_held": cache.bytes_held,
            "prefix_evictions": cache.evictions,
            "prefix_budget_bytes": cache.budget_bytes,
        }

    def close(self) -> None:
        self.scheduler.close()
        self.transfers.close()


class _FrameJobs:
    """A transfer's frames on their way into its cache on the engine thread. The handler does not
    wait for each: a frame would then wait for a whole decode round, and a transfer of 30 layers for
    30 of them. Queued frames are assembled together between two rounds, in order; at most
    `MAX_QUEUED` wait, so a fast sender cannot fill memory faster than the engine thread takes it."""

    MAX_QUEUED = 64

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.pending: deque[Future] = deque()

    def add(self, fn, *args) -> None:
        if len(self.pending) >= self.MAX_QUEUED:
            self.pending.popleft().result()
        self.pending.append(self.scheduler.compute.submit(fn, *args))

    def check(self) -> None:
        """Raise the first refused frame's error, once it is known."""
        while self.pending and self.pending[0].done():
            self.pending.popleft().result()

    def wait(self) -> None:
        while self.pending:
            self.pending.popleft().result()

    def cancel(self) -> None:
        for future in self.pending:
            future.cancel()
        self.pending.clear()


def _response(tokens: list[Sampled], index: int) -> pb.GenerateResponse:
    response = pb.GenerateResponse(token_ids=[sampled.token for sampled in tokens], index=index)
    if tokens and tokens[0].logprob is not None:  # the request asked for logprobs
        response.logprobs.extend(logprobs_to_pb(sampled) for sampled in tokens)
    return response


def start_decode_worker(
    settings: DecodeSettings, loaded: LoadedModel, compute: ComputeThread | None = None
) -> RunningServer:
    """compute: the thread that loaded `loaded` (None: the scheduler starts a thread of its own)."""
    servicer = DecodeServicer(loaded, settings, compute)
    auth = settings.internal_auth()
    server, health = make_server(settings.grpc_workers, max_concurrent_rpcs=settings.grpc_workers - 2, auth=auth)
    pb_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    address = start_serving(server, health, settings.host, settings.port, settings.advertise_host, [SERVICE], auth)
    log.info("decode worker serving %s on %s", loaded.name, address)
    return RunningServer(server, servicer, address, health)
