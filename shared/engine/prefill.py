"""Lazy prefill: the prompt's forward pass, pruning the live token set at each stage layer.

At layer l the live set (sorted original positions) is computed; its KV is written to the cache.
After a stage layer, the attention of the last live queries (the configured window) scores the
live tokens, the top fraction goes on, and the rest stop: their hidden states go to that layer's
Aux Cache. A `lazy` schedule keeps that window of queries for decode's re-selection. Every
finished layer is handed to `on_layer` as a LayerFrame, which the disaggregated prefill streams
as it comes.

A prefill may start from a prefix cache hit (shared/engine/prefix.py): at the shared layers only
the new tokens are computed, over the cached keys and their own; leaving the last shared layer
the cached tokens rejoin from their stored hidden states, and selection scores every token with
this prompt's own query window, as without the cache.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shared.compute import require_compute_thread
from shared.engine.cache import BoundaryStates, LazyCache, QueryWindow
from shared.engine.layer import (
    attend,
    causal_mask,
    finish,
    logits_of,
    mask_and,
    project_qkv,
    prompt_attention,
    window_mask,
    window_scores,
)
from shared.engine.model import EngineModel
from shared.engine.prefix import PrefixHit, held_layers
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
    # Leaving the last layer a prefix cache holds, when the run keeps it: the hidden states of the
    # tokens that went on deeper (those that stopped are in aux_hidden), so that a receiver holds
    # every prompt token's state there and can cache the prompt too.
    boundary_positions: torch.Tensor | None = None  # [b]
    boundary_hidden: torch.Tensor | None = None  # [b, hidden]


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
        prefix: PrefixHit | None = None,
        keep_boundary: bool = False,
    ):
        require_compute_thread("a prefill")
        n = ids.shape[0]
        if n < 1:
            raise ValueError("empty prompt")
        self.model, self.on_layer, self.num_prompt = model, on_layer, n
        held = held_layers(config, model.spec.num_layers)
        if prefix is not None:
            if prefix.layers != held:
                raise ValueError(f"a prefix of {prefix.layers} layers for a schedule that shares {held}")
            if not 0 < prefix.tokens <= n - max(config.for_prompt(n).window, 1):
                raise ValueError(f"a prefix of {prefix.tokens} tokens leaves no query window in {n}")
        self.prefix, self.held = prefix, held
        model.spec.check(config)  # stages only where the last query sees the whole prompt
        self.config = config.for_prompt(n)
        self.cache = LazyCache.empty(model.spec, n, reserve, model.dtype, model.device)
        self.cache.cached_tokens = 0 if prefix is None else prefix.tokens
        self.scorer = scorer_for(self.config)
        start = 0 if prefix is None else prefix.tokens
        self.positions = torch.arange(start, n, device=model.device)  # the live set computed, sorted
        self.prompt_ids = ids
        self.ids = ids[start:]  # the tokens this run computes from layer 0
        self.prefix_keys: list[bytes] = []  # set by a PrefixReuse: the prompt's block keys
        self.h: torch.Tensor | None = None  # [live, hidden]; embedded at the first step
        self.layer = 0
        self._masks: dict[tuple, tuple] = {}  # (window, hit) -> (query positions, key positions, mask)
        self._prompt_masks: dict[tuple, torch.Tensor] = {}  # prompt_attention's masks
        self.logits: torch.Tensor | None = None  # [vocab], once the last layer has run
        self.started_s: float | None = None  # perf_counter at the first step
        self.elapsed_s: float | None = None  # from the first step to the logits
        # With keep_boundary, the cache keeps every token's hidden state leaving layer held - 1
        # (what a prefix cache entry holds besides K/V); decode adds the generated tokens'.
        self.keep_boundary = keep_boundary and held < model.spec.num_layers
        if self.keep_boundary:
            spec = model.spec
            self.cache.boundary = BoundaryStates(held - 1, spec.hidden_size, model.dtype, model.device, n + reserve)

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
        require_compute_thread("a prefill")
        if self.done:
            raise RuntimeError("the prefill has finished")
        if self.started_s is None:
            self.started_s = time.perf_counter()
        model, cache, config, index = self.model, self.cache, self.config, self.layer
        if self.h is None:
            self.h = model.embed_tokens(self.ids.to(model.device))
        positions, h = self.positions, self.h
        # With batch invariance, prompt rows in fixed tiles, each row at offset (its position) mod
        # PROMPT_TILE: a hit's new rows sit where a prefill from scratch computes them (invariant.py).
        tile, offset = model.prompt_tile, int(positions[0])
        q, k, v = project_qkv(model, index, h, positions, tile, offset)
        hit = self.prefix is not None and index < self.prefix.layers
        if hit:
            # The cached rows first (positions 0..p-1), then the new ones: the layer stays sorted.
            cached = torch.arange(self.prefix.tokens, device=model.device)
            prefix_k, prefix_v = self.prefix.k[index : index + 1], self.prefix.v[index : index + 1]
            cache.write(index, cached, prefix_k.to(model.device), prefix_v.to(model.device), computed=False)
        cache.write(index, positions, k, v)
        layer_kv = cache.layers[index]
        keys, values, key_positions = (layer_kv.k, layer_kv.v, layer_kv.positions) if hit else (k, v, positions)
        cache.kept_per_layer.append(key_positions.shape[0])
        written, aux_positions, aux_hidden, window = key_positions, positions[:0], h[:0], None
        boundary_here = self.keep_boundary and index == self.held - 1
        if index == model.spec.num_layers - 1:
            h = self._last_layer(index, positions, h, q, keys, values, key_positions)
        else:
            out = self._attend(index, q, k, v, keys, values, key_positions, hit, offset)
            h = finish(model, index, h, out, tile, offset)
            if hit and index == self.prefix.layers - 1:
                # Leaving the last shared layer: the cached tokens rejoin from their stored states.
                h = torch.cat([self.prefix.hidden.to(model.device), h])
                positions = key_positions
            if boundary_here:
                cache.boundary.write(positions, h)
            keep = config.keep_at(index) if config.enabled else None
            if keep is not None:
                positions, h, aux_positions, aux_hidden, window = self._select(
                    index, keep, q, keys, positions, key_positions, h
                )
        self.positions, self.h = positions, h
        self.layer += 1
        if self.on_layer is not None:
            frame = LayerFrame(index, written, keys, values, aux_positions, aux_hidden, window)
            if boundary_here:
                frame = dataclasses.replace(frame, boundary_positions=positions, boundary_hidden=h)
            self.on_layer(frame)
        return k.shape[2]

    def _last_layer(self, index: int, positions, h, q, keys, values, key_positions) -> torch.Tensor:
        """The logits; only the last row's output is used (the others need KV here, not attention
        or MLP). Returns that row's hidden state [1, hidden]."""
        model = self.model
        mask = window_mask(model, index, positions[-1:], key_positions)
        h = finish(model, index, h[-1:], attend(model, q[:, :, -1:], keys, values, mask=mask))
        self.logits = logits_of(model, h)[0]
        self.elapsed_s = time.perf_counter() - self.started_s
        self._masks.clear()  # a finished run may be held for decode: not its masks
        self._prompt_masks.clear()
        return h

    def _attend(self, index: int, q, k, v, keys, values, key_positions, hit: bool, offset: int) -> torch.Tensor:
        """The new rows' attention over the keys held at this layer."""
        model = self.model
        if key_positions.shape[0] == self.num_prompt and model.prompt_tile is not None:
            # Every prompt token has K here (no stage has pruned yet): the rows computed are a
            # run of positions to the end, computed as every prompt computes them.
            return prompt_attention(model, index, q, keys, values, offset, self._prompt_masks)
        mask = self._mask(index, self.positions, key_positions, hit)
        if mask is not None:
            return attend(model, q, keys, values, mask=mask)
        return attend(model, q, k, v, is_causal=True)

    def _select(self, index: int, keep: float, q, keys, positions, key_positions, h):
        """A stage layer's cut: (positions, h) that go deeper, and (positions, h) stashed in the
        Aux Cache here, and the query window kept for decode's re-selection (or None)."""
        config, cache, w = self.config, self.cache, self.config.window
        attention = None
        if self.scorer.needs_attention:
            attention = window_scores(self.model, q[:, :, -w:], keys, None, positions[-w:], key_positions)
        scores = self.scorer.score(ScoreInputs(index, positions, attention))
        chosen = select(config, keep, scores, positions, self.num_prompt, mass=attention)
        window = None
        if config.reselects and w > 1:
            window = cache.windows[index] = QueryWindow(positions[-w:].clone(), q[:, :, -w:].clone())
        aux_positions, aux_hidden = positions[~chosen], h[~chosen]
        cache.stash(index, aux_positions, aux_hidden)
        return positions[chosen], h[chosen], aux_positions, aux_hidden, window

    def _mask(self, index: int, positions, key_positions, hit: bool) -> torch.Tensor | None:
        """Causal by original position over the keys held here (a hit's cached ones first), within
        the layer's sliding window if it has one; None where is_causal says it all. A mask is
        reused by every later layer of the same window over the same rows, as transformers builds
        one per layer type: at 8k tokens each is a 64 MB boolean matrix, built in three passes."""
        window = self.model.spec.window_at(index)
        memo = self._masks.get((window, hit))
        if memo is not None and torch.equal(memo[0], positions) and torch.equal(memo[1], key_positions):
            return memo[2]
        sliding = window_mask(self.model, index, positions, key_positions)
        mask = mask_and(causal_mask(positions, key_positions), sliding) if hit or sliding is not None else None
        self._masks[(window, hit)] = (positions, key_positions, mask)
        return mask

    def shared_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a prefix cache keeps of this prompt, once the run is done: K and V of every prompt
        token at the shared layers [held, Hkv, n, D] and, when not every layer is shared, their
        hidden states leaving the last shared one [n, hidden] (the run needs keep_boundary)."""
        if not self.done:
            raise RuntimeError("a prefill's shared rows exist once it has run")
        return self.cache.shared_rows(self.held)


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
