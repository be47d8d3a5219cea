"""Fidelity of a pruned run to the unpruned model on one case, whether or not the model solves it.

The unpruned reference of a case is computed once (prefill, then a greedy continuation with the
distribution at every step) and reused for every configuration. A configuration then costs one
pruned prefill and one pass of teacher forcing: the reference's tokens go through the pruned
decode path (per-step re-selection and revival included), so its distributions are compared step
by step with the reference's. The pruned model's own greedy answer is the reference's tokens up to
the first disagreement; from there a copy of the cache decodes on freely.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from shared.engine import EngineModel, PruneConfig, decode_step, prefill

TEACHER_TOKENS = 32


@dataclass
class Reference:
    """The unpruned run of one case. logprobs [T, vocab]: row t is the distribution of token t."""

    tokens: list[int]  # greedy, up to TEACHER_TOKENS, ending at a stop token if one came
    logprobs: torch.Tensor
    ttft_s: float


@dataclass
class Run:
    """A configuration's run of one case, against the reference."""

    tokens: list[int]  # the pruned model's own greedy output, max_tokens at most
    ttft_s: float
    seconds: float  # prefill, teacher forcing and free decoding together
    first_kl: float
    first_top1: float  # 1.0 when the first token's argmax equals the reference's
    teacher_top1: float  # mean over teacher-forced steps of top-1 agreement
    teacher_kl: float  # mean over those steps of KL(reference || pruned)
    prefix_match: float  # share of the reference's tokens reproduced before the first divergence
    computed_fraction: float  # prompt token-layers computed by prefill and the teacher-forced decode
    revived_token_layers: int


def kl_divergence(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats from log-probabilities [..., vocab]; 0 for equal distributions."""
    return (p_log.exp() * (p_log - q_log)).sum(-1).clamp_min(0.0)


def agreement(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """Top-1 agreement per row [...]: 1.0 where both put the most mass on the same token."""
    return (p_log.argmax(-1) == q_log.argmax(-1)).float()


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


@torch.inference_mode()
def reference(model: EngineModel, ids: list[int], stop_ids: tuple[int, ...], steps: int = TEACHER_TOKENS) -> Reference:
    start = time.perf_counter()
    cache, logits = prefill(model, torch.tensor(ids), PruneConfig(mode="off"), reserve=steps)
    ttft = time.perf_counter() - start
    rows, tokens = [_log_softmax(logits)], []
    while True:
        token = int(rows[-1].argmax())
        tokens.append(token)
        if token in stop_ids or len(tokens) >= steps:
            break
        rows.append(_log_softmax(decode_step(model, cache, token, PruneConfig(mode="off"))))
    return Reference(tokens, torch.stack(rows), ttft)


@torch.inference_mode()
def run(
    model: EngineModel, ids: list[int], config: PruneConfig, ref: Reference, max_tokens: int, stop_ids: tuple[int, ...]
) -> Run:
    """Prefill under `config`, teacher-force the reference's tokens, and decode the pruned greedy answer."""
    start = time.perf_counter()
    cache, logits = prefill(model, torch.tensor(ids), config, reserve=TEACHER_TOKENS + max_tokens)
    ttft = time.perf_counter() - start
    rows = [_log_softmax(logits)]
    own: list[int] | None = None  # the pruned greedy output, once it left the reference
    for t, token in enumerate(ref.tokens):
        mine = int(rows[t].argmax())
        if own is None and mine != token and t < max_tokens:
            # Diverged: a copy of the cache (the reference fed up to t) decodes the pruned answer on.
            own = ref.tokens[:t] + _free(model, copy.deepcopy(cache), config, mine, max_tokens - t, stop_ids)
        if t + 1 < len(ref.tokens):
            rows.append(_log_softmax(decode_step(model, cache, token, config)))
    computed, revived = cache.computed_token_layers, cache.revived_token_layers
    pruned = torch.stack(rows)
    top1 = agreement(ref.logprobs, pruned)
    if own is None:
        own = [token for token in ref.tokens[:max_tokens] if token not in stop_ids]
    matched = int(top1.cumprod(0).sum())
    full_layers = model.spec.num_layers * (len(ids) + len(ref.tokens) - 1)
    return Run(
        tokens=own[:max_tokens],
        ttft_s=ttft,
        seconds=time.perf_counter() - start,
        first_kl=float(kl_divergence(ref.logprobs[0], pruned[0])),
        first_top1=float(top1[0]),
        teacher_top1=float(top1[1:].mean()) if len(top1) > 1 else float(top1[0]),
        teacher_kl=float(kl_divergence(ref.logprobs[1:], pruned[1:]).mean()) if len(top1) > 1 else 0.0,
        prefix_match=matched / len(ref.tokens),
        computed_fraction=computed / full_layers,
        revived_token_layers=revived,
    )


def _free(model, cache, config: PruneConfig, token: int, budget: int, stop_ids) -> list[int]:
    """Greedy decoding from `token` on, as a client of the pruned model would see it."""
    tokens = []
    while True:
        if token in stop_ids:
            return tokens
        tokens.append(token)
        if len(tokens) >= budget:
            return tokens
        token = int(decode_step(model, cache, token, config).argmax())
