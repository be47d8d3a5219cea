"""One request through the workers: place, prefill (or not), generate, retry before the first
token, migrate after it.

Each attempt is client.generate_on, the one client of the worker services. Before each, the
request is placed: routed (the policy) to a decode worker with room for its choices, whose
sequences it then holds (`SEQUENCES`) until the attempt ends; while no worker has room it waits in
the gateway's admission queue. A worker that is full after all (RESOURCE_EXHAUSTED: its other
clients, or a give-back still on its way) puts the request back in the queue; that is not a
failure.

Async (grpc.aio) so the gateway's event loop carries many streams. Yields the Decision, Tokens as
they arrive and one Finished per choice. A failure before any token was yielded is retried once on
other workers. After it, each unfinished choice migrates (services.router.migration): a
continuation with its tokens so far, its own seed and the same limits is placed through the
queue on a live worker, which replays those tokens and goes on, up to `migration_limit` times;
past that, or for an error of the request itself, it is raised for the gateway to report. A
worker that failed is left out of placement until its health check answers (services.router.down),
so a continuation waits for a restarting worker when no other is live. Closing the iterator (a
client that went away, a stop string) cancels the downstream calls, and the decode worker frees
the sequences.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from opentelemetry import context as otel_context

from services.router.admission import AdmissionQueue, Full, in_background, off_loop
from services.router.client import Channels, Finished, Prefilled, Tokens, UpstreamError, WorkerFailed, generate_on
from services.router.down import DownWorkers
from services.router.drains import Drains
from services.router.merge import merged
from services.router.metrics import GatewayMetrics
from services.router.migration import MIGRATED, Broken, Kept, Migrations
from services.router.policy import Decision, NoWorkerError
from services.router.prefixes import PrefixIndex, prompt_keys
from services.router.tracing import annotate_decision
from services.router.workers import DECODE_TOKENS, PREFILL_COST, PREFILL_QUEUED, SEQUENCES, Workers
from shared.api.serving import Prepared, RequestError
from shared.contract.prefix import BLOCK_TOKENS, held_layers
from shared.models.text import TextModel
from shared.net.telemetry import tracer
from shared.net.transport import NO_AUTH, InternalAuth

log = logging.getLogger(__name__)

# Codes that say the request itself is wrong: retrying elsewhere would fail the same way.
NOT_RETRIED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# A worker with unknown capacity (a static address that has not answered Status yet) decides for
# itself: placements there are counted but not bounded, and its refusal requeues the request.
UNBOUNDED = 1 << 30
# After a worker refused for want of room, the request waits this long (doubling) before its turn
# comes again, so a worker that is fuller than the gateways count is not asked in a tight loop.
FULL_BACKOFF_S = (0.05, 1.0)
# A continuation with no live decode worker to go to (the only one is restarting) looks again this often.
NO_WORKER_WAIT_S = 0.5


class DeadlineError(Exception):
    """The request deadline passed (504)."""


@dataclass
class _Tries:
    """What one request's attempts have met: workers to avoid, retries and refusals so far, and
    the last failure's message (for the error if no other worker is left)."""

    max_retries: int
    metrics: GatewayMetrics
    exclude: set[str] = field(default_factory=set)
    retries: int = 0
    refusals: int = 0
    last_failure: str | None = None

    async def after(self, failure: WorkerFailed, emitted: bool, request_id: str, deadline: float) -> None:
        """What a failed attempt leads to: returns when the request goes on (after a pause when the
        worker was full, elsewhere when it failed), raises when it ends."""
        error = failure.error
        if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= deadline:
            raise DeadlineError("the request did not finish before its deadline") from None
        message = f"worker {failure.worker.address} failed: {error.code().name}: {error.details()}"
        if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not emitted:
            # Full, not failed: back to the queue after a pause, on any worker.
            log.info("request %s: %s; back in the queue", request_id, message)
            self.metrics.requeued.inc()
            pause = min(FULL_BACKOFF_S[0] * 2**self.refusals, FULL_BACKOFF_S[1])
            self.refusals += 1
            await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            return
        if emitted and error.code() in MIGRATED:
            raise Broken(failure) from None
        if emitted or self.retries >= self.max_retries or error.code() in NOT_RETRIED:
            raise UpstreamError(message) from None
        log.warning("request %s: %s; retrying on another worker", request_id, message)
        self.metrics.retries.inc()
        self.exclude.add(failure.worker.worker_id)
        self.last_failure = message
        self.retries += 1


