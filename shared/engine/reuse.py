"""A worker's prefix cache in use: what a prefill starts from, and what a prefill (or a received
transfer) leaves behind for the next prompt with the same start. Answers are not cached: decode
computes them one row at a time, which a later prefill of the same text does not reproduce bit
for bit.

The keys name the model, the dtype, the layers held and a salt made by the server (one per API
key), so tenants never share entries. The prefill worker, the decode worker and run-batch each
hold one; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from shared.compute import require_compute_thread
from shared.contract import PruneConfig
from shared.engine.cache import LazyCache
from shared.engine.model import EngineModel
from shared.engine.prefill import LayerFrame, PrefillRun
from shared.engine.prefix import BLOCK_TOKENS, PrefixCache, block_keys, held_layers, namespace


class PrefixReuse:
    def __init__(self, model: EngineModel, model_name: str, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        self.model, self.model_name = model, model_name
        self.cache = PrefixCache(budget_bytes, block_tokens)
        self.queried_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # ... of which came from the cache

    @classmethod
    def configured(cls, model: EngineModel, model_name: str, settings) -> PrefixReuse | None:
        """A worker's prefix cache as its EngineSettings say (enable_prefix_caching,
        prefix_cache_bytes), or None when it is off."""
        if not settings.enable_prefix_caching:
            return None
        return cls(model, model_name, int(settings.prefix_cache_bytes))

    def keys(self, ids: Sequence[int], config: PruneConfig, salt: str) -> list[bytes]:
        layers = held_layers(config, self.model.spec.num_layers)
        root = namespace(self.model_name, self.model.dtype_name, layers, salt)
        return block_keys(list(ids), root, self.cache.block_tokens)

    def start(
        self,
        ids: torch.Tensor,
        config: PruneConfig,
        salt: str = "",
        *,
        reserve: int = 0,
        on_layer: Callable[[LayerFrame], None] | None = None,
    ) -> PrefillRun:
        """A prefill of `ids` from its longest cached start (pinned until `finish` or `abandon`);
        shared.engine.request's start_prefill is the way in for a request.
        The hit leaves at least the query window (and one token) to compute."""
        n = ids.shape[0]
        keys = self.keys(ids.tolist(), config, salt)
        # The query window applies where the schedule does: an unpruned short prompt needs one token.
        hit = self.cache.lookup(keys, n - max(config.for_prompt(n).window, 1))
        self.queried_tokens += n
        self.hit_tokens += 0 if hit is None else hit.tokens
        try:
            run = PrefillRun(
                self.model, ids, config, reserve=reserve, on_layer=on_layer, prefix=hit, keep_boundary=True
            )
        except BaseException:
            self.cache.release(hit)
            raise
        run.prefix_keys = keys
        return run

    def finish(self, run: PrefillRun) -> None:
        """Cache a finished prefill's shareable rows and unpin what it started from."""
        try:
            self._insert(run.cache, run.prefix_keys, run.held)
        finally:
            run.cache.boundary = None  # cached: nothing reads them again
            self.abandon(run)

    def abandon(self, run: PrefillRun) -> None:
        """Unpin a prefill's hit (failed, cancelled or finished); safe to call twice."""
        if run.prefix_keys:  # cleared once released
            run.prefix_keys = []
            self.cache.release(run.prefix)

    def remember(self, cache: LazyCache, ids: Sequence[int], config: PruneConfig, salt: str = "") -> int:
        """Cache every full block of a received prompt (`ids`, the tokens `cache` holds). A cache
        that lacks the states leaving the shared layers (a transfer from a sender that did not keep
        them) is skipped. Returns blocks added; the states are dropped after."""
        try:
            layers = held_layers(config, self.model.spec.num_layers)
            if layers < self.model.spec.num_layers and (cache.boundary is None or cache.boundary.layer != layers - 1):
                return 0
            count = cache.length - cache.length % self.cache.block_tokens
            if count == 0:
                return 0
            return self._insert(cache, self.keys(list(ids)[:count], config, salt), layers)
        finally:
            cache.boundary = None  # cached or not, nothing reads them again

    def _insert(self, cache: LazyCache, keys: list[bytes], layers: int) -> int:
        """Gather only the rows of blocks not held yet (a warm prompt adds a block or two)."""
        require_compute_thread("caching a prefix")
        first = self.cache.first_missing(keys)
        if first == len(keys):
            self.cache.touch(keys)
            return 0
        k, v, hidden = cache.shared_rows(layers, first * self.cache.block_tokens)
        return self.cache.insert(keys, k, v, hidden, first)
