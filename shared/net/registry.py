"""Workers in Redis: who serves what, kept alive by heartbeats.

Each worker writes its WorkerInfo under `lazyserve:worker:<id>` with a TTL and refreshes it every
third of the TTL; a worker that dies stops refreshing and drops out when the key expires. The
set `lazyserve:workers` indexes the ids; readers prune ids whose key has expired. Redis is the
multi-host mode; a single host can use a static list instead (the router's settings).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Literal

import redis
from pydantic import BaseModel, Field

log = logging.getLogger(__name__)

PREFIX = "lazyserve"
WORKERS = f"{PREFIX}:workers"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


class WorkerInfo(BaseModel):
    worker_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    role: Literal["prefill", "decode"]
    address: str
    model: str
    capacity: int = Field(1, ge=1, description="prefills (prefill) or sequences (decode) at once")
    # A transfer must be in its decode worker's dtype; `--dtype auto` can choose differently on
    # hosts with different CPUs. "" (a static list) is unknown: any pairing.
    dtype: str = Field("", description="the model's dtype on this worker: float32, bfloat16, ...")

    def can_pair(self, other: WorkerInfo) -> bool:
        """Whether a transfer between this worker and `other` is in a dtype both run."""
        return not self.dtype or not other.dtype or self.dtype == other.dtype


def connect(url: str) -> redis.Redis:
    # Short timeouts: a Redis outage must turn into a clear error quickly, never a hung request.
    return redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0, decode_responses=True)


class Heartbeat:
    """Registers a worker and keeps it registered until stop() (or until the process dies)."""

    def __init__(self, url: str, info: WorkerInfo, ttl_s: float = 3.0):
        self.client, self.info, self.ttl_s = connect(url), info, ttl_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-heartbeat", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        with self.client.pipeline() as pipe:
            pipe.set(worker_key(self.info.worker_id), self.info.model_dump_json(), px=int(self.ttl_s * 1000))
            pipe.sadd(WORKERS, self.info.worker_id)
            pipe.execute()

    def _run(self) -> None:
        while True:
            try:
                self.beat()
            except redis.RedisError as error:
                log.warning("heartbeat to Redis failed (will retry): %s", error)
            if self._stop.wait(self.ttl_s / 3):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.client.delete(worker_key(self.info.worker_id))
            self.client.srem(WORKERS, self.info.worker_id)
        except redis.RedisError:
            pass  # the key expires on its own


def list_workers(client: redis.Redis) -> list[WorkerInfo]:
    """Live workers; ids whose key expired are removed from the index."""
    ids = sorted(client.smembers(WORKERS))
    if not ids:
        return []
    values = client.mget([worker_key(i) for i in ids])
    dead = [i for i, value in zip(ids, values) if value is None]
    if dead:
        client.srem(WORKERS, *dead)
    return [WorkerInfo.model_validate_json(value) for value in values if value is not None]
