"""Generation loop: prefill, then decode steps with sampling, stopping and stats.

Token ids in, token ids out: this module knows nothing about tokenization or chat templates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from shared.engine.cache import LazyCache
from shared.engine.decode import decode_step
from shared.engine.model import EngineModel
from shared.engine.prefill import prefill
from shared.engine.pruning import PruneConfig
from shared.engine.stats import Stats


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        assert self.max_new_tokens >= 1, "max_new_tokens must be >= 1"
        assert self.temperature >= 0.0, "temperature must be >= 0"
        assert 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling. logits: [vocab]."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        outside = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (a stop token) or "length" (max_new_tokens)
    stats: Stats = field(default_factory=Stats)


def fill_cache_stats(stats: Stats, cache: LazyCache, num_layers: int) -> None:
    stats.token_layers_computed = cache.computed_token_layers
    stats.token_layers_full = num_layers * cache.length
    stats.revived_token_layers = cache.revived_token_layers
    stats.kv_cache_bytes = cache.kv_bytes
    stats.aux_cache_bytes = cache.aux_bytes


def decode_tokens(
    model: EngineModel,
    cache: LazyCache,
    first_logits: torch.Tensor,
    config: PruneConfig,
    params: SamplingParams,
    generation: Generation,
) -> Iterator[int]:
    """Sample from first_logits, then decode step by step; yields each token as it is chosen."""
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(params.seed)
    stats, logits = generation.stats, first_logits
    start = time.perf_counter()
    try:
        while True:
            token = sample(logits, params, generator)
            if token in params.stop_token_ids:
                generation.finish_reason = "stop"
                return
            generation.tokens.append(token)
            stats.completion_tokens = len(generation.tokens)
            yield token
            if len(generation.tokens) >= params.max_new_tokens:
                generation.finish_reason = "length"
                return
            logits = decode_step(model, cache, token, config)
    finally:
        # Also when the consumer stops early (a stop string, a cancelled request).
        stats.decode_s = time.perf_counter() - start
        fill_cache_stats(stats, cache, model.spec.num_layers)


def stream(
    model: EngineModel, ids: list[int] | torch.Tensor, config: PruneConfig, params: SamplingParams, generation: Generation
) -> Iterator[int]:
    """Prefill `ids` and yield generated tokens; `generation` is filled in as it goes."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    config.check_for(model.spec.num_layers)
    start = time.perf_counter()
    cache, logits = prefill(model, ids, config, reserve=params.max_new_tokens)
    stats = generation.stats
    stats.ttft_s = time.perf_counter() - start
    stats.prompt_tokens = ids.shape[0]
    stats.prefill_token_layers = cache.computed_token_layers
    stats.kept_per_layer = list(cache.kept_per_layer)
    yield from decode_tokens(model, cache, logits, config, params, generation)


def generate(
    model: EngineModel, ids: list[int] | torch.Tensor, config: PruneConfig, params: SamplingParams
) -> Generation:
    generation = Generation()
    for _ in stream(model, ids, config, params, generation):
        pass
    return generation
