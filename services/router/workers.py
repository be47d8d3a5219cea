"""Where the router finds workers and their load: a static list in memory, or Redis.

Load is two numbers per worker: outstanding predicted prefill cost (prefill workers) and
outstanding tokens (decode workers). In Redis they are hash fields updated with HINCRBYFLOAT,
atomic across router replicas, so several routers balance on the same picture.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Protocol

from shared.registry import PREFIX, WorkerInfo, connect, list_workers

PREFILL_COST, DECODE_TOKENS = "prefill_cost", "decode_tokens"


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
    """The multi-host mode: workers register themselves (shared.registry); load is shared."""

    def __init__(self, url: str):
        self.client = connect(url)

    def list(self) -> list[WorkerInfo]:
        return list_workers(self.client)

    def add_load(self, kind: str, worker_id: str, amount: float) -> None:
        self.client.hincrbyfloat(f"{PREFIX}:load:{kind}", worker_id, amount)

    def loads(self, kind: str) -> dict[str, float]:
        return {key: float(value) for key, value in self.client.hgetall(f"{PREFIX}:load:{kind}").items()}
