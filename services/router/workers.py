"""Where the router finds workers and their load: a static list in memory, or Redis.

Load is two numbers per worker: outstanding predicted prefill cost (prefill workers) and
outstanding tokens (decode workers). In Redis they are hash fields updated with HINCRBYFLOAT,
atomic, one share per router replica, summed by readers, so several routers balance on the same
picture.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import defaultdict
from typing import Protocol

import redis

from shared.registry import PREFIX, WorkerInfo, connect, list_workers

log = logging.getLogger(__name__)

PREFILL_COST, DECODE_TOKENS = "prefill_cost", "decode_tokens"
ROUTERS = f"{PREFIX}:routers"  # ids of router replicas that have held load (shares expire on their own)


class Workers(Protocol):
    def list(self) -> list[WorkerInfo]: ...

    def add_load(self, kind: str, worker_id: str, amount: float) -> None: ...

    def loads(self, kind: str) -> dict[str, float]: ...


class StaticWorkers:
    """The single-host mode: addresses from settings, load kept in this process."""

    def __init__(self, workers: list[WorkerInfo]):
        self.workers = workers
        self._load: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._lock = threading.Lock()

    def list(self) -> list[WorkerInfo]:
        return list(self.workers)

    def add_load(self, kind: str, worker_id: str, amount: float) -> None:
        with self._lock:
            self._load[kind][worker_id] += amount

    def loads(self, kind: str) -> dict[str, float]:
        with self._lock:
            return dict(self._load[kind])


class RedisWorkers:
    """The multi-host mode: workers register themselves (shared.registry); load is shared.

    Each router replica keeps its own share of the load in its own hashes
    (`lazyserve:load:<kind>:<router id>`), refreshed with a TTL while it lives; readers add up the
    shares of the live replicas. A router that dies mid-request takes its share with it when the
    TTL runs out, instead of leaving load on the workers forever.
    """

    def __init__(self, url: str, ttl_s: float = 10.0):
        self.client = connect(url)
        self.router_id = uuid.uuid4().hex[:12]
        self.ttl_s = ttl_s
        self._stop = threading.Event()
        # Started by the first add_load: a replica that only reads holds no share to keep alive.
        self._starting = threading.Lock()
        self._refresher = threading.Thread(target=self._refresh, name="load-refresh", daemon=True)

    def list(self) -> list[WorkerInfo]:
        return list_workers(self.client)

    def _key(self, kind: str, router_id: str) -> str:
        return f"{PREFIX}:load:{kind}:{router_id}"

    def add_load(self, kind: str, worker_id: str, amount: float) -> None:
        key = self._key(kind, self.router_id)
        with self._starting:
            if self._refresher.ident is None and not self._stop.is_set():
                self._refresher.start()
        with self.client.pipeline() as pipe:
            pipe.hincrbyfloat(key, worker_id, amount)
            pipe.pexpire(key, int(self.ttl_s * 1000))
            pipe.sadd(ROUTERS, self.router_id)
            pipe.execute()

    def loads(self, kind: str) -> dict[str, float]:
        routers = sorted(self.client.smembers(ROUTERS))
        with self.client.pipeline() as pipe:
            for router in routers:
                pipe.hgetall(self._key(kind, router))
            shares = pipe.execute()
        total: dict[str, float] = defaultdict(float)
        for share in shares:
            for worker_id, value in share.items():
                total[worker_id] += float(value)
        gone = [router for router, share in zip(routers, shares) if not share]
        if gone:  # expired shares of dead routers: forget their ids (a live one re-adds itself)
            with self.client.pipeline() as pipe:
                for router in gone:
                    pipe.exists(*(self._key(kind, router) for kind in (PREFILL_COST, DECODE_TOKENS)))
                dead = [router for router, count in zip(gone, pipe.execute()) if count == 0]
            if dead:
                self.client.srem(ROUTERS, *dead)
        return dict(total)

    def _refresh(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with self.client.pipeline() as pipe:
                    for kind in (PREFILL_COST, DECODE_TOKENS):
                        pipe.pexpire(self._key(kind, self.router_id), int(self.ttl_s * 1000))
                    pipe.execute()
            except redis.RedisError as error:
                log.warning("could not refresh this router's load share: %s", error)

    def close(self) -> None:
        """Stop refreshing this router's share (it then expires) and release the connection."""
        self._stop.set()
        if self._refresher.is_alive():
            self._refresher.join(timeout=5)
        self.client.close()
