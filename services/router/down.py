"""Workers a call found gone, left out of placement until their health check says SERVING again.

A static worker list (`lazyserve up`) says nothing of liveness, and a Redis registration outlives
its worker by its TTL: without this, every request placed on a dead or draining worker meanwhile
would pay a failed call and a retry, and a migrating stream could be sent straight back to the
worker that just failed it. A worker is marked down when a call to it fails UNAVAILABLE (killed,
restarting, draining); placement asks `excluded()`, which probes each down worker's
grpc.health.v1 at most once per `probe_every_s` and forgets it once it answers SERVING (a
restarted worker on the same address; a draining one answers NOT_SERVING until it is gone).
Blocking (gRPC): called where placement runs, off the event loop.
"""

from __future__ import annotations

import logging
import threading
import time

from shared.net.registry import WorkerInfo
from shared.net.rpc import check_health
from shared.net.transport import NO_AUTH, InternalAuth

log = logging.getLogger(__name__)


class DownWorkers:
    def __init__(self, auth: InternalAuth = NO_AUTH, probe_every_s: float = 0.5, probe_timeout_s: float = 0.5):
        self.auth, self.probe_every_s, self.probe_timeout_s = auth, probe_every_s, probe_timeout_s
        self._down: dict[str, tuple[WorkerInfo, float]] = {}  # worker id -> (worker, last probe)
        self._lock = threading.Lock()

    def mark(self, worker: WorkerInfo, why: str) -> None:
        with self._lock:
            if worker.worker_id not in self._down:
                log.warning("worker %s is down (%s): not placed on until its health check answers", worker.address, why)
            self._down[worker.worker_id] = (worker, time.monotonic())

    def excluded(self) -> set[str]:
        """The ids of workers still down, after probing those whose turn has come."""
        now = time.monotonic()
        with self._lock:
            due = [worker for worker, probed in self._down.values() if now - probed >= self.probe_every_s]
            for worker in due:  # one prober per worker at a time: the others see it as still down
                self._down[worker.worker_id] = (worker, now)
        for worker in due:
            if check_health(worker.address, self.probe_timeout_s, auth=self.auth):
                with self._lock:
                    self._down.pop(worker.worker_id, None)
                log.info("worker %s answers again", worker.address)
        with self._lock:
            return set(self._down)