class Dispatcher:
    def __init__(
        self,
        workers: Workers,
        policy,
        text: TextModel,
        metrics: GatewayMetrics,
        retries: int,
        auth: InternalAuth = NO_AUTH,
        attempt=generate_on,
        prefixes: PrefixIndex | None = None,
        queue: AdmissionQueue | None = None,
        migration_limit: int = 3,
        migration_max_tokens: int = 4096,
        migration_wait_s: float = 60.0,
    ):
        self.workers, self.policy, self.text, self.metrics, self.retries = workers, policy, text, metrics, retries
        self.migrations = Migrations(metrics, migration_limit, migration_max_tokens)
        self.migration_wait_s = migration_wait_s  # how long a continuation waits for a live worker
        self.queue = queue or AdmissionQueue(metrics, max_queued=1024)  # the gateway's, shared with its Admission
        self.channels = Channels(auth)
        self.down = DownWorkers(auth)  # workers a call found gone, until their health check answers
        self.attempt = attempt  # client.generate_on; the retry tests give a scripted one
        self.prefixes = prefixes  # which worker holds which prompt start; None: no prefix caching
        # Each worker's prefill rate as it last reported it (with a prefill's reply or first token),
        # and how fast its queue drains as this gateway sees it: the route takes the lesser.
        self.rates: dict[str, float] = {}
        self.drains = Drains()

    async def close(self) -> None:
        await self.channels.close()

    def keys(self, prepared: Prepared, ids: list[int] | None = None) -> list[bytes]:
        spec = self.text.spec
        return prompt_keys(ids or prepared.ids, self.text.name, prepared.pruning, spec.num_layers, prepared.cache_salt)

    def choose(
        self,
        prepared: Prepared,
        exclude: set[str],
        parent: otel_context.Context | None = None,
        keys: list[bytes] | None = None,
    ) -> Decision:
        """keys: the prompt's block keys (`keys`), when the gateway routes by cache."""
        fraction = prepared.pruning.computed_fraction(self.text.spec.num_layers, len(prepared.ids))
        with tracer.start_as_current_span("route", context=parent) as span:
            matched = None
            if self.prefixes is not None:
                try:
                    blocks = self.prefixes.matches(keys if keys is not None else self.keys(prepared))
                except Exception as error:  # an index that cannot answer (Redis blip) routes by load
                    log.warning("prefix index lookup failed: %s", error)
                    blocks = {}
                matched = {worker: count * BLOCK_TOKENS for worker, count in blocks.items()}
                span.set_attribute("lazyserve.prefix_matched_tokens", max(matched.values(), default=0))
            spec = self.text.spec
            decision = self.policy.choose(
                self.workers,
                self.text.name,
                len(prepared.ids),
                fraction,
                prepared.sampling.max_new_tokens,
                exclude=exclude,
                matched=matched,
                shared=held_layers(prepared.pruning, spec.num_layers) / spec.num_layers,
                rates=self.drains.rates(dict(self.rates)),
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

    def check_fits(self, all_prepared: list[Prepared]) -> None:
        """A 400 that names the numbers for a prompt whose choices no live decode worker could ever
        hold at once (each prompt's choices run together on one worker), before any work."""
        capacities = [self.workers.capacity(w) for w in self._decoders(set())]
        if not capacities or None in capacities:  # a worker with unknown capacity decides for itself
            return
        largest = max(capacities)
        for prepared in all_prepared:
            if prepared.sampling.n > largest:
                raise RequestError(
                    400,
                    f"n={prepared.sampling.n} needs {prepared.sampling.n} sequences on one decode worker at once; "
                    f"the largest live decode worker generates at most {largest}",
                    "n",
                    "too_many_choices",
                )

    def _decoders(self, exclude: set[str]) -> list:
        name = self.text.name
        return [w for w in self.workers.list() if w.role == "decode" and w.model == name and w.worker_id not in exclude]

    def place(
        self, prepared: Prepared, exclude: set[str], parent: otel_context.Context | None, keys: list[bytes]
    ) -> Decision:
        """Route to a decode worker with room for the prompt's choices and take that room; Full when
        none has it. Blocking (Redis): run off the event loop."""
        seats = prepared.sampling.n
        exclude = exclude | self.down.excluded()
        decoders = self._decoders(exclude)
        held = self.workers.loads(SEQUENCES)
        capacity = {w.worker_id: self.workers.capacity(w) for w in decoders}
        full = {
            w.worker_id
            for w in decoders
            if capacity[w.worker_id] is not None and held.get(w.worker_id, 0) + seats > capacity[w.worker_id]
        }
        if decoders and len(full) == len(decoders):
            room = ", ".join(
                f"{w.address} holds {held.get(w.worker_id, 0):.0f} of {capacity[w.worker_id]}" for w in decoders
            )
            raise Full("workers", f"it needs {seats} sequences on one decode worker; {room}")
        decision = self.choose(prepared, exclude | full, parent, keys)
        worker = decision.decode
        limit = capacity.get(worker.worker_id) or UNBOUNDED
        if not self.workers.acquire(SEQUENCES, worker.worker_id, limit, seats):
            raise Full("workers", f"another gateway took the room on {worker.address} first")
        return decision

    def _unplace(self, decision: Decision, seats: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Give a placement's sequences back (blocking: in a thread), then serve the queue."""
        try:
            self.workers.release(SEQUENCES, decision.decode.worker_id, seats)
        finally:
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self.queue.wake)

    async def run(
        self,
        prepared: Prepared,
        request_id: str,
        deadline: float,
        parent: otel_context.Context | None = None,
        caller: str = "",
    ) -> AsyncIterator[Decision | Tokens | Finished]:
        """caller: whose turn in the admission queue this request waits for."""
        kept = Kept(prepared.sampling.n, self.migrations.max_tokens)
        try:
            async with aclosing(self._attempts(prepared, request_id, deadline, parent, caller)) as events:
                async for event in events:
                    kept.note(event)
                    yield event
            return
        except Broken as broken:
            failure = broken

        # Each unfinished choice goes on alone, on whichever live worker has room for one.
        def attempts(choice: Prepared, own_id: str, tokens: list[int]):
            return self._attempts(choice, own_id, deadline, parent, caller, generated=tokens)

        continuations = [
            self.migrations.choice(attempts, prepared, index, kept, failure, request_id, parent)
            for index in kept.unfinished()
        ]
        async with aclosing(merged(continuations)) as events:
            async for event in events:
                yield event

    async def _attempts(
        self,
        prepared: Prepared,
        request_id: str,
        deadline: float,
        parent: otel_context.Context | None,
        caller: str,
        generated: list[int] | None = None,
    ) -> AsyncIterator[Decision | Tokens | Finished]:
        """Attempts at one request (a continuation: with its choice's `generated` tokens) until one
        finishes; retried before its first token, Broken after it."""
        tries, seats, loop = _Tries(self.retries, self.metrics), prepared.sampling.n, asyncio.get_running_loop()
        # Hashed once, off the event loop: every attempt's routing and the index record use them.
        keys = await off_loop(self.keys, prepared) if self.prefixes is not None else []
        patience = time.monotonic() + self.migration_wait_s  # a continuation's wait for a live worker
        while True:
            try:
                decision = await self.queue.take(
                    caller,
                    lambda: off_loop(self.place, prepared, tries.exclude, parent, keys),
                    lambda placed: self._unplace(placed, seats),
                    deadline,
                )
            except NoWorkerError:
                # A continuation, or a request whose worker failed before its first token, waits
                # for a worker to come back (the only one restarting) when migration is on; the
                # down list, probed, says when (tries' own exclusions would outlast it).
                placed_again = generated or (tries.last_failure is not None and self.migrations.limit > 0)
                if placed_again and time.monotonic() + NO_WORKER_WAIT_S < min(deadline, patience):
                    tries.exclude.clear()
                    await asyncio.sleep(NO_WORKER_WAIT_S)
                    continue
                if generated:
                    raise NoWorkerError(f"no live decode worker within {self.migration_wait_s:g} s") from None
                if tries.last_failure is None:
                    raise
                raise UpstreamError(f"{tries.last_failure}; no other worker is live to retry it on") from None
            added = emitted = False  # emitted: a token has gone out, so no retry
            queued = False  # its prefill counted in the prefilling worker's queue
            prefilling = decision.prefill or decision.decode
            try:
                yield decision  # for the gateway's trace and response headers; not a token
                drain = self.drains.placed(prefilling.worker_id, decision.queued_ahead, decision.prefill_cost)
                added = queued = True  # before the call: a -1 that lands first still sums to nothing
                placed = time.monotonic()
                await off_loop(self._add_load, decision, +1)  # Redis: in a thread, never on the loop
                attempt = self._attempt(decision, prepared, request_id, deadline, parent, keys, generated)
                async with aclosing(attempt) as events:
                    async for event in events:
                        if queued and isinstance(event, Tokens):  # prefilled: out of the queue
                            queued = False
                            self.drains.prefilled(prefilling.worker_id, drain)
                            in_background(self._queue_load, decision, -1)
                            waited = time.monotonic() - placed
                            self.metrics.prefill_wait.labels(decision.kind, prefilling.address).observe(waited)
                        emitted = emitted or isinstance(event, Tokens)
                        yield event
                return
            except WorkerFailed as failure:
                if failure.error.code() == grpc.StatusCode.UNAVAILABLE:
                    self.down.mark(failure.worker, failure.error.details() or "UNAVAILABLE")
                await tries.after(failure, emitted, request_id, deadline)
            finally:
                # Also while this task is being cancelled: in threads, never awaited.
                if added:
                    in_background(self._add_load, decision, -1)
                if queued:
                    self.drains.prefilled(prefilling.worker_id, drain, observe=False)
                    in_background(self._queue_load, decision, -1)
                in_background(self._unplace, decision, seats, loop)

    async def _attempt(self, decision: Decision, prepared: Prepared, request_id, deadline, parent, keys, generated):
        """One attempt on the placed workers: its Tokens and Finished (the prefill's figures noted)."""
        events = self.attempt(
            self.channels,
            decision.decode,
            decision.prefill,
            prepared.ids,
            prepared.pruning,
            prepared.sampling,
            request_id,
            deadline,
            parent,
            cache_salt=prepared.cache_salt,
            token_depths=prepared.token_depths,
            generated=generated,
        )
        # aclosing: when the consumer leaves early, the attempt's calls are cancelled now, not
        # when the garbage collector finalizes the generator.
        async with aclosing(events):
            prefilled = False
            async for event in events:
                if isinstance(event, Prefilled):
                    self._rated(decision.prefill, event.reply.prefill_rate)
                    self.metrics.kv_bytes.inc(event.reply.bytes_sent)
                    self._prefill_cache_figures(decision, event.reply)
                    continue
                if isinstance(event, Tokens) and event.index == 0 and event.stats is not None and not prefilled:
                    if decision.prefill is None:
                        self._rated(decision.decode, event.prefill_rate)
                    self._prefilled(decision, keys, event.stats)
                prefilled = prefilled or isinstance(event, Tokens)
                yield event

    def _prefilled(self, decision: Decision, keys: list[bytes], stats) -> None:
        """The prompt is prefilled: count what the cache gave, and note who holds the prompt now."""
        prefiller = decision.prefill or decision.decode
        self.metrics.prefix_queried.labels(prefiller.address).inc(stats.prompt_tokens)
        self.metrics.prefix_hit.labels(prefiller.address).inc(stats.cached_tokens)
        if self.prefixes is None:
            return
        # The decode worker caches a transferred prompt when it claims it, right after this.
        holders = [decision.decode] if decision.prefill is None else [decision.prefill, decision.decode]
        in_background(self._record, keys, holders)

    def _record(self, keys: list[bytes], holders) -> None:
        try:
            for worker in holders:
                self.prefixes.record(keys, worker.worker_id)
        except Exception as error:  # the index is a hint: a failed record costs a later hit, nothing more
            log.warning("prefix index record failed: %s", error)

    def _prefill_cache_figures(self, decision: Decision, reply) -> None:
        if decision.prefill is not None:
            address = decision.prefill.address
            self.metrics.prefix_bytes.labels(address).set(reply.prefix_bytes_held)
            self.metrics.prefix_evictions.labels(address).set(reply.prefix_evictions)

    def _add_load(self, decision: Decision, sign: int) -> None:
        try:
            self.workers.add_load(DECODE_TOKENS, decision.decode.worker_id, sign * decision.decode_tokens)
            if decision.prefill is not None:
                self.workers.add_load(PREFILL_COST, decision.prefill.worker_id, sign * decision.prefill_cost)
            if sign > 0:  # taken out of the queue by _queue_load, at its first token or its end
                self._queue_load(decision, +1)
        except Exception as error:  # a load counter must not fail a request (Redis blip): logged
            log.warning("load counter update failed: %s", error)

    def _queue_load(self, decision: Decision, sign: int) -> None:
        """The prompt's predicted prefill cost in (or out of) the prefilling worker's queue."""
        worker = decision.prefill or decision.decode
        self.workers.add_load(PREFILL_QUEUED, worker.worker_id, sign * decision.prefill_cost)
        self.metrics.prefill_queued.labels(worker.address).inc(sign * decision.prefill_cost)

    def _rated(self, worker, rate: float) -> None:
        if worker is not None and rate > 0:
            self.rates[worker.worker_id] = rate
