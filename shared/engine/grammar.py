"""Structured output: a request's grammar as a mask on the logits, through llguidance.

llguidance (the Rust engine behind guidance, also one of vLLM's structured-output backends)
compiles JSON schemas and grammars and, per sequence, says which tokens may come next; a matcher
follows the tokens generated. We use its matcher and mask, not a grammar engine of our own.
The grammar travels in SamplingParams as llguidance's serialized form (built at the API edge from
`response_format`), so the prefill worker (first token) and the decode worker (the rest) apply the
same one; the decode worker's matcher catches up by consuming the first token.
"""

from __future__ import annotations

import threading

import torch
from llguidance import LLMatcher, LLTokenizer


class GrammarError(ValueError):
    """A grammar that does not compile for this tokenizer (a worker answers INVALID_ARGUMENT)."""


class Grammars:
    """Matchers for one model's tokenizer. The llguidance tokenizer takes about a second to build:
    once per process, at the first request that needs it."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self._source, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self._tokenizer: LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                serialized = self._source.backend_tokenizer.to_str()
                self._tokenizer = LLTokenizer(serialized, n_vocab=self.vocab_size, eos_token=list(self.stop_token_ids))
            return self._tokenizer

    def matcher(self, grammar: str) -> LLMatcher:
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher


def allowed(matcher: LLMatcher, vocab_size: int) -> torch.Tensor:
    """The tokens the grammar allows next: bool [vocab_size]."""
    bias = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[: min(vocab_size, bias.shape[0])] = bias[:vocab_size] > 0
    return mask
