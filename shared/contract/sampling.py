"""How a request samples: the parameters the engine's sampler and every transport share. No torch."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Sampled:
    """A chosen token; with `logprobs` requested, its log-probability (the model's) and the
    likeliest tokens' as (token, logprob) pairs."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs
MAX_N = 16  # choices per request: each holds its own copy of the prompt's cache


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    # Tokens that end the sequence (not output): the model's end-of-sequence tokens unless the
    # request ignores them, plus the request's own stop_token_ids.
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # stop tokens are masked until this many tokens are out
    logprobs: int | None = None  # None: none; k: the chosen token's log-probability and the k likeliest
    n: int = 1  # choices sampled from one prefill
    grammar: str | None = None  # structured output: an llguidance grammar (shared.engine.grammar)

    def __post_init__(self):
        # Explicit checks, not asserts: they hold under `python -O` too.
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if not self.temperature >= 0.0:
            raise ValueError("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0: off)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError("repetition_penalty must be in (0, 10]")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError("min_tokens must be in [0, max_new_tokens]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}]")

    def choices(self) -> list[SamplingParams]:
        """Each choice's own parameters: n = 1, and with a seed, seed + i (as vLLM's parallel
        sampling does), so that seeded choices differ from each other and repeat across runs."""
        if self.n == 1:
            return [self]
        # Modulo 2**64: the generator's seed range, which maps a negative seed the same way.
        seeds = [None if self.seed is None else (self.seed + i) % 2**64 for i in range(self.n)]
        return [replace(self, n=1, seed=seed) for seed in seeds]

    @property
    def processes_logits(self) -> bool:
        """Whether anything but temperature and the top-k/p/min-p cuts changes the logits."""
        return bool(
            self.grammar
            or self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )
