"""Generation loop: prefill, then decode steps with sampling, stopping and stats.

Token ids in, token ids out: this module knows nothing about tokenization or chat templates.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from shared.contract import PruneConfig, SamplingParams, Stats
from shared.engine.cache import LazyCache
from shared.engine.decode import decode_step
from shared.engine.model import EngineModel
from shared.engine.prefill import prefill


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise nucleus sampling. logits: [vocab]."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    # Shift by the max first and work in float64: a temperature as small as 1e-300 must give the
    # argmax (probability 1), not inf/inf = NaN (found by schemathesis through the gateway).
    logits = logits.double()
    probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        outside = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class Sampler:
    """`sample` with the request's generator. Its state travels with a KV transfer, so seeded
    sampling continues on the decode worker exactly where the prefill worker left it."""

    def __init__(self, params: SamplingParams, state: bytes = b""):
        self.params = params
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
            if state:
                self.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))

    def __call__(self, logits: torch.Tensor) -> int:
        return sample(logits, self.params, self.generator)

    def state(self) -> bytes:
        return b"" if self.generator is None else self.generator.get_state().numpy().tobytes()


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


class Decoding:
    """One sequence's decode loop as data: the token to feed next, the tokens so far, when to stop.

    The model call is not in here, so a scheduler can run one `decode_batch` for many Decodings
    and hand each its row of logits (`advance`); `decode_tokens` is the loop for one.
    """

    def __init__(
        self,
        cache: LazyCache,
        config: PruneConfig,
        params: SamplingParams,
        generation: Generation,
        sampler: Sampler | None = None,
    ):
        self.cache, self.config, self.params, self.generation = cache, config, params, generation
        self.sampler = sampler or Sampler(params)
        self.next_token: int | None = None  # chosen and not yet fed to the model
        self.done = False
        self._start = time.perf_counter()

    def accept(self, token: int) -> bool:
        """Record a chosen token; False when it is a stop token (which is not output)."""
        generation = self.generation
        if token in self.params.stop_token_ids:
            generation.finish_reason, self.done = "stop", True
            return False
        generation.tokens.append(token)
        generation.stats.completion_tokens = len(generation.tokens)
        if len(generation.tokens) >= self.params.max_new_tokens:
            generation.finish_reason, self.done = "length", True
        else:
            self.next_token = token
        return True

    def advance(self, logits: torch.Tensor) -> int | None:
        """Sample from `logits` [vocab]; the token to output, or None when it was a stop token."""
        token = self.sampler(logits)
        return token if self.accept(token) else None

    def close(self, num_layers: int) -> None:
        """Fill the stats; also when the consumer stops early (a stop string, a cancelled request)."""
        self.generation.stats.decode_s = time.perf_counter() - self._start
        fill_cache_stats(self.generation.stats, self.cache, num_layers)


def decode_tokens(
    model: EngineModel,
    cache: LazyCache,
    first_logits: torch.Tensor | None,
    config: PruneConfig,
    params: SamplingParams,
    generation: Generation,
    sampler: Sampler | None = None,
    first_token: int | None = None,
) -> Iterator[int]:
    """Sample from first_logits, then decode step by step; yields each token as it is chosen.

    With first_token instead of first_logits, generation resumes after a token sampled elsewhere
    (a prefill worker): it is recorded but not yielded again.
    """
    if (first_logits is None) == (first_token is None):
        raise ValueError("give first_logits or first_token")
    decoding = Decoding(cache, config, params, generation, sampler)
    try:
        if first_token is None:
            token = decoding.advance(first_logits)
            if token is None:
                return
            yield token
        elif not decoding.accept(first_token):
            return
        while not decoding.done:
            token = decoding.advance(decode_step(model, cache, decoding.next_token, config))
            if token is None:
                return
            yield token
    finally:
        decoding.close(model.spec.num_layers)


def fill_prefill_stats(stats: Stats, cache: LazyCache, ttft_s: float) -> None:
    """Everything a finished prefill reports: its time, the prompt, the schedule as honoured, and
    the cache's work and memory (refreshed by decode when it ends). The one place for it: the
    in-process stream, the decode worker's local prefill and the prefill worker all call this."""
    stats.ttft_s = ttft_s
    stats.prompt_tokens = cache.num_prompt
    stats.prefill_token_layers = cache.computed_token_layers
    stats.kept_per_layer = list(cache.kept_per_layer)
    fill_cache_stats(stats, cache, cache.spec.num_layers)


def stream(
    model: EngineModel,
    ids: list[int] | torch.Tensor,
    config: PruneConfig,
    params: SamplingParams,
    generation: Generation,
) -> Iterator[int]:
    """Prefill `ids` and yield generated tokens; `generation` is filled in as it goes."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    config.check_for(model.spec.num_layers)
    start = time.perf_counter()
    cache, logits = prefill(model, ids, config, reserve=params.max_new_tokens)
    fill_prefill_stats(generation.stats, cache, time.perf_counter() - start)
    yield from decode_tokens(model, cache, logits, config, params, generation)


def generate(
    model: EngineModel, ids: list[int] | torch.Tensor, config: PruneConfig, params: SamplingParams
) -> Generation:
    generation = Generation()
    for _ in stream(model, ids, config, params, generation):
        pass
    return generation
