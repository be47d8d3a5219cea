"""Redis as a help, not a gate: a gateway that loses Redis keeps serving on what it last knew.

`SharedState` says whether this gateway reaches Redis (degraded while it does not: `/status`,
the `lazyserve_degraded` gauge, one log line per outage). `FallbackWorkers` wraps RedisWorkers:
- it mirrors this replica's own share of every load kind in memory, whatever Redis answers;
- while Redis fails, `list` gives the workers it last saw, loads and limits count this replica's
  own share only (each gateway then bounds a key by what it serves itself), and no request waits
  on a dead connection: a thread of its own tries Redis again once a `retry_s`;
- when Redis answers again, this replica's share is written back from the mirror (what it holds
  now, not what it held when Redis went: anything taken or given back meanwhile counts), so
  every replica's limits hold over one count again; a Redis that restarted empty has no worker
  registered until their next heartbeat, so for `grace_s` an empty list is not believed.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from services.router.workers import KINDS, ROUTERS, RedisWorkers, StaticWorkers
from shared.net.registry import WorkerInfo

log = logging.getLogger(__name__)


class SharedState:
    def __init__(self, retry_s: float = 1.0):
        self.retry_s = retry_s
        self.degraded_since: float | None = None  # time.monotonic() when Redis last failed
        self.outages = 0
        self._lock = threading.Lock()

    @property
    def degraded(self) -> bool:
        return self.degraded_since is not None

    def failed(self, error: Exception) -> None:
        with self._lock:
            if self.degraded_since is None:
                self.degraded_since, self.outages = time.monotonic(), self.outages + 1
                log.warning("Redis is unavailable (%s): serving degraded on the workers last seen", error)

    def recovered(self) -> float:
        """Back on Redis; returns how long the outage lasted."""
        with self._lock:
            lasted = time.monotonic() - (self.degraded_since or time.monotonic())
            self.degraded_since = None
        log.warning("Redis is back after %.1f s: shared state reconciled", lasted)
        return lasted


class GuardedRedis:
    """The Redis client for the calls that have a fallback (API keys, the prefix index, request
    records): while the gateway is degraded they fail at once, instead of each waiting out a dead
    connection's timeouts (2 s) on every request, and a failure marks the gateway degraded.
    FallbackWorkers' own calls use the client itself: they are what finds Redis back."""

    def __init__(self, client: redis.Redis, state: SharedState):
        self.client, self.state = client, state

    def __getattr__(self, name: str):
        attribute = getattr(self.client, name)
        if not callable(attribute):
            return attribute

        def call(*args, **kwargs):
            if self.state.degraded:
                raise redis.ConnectionError("Redis is unavailable: this gateway serves degraded")
            try:
                return attribute(*args, **kwargs)
            except redis.RedisError as error:
                self.state.failed(error)
                raise

        return call


class FallbackWorkers:
    """RedisWorkers that go on without Redis (module docstring)."""

    def __init__(self, shared: RedisWorkers, state: SharedState | None = None, grace_s: float = 5.0):
        self.shared, self.client = shared, shared.client
        self.state = state or SharedState()
        self.own = StaticWorkers([])  # this replica's share of every kind, kept whatever Redis does
        self.grace_s = grace_s
        self._seen: list[WorkerInfo] = []
        self._back_at = float("-inf")  # when Redis last came back
        self._stop = threading.Event()
        # Held by an update of this replica's share (the mirror and Redis) and by the write-back, so
        # that no update falls between the mirror's snapshot and the switch back to Redis.
        self._sync = threading.Lock()
        threading.Thread(target=self._watch, name="redis-reconnect", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(self.state.retry_s):
            if self.state.degraded:
                self._rejoin()

    def _redis(self, call, *args):
        """`call(*args)` on Redis; None (and degraded) when it fails, or while degraded: only the
        watcher thread tries Redis then, so that no request waits on a dead connection."""
        if self.state.degraded:
            return None
        try:
            return call(*args)
        except redis.RedisError as error:
            self.state.failed(error)
            return None

    def _rejoin(self) -> bool:
        with self._sync:
            try:
                self._write_share()
            except redis.RedisError as error:
                self.state.failed(error)
                return False
            self.state.recovered()
        self._back_at = time.monotonic()
        return True

    def _write_share(self) -> None:
        """This replica's share from the mirror, in place of whatever Redis holds of it."""
        shared = self.shared
        with self.client.pipeline() as pipe:
            for kind in KINDS:
                key = shared._key(kind, shared.router_id)
                pipe.delete(key)
                held = {field: amount for field, amount in self.own.loads(kind).items() if amount}
                if held:
                    pipe.hset(key, mapping=held)
                    pipe.pexpire(key, int(shared.ttl_s * 1000))
            pipe.sadd(ROUTERS, shared.router_id)
            pipe.execute()

    def list(self) -> list[WorkerInfo]:
        seen = self._redis(self.shared.list)
        if seen is None or (not seen and time.monotonic() - self._back_at < self.grace_s):
            return list(self._seen)
        self._seen = seen
        return seen

    def capacity(self, worker: WorkerInfo) -> int | None:
        return worker.capacity

    def add_load(self, kind: str, worker_id: str, amount: float) -> None:
        with self._sync:
            self.own.add_load(kind, worker_id, amount)
            self._redis(self.shared.add_load, kind, worker_id, amount)

    def loads(self, kind: str) -> dict[str, float]:
        total = self._redis(self.shared.loads, kind)
        return self.own.loads(kind) if total is None else total

    def acquire(self, kind: str, field: str, limit: int, amount: int = 1) -> bool:
        with self._sync:
            taken = self._redis(self.shared.acquire, kind, field, limit, amount)
            if taken is None:  # degraded: this replica's own count bounds it
                return self.own.acquire(kind, field, limit, amount)
            if taken:
                self.own.add_load(kind, field, amount)
            return taken

    def release(self, kind: str, field: str, amount: int = 1) -> None:
        with self._sync:
            self.own.release(kind, field, amount)
            self._redis(self.shared.release, kind, field, amount)

    def close(self) -> None:
        self._stop.set()
        self.shared.close()
