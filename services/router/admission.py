"""Admission: whether a request may start, and the slot it holds until its response has ended.

Two bounds: requests in progress on this gateway (`max_in_flight`, in memory) and each caller's
requests in progress on every gateway (`max_streams_per_key`, counted in Redis when there is one:
workers.acquire is an atomic check-and-take). A Slot gives both back in one place, once, however
the request ends: finished, failed, or its client gone mid-stream.

Redis is only ever called from a thread (`off_loop`), so a slow Redis never stalls the event
loop and with it every other stream of this gateway.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

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


class Slot:
    """One admitted request's share of both bounds. Only the first give-back counts."""

    def __init__(self, admission: Admission, caller: str):
        self._admission, self.caller = admission, caller
        self._held = True

    async def give_back(self) -> None:
        """Give the slot back and wait until every gateway sees it free. Awaited before a
        response's last byte: a client that sends its next request once a response has ended
        must never find its own finished request still counted against it."""
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
    def __init__(self, workers: Workers, metrics: GatewayMetrics, max_in_flight: int, max_streams_per_caller: int):
        self.workers, self.metrics = workers, metrics
        self.max_in_flight, self.max_streams_per_caller = max_in_flight, max_streams_per_caller
        self.in_flight = 0

    async def admit(self, caller: str) -> Slot:
        """A slot for `caller`, or a 429 RequestError saying which bound is full."""
        if self.in_flight >= self.max_in_flight:
            raise RequestError(429, f"the gateway has {self.max_in_flight} requests in progress; retry later")
        self._count(+1)  # taken before the next await: concurrent requests cannot overshoot the bound
        try:
            acquired = await off_loop(self.workers.acquire, STREAMS, caller, self.max_streams_per_caller)
        except BaseException:
            self._count(-1)
            raise
        if not acquired:
            self._count(-1)
            raise RequestError(
                429,
                f"this key (or, with API keys off, this client address) has {self.max_streams_per_caller} "
                "requests in progress on all gateways; retry later",
            )
        return Slot(self, caller)

    def _give_back(self, caller: str) -> Future:
        self._count(-1)
        # This replica's share (and the count in it) would expire with the replica only; a failed
        # release costs the caller one slot until then. Logged by in_background, never raised.
        return in_background(self.workers.release, STREAMS, caller)

    def _count(self, change: int) -> None:
        self.in_flight += change
        self.metrics.in_flight.set(self.in_flight)
