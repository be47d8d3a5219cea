"""Generation loop: prefill, then decode steps with sampling, stopping and stats.

Token ids in, token ids out: this module knows nothing about tokenization or chat templates.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from shared.compute import require_compute_thread
from shared.contract import PruneConfig, SamplingParams, Stats
from shared.engine.cache import LazyCache
from shared.engine.decode import decode_step
from shared.engine.model import EngineModel
from shared.engine.request import fill_cache_stats, run_prefill
from shared.engine.reuse import PrefixReuse
from shared.engine.sampling import Sampled, Sampler


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (a stop token) or "length" (max_new_tokens)
    stats: Stats = field(default_factory=Stats)
    logprobs: list[Sampled] = field(default_factory=list)  # with params.logprobs: one per token


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
        prompt_ids=(),
    ):
        self.cache, self.config, self.params, self.generation = cache, config, params, generation
        # The prompt's ids are for repetition_penalty: pass them, or a sampler built with them.
        self.sampler = sampler or Sampler(params, prompt_ids=prompt_ids)
        self.next_token: int | None = None  # chosen and not yet fed to the model
        self.done = False
        # A continuation's tokens so far (`replay`), taken in place of sampling, one per step.
        self.replayed: collections.deque[int] = collections.deque()
        self.depths = False  # report token depths in the stats at the end (return_token_depths)
        self._start = time.perf_counter()

    def accept(self, sampled: Sampled | int) -> bool:
        """Record a chosen token; False when it is a stop token (which is not output)."""
        generation = self.generation
        sampled = sampled if isinstance(sampled, Sampled) else Sampled(sampled)
        token = sampled.token
        if token in self.params.stop_token_ids:
            generation.finish_reason, self.done = "stop", True
            return False
        self.sampler.observe(token)
        generation.tokens.append(token)
        if self.params.logprobs is not None:
            generation.logprobs.append(sampled)
        generation.stats.completion_tokens = len(generation.tokens)
        if len(generation.tokens) >= self.params.max_new_tokens:
            generation.finish_reason, self.done = "length", True
        else:
            self.next_token = token
        return True

    def replay(self, tokens: list[int]) -> None:
        """Continue a choice whose first `tokens` were generated elsewhere (a worker that failed):
        the next steps take them in turn instead of sampling and output nothing, so the cache,
        the selection and the sampler's counts go through the same states as the first run did.
        A decode step's row does not depend on its batch under --batch-invariant, so a greedy
        continuation then equals the uninterrupted answer bit for bit."""
        if len(self.generation.tokens) + len(tokens) >= self.params.max_new_tokens:
            raise ValueError(
                f"{len(tokens)} tokens to replay leave nothing of max_new_tokens {self.params.max_new_tokens}"
            )
        if stops := set(tokens) & set(self.params.stop_token_ids):
            raise ValueError(f"tokens to replay include the stop token {min(stops)}")
        self.replayed.extend(tokens)

    def resume(self, tokens: list[int]) -> None:
        """Count a continuation's tokens so far as generated (the penalties, min_tokens and
        max_new_tokens see them) when they were prefilled with the prompt instead of replayed:
        the next `advance` samples the token after them, at their position's seed."""
        if len(self.generation.tokens) + len(tokens) >= self.params.max_new_tokens:
            raise ValueError(f"{len(tokens)} tokens leave nothing of max_new_tokens {self.params.max_new_tokens}")
        for token in tokens:
            self.sampler.observe(token)
            self.generation.tokens.append(token)
        self.generation.stats.completion_tokens = len(self.generation.tokens)

    def advance(self, logits: torch.Tensor) -> Sampled | None:
        """Sample from `logits` [vocab]; the token to output, or None when it was a stop token or
        a replayed one (not output again)."""
        if self.replayed:
            self.accept(self.replayed.popleft())
            return None
        sampled = self.sampler.choose(logits)
        return sampled if self.accept(sampled) else None

    def close(self, num_layers: int) -> None:
        """Fill the stats; also when the consumer stops early (a stop string, a cancelled request)."""
        self.generation.stats.decode_s = time.perf_counter() - self._start
        fill_cache_stats(self.generation.stats, self.cache, num_layers, self.depths)


def decode_tokens(
    model: EngineModel,
    cache: LazyCache,
    first_logits: torch.Tensor | None,
    config: PruneConfig,
    params: SamplingParams,
    generation: Generation,
    sampler: Sampler | None = None,
    first_token: int | None = None,
    prompt_ids=(),
) -> Iterator[int]:
    """Sample from first_logits, then decode step by step; yields each token as it is chosen.

    With first_token instead of first_logits, generation resumes after a token sampled elsewhere
    (a prefill worker): it is recorded but not yielded again.
    """
    if (first_logits is None) == (first_token is None):
        raise ValueError("give first_logits or first_token")
    yield from run_decoding(
        model, Decoding(cache, config, params, generation, sampler, prompt_ids), first_logits, first_token
    )


def run_decoding(
    model: EngineModel, decoding: Decoding, first_logits: torch.Tensor | None = None, first_token: int | None = None
) -> Iterator[int]:
    """`decode_tokens`' loop over a Decoding already made (one of `choice_decodings`)."""
    cache, config = decoding.cache, decoding.config
    try:
        if first_token is None:
            sampled = decoding.advance(first_logits)
            if sampled is not None:
                yield sampled.token
        else:
            decoding.accept(first_token)
        while not decoding.done:  # a stop token ends it; a replayed token is not yielded again
            sampled = decoding.advance(decode_step(model, cache, decoding.next_token, config))
            if sampled is not None:
                yield sampled.token
    finally:
        decoding.close(model.spec.num_layers)


def choice_decodings(
    cache: LazyCache,
    config: PruneConfig,
    params: SamplingParams,
    prompt_ids,
    grammars=None,
    prefill_stats: Stats | None = None,
) -> list[Decoding]:
    """One Decoding per choice (params.n) from one prefilled cache: the first keeps `cache`, the
    others get copies taken before any decodes; each has its own sampler (seeded seed + i) and a
    Generation starting from the prefill's figures."""
    require_compute_thread("a request's choices")
    choices = params.choices()
    caches = [cache] + [cache.fork() for _ in choices[1:]]
    decodings = []
    for choice, own in zip(choices, caches):
        stats = dataclasses.replace(prefill_stats, completion_tokens=0) if prefill_stats else Stats()
        sampler = Sampler(choice, prompt_ids, grammars)
        decodings.append(Decoding(own, config, choice, Generation(stats=stats), sampler))
    return decodings


def stream(
    model: EngineModel,
    ids: list[int] | torch.Tensor,
    config: PruneConfig,
    params: SamplingParams,
    generation: Generation,
    sampler: Sampler | None = None,
    prefix: PrefixReuse | None = None,
) -> Iterator[int]:
    """Prefill `ids` and yield generated tokens; `generation` is filled in as it goes.
    sampler: one built with the model's grammars, for structured output; prefix: a prefix cache
    to start from and to leave the prompt in."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    run, _ = run_prefill(model, ids, config, prefix=prefix, reserve=params.max_new_tokens, stats=generation.stats)
    yield from decode_tokens(model, run.cache, run.logits, config, params, generation, sampler, prompt_ids=ids)


def generate(
    model: EngineModel, ids: list[int] | torch.Tensor, config: PruneConfig, params: SamplingParams
) -> Generation:
    generation = Generation()
    for _ in stream(model, ids, config, params, generation):
        pass
    return generation
