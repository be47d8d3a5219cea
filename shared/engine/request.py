"""A request's prefill: the one way in for every caller that serves one (the prefill worker, the
decode worker's local prefill, run-batch and the in-process stream), and the stats it reports.

`start_prefill` begins it from the longest cached start of the prompt when there is a prefix
cache, from scratch otherwise; a caller that interleaves it with decode rounds steps the run a
layer at a time, the others call `run_prefill`. `finish_prefill` fills the stats and leaves the
prompt's shareable rows in the prefix cache. Token ids in, a cache and logits out: what comes after
(sampling each choice's first token, decoding) is the caller's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from shared.contract import PruneConfig, Stats
from shared.engine.cache import LazyCache
from shared.engine.model import EngineModel
from shared.engine.prefill import LayerFrame, PrefillRun
from shared.engine.reuse import PrefixReuse

log = logging.getLogger(__name__)


def start_prefill(
    model: EngineModel,
    ids: torch.Tensor,
    config: PruneConfig,
    *,
    prefix: PrefixReuse | None = None,
    salt: str = "",
    reserve: int = 0,
    on_layer: Callable[[LayerFrame], None] | None = None,
) -> PrefillRun:
    """A prefill of `ids` [n], not stepped yet. prefix: the worker's prefix cache (its hit is pinned
    until `finish_prefill` or `abandon_prefill`); salt: the tenant's cache namespace; reserve: room
    for decode steps; on_layer: each finished layer's frame, as it is computed."""
    if prefix is None:
        return PrefillRun(model, ids, config, reserve=reserve, on_layer=on_layer)
    return prefix.start(ids, config, salt, reserve=reserve, on_layer=on_layer)


def finish_prefill(run: PrefillRun, prefix: PrefixReuse | None = None, stats: Stats | None = None) -> Stats:
    """A finished run's stats (into `stats` when given), then its shareable rows cached. Caching is
    an optimization: a failure there is logged and the request goes on."""
    stats = stats if stats is not None else Stats()
    fill_prefill_stats(stats, run.cache, run.elapsed_s)
    if prefix is not None:
        try:
            prefix.finish(run)
        except Exception:
            log.exception("prefix caching failed; the request is not affected")
    return stats


def abandon_prefill(run: PrefillRun, prefix: PrefixReuse | None) -> None:
    """A run that will not finish (failed, cancelled): its prefix hit is unpinned."""
    if prefix is not None:
        prefix.abandon(run)


def run_prefill(
    model: EngineModel, ids: torch.Tensor, config: PruneConfig, *, stats: Stats | None = None, **options
) -> tuple[PrefillRun, Stats]:
    """`start_prefill` (with its keyword `options`) stepped to the end and finished: the run (its
    cache and logits) and its stats."""
    prefix = options.get("prefix")
    run = start_prefill(model, ids, config, **options)
    try:
        while not run.done:
            run.step()
    except BaseException:
        abandon_prefill(run, prefix)
        raise
    return run, finish_prefill(run, prefix, stats)


def fill_prefill_stats(stats: Stats, cache: LazyCache, ttft_s: float) -> None:
    """Everything a finished prefill reports: its time, the prompt, the schedule as honoured, and
    the cache's work and memory (refreshed by decode when it ends)."""
    stats.ttft_s = ttft_s
    stats.prompt_tokens = cache.num_prompt
    stats.prefill_token_layers = cache.computed_token_layers
    stats.kept_per_layer = list(cache.kept_per_layer)
    stats.cached_tokens = cache.cached_tokens
    fill_cache_stats(stats, cache, cache.spec.num_layers)


def fill_cache_stats(stats: Stats, cache: LazyCache, num_layers: int, depths: bool = False) -> None:
    """depths: also each prompt token's depth and the revived positions (return_token_depths)."""
    if depths:
        stats.token_depths = cache.depth[: cache.num_prompt].tolist()
        stats.revived_positions = sorted(cache.revived)
    stats.token_layers_computed = cache.computed_token_layers
    stats.token_layers_full = num_layers * cache.length
    stats.revived_token_layers = cache.revived_token_layers
    stats.kv_cache_bytes = cache.kv_bytes
    stats.aux_cache_bytes = cache.aux_bytes
