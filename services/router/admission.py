"""Admission: a burst waits its turn instead of being refused.

Two things must be free before a request runs, each taken in one atomic step (in this process, or
in Redis with several gateways, workers.acquire):
- a share of its caller's bound (`max_streams_per_key` requests in progress on all gateways);
- room on one decode worker for each prompt's choices (`SEQUENCES`: the sequences the gateways
  have placed there, against the `max_sequences` the worker reports).
What cannot be taken now waits in one bounded queue per gateway (`AdmissionQueue`): fair between
callers (each caller's next request takes its turn after every other waiting caller's), first
come first served within one. A waiter leaves when it gets what it waited for, when its client
goes away (nothing was computed, nothing is held) or when its deadline passes (`QueueTimeout`).
Refusals are kept for what waiting cannot fix: a full queue (429 with Retry-After) and a request
larger than any worker (400, checked before it queues).

Redis is only ever called from a thread (`off_loop`), so a slow Redis never stalls the event
loop and with it every other stream of this gateway.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from services.router.metrics import GatewayMetrics
from services.router.workers import STREAMS, Workers
from shared.api.serving import RequestError

log = logging.getLogger(__name__)


async def off_loop(fn: Callable, *args):
    """Run a blocking call (Redis, tokenizing) in a worker thread and wait for it."""
    return await asyncio.to_thread(fn, *args)


# Give-backs run here, not awaited: they must happen even while the task that owed them is being
# cancelled, or from a finalizer outside the event loop.
_GIVE_BACKS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="give-back")


def in_background(fn: Callable, *args) -> Future:
    """Run a blocking call in a thread without waiting for it. Failures are logged, never raised:
    the returned future always ends with None."""

    def run():
        try:
            fn(*args)
        except Exception as error:
            log.warning("%s failed: %s", getattr(fn, "__name__", fn), error)

    return _GIVE_BACKS.submit(run)


class Full(Exception):
    """What a try found taken. `scope` says who else it stops: "caller" (the caller's own bound:
    other callers' waiters may pass) or "workers" (no worker has room: everyone behind waits too,
    so a large request is not passed over for ever by small ones)."""

    def __init__(self, scope: Literal["caller", "workers"], message: str):
        super().__init__(message)
        self.scope = scope


class QueueTimeout(Exception):
    """The deadline passed while the request waited in the queue (504)."""


class ClientGone(Exception):
    """The client went away while its request waited (499); nothing was computed."""


@dataclass(order=True)
class _Waiter:
    turn: int  # fair order: see AdmissionQueue._turn_of
    arrival: int
    caller: str = field(compare=False)
    take: Callable[[], Awaitable[Any]] = field(compare=False)
    undo: Callable[[Any], None] = field(compare=False)  # gives back what a take got, off the loop
    future: asyncio.Future = field(compare=False)
    reason: str = field(default="", compare=False)  # what it last found full
    started: float = field(default=0.0, compare=False)  # time.monotonic() when it arrived


class AdmissionQueue:
    """Waiters in fair order, served by one task whenever something may have come free.

    `take` tries the waiter's acquisition and raises Full when it cannot have it yet. The serving
    task runs when a waiter arrives, when something is given back on this gateway (`wake`), and
    every `poll_s` while anyone waits: another gateway's give-back shows only in Redis.
    """

    def __init__(self, metrics: GatewayMetrics, max_queued: int, poll_s: float = 0.2):
        self.metrics, self.max_queued, self.poll_s = metrics, max_queued, poll_s
        self._heap: list[_Waiter] = []
        self._arrivals = itertools.count()
        self._clock = 0  # the turn last served
        self._last_turn: dict[str, int] = {}  # each caller's latest turn given out
        self._wake: asyncio.Event | None = None
        self._server: asyncio.Task | None = None

    @property
    def depth(self) -> int:
        return sum(not waiter.future.done() for waiter in self._heap)

    def oldest_wait_s(self, now: float | None = None) -> float:
        starts = [waiter.started for waiter in self._heap if not waiter.future.done()]
        return (now or time.monotonic()) - min(starts) if starts else 0.0

    def check_room(self) -> None:
        """429 when the queue is full: called for a new request, before any of its work."""
        if self.depth >= self.max_queued:
            self.metrics.rejections.labels("queue_full").inc()
            raise RequestError(
                429, f"{self.max_queued} requests are waiting for a worker already; retry later", code="queue_full"
            )

    def wake(self) -> None:
        """Something was given back: serve the queue now rather than at the next poll."""
        if self._wake is not None:
            self._wake.set()

    async def take(self, caller: str, take: Callable[[], Awaitable[Any]], undo: Callable[[Any], None], deadline: float):
        """What `take` returns, once it can be had: at once when nobody waits and it is free,
        else in the caller's turn. Raises QueueTimeout when `deadline` (time.monotonic()) passes;
        cancelling the awaiting task leaves the queue with nothing held."""
        start = time.monotonic()
        if not self._heap:
            try:
                result = await take()
            except Full as full:
                reason = str(full)
            else:
                self.metrics.queue_wait.observe(0.0)
                return result
        else:
            reason = "others are waiting"
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(self._turn_of(caller), next(self._arrivals), caller, take, undo, future, reason, start)
        heapq.heappush(self._heap, waiter)
        self._changed()
        got = False
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0.0)):
                result = await asyncio.shield(waiter.future)
            got = True
        except TimeoutError:
            waited = time.monotonic() - start
            self.metrics.rejections.labels("deadline").inc()
            raise QueueTimeout(
                f"the request waited {waited:.1f} s in the queue and its deadline passed ({waiter.reason})"
            ) from None
        finally:
            if not got:
                if waiter.future.done() and not waiter.future.cancelled() and waiter.future.exception() is None:
                    in_background(undo, waiter.future.result())  # granted while it was leaving
                waiter.future.cancel()
            self._remove(waiter)
        self.metrics.queue_wait.observe(time.monotonic() - start)
        return result

    # ------------------------------------------------------------------ internals
    def _turn_of(self, caller: str) -> int:
        """Round robin between callers: a caller's next waiter comes one turn after its previous
        one, and never before the turn being served (a caller that waited for nothing earns no
        credit). Ties go in arrival order."""
        turn = max(self._clock, self._last_turn.get(caller, 0)) + 1
        self._last_turn[caller] = turn
        return turn

    def _remove(self, waiter: _Waiter) -> None:
        if waiter in self._heap:
            self._heap.remove(waiter)
            heapq.heapify(self._heap)
        if not self._heap:  # forget callers' turns: nobody waits, nobody is owed a place
            self._last_turn.clear()
        self._changed()

    def _changed(self) -> None:
        self.metrics.queue_depth.set(self.depth)
        if self._heap:
            self._ensure_server()
            self.wake()

    def _ensure_server(self) -> None:
        if self._server is None or self._server.done():
            self._wake = asyncio.Event()
            self._server = asyncio.get_running_loop().create_task(self._serve_forever())

    async def _serve_forever(self) -> None:
        while self._heap:
            try:
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self._serve()
            except Exception:  # a bug here must not leave every waiter waiting for its deadline
                log.exception("serving the admission queue failed")

    async def _serve(self) -> None:
        """Try waiters in turn order; stop at the first that finds no worker with room."""
        callers_full: set[str] = set()
        for waiter in sorted(self._heap):
            if waiter.future.done() or waiter.caller in callers_full:
                continue
            try:
                result = await waiter.take()
            except Full as full:
                waiter.reason = str(full)
                if full.scope == "workers":
                    return
                callers_full.add(waiter.caller)
                continue
            except Exception as error:  # Redis down, no worker at all: the waiter reports it
                if not waiter.future.done():
                    waiter.future.set_exception(error)
                continue
            if waiter.future.done():  # it left while its take ran
                in_background(waiter.undo, result)
                continue
            waiter.future.set_result(result)
            self._clock = max(self._clock, waiter.turn)


class Slot:
    """One admitted request's share of its caller's bound. Only the first give-back counts."""

    def __init__(self, admission: Admission, caller: str):
        self._admission, self.caller = admission, caller
        self._held = True

    async def give_back(self) -> None:
        """Give the slot back and wait until every gateway sees it free. Awaited before a
        response's last byte: a client that sends its next request once a response has ended
        must find its own finished request no longer counted against it."""
        if self._held:
            self._held = False
            # Shielded: a cancelled request still gives its slot back, only without waiting.
            await asyncio.shield(asyncio.wrap_future(self._admission._give_back(self.caller)))

    def release(self) -> None:
        """Give the slot back without waiting: for paths that cannot await (a cancelled task, a
        finalizer)."""
        if self._held:
            self._held = False
            self._admission._give_back(self.caller)


class Admission:
    """Each caller's bound on requests in progress; past it, a request waits in the queue."""

    def __init__(self, workers: Workers, metrics: GatewayMetrics, queue: AdmissionQueue, max_streams_per_caller: int):
        self.workers, self.metrics, self.queue = workers, metrics, queue
        self.max_streams_per_caller = max_streams_per_caller
        self.in_flight = 0  # requests admitted on this gateway and not yet ended

    async def admit(self, caller: str, deadline: float) -> Slot:
        """A slot for `caller`, once its bound allows (QueueTimeout if not by `deadline`)."""

        async def take() -> bool:
            if not await off_loop(self.workers.acquire, STREAMS, caller, self.max_streams_per_caller):
                raise Full(
                    "caller",
                    f"this key (or, with API keys off, this client address) has {self.max_streams_per_caller} "
                    "requests in progress on all gateways",
                )
            return True

        await self.queue.take(caller, take, lambda _: self.workers.release(STREAMS, caller), deadline)
        self._count(+1)
        return Slot(self, caller)

    def _give_back(self, caller: str) -> Future:
        self._count(-1)
        self.queue.wake()
        # This replica's share (and the count in it) would expire with the replica only; a failed
        # release costs the caller one slot until then. Logged by in_background, never raised.
        return in_background(self.workers.release, STREAMS, caller)

    def _count(self, change: int) -> None:
        self.in_flight += change
        self.metrics.in_flight.set(self.in_flight)
