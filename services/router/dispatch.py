"""One request through the workers: place, prefill (or not), generate, retry before the first
token, migrate after it.

Each attempt is client.generate_on, the one client of the worker services. Before each, the
request is placed (services.router.placement): routed to a decode worker with room for its
choices, whose sequences it then holds (`SEQUENCES`) until the attempt ends; while no worker has
room it waits in the gateway's admission queue. A worker that is full after all
(RESOURCE_EXHAUSTED: its other clients, or a give-back still on its way) puts the request back in
the queue; that is not a failure.

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

from services.router.admission import AdmissionQueue, in_background, off_loop
from services.router.client import Channels, Finished, Prefilled, Tokens, UpstreamError, WorkerFailed, generate_on
from services.router.down import DownWorkers
from services.router.merge import merged
from services.router.metrics import GatewayMetrics
from services.router.migration import MIGRATED, Broken, Kept, Migrations
from services.router.placement import Placement
from services.router.policy import Decision, NoWorkerError
from services.router.prefixes import PrefixIndex
from services.router.workers import DECODE_TOKENS, PREFILL_COST, PREFILL_QUEUED, Workers
from shared.api.serving import Prepared
from shared.models.text import TextModel
from shared.net.transport import NO_AUTH, InternalAuth

log = logging.getLogger(__name__)

# Codes that say the request itself is wrong: retrying elsewhere would fail the same way.
NOT_RETRIED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
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
        self.workers, self.policy, self.metrics, self.retries = workers, policy, metrics, retries
        self.migrations = Migrations(metrics, migration_limit, migration_max_tokens)
        self.migration_wait_s = migration_wait_s  # how long a continuation waits for a live worker
        self.queue = queue or AdmissionQueue(metrics, max_queued=1024)  # the gateway's, shared with its Admission
        self.channels = Channels(auth)
        self.down = DownWorkers(auth)  # workers a call found gone, until their health check answers
        self.attempt = attempt  # client.generate_on; the retry tests give a scripted one
        self.placement = Placement(workers, policy, text, metrics, self.queue, self.down, prefixes)

    async def close(self) -> None:
        await self.channels.close()

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
        placement = self.placement
        keys = await off_loop(placement.keys, prepared) if placement.prefixes is not None else []
        patience = time.monotonic() + self.migration_wait_s  # a continuation's wait for a live worker
        while True:
            try:
                decision = await self.queue.take(
                    caller,
                    lambda: off_loop(placement.place, prepared, tries.exclude, parent, keys),
                    lambda placed: placement.unplace(placed, seats),
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
                drain = placement.drains.placed(prefilling.worker_id, decision.queued_ahead, decision.prefill_cost)
                added = queued = True  # before the call: a -1 that lands first still sums to nothing
                placed = time.monotonic()
                await off_loop(self._add_load, decision, +1)  # Redis: in a thread, never on the loop
                attempt = self._attempt(decision, prepared, request_id, deadline, parent, keys, generated)
                async with aclosing(attempt) as events:
                    async for event in events:
                        if queued and isinstance(event, Tokens):  # prefilled: out of the queue
                            queued = False
                            placement.drains.prefilled(prefilling.worker_id, drain)
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
                    placement.drains.prefilled(prefilling.worker_id, drain, observe=False)
                    in_background(self._queue_load, decision, -1)
                in_background(placement.unplace, decision, seats, loop)

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
                    self.placement.rated(decision.prefill, event.reply.prefill_rate)
                    self.metrics.kv_bytes.inc(event.reply.bytes_sent)
                    self.placement.cache_figures(decision, event.reply)
                    continue
                if isinstance(event, Tokens) and event.index == 0 and event.stats is not None and not prefilled:
                    if decision.prefill is None:
                        self.placement.rated(decision.decode, event.prefill_rate)
                    self.placement.prefilled(decision, keys, event.stats)
                prefilled = prefilled or isinstance(event, Tokens)
                yield event

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
