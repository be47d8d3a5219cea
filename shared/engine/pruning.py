"""Pruning configuration and selection: which prompt tokens go on past a stage layer.

A method is a small scorer with one `score()`; the top-k, block grouping and the tokens that are
always kept (the last prompt token, attention sinks) live once, in `select()`. The cache
bookkeeping (Aux Cache, revival) is the prefill's and decode's business, not this module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Mode = Literal["off", "lazy", "static", "random"]


class PruneConfig(BaseModel):
    """A pruning schedule, validated once at the edge.

    mode: lazy re-selects at every decode step and revives tokens from the Aux Cache; static
    selects once during prefill and keeps that selection; random drops at random (once, like
    static) at the same budget; off computes every token at every layer.
    stages: (layer, keep) pairs, 0-based layer after which only the top `keep` fraction of the
    prompt goes on. Layers increase, keep fractions do not.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: Mode = "lazy"
    stages: tuple[tuple[int, float], ...] = ()
    sink_tokens: int = Field(0, ge=0)
    granularity: Literal["token", "block"] = "token"
    block_size: int = Field(16, ge=1)
    seed: int = 0

    @field_validator("stages")
    @classmethod
    def _check_stages(cls, stages):
        layers = [layer for layer, _ in stages]
        keeps = [keep for _, keep in stages]
        if any(layer < 0 for layer in layers):
            raise ValueError("stage layers must be >= 0")
        if layers != sorted(set(layers)):
            raise ValueError(f"stage layers must strictly increase, got {layers}")
        if any(not 0.0 < keep <= 1.0 for keep in keeps):
            raise ValueError(f"keep fractions must be in (0, 1], got {keeps}")
        if keeps != sorted(keeps, reverse=True):
            raise ValueError(f"keep fractions must not increase, got {keeps}")
        return stages

    @model_validator(mode="after")
    def _check_mode(self):
        if self.mode != "off" and not self.stages:
            raise ValueError(f"mode {self.mode!r} needs at least one stage")
        return self

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def reselects(self) -> bool:
        """Whether decode steps select again (and so may revive tokens)."""
        return self.mode == "lazy"

    def check_for(self, num_layers: int) -> "PruneConfig":
        """Raise if a stage does not fit a model of num_layers layers."""
        for layer, _ in self.stages:
            if layer >= num_layers - 1:
                raise ValueError(f"stage layer {layer} must be below the last layer ({num_layers - 1})")
        return self

    def keep_at(self, layer: int) -> float | None:
        for stage_layer, keep in self.stages:
            if stage_layer == layer:
                return keep
        return None

    def computed_fraction(self, num_layers: int) -> float:
        """Share of the prompt's token-layers a prefill computes under this schedule (block rounding aside)."""
        if not self.enabled:
            return 1.0
        total, keep, previous = 0.0, 1.0, 0
        for layer, fraction in self.stages:
            total += (layer + 1 - previous) * keep
            keep, previous = fraction, layer + 1
        total += (num_layers - previous) * keep
        return total / num_layers


OFF = PruneConfig(mode="off")


@dataclass(frozen=True)
class ScoreInputs:
    """What a scorer may look at. attention: the last query's attention per candidate, or None if unused."""

    layer: int
    positions: torch.Tensor  # [c] original positions of the candidates
    attention: torch.Tensor | None  # [c]


@dataclass(frozen=True)
class AttentionScorer:
    """LazyLLM: importance is the last query's attention probability, averaged over heads."""

    needs_attention = True

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        return inputs.attention


@dataclass(frozen=True)
class RandomScorer:
    """Random drop at the same budget; deterministic for (seed, layer)."""

    seed: int
    needs_attention = False

    def score(self, inputs: ScoreInputs) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + inputs.layer)
        return torch.rand(int(inputs.positions.max()) + 1, generator=generator)[inputs.positions.cpu()].to(
            inputs.positions.device
        )


def scorer_for(config: PruneConfig):
    return RandomScorer(config.seed) if config.mode == "random" else AttentionScorer()


def select(
    config: PruneConfig,
    keep: float,
    scores: torch.Tensor,
    positions: torch.Tensor,
    num_prompt: int,
) -> torch.Tensor:
    """Boolean mask over candidates: the top `keep` fraction of the prompt, by score.

    scores, positions: [c] for the candidate prompt tokens. The last prompt token and the first
    `sink_tokens` positions are always kept. With block granularity, whole blocks of
    `block_size` consecutive positions are kept or dropped, each scored by its best token.
    """
    budget = max(1, math.ceil(keep * num_prompt))
    forced = (positions == num_prompt - 1) | (positions < config.sink_tokens)
    scores = torch.where(forced, torch.tensor(float("inf"), dtype=scores.dtype, device=scores.device), scores)
    count = positions.shape[0]
    if budget >= count:
        return torch.ones(count, dtype=torch.bool, device=positions.device)
    if config.granularity == "token":
        chosen = torch.zeros(count, dtype=torch.bool, device=positions.device)
        chosen[torch.topk(scores, budget, sorted=False).indices] = True
        return chosen | forced
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
    return taken[blocks] | forced


# The default schedule, as (depth fraction, keep fraction) so that it fits any layer count; on
# SmolLM2's 30 layers it reads (3, 0.5), (6, 0.3), (12, 0.15). Chosen by the evaluation (docs/results.md).
DEFAULT_STAGES = ((0.1, 0.5), (0.2, 0.3), (0.4, 0.15))


def default_pruning(num_layers: int) -> PruneConfig:
    stages: dict[int, float] = {}
    for depth, keep in DEFAULT_STAGES:
        layer = min(max(round(depth * num_layers), 0), num_layers - 2)
        stages.setdefault(layer, keep)
    return PruneConfig(mode="lazy", stages=tuple(sorted(stages.items())))
