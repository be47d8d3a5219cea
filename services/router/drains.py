"""How fast each worker's prefill queue drains, as this gateway sees it: the rate the route divides
a queue by (services.router.policy).

A worker reports its own rate with each prefill (shared/load.py), but only when one finishes: a
worker that has stopped making progress (a prefill actor at a high nice value on a host whose
decode loop takes every core, a worker stuck behind a huge prompt) reports nothing, and a router
that trusts its last report keeps filling a queue that does not move. So the gateway also
watches its own prompts: each is placed with the queue ahead of it (`ahead`, in the policy's
unit) and its own work; when its first token comes, (ahead + own) / waited is what the queue
drained at, kept as a running average; and while a prompt still waits, (ahead + own) / waited so
far bounds the rate from above, since the queue has not got through that much yet. The rate used
is the least of the report, the average and the bound.
"""

from __future__ import annotations

import itertools
import threading
import time

# Weight of the newest observed drain in the running average.
SMOOTHING = 0.3


class Drains:
    def __init__(self):
        self._observed: dict[str, float] = {}  # worker id -> running average, work units a second
        self._waiting: dict[str, dict[int, tuple[float, float]]] = {}  # worker id -> {key: (placed, ahead + own)}
        self._keys = itertools.count()
        self._lock = threading.Lock()  # placed and prefilled from the event loop, read from threads

    def placed(self, worker_id: str, ahead: float, own: float) -> int:
        """A prompt placed on `worker_id` behind `ahead` units of queued work: a key for `prefilled`."""
        key = next(self._keys)
        with self._lock:
            self._waiting.setdefault(worker_id, {})[key] = (time.monotonic(), ahead + own)
        return key

    def prefilled(self, worker_id: str, key: int, observe: bool = True) -> None:
        """Its first token came (observe: the drain it saw counts), or it left before one."""
        with self._lock:
            placed = self._waiting.get(worker_id, {}).pop(key, None)
            if placed is None or not observe:
                return
            waited = time.monotonic() - placed[0]
            if waited > 0 and placed[1] > 0:
                rate = placed[1] / waited
                mean = self._observed.get(worker_id)
                self._observed[worker_id] = rate if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * rate

    def rates(self, reported: dict[str, float]) -> dict[str, float]:
        """Per worker, the least of its reported rate, the drain observed and the bound from the
        prompts waiting there now; a worker with none of the three is left out (unknown)."""
        now = time.monotonic()
        with self._lock:
            bounds = {
                worker: min((work / (now - placed) for placed, work in waiting.values() if now > placed), default=None)
                for worker, waiting in self._waiting.items()
            }
            observed = dict(self._observed)
        rates = {}
        for worker in set(reported) | set(observed) | set(bounds):
            known = [rate for rate in (reported.get(worker), observed.get(worker), bounds.get(worker)) if rate]
            if known:
                rates[worker] = min(known)
        return rates
