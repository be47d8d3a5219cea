"""The prefill worker: a gRPC PrefillService around the engine's lazy prefill.

Each request's KV goes, layer by layer as it is computed, to the decode worker the caller named;
the reply (the first token and the stats) comes once that worker holds the whole transfer. This
module knows nothing of Ray: actor.py hosts it in a Ray actor.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import torch
from opentelemetry.trace import SpanKind

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from proto.lazyserve.v1 import lazyserve_pb2_grpc as pb_grpc
from services.prefill.sender import KVSender, SenderFactory
from services.prefill.settings import PrefillSettings
from shared.compute import ComputeThread
from shared.contract.wire import logprobs_to_pb, prompt_from_pb
from shared.engine import PrefixReuse, Sampler, Stats, run_prefill
from shared.engine.grammar import GrammarError
from shared.load import PrefillRate
from shared.models.weights import LoadedModel
from shared.net.rpc import Cancelled, DeadlineExceeded, InvalidArgument, RunningServer, make_server, start_serving
from shared.net.telemetry import extract_context, tracer
from shared.transfer import end_message, header_message, stats_to_pb

log = logging.getLogger(__name__)

SERVICE = "lazyserve.v1.PrefillService"


@dataclass
class PrefillCounters:
    completed: int = 0
    failed: int = 0  # stopped early: the receiver failed, the caller left, or the deadline passed
    layers_computed: int = 0  # over all requests, including stopped ones


class Turns:
    """At most `capacity` holders at once, granted in arrival order. threading.Semaphore wakes an
    arbitrary waiter, which under a burst gives the prompts queued here their first tokens in
    random order; the router's predicted wait assumes first come, first served."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._tickets = itertools.count()
        self._serving = 0  # the lowest ticket not yet granted or given up
        self._given_up: set[int] = set()
        self._held = 0
        self._changed = threading.Condition()

    def take(self) -> int:
        """A ticket, to wait with: `wait(ticket, ...)` until it is its turn."""
        with self._changed:
            return next(self._tickets)

    def wait(self, ticket: int, timeout: float) -> bool:
        """True once `ticket` holds a turn; False if `timeout` passed first (it keeps its place)."""
        with self._changed:
            granted = self._changed.wait_for(
                lambda: self._held < self.capacity and self._skip_given_up() == ticket, timeout
            )
            if granted:
                self._held += 1
                self._serving += 1
                self._changed.notify_all()
            return granted

    def give_up(self, ticket: int) -> None:
        """A waiter that leaves (cancelled, past its deadline): the tickets behind it move up."""
        with self._changed:
            self._given_up.add(ticket)
            self._changed.notify_all()

    def release(self) -> None:
        with self._changed:
            self._held -= 1
            self._changed.notify_all()

    def _skip_given_up(self) -> int:
        while self._serving in self._given_up:
            self._given_up.remove(self._serving)
            self._serving += 1
        return self._serving


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(
        self,
        loaded: LoadedModel,
        settings: PrefillSettings,
        sender: SenderFactory = KVSender,
        compute: ComputeThread | None = None,
    ):
        self.loaded, self.model, self.settings = loaded, loaded.engine, settings
        # The thread that loaded the model, or one of its own (tests hand it a model loaded elsewhere).
        self._owns_compute = compute is None
        self.compute = compute or ComputeThread("prefill-engine")
        self.sender = sender  # how a transfer reaches its decode worker
        self.auth = settings.internal_auth()  # its channels to decode workers use the same credentials
        self.counters = PrefillCounters()
        # What it prefills, for the next prompt that starts the same (None: --no-enable-prefix-caching).
        self.prefix = PrefixReuse.configured(loaded.engine, loaded.name, settings.engine)
        self._turns = Turns(settings.max_concurrent_prefills)
        # Its recent rate, sent with each reply: the router predicts this actor's wait with it.
        self.rate = PrefillRate(self.model.spec.num_layers)
        # For a request that names no pruning (the router always names one).
        self.default_pruning = self.model.spec.preset(settings.engine.pruning_preset)

    def close(self) -> None:
        if self._owns_compute:
            self.compute.close()

    def Prefill(self, request: pb.PrefillRequest, context):
        spec = self.model.spec
        if not request.transfer_id or not request.decode_address:
            raise InvalidArgument("transfer_id and decode_address are required")
        pruning = request.pruning if request.HasField("pruning") else self.default_pruning
        _, config, params = prompt_from_pb(request.prompt_ids, pruning, request.sampling, spec)
        n = len(request.prompt_ids)
        timeout = context.time_remaining()
        timeout = self.settings.transfer_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with tracer.start_as_current_span("prefill", context=extract_context(context), kind=SpanKind.SERVER) as span:
            span.set_attribute("lazyserve.transfer_id", request.transfer_id)
            span.set_attribute("gen_ai.usage.input_tokens", n)
            span.set_attribute("lazyserve.decode_address", request.decode_address)
            self._wait_turn(context, deadline)
            started = time.perf_counter()
            try:
                reply = self._run(request, context, config, params, deadline)
            finally:
                self._turns.release()
            self.rate.add(reply.stats.prefill_token_layers, time.perf_counter() - started)
            reply.prefill_rate = self.rate.tokens_per_s
            stats = reply.stats
            span.set_attribute("lazyserve.prefill_s", stats.ttft_s)
            span.set_attribute("lazyserve.cached_tokens", stats.cached_tokens)
            span.set_attribute("lazyserve.prefill_token_layers", stats.prefill_token_layers)
            span.set_attribute("lazyserve.computed_fraction", stats.prefill_token_layers / max(1, n * spec.num_layers))
            span.set_attribute("lazyserve.kept_fraction_per_layer", [k / n for k in stats.kept_per_layer])
            span.set_attribute("lazyserve.kv_bytes_sent", reply.kv_bytes_sent)
            span.set_attribute("lazyserve.aux_bytes_sent", reply.aux_bytes_sent)
            return reply

    def _wait_turn(self, context, deadline: float) -> None:
        """Wait for this request's turn (first come, first served), watching its caller and deadline."""
        ticket = self._turns.take()
        while not self._turns.wait(ticket, timeout=0.05):
            if not context.is_active():
                self._turns.give_up(ticket)
                raise Cancelled("the caller went away while waiting for a prefill slot")
            if time.monotonic() > deadline:
                self._turns.give_up(ticket)
                raise DeadlineExceeded("the deadline passed while waiting for a prefill slot")

    def _run(self, request, context, config, params, deadline: float) -> pb.PrefillReply:
        s = self.settings
        ids = torch.tensor(list(request.prompt_ids), dtype=torch.long)
        header = header_message(request.transfer_id, self.loaded.name, self.model.spec, self.model.dtype, len(ids))
        sender = self.sender(
            request.decode_address, header, s.frame_bytes, s.send_queue_layers, deadline - time.monotonic(), self.auth
        )

        def on_layer(frame) -> None:
            if not context.is_active():
                raise Cancelled("the caller went away")
            if time.monotonic() > deadline:
                raise DeadlineExceeded("the deadline passed during prefill")
            sender.put(frame)
            self.counters.layers_computed += 1

        try:
            # On the compute thread; this handler waits, then waits for the decode worker's reply.
            firsts, stats = self.compute.call(self._compute, request, ids, config, params, on_layer)
            waited = time.perf_counter()
            reply = sender.finish(
                lambda num_frames: end_message(
                    request.transfer_id,
                    request.prompt_ids,
                    [first.token for first in firsts],
                    config,
                    params,
                    num_frames,
                    stats,
                )
            )
            waited = time.perf_counter() - waited
        except BaseException:
            sender.abort()
            self.counters.failed += 1
            raise
        self.counters.completed += 1
        log.debug(
            "prefill %s: %d tokens, %d frames, %d bytes",
            request.transfer_id,
            len(ids),
            reply.num_frames,
            sender.bytes_sent,
        )
        return pb.PrefillReply(
            transfer_id=request.transfer_id,
            first_tokens=[first.token for first in firsts],
            stats=stats_to_pb(stats),
            num_frames=sender.num_frames,
            kv_bytes_sent=sender.kv_bytes,
            aux_bytes_sent=sender.aux_bytes,
            bytes_sent=sender.bytes_sent,
            transfer_wait_s=waited,
            first_logprobs=[logprobs_to_pb(first) for first in firsts if first.logprob is not None],
            prefix_bytes_held=0 if self.prefix is None else self.prefix.cache.bytes_held,
            prefix_evictions=0 if self.prefix is None else self.prefix.cache.evictions,
        )

    def _compute(self, request, ids: torch.Tensor, config, params, on_layer) -> tuple[list, Stats]:
        """The engine's part of a request: the prefill (its frames go to `on_layer` as it runs),
        and each choice's first token (Sampled) with the prefill's stats."""
        # Each choice's sampler first: a grammar that does not compile is refused before any work.
        grammars = self.loaded.grammars
        try:
            samplers = [Sampler(c, prompt_ids=request.prompt_ids, grammars=grammars) for c in params.choices()]
        except GrammarError as error:
            raise InvalidArgument(f"sampling.grammar: {error}") from None
        run, stats = run_prefill(
            self.model, ids, config, prefix=self.prefix, salt=request.cache_salt, on_layer=on_layer
        )
        logits = run.logits
        del run  # the decode worker gets its own copy of the cache; this one is not needed past here
        # Each choice's first token from the one prefill, with its own generator.
        return [sampler.choose(logits) for sampler in samplers], stats


def start_prefill_worker(
    settings: PrefillSettings, loaded: LoadedModel, compute: ComputeThread | None = None
) -> RunningServer:
    """compute: the thread that loaded `loaded` (None: a thread of its own runs the engine)."""
    servicer = PrefillServicer(loaded, settings, compute=compute)
    server, health = make_server(settings.grpc_workers, auth=servicer.auth)
    pb_grpc.add_PrefillServiceServicer_to_server(servicer, server)
    address = start_serving(
        server, health, settings.host, settings.port, settings.advertise_host, [SERVICE], servicer.auth
    )
    log.info("prefill worker serving %s on %s", loaded.name, address)
    return RunningServer(server, servicer, address)
