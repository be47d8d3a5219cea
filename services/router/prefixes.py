"""Which worker holds which prompt start: the router's index of what it sent where.

SGLang's router keeps such an approximate tree of the prefixes it routed; Dynamo and llm-d have the
workers publish their blocks instead. This is the first kind: the router records a prompt's block
keys (shared.contract.prefix, the workers' own chained hash, under the model, the layers held and
the tenant's salt) for the workers that prefilled or received it, once they hold it, and looks up
how many leading blocks each worker holds. It is approximate: a worker's own LRU may have evicted
what the index still lists (entries expire after `ttl_s`; a wrong guess costs one prefill, never a
wrong answer, since the worker computes whatever it does not find), and a dead or restarted worker
drops out because only live workers are candidates (a restarted one has a new id).

In memory for one gateway (an LRU over blocks); in Redis for several, so that each gateway sends a
conversation's next turn where another sent its first.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Protocol

import redis

from shared.contract import PruneConfig
from shared.contract.prefix import BLOCK_TOKENS, block_keys, held_layers, namespace
from shared.net.registry import PREFIX

DEFAULT_TTL_S = 1800.0  # well past a conversation's pause between turns
MAX_BLOCKS = 1 << 20  # about 100 MB of index at most in one gateway


def prompt_keys(ids: list[int], model: str, config: PruneConfig, num_layers: int, salt: str) -> list[bytes]:
    """The keys a worker files `ids` under, less the dtype: each worker runs one dtype, and the
    router pairs workers of one dtype, so the worker's id stands for it."""
    return block_keys(ids, namespace(model, "", held_layers(config, num_layers), salt), BLOCK_TOKENS)


def leading(holders: list[set[str]]) -> dict[str, int]:
    """Per worker, how many blocks from the first it holds without a gap, given each block's holders."""
    matched: dict[str, int] = {}
    alive = set(holders[0]) if holders else set()
    for count, block in enumerate(holders, start=1):
        alive &= block
        if not alive:
            break
        for worker in alive:
            matched[worker] = count
    return matched


class PrefixIndex(Protocol):
    def record(self, keys: list[bytes], worker_id: str) -> None: ...

    def matches(self, keys: list[bytes]) -> dict[str, int]:
        """Per worker, the leading blocks of `keys` it holds (workers holding none are absent)."""
        ...


class MemoryPrefixIndex:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S, max_blocks: int = MAX_BLOCKS):
        self.ttl_s, self.max_blocks = ttl_s, max_blocks
        self._blocks: OrderedDict[bytes, dict[str, float]] = OrderedDict()  # key -> worker -> expiry
        self._lock = threading.Lock()

    def record(self, keys: list[bytes], worker_id: str) -> None:
        expiry = time.monotonic() + self.ttl_s
        with self._lock:
            for key in keys:
                self._blocks.setdefault(key, {})[worker_id] = expiry
                self._blocks.move_to_end(key)
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)

    def matches(self, keys: list[bytes]) -> dict[str, int]:
        now = time.monotonic()
        holders = []
        with self._lock:
            for key in keys:
                workers = self._blocks.get(key)
                held = {worker for worker, expiry in (workers or {}).items() if expiry > now}
                if not held:
                    break
                holders.append(held)
        return leading(holders)


class RedisPrefixIndex:
    """One hash per block, `lazyserve:prefix:<key>`: worker id -> when recorded; the hash expires
    `ttl_s` after its last record, so blocks no request reaches any more leave by themselves."""

    def __init__(self, client: redis.Redis, ttl_s: float = DEFAULT_TTL_S):
        self.client, self.ttl_s = client, ttl_s

    @staticmethod
    def _key(key: bytes) -> str:
        return f"{PREFIX}:prefix:{key.hex()}"

    def record(self, keys: list[bytes], worker_id: str) -> None:
        now, ttl = int(time.time()), int(self.ttl_s * 1000)
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hset(self._key(key), worker_id, now)
                pipe.pexpire(self._key(key), ttl)
            pipe.execute()

    def matches(self, keys: list[bytes]) -> dict[str, int]:
        if not keys:
            return {}
        with self.client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hkeys(self._key(key))
            found = pipe.execute()
        return leading([set(workers) for workers in found])
