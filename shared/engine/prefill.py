"""Lazy prefill: the prompt's forward pass, pruning the live token set at each stage layer.

At layer l the live set (sorted original positions) is computed; its KV is written to the cache.
After a stage layer, the attention of the last live queries (the configured window) scores the
live tokens, the top fraction goes on, and the rest stop: their hidden states go to that layer's
Aux Cache. A `lazy` schedule keeps that window of queries for decode's re-selection. Every
finished layer is handed to `on_layer` as a LayerFrame, which the disaggregated prefill streams
as it comes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.engine.cache import LazyCache, QueryWindow
from shared.engine.layer import attend, finish, logits_of, project_qkv, window_scores
from shared.engine.model import EngineModel
from shared.engine.pruning import PruneConfig, ScoreInputs, scorer_for, select


@dataclass(frozen=True)
class LayerFrame:
    """What one layer of prefill added: KV of the tokens computed there, Aux entries made there."""

    layer: int
    positions: torch.Tensor  # [m]
    k: torch.Tensor  # [1, Hkv, m, D]
    v: torch.Tensor  # [1, Hkv, m, D]
    aux_positions: torch.Tensor  # [a]
    aux_hidden: torch.Tensor  # [a, hidden]
    window: QueryWindow | None = None  # at a stage layer of a lazy schedule with window > 1


class PrefillRun:
    """A prefill that runs one layer per `step()`, so a scheduler can put decode steps between
    layers (chunked prefill at layer granularity). Every layer sees the whole live set, so the
    result is the same tensors, bit for bit, as running it in one go: a stage layer's selection
    needs the attention of the last queries over every key, which a token-chunked layer would only
    have after its last chunk. `prefill()` is a run stepped to the end.
    """

    @torch.inference_mode()
    def __init__(
        self,
        model: EngineModel,
        ids: torch.Tensor,
        config: PruneConfig,
        *,
        reserve: int = 0,
        on_layer: Callable[[LayerFrame], None] | None = None,
    ):
        n = ids.shape[0]
        if n < 1:
            raise ValueError("empty prompt")
        self.model, self.on_layer, self.num_prompt = model, on_layer, n
        self.config = config.for_prompt(n)
        self.cache = LazyCache.empty(model.spec, n, reserve, model.dtype, model.device)
        self.scorer = scorer_for(self.config)
        self.positions = torch.arange(n, device=model.device)  # the live set, sorted
        self.ids = ids
        self.h: torch.Tensor | None = None  # [live, hidden]; embedded at the first step
        self.layer = 0
        self.logits: torch.Tensor | None = None  # [vocab], once the last layer has run

    @property
    def done(self) -> bool:
        return self.logits is not None

    @property
    def next_rows(self) -> int:
        """Rows the next step computes: no later step computes more."""
        return self.positions.shape[0]

    @torch.inference_mode()
    def step(self) -> int:
        """Run the next layer; returns the rows it computed."""
        if self.done:
            raise RuntimeError("the prefill has finished")
        model, cache, config, index = self.model, self.cache, self.config, self.layer
        if self.h is None:
            self.h = model.embed_tokens(self.ids.to(model.device))
        positions, h = self.positions, self.h
        n = self.num_prompt
        q, k, v = project_qkv(model, index, h, positions)
        cache.write(index, positions, k, v)
        cache.kept_per_layer.append(positions.shape[0])
        written, aux_positions, aux_hidden, window = positions, positions[:0], h[:0], None
        if index == model.spec.num_layers - 1:
            # Only the last row's output is used: the others need KV here, not attention or MLP.
            h = finish(model, index, h[-1:], attend(model, q[:, :, -1:], k, v))
            self.logits = logits_of(model, h)[0]
        else:
            h = finish(model, index, h, attend(model, q, k, v, is_causal=True))
            keep = config.keep_at(index) if config.enabled else None
            if keep is not None:
                w = config.window
                attention = None
                if self.scorer.needs_attention:
                    attention = window_scores(model, q[:, :, -w:], k, None, positions[-w:], positions)
                scores = self.scorer.score(ScoreInputs(index, positions, attention))
                chosen = select(config, keep, scores, positions, n, mass=attention)
                if config.reselects and w > 1:
                    window = cache.windows[index] = QueryWindow(positions[-w:].clone(), q[:, :, -w:].clone())
                aux_positions, aux_hidden = positions[~chosen], h[~chosen]
                cache.stash(index, aux_positions, aux_hidden)
                positions, h = positions[chosen], h[chosen]
        self.positions, self.h = positions, h
        self.layer += 1
        if self.on_layer is not None:
            self.on_layer(LayerFrame(index, written, k, v, aux_positions, aux_hidden, window))
        return written.shape[0]


def prefill(
    model: EngineModel,
    ids: torch.Tensor,
    config: PruneConfig,
    *,
    reserve: int = 0,
    on_layer: Callable[[LayerFrame], None] | None = None,
) -> tuple[LazyCache, torch.Tensor]:
    """Run the prompt `ids` [n]; return the cache and the next-token logits [vocab].

    reserve: room to preallocate for decode steps (generated tokens and revivals).
    """
    run = PrefillRun(model, ids, config, reserve=reserve, on_layer=on_layer)
    while not run.done:
        run.step()
    return run.cache, run.logits
