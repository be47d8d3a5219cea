"""Where the router finds workers and their load: a static list in memory, or Redis.

Load is two numbers per worker: outstanding predicted prefill cost (prefill workers) and
outstanding tokens (decode workers). In Redis they are hash fields updated with HINCRBYFLOAT,
atomic, one share per router replica, summed by readers, so several routers balance on the same
picture. The same shares count each API key's requests in progress (STREAMS), so a key's limit
holds across all gateway replicas rather than per replica, and the sequences placed on each decode
worker (SEQUENCES), so replicas admit against one count of its room (services.router.admission).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

import redis

from shared.net.registry import PREFIX, WorkerInfo, connect, list_workers

log = logging.getLogger(__name__)

PREFILL_COST, DECODE_TOKENS, STREAMS = "prefill_cost", "decode_tokens", "streams"
SEQUENCES = "sequences"  # sequences the gateways have placed on each decode worker (admission)
# Predicted prefill cost placed on each worker (a prefill worker, or a decode worker prefilling a
# prompt itself) whose first token has not come yet: the queue the router predicts waits from.
PREFILL_QUEUED = "prefill_queued"
KINDS = (PREFILL_COST, DECODE_TOKENS, STREAMS, SEQUENCES, PREFILL_QUEUED)
ROUTERS = f"{PREFIX}:routers"  # ids of router replicas that have held load (shares expire on their own)

# Check and take `amount` units in a single step, so two replicas cannot both see "room left" and
# both take it. Reads other replicas' shares by name, which a Redis Cluster would refuse (standalone
# Redis, as deployed here, is fine).
# KEYS: the router-id set, this router's share.
# ARGV: share-key prefix, field, limit, TTL ms, router id, amount.
_ACQUIRE = """
local total = 0
for _, router in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  total = total + tonumber(redis.call('HGET', ARGV[1] .. router, ARGV[2]) or '0')
end
if total + tonumber(ARGV[6]) > tonumber(ARGV[3]) then return 0 end
redis.call('HINCRBYFLOAT', KEYS[2], ARGV[2], ARGV[6])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('SADD', KEYS[1], ARGV[5])
return 1
"""
# KEYS: this router's share. ARGV: field, amount. A field back at zero is removed (callers come and go).
_RELEASE = """
local left = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], ARGV[1], -tonumber(ARGV[2])))
if left <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return 1
"""


class Workers(Protocol):
    def list(self) -> list[WorkerInfo]: ...

    def add_load(self, kind: str, worker_id: str, amount: float) -> None: ...

    def loads(self, kind: str) -> dict[str, float]: ...

    def acquire(self, kind: str, field: str, limit: int, amount: int = 1) -> bool:
        """Take `amount` units of `field` if that keeps all routers' total within `limit`; False if not."""
        ...

    def release(self, kind: str, field: str, amount: int = 1) -> None: ...

    def capacity(self, worker: WorkerInfo) -> int | None:
        """The sequences a decode worker reports it generates at once; None while unknown."""
        ...


class StaticWorkers:
    """The single-host mode: addresses from settings, load kept in this process.

    A static address says nothing of its worker's capacity: `ask_capacity(worker)` (the gateway's:
    the worker's Status) is asked for it, at most once per `ask_every_s` until it answers.
    """

    def __init__(
        self,
        workers: list[WorkerInfo],
        ask_capacity: Callable[[WorkerInfo], int | None] | None = None,
        ask_every_s: float = 1.0,
    ):
        self.workers = workers
        self._load: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._lock = threading.Lock()
        self.ask_capacity, self._ask_every_s = ask_capacity, ask_every_s
        self._capacity: dict[str, int] = {}
        self._asked: dict[str, float] = {}

    def capacity(self, worker: WorkerInfo) -> int | None:
        if worker.worker_id in self._capacity or self.ask_capacity is None:
            return self._capacity.get(worker.worker_id)
        now = time.monotonic()
        if now - self._asked.get(worker.worker_id, -self._ask_every_s) < self._ask_every_s:
            return None
        self._asked[worker.worker_id] = now
        try:
            self._capacity[worker.worker_id] = self.ask_capacity(worker)
        except Exception as error:  # not up yet, or gone: it decides for itself meanwhile
            log.info("decode worker %s did not report its capacity: %s", worker.address, error)
        return self._capacity.get(worker.worker_id)

    def list(self) -> list[WorkerInfo]:
        return list(self.workers)

    def add_load(self, kind: str, worker_id: str, amount: float) -> None:
        with self._lock:
            self._load[kind][worker_id] += amount

    def loads(self, kind: str) -> dict[str, float]:
        with self._lock:
            return dict(self._load[kind])

    def acquire(self, kind: str, field: str, limit: int, amount: int = 1) -> bool:
        with self._lock:
            if self._load[kind][field] + amount > limit:
                return False
            self._load[kind][field] += amount
            return True

    def release(self, kind: str, field: str, amount: int = 1) -> None:
        with self._lock:
            self._load[kind][field] -= amount
            if self._load[kind][field] <= 0:
                del self._load[kind][field]


class RedisWorkers:
    """The multi-host mode: workers register themselves (shared.net.registry); load is shared.

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
        self._acquire = self.client.register_script(_ACQUIRE)
        self._release = self.client.register_script(_RELEASE)

    def list(self) -> list[WorkerInfo]:
        return list_workers(self.client)

    def capacity(self, worker: WorkerInfo) -> int | None:
        return worker.capacity  # registered by the worker itself (its max_sequences)

    def _key(self, kind: str, router_id: str) -> str:
        return f"{PREFIX}:load:{kind}:{router_id}"

    def _hold_share(self) -> None:
        with self._starting:
            if self._refresher.ident is None and not self._stop.is_set():
                self._refresher.start()

    def add_load(self, kind: str, worker_id: str, amount: float) -> None:
        key = self._key(kind, self.router_id)
        self._hold_share()
        with self.client.pipeline() as pipe:
            pipe.hincrbyfloat(key, worker_id, amount)
            pipe.pexpire(key, int(self.ttl_s * 1000))
            pipe.sadd(ROUTERS, self.router_id)
            pipe.execute()

    def acquire(self, kind: str, field: str, limit: int, amount: int = 1) -> bool:
        self._hold_share()
        keys = [ROUTERS, self._key(kind, self.router_id)]
        args = [self._key(kind, ""), field, limit, int(self.ttl_s * 1000), self.router_id, amount]
        return bool(self._acquire(keys=keys, args=args))

    def release(self, kind: str, field: str, amount: int = 1) -> None:
        self._release(keys=[self._key(kind, self.router_id)], args=[field, amount])

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
                    pipe.exists(*(self._key(kind, router) for kind in KINDS))
                dead = [router for router, count in zip(gone, pipe.execute()) if count == 0]
            if dead:
                self.client.srem(ROUTERS, *dead)
        return dict(total)

    def _refresh(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with self.client.pipeline() as pipe:
                    for kind in KINDS:
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
