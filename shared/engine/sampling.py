"""Choosing the next token from a row of logits, as vLLM's OpenAI server does.

The order is vLLM's and transformers': the logits are processed first (logit_bias, min_tokens'
masking of stop tokens, then the repetition, frequency and presence penalties), then greedy
(temperature 0) takes the argmax, or sampling scales by the temperature and cuts with top_k,
top_p and min_p, in transformers' warper order. Log-probabilities are the model's own (a
log-softmax of the logits before any processing, vLLM's default "raw_logprobs"); under pruning
they are the pruned model's.
"""

from __future__ import annotations

import torch

from shared.contract import Sampled, SamplingParams
from shared.engine.grammar import GrammarError, Grammars, allowed


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What sampling draws from (temperature > 0): float64 [vocab], zero outside the cuts, not
    renormalized after top_p and min_p (multinomial does not need it)."""
    # Shift by the max first and work in float64: a temperature as small as 1e-300 must give the
    # argmax (probability 1), not inf/inf = NaN (found by schemathesis through the gateway).
    logits = logits.double()
    top = logits.max()
    if top == float("inf"):
        # Tokens at +inf (a repetition penalty near 0 divides positive logits by it, past float32's
        # range) take all the mass, shared equally: softmax's limit, where inf - inf would be NaN.
        logits = torch.where(logits == top, 0.0, float("-inf")).double()
        top = 0.0
    probs = torch.softmax((logits - top) / params.temperature, dim=-1)
    if 0 < params.top_k < probs.shape[0]:
        probs[probs < torch.topk(probs, params.top_k).values[-1]] = 0.0
        probs /= probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always).
        outside = torch.cumsum(sorted_probs, 0) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if params.min_p > 0.0:
        # Relative to the likeliest token: a cut that does not depend on the renormalizing above.
        probs[probs < params.min_p * probs.max()] = 0.0
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy at temperature 0; otherwise temperature, then top_k, top_p and min_p. logits: [vocab]."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded choice's token at `position` (0: its first generated token):
    splitmix64 of the pair, so that neighbouring seeds and positions give unrelated streams."""
    mask = 2**64 - 1
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


class Sampler:
    """One sequence's token chooser: the request's parameters, its generator, and what the
    penalties need (the prompt's tokens and the counts of those generated so far).

    A seeded choice draws its token at position k from a generator seeded by (seed, k), not from
    one stream that runs on: token k is drawn the same way on any worker, whatever drew the
    tokens before it, so a prefill worker's first token, the decode worker's next ones and a
    continuation placed on another worker after a failure (services.router.dispatch) are one
    random stream. A decode worker rebuilds the rest from the prompt ids and the tokens so far,
    which it `observe`s.
    """

    def __init__(self, params: SamplingParams, prompt_ids=(), grammars: Grammars | None = None):
        self.params = params
        self.matcher = None
        if params.grammar is not None:
            if grammars is None:
                raise GrammarError("structured output needs the model's tokenizer, which this process does not have")
            self.matcher = grammars.matcher(params.grammar)
        self.generator = None if params.seed is None else torch.Generator()
        self.generated = 0
        self._prompt = torch.as_tensor(list(prompt_ids), dtype=torch.long).unique()
        self._output: dict[int, int] = {}  # token -> times generated

    def observe(self, token: int) -> None:
        """Record a token as generated (the penalties and min_tokens count it)."""
        self.generated += 1
        self._output[token] = self._output.get(token, 0) + 1
        if self.matcher is not None:
            self.matcher.consume_token(token)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits after logit_bias, min_tokens and the penalties (a copy when any applies)."""
        params = self.params
        if not params.processes_logits:
            return logits
        logits = logits.float().clone()
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias)
            logits[list(ids)] += torch.tensor(biases, dtype=logits.dtype)
        if self.matcher is not None:
            logits[~allowed(self.matcher, logits.shape[0])] = float("-inf")
        if self.generated < params.min_tokens and params.stop_token_ids:
            held = logits.clone()
            held[list(params.stop_token_ids)] = float("-inf")
            if bool(torch.isfinite(held).any()):  # a finished grammar allows only a stop token: it wins
                logits = held
        if params.repetition_penalty != 1.0:
            # transformers' RepetitionPenaltyLogitsProcessor over the prompt and the output, as vLLM.
            seen = torch.cat([self._prompt, torch.tensor(list(self._output), dtype=torch.long)]).unique()
            scores = logits[seen]
            penalty = params.repetition_penalty
            logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
        if self._output and (params.presence_penalty or params.frequency_penalty):
            # OpenAI's definition: over the generated tokens only.
            ids = torch.tensor(list(self._output), dtype=torch.long)
            counts = torch.tensor(list(self._output.values()), dtype=logits.dtype)
            logits[ids] -= counts * params.frequency_penalty + params.presence_penalty
        return logits

    def choose(self, logits: torch.Tensor) -> Sampled:
        """The next token from `logits` [vocab] (not yet observed), with its log-probabilities if asked."""
        # On the CPU in float32 whatever the model's device and dtype (a no-op for a CPU float32
        # model): the generator is a CPU one, so a seeded stream is the same on CPU and GPU workers
        # and its state travels in a transfer between them; one row of logits is cheap to move.
        logits = logits.float().cpu()
        if self.generator is not None:
            self.generator.manual_seed(position_seed(self.params.seed % 2**64, self.generated))
        token = sample(self.process(logits), self.params, self.generator)
        if self.params.logprobs is None:
            return Sampled(token)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top = ()
        if self.params.logprobs:
            values, ids = torch.topk(logprobs, self.params.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        return Sampled(token, float(logprobs[token]), top)

    def __call__(self, logits: torch.Tensor) -> int:
        return self.choose(logits).token
