"""Selection: which prompt tokens go on past a stage layer (the config is shared/contract/pruning.py).

A method is a small scorer with one `score()`; pooling, the budget (a fixed fraction or an
attention mass), the top-k, block grouping and the tokens that are always kept (the last prompt
token, attention sinks, the recent tokens) live once, in `select()`. The cache bookkeeping (Aux
Cache, revival, the decode-time query window) is the prefill's and decode's business.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.contract.pruning import PruneConfig


@dataclass(frozen=True)
class ScoreInputs:
    """What a scorer may look at. attention: the query window's summed attention per candidate
    (the last query's alone for window 1), or None if the scorer does not use it."""

    layer: int
    positions: torch.Tensor  # [c] original positions of the candidates
    attention: torch.Tensor | None  # [c]


@dataclass(frozen=True)
class AttentionScorer:
    """LazyLLM: importance is the attention the last queries pay a token, averaged over heads."""

    needs_attention = True

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.attention


@dataclass(frozen=True)
class RandomScorer:
    """Random drop at the same budget; deterministic for (seed, layer)."""

    seed: int
    needs_attention = False

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + inputs.layer) % 2**64)
        return torch.rand(int(inputs.positions.max()) + 1, generator=generator)[inputs.positions.cpu()].to(
            inputs.positions.device
        )


def scorer_for(config: PruneConfig):
    return RandomScorer(config.seed) if config.mode == "random" else AttentionScorer()


def protected(config: PruneConfig, positions: torch.Tensor, num_prompt: int) -> torch.Tensor:
    """Bool [c]: candidates kept whatever their score: the last prompt token, sinks, recent tokens."""
    forced = (positions == num_prompt - 1) | (positions < config.sink_tokens)
    if config.recent_tokens:
        forced |= positions >= num_prompt - config.recent_tokens
    return forced


def pool_scores(config: PruneConfig, scores: torch.Tensor, positions: torch.Tensor, num_prompt: int) -> torch.Tensor:
    """Pool each candidate's score with its neighbours by original position (SnapKV's 1-D pooling),
    so that a span around a strong token survives whole. Positions that are no longer candidates
    do not count. scores, positions: [c] -> [c]."""
    kernel, pad = config.pool_kernel, config.pool_kernel // 2
    if config.pool == "max":
        dense = scores.new_full((1, 1, num_prompt), float("-inf"))
        dense[0, 0, positions] = scores
        return F.max_pool1d(dense, kernel, stride=1, padding=pad)[0, 0, positions]
    dense = scores.new_zeros((2, 1, num_prompt))
    dense[0, 0, positions] = scores
    dense[1, 0, positions] = 1.0
    summed = F.avg_pool1d(dense, kernel, stride=1, padding=pad)  # the same divisor for both rows
    return (summed[0, 0] / summed[1, 0])[positions]


def mass_budget(
    config: PruneConfig, keep: float, order_scores: torch.Tensor, mass: torch.Tensor, num_prompt: int
) -> int:
    """How many candidates, taken best first by order_scores, hold `keep_mass` of the attention
    `mass` (UniPrefill's budget), clipped to [min_keep, keep] of the prompt."""
    order = torch.argsort(order_scores, descending=True, stable=True)
    covered = torch.cumsum(mass[order].double(), 0)
    needed = int(torch.searchsorted(covered, config.keep_mass * float(covered[-1]))) + 1
    low = math.ceil(config.min_keep * num_prompt)
    return min(max(needed, low, 1), max(1, math.ceil(keep * num_prompt)))


def select(
    config: PruneConfig,
    keep: float,
    scores: torch.Tensor,
    positions: torch.Tensor,
    num_prompt: int,
    mass: torch.Tensor | None = None,
    exclude: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask over candidates: the top `keep` fraction of the prompt, by score.

    scores, positions: [c] for the candidate prompt tokens. The last prompt token, the first
    `sink_tokens` and the last `recent_tokens` positions are always kept. With `pool_kernel` > 1
    the scores are pooled over neighbours first. With `keep_mass`, the budget is the fewest
    tokens whose attention `mass` [c] reaches that share, at most `keep`. With block granularity,
    whole blocks of `block_size` consecutive positions are kept or dropped, each scored by its best token.
    exclude: bool [c], candidates not to take unless protected (after pooling, so that they still
    lend their score to their neighbours); decode's revival budget defers them this way.
    """
    if config.pool_kernel > 1:
        scores = pool_scores(config, scores, positions, num_prompt)
    forced = protected(config, positions, num_prompt)
    if exclude is not None:
        scores = scores.masked_fill(exclude & ~forced, float("-inf"))
    scores = torch.where(forced, torch.tensor(float("inf"), dtype=scores.dtype, device=scores.device), scores)
    if config.keep_mass is not None:
        if mass is None:
            raise ValueError("keep_mass needs the attention mass")
        budget = mass_budget(config, keep, scores, mass, num_prompt)
    else:
        budget = max(1, math.ceil(keep * num_prompt))
    count = positions.shape[0]
    if budget >= count:
        return torch.ones(count, dtype=torch.bool, device=positions.device)
    if config.granularity == "token":
        chosen = torch.zeros(count, dtype=torch.bool, device=positions.device)
        chosen[torch.topk(scores, budget, sorted=False).indices] = True
    else:
        chosen = _blocks(config, budget, scores, positions)
    if exclude is not None:  # a block taken for its other tokens, or too few candidates left
        chosen &= ~exclude
    return chosen | forced


def _blocks(config: PruneConfig, budget: int, scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Bool [c]: whole blocks, best first by their best token's score, until `budget` tokens."""
    blocks = positions // config.block_size
    num_blocks = int(blocks.max()) + 1
    block_score = torch.full((num_blocks,), float("-inf"), dtype=scores.dtype, device=scores.device)
    block_score = block_score.scatter_reduce(0, blocks, scores, reduce="amax")
    block_size = torch.bincount(blocks, minlength=num_blocks)
    order = torch.argsort(block_score, descending=True)
    # Take blocks best first until the budget is met; the block that crosses it is kept whole.
    before = torch.cumsum(block_size[order], 0) - block_size[order]
    taken = torch.zeros(num_blocks, dtype=torch.bool, device=positions.device)
    taken[order[before < budget]] = True
    return taken[blocks]
