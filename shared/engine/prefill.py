"""Lazy prefill: the prompt's forward pass, pruning the live token set at each stage layer.

At layer l the live set (sorted original positions) is computed; its KV is written to the cache.
After a stage layer, the attention of the last live queries (the configured window) scores the
live tokens, the top fraction goes on, and the rest stop: their hidden states go to that layer's
Aux Cache. A `lazy` schedule keeps that window of queries for decode's re-selection. Every
finished layer is handed to `on_layer` as a LayerFrame, which the disaggregated prefill streams
as it comes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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


@torch.inference_mode()
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
    spec = model.spec
    n = ids.shape[0]
    assert n >= 1, "empty prompt"
    config = config.for_prompt(n)
    cache = LazyCache.empty(spec, n, reserve, model.dtype, model.device)
    scorer = scorer_for(config)
    positions = torch.arange(n, device=model.device)
    h = model.embed_tokens(ids.to(model.device))  # [n, hidden]
    no_aux = positions[:0]
    for index in range(spec.num_layers):
        q, k, v = project_qkv(model, index, h, positions)
        cache.write(index, positions, k, v)
        cache.kept_per_layer.append(positions.shape[0])
        written, aux_positions, aux_hidden, window = positions, no_aux, h[:0], None
        if index == spec.num_layers - 1:
            # Only the last row's output is used: the others need KV here, not attention or MLP.
            h = finish(model, index, h[-1:], attend(model, q[:, :, -1:], k, v))
        else:
            h = finish(model, index, h, attend(model, q, k, v, is_causal=True))
            keep = config.keep_at(index) if config.enabled else None
            if keep is not None:
                w = config.window
                attention = None
                if scorer.needs_attention:
                    attention = window_scores(model, q[:, :, -w:], k, None, positions[-w:], positions)
                scores = scorer.score(ScoreInputs(index, positions, attention))
                chosen = select(config, keep, scores, positions, n, mass=attention)
                if config.reselects and w > 1:
                    window = cache.windows[index] = QueryWindow(positions[-w:].clone(), q[:, :, -w:].clone())
                aux_positions, aux_hidden = positions[~chosen], h[~chosen]
                cache.stash(index, aux_positions, aux_hidden)
                positions, h = positions[chosen], h[chosen]
        if on_layer is not None:
            on_layer(LayerFrame(index, written, k, v, aux_positions, aux_hidden, window))
    return cache, logits_of(model, h[-1])
