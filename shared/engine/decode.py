"""Decode steps with LazyLLM's per-step re-selection and revival from the Aux Cache, batched.

`decode_batch` advances any number of sequences by one token each in one pass over the layers:
the rows of every sequence (its new token, plus the tokens it revives at that layer) go through
the norms, the q/k/v and output projections and the MLP as one matrix, so the weights are read
once per step for the whole batch. Selection and the Aux Cache stay per sequence, each with its
own cache and pruning config; `decode_step` is a batch of one.

Within one sequence: the new token runs through every layer. Under `lazy`, each stage layer scores
the live prompt tokens by the attention of the new token and the query window before it (the
configured `window`; 1 is the new token alone) and keeps the top fraction (generated tokens are
always kept). A kept token that has no KV at the next layer stopped exactly at this one, so its
hidden state is in this layer's Aux Cache: it is revived from there and computed onward, layer by
layer, together with the new token, until it is dropped again (back into the Aux Cache) or reaches
the last layer. Under `static`, `random` and `off`, the live set at each layer is whatever has KV
there.

Revived rows are the pruned step's largest cost (`lazyserve bench step`), so two config fields
bound them: `revive_budget` caps the prompt tokens one re-selection revives (best first; the slots
left go to tokens already computed deeper), `reselect_every` keeps each stage's live set between
re-selections. At the first stage the window's older queries keep their attention rows in a memo
(QueryWindow.rows): each step scores one new query row, not `window` of them.

Attention: where the caches decode from a DecodeSlots (slots.py; the decode worker's Scheduler
keeps one), each layer writes every new token's K/V row in one call and attends every new token
in one call over the batch's slots, keys past a slot's size and keys its live set leaves out
masked (_SlotStep). Only revived rows, a few at a re-selection step, are written and attend per
sequence. Without slots, with batch invariance on (a slot call's shape depends on the batch) and
at sliding-window layers (whose keys are each query's window), each sequence attends in a call of
its own (_attend_each). In float32 the two agree to rounding; bfloat16 rounds a slot call's
padded, masked sums otherwise, a step or two on a logit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from shared import kernels
from shared.compute import require_compute_thread
from shared.engine.cache import LazyCache, QueryWindow
from shared.engine.layer import (
    attend,
    attend_live,
    attend_slots,
    causal_mask,
    finish,
    logits_of,
    mask_and,
    project_qkv,
    window_mask,
    window_probs,
    window_scores,
)
from shared.engine.model import EngineModel
from shared.engine.pruning import PruneConfig, ScoreInputs, scorer_for, select
from shared.engine.slots import DecodeSlots


class _SequenceStep:
    """One sequence inside a batched step: its rows at the current layer and its live set."""

    def __init__(self, model: EngineModel, cache: LazyCache, config: PruneConfig):
        self.model, self.cache = model, cache
        self.num_prompt = cache.num_prompt
        self.config = config.for_prompt(self.num_prompt)
        self.new_position = cache.length
        self.reselects = self.config.enabled and self.config.reselects
        # Between re-selections (reselect_every > 1) each stage keeps its last live set: nothing
        # is scored and nothing revives, the new token just joins the live set.
        self.selecting = (self.new_position - self.num_prompt) % self.config.reselect_every == 0
        self.scorer = scorer_for(self.config)
        self.stages = {layer for layer, _ in self.config.stages} if self.reselects else set()
        # Rows computed at the current layer: revived tokens (sorted) and the new token, always last.
        self.rows = torch.tensor([self.new_position], device=model.device)
        self.h: torch.Tensor | None = None  # [rows, hidden]
        self.live: torch.Tensor | None = None  # bool over positions; None: every token with KV here
        self.q = self.key_live = None
        self.depth_written = 0  # layers of the new token's depth written to the cache (_SlotStep defers it)

    def write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this layer's K/V of the rows [1, Hkv, rows, D]."""
        cache = self.cache
        if self.depth_written != index:  # the slot path left the new token's depth to the end of the step
            cache.depth[self.new_position] = index
        cache.write(index, self.rows, k, v)
        self.depth_written = index + 1
        cache.revived_token_layers += self.rows.shape[0] - 1

    def live_keys(self, index: int) -> torch.Tensor | None:
        """bool [keys held at `index`]: which of them are in the live set; None when all are."""
        if self.live is None:
            return None
        key_live = self.live[self.cache.layers[index].positions]
        return None if bool(key_live.all()) else key_live

    def attend(self, index: int, q: torch.Tensor, last: bool) -> torch.Tensor:
        """Attend over the live keys (written already). Returns [1, H, rows or 1, D]."""
        kv = self.cache.layers[index]
        self.q = q
        if kernels.native() and self.model.spec.window_at(index) is None:
            if last or self.rows.shape[0] == 1:
                return self._attend_native(index, q[:, :, -1:], self.rows[-1:])
            return self._attend_native(index, q, self.rows)
        key_live = self.live_keys(index)
        if last or self.rows.shape[0] == 1:
            k, v, live = kv.k, kv.v, key_live
            inside = window_mask(self.model, index, self.rows[-1:], kv.positions)
            if inside is not None:
                # A sliding layer: only its window's keys, gathered, not masked: the sums run over
                # the keys a sliding-window cache holds, as in transformers (in bfloat16 a masked
                # call rounds differently), and the call reads W keys instead of all of them.
                inside = inside[0]
                k, v, live = k[:, :, inside], v[:, :, inside], None if live is None else live[inside]
            return attend(self.model, q[:, :, -1:], k, v, mask=live, masked_call=inside is not None)
        return self.attend_causal(index, q, key_live)

    def attend_causal(self, index: int, q: torch.Tensor, key_live: torch.Tensor | None) -> torch.Tensor:
        """Rows q [1, H, m, D] at the first m of self.rows, causally, by original position, over
        the live keys in the window (revived rows). Returns [1, H, m, D]."""
        kv, rows = self.cache.layers[index], self.rows[: q.shape[2]]
        if kernels.native() and self.model.spec.window_at(index) is None:
            return self._attend_native(index, q, rows)
        mask = mask_and(causal_mask(rows, kv.positions), window_mask(self.model, index, rows, kv.positions))
        return attend(self.model, q, kv.k, kv.v, mask=mask if key_live is None else mask & key_live[None])

    def _attend_native(self, index: int, q: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Rows q [1, H, m, D] at positions `rows` [m] over this layer's keys they see (causal, in
        the live set), read by the native kernel: only those keys. Returns [1, H, m, D]."""
        kv, device = self.cache.layers[index], q.device
        sizes = torch.tensor([kv.size], device=device)
        row_slot = torch.zeros(rows.shape[0], dtype=torch.long, device=device)
        live = None if self.live is None else self.live[None]
        return attend_live(self.model, q, kv.k, kv.v, kv.positions[None], sizes, row_slot, rows, live)

    def reselect(self, index: int) -> bool:
        """After layer `index`: pick the live set, stash the rows that stop here, revive the ones
        that go on. False where `index` is not a stage of this sequence (nothing changed)."""
        config, cache = self.config, self.cache
        keep = config.keep_at(index) if self.reselects else None
        if keep is None:
            return False
        kv = cache.layers[index]
        window = self._push_window(index) if config.window > 1 else None
        held = cache.selected.get(index)
        live = torch.ones(self.new_position + 1, dtype=torch.bool, device=self.model.device)
        if self.selecting or held is None:
            self.key_live = self.live_keys(index)  # before this stage changes the live set
            held = cache.selected[index] = self._select(index, keep, kv, window)
        live[: self.num_prompt] = held
        self.live = live
        # Rows dropped here stop after this layer; kept tokens that stopped here earlier revive.
        staying = live[self.rows]
        cache.stash(index, self.rows[~staying], self.h[~staying])
        rows, h = self.rows[staying], self.h[staying]
        waiting = cache.aux[index].positions
        revived = waiting[live[waiting]] if waiting.shape[0] else waiting
        if revived.shape[0]:
            cache.revived.update(revived.tolist())
            rows = torch.cat([revived, rows])
            h = torch.cat([cache.revive(index, revived), h])
            order = torch.argsort(rows)
            rows, h = rows[order], h[order]
        self.rows, self.h = rows, h
        return True

    def _select(self, index: int, keep: float, kv, window: QueryWindow | None) -> torch.Tensor:
        """The prompt tokens kept past stage `index` this step: bool [prompt]."""
        config = self.config
        candidates = kv.positions < self.num_prompt
        if self.key_live is not None:
            candidates &= self.key_live
        positions = kv.positions[candidates]
        attention = None
        if self.scorer.needs_attention:
            attention = self._scores(index, kv, window)[candidates]
        scores = self.scorer.score(ScoreInputs(index, positions, attention))
        if config.revive_budget == 0:  # nothing may revive: one pass without the waiting tokens
            waiting = self.cache.depth[positions] == index + 1
            chosen = select(config, keep, scores, positions, self.num_prompt, mass=attention, exclude=waiting)
        else:
            chosen = select(config, keep, scores, positions, self.num_prompt, mass=attention)
            if config.revive_budget is not None:
                chosen = self._within_budget(index, keep, scores, positions, chosen, attention)
        held = torch.zeros(self.num_prompt, dtype=torch.bool, device=self.model.device)
        held[positions[chosen]] = True
        return held

    def _within_budget(self, index, keep, scores, positions, chosen, attention) -> torch.Tensor:
        """The selection with at most `revive_budget` revivals from this layer's Aux Cache, the
        best-scored first (whole blocks under block granularity); the slots the others leave go to
        the best candidates that already have KV deeper, so the stage keeps its budget of tokens."""
        config = self.config
        waiting = self.cache.depth[positions] == index + 1  # stopped here: taking them revives them
        reviving = chosen & waiting
        count = int(reviving.sum())
        if count <= config.revive_budget:
            return chosen
        units = positions // config.block_size if config.granularity == "block" else positions
        unit_ids, inverse = torch.unique(units[reviving], return_inverse=True)
        best = torch.full((unit_ids.shape[0],), float("-inf"), dtype=scores.dtype, device=scores.device)
        best = best.scatter_reduce(0, inverse, scores[reviving], reduce="amax")
        sizes = torch.bincount(inverse, minlength=unit_ids.shape[0])
        order = torch.argsort(best, descending=True, stable=True)
        allowed_units = unit_ids[order[torch.cumsum(sizes[order], 0) <= config.revive_budget]]
        deferred = waiting & ~torch.isin(units, allowed_units)
        return select(config, keep, scores, positions, self.num_prompt, mass=attention, exclude=deferred)

    def _push_window(self, index: int) -> QueryWindow:
        """The query window at stage `index` after this step's new query [1, H, 1, D] joins it."""
        q_new, position = self.q[:, :, -1:], self.rows[-1:]
        window = self.cache.windows.get(index)
        window = QueryWindow(position, q_new) if window is None else window.push(position, q_new, self.config.window)
        self.cache.windows[index] = window
        return window

    def _scores(self, index: int, kv, window: QueryWindow | None) -> torch.Tensor:
        """Window attention over this layer's keys [count]; the new query [1, H, 1, D] alone for window 1."""
        if window is None:
            return window_scores(self.model, self.q[:, :, -1:], kv.k, self.key_live)
        if self.key_live is not None or index != self.config.stages[0][0]:
            # Past the first stage, keys are masked and revived ones join: the rows change.
            return window_scores(self.model, window.q, kv.k, self.key_live, window.positions, kv.positions)
        return self._memo_scores(kv, window)

    def _memo_scores(self, kv, window: QueryWindow) -> torch.Tensor:
        """The window's scores with each older query's row from the memo (their keys are all there
        and do not change; later keys are later positions, which they cannot see): one new row a
        step. Equal to window_scores up to the order of its sums (each row averaged over the heads
        first, then the rows summed). A memo that does not hold every query but the newest (a step
        that pushed without scoring, under reselect_every) is rebuilt whole."""
        memo, w = window.rows, window.q.shape[2]
        fresh = 1 if memo is not None and len(memo) == w - 1 else w
        probs = window_probs(self.model, window.q[:, :, -fresh:], kv.k, None, window.positions[-fresh:], kv.positions)
        new_rows = tuple(probs.mean(dim=(0, 1)).unbind(0))  # [fresh] rows of [keys held now]
        window.rows = (memo if fresh == 1 else ()) + new_rows
        scores = torch.zeros(kv.size, dtype=torch.float32, device=kv.k.device)
        for row in window.rows:
            scores[: row.shape[0]] += row
        return scores


class _SlotStep:
    """The sequences of one step in a DecodeSlots: per layer, one write of the new tokens' K/V
    rows and one attention call for every new token; revived rows (a few, at re-selection steps)
    are written and attend per sequence."""

    def __init__(self, model: EngineModel, slots: DecodeSlots, seqs: list[_SequenceStep]):
        self.model, self.slots, self.seqs = model, slots, seqs
        slot_of = {}
        for i, seq in enumerate(seqs):
            slot = slots.join(seq.cache)
            if slot is not None:  # else left out of the store (slots.py): it attends alone
                slot_of[i] = slot
                seq.cache.claim(seq.new_position)
        self.order = sorted(slot_of, key=slot_of.__getitem__)  # the members' batch indices, in slot order
        ordered = [slot_of[i] for i in self.order]
        first = ordered[0] if ordered else 0
        if ordered != list(range(first, first + len(ordered))):
            # Not a run of slots (a batch of some of the members, when more run than one step
            # takes): one call would read a copy of their keys, which costs what it saves.
            self.order, ordered = [], []
        self.everyone = len(self.order) == len(seqs)
        self.row_of = {i: j for j, i in enumerate(self.order)}  # a member's row in slot order
        device = model.device
        self.slot_ids = torch.tensor(ordered, dtype=torch.long, device=device)
        self.span = slice(first, first + len(ordered))
        self.new_positions = torch.tensor([seqs[i].new_position for i in self.order], device=device)
        self.in_order = self.order == list(range(len(seqs)))
        self.order_tensor = torch.tensor(self.order, dtype=torch.long, device=device)
        # With every sequence a member, where each member's row of a slot-order tensor goes back to.
        self.to_batch = torch.tensor(sorted(range(len(self.order)), key=self.order.__getitem__), device=device)
        self.live_table: torch.Tensor | None = None  # bool [members, positions], slot order; None: all live

    def attend(self, index: int, q, k, v, sizes: list[int], last: bool) -> torch.Tensor:
        """Write the layer's K/V rows, then attend. Returns [1, H, rows (1 a sequence if last), D]."""
        seqs, n = self.seqs, len(self.seqs)
        ends = list(itertools.accumulate(sizes))
        alone = {}  # the outputs of sequences left out of the store
        for i, (seq, end, size) in enumerate(zip(seqs, ends, sizes)):
            rows = slice(end - size, end)
            if i not in self.row_of:
                seq.write(index, k[:, :, rows], v[:, :, rows])
                alone[i] = seq.attend(index, q[:, :, rows], last)
                continue
            if size > 1 or index in seq.stages:  # what reselect and the revived rows' call read
                seq.q = q[:, :, rows]
            if size > 1:  # revived rows join here: written alone, in the cache's own order
                seq.write(index, k[:, :, rows], v[:, :, rows])
        if not self.order:
            return torch.cat([alone[i] for i in range(n)], dim=2)
        if self.everyone and ends[-1] == n:  # one row each, in batch order (no revival at this layer)
            single = self.order
            k_new, v_new, q_new = k[0].transpose(0, 1), v[0].transpose(0, 1), q[0].transpose(0, 1)
            if not self.in_order:
                k_new, v_new, q_new = (x.index_select(0, self.order_tensor) for x in (k_new, v_new, q_new))
        else:
            single = [i for i in self.order if sizes[i] == 1]
            tails = torch.tensor([ends[i] - 1 for i in self.order], dtype=torch.long, device=q.device)
            q_new = q[0, :, tails].transpose(0, 1)
            rows = torch.tensor([ends[i] - 1 for i in single], dtype=torch.long, device=q.device)
            k_new, v_new = k[0, :, rows].transpose(0, 1), v[0, :, rows].transpose(0, 1)
        if single:
            self._write(index, single, k_new, v_new)
        news = self._attend_new(index, q_new.unsqueeze(2))  # [1, H, members, D], slot order
        if self.everyone and (last or len(single) == n):
            return news if self.in_order else news.index_select(2, self.to_batch)
        outs = []
        for i, (seq, end, size) in enumerate(zip(seqs, ends, sizes)):
            if i in alone:
                outs.append(alone[i])
                continue
            if size > 1 and not last:
                outs.append(seq.attend_causal(index, q[:, :, end - size : end - 1], seq.live_keys(index)))
            outs.append(news[:, :, self.row_of[i] : self.row_of[i] + 1])
        return torch.cat(outs, dim=2)

    def _write(self, index: int, single: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """The new K/V rows [len(single), Hkv, D] of the sequences `single` (batch indices in slot
        order), each at the end of its slot, in one write."""
        at = []
        for i in single:
            cache = self.seqs[i].cache
            layer = cache.layers[index]
            if layer.size + 1 > layer.capacity:
                layer.resize(layer.size + 1 + layer.capacity)  # the store grows for every slot
            at.append(layer.size)
            layer.appended(1)
            cache.computed_token_layers += 1
        slots, positions = self.slot_ids, self.new_positions
        if len(single) != len(self.order):
            where = torch.tensor([self.row_of[i] for i in single], device=k.device)
            slots, positions = slots[where], positions[where]
        self.slots.write(index, slots, torch.tensor(at, device=k.device), positions, k, v)

    def _attend_new(self, index: int, q: torch.Tensor) -> torch.Tensor:
        """Each sequence's new token q [n, H, 1, D] (slot order) over its live keys: [1, H, n, D]."""
        sizes = [self.seqs[i].cache.layers[index].size for i in self.order]
        k, v, positions = self.slots.store(index, self.span)
        if kernels.native():  # the kernel reads each slot's live keys and nothing past its size
            held = torch.tensor(sizes, device=q.device)
            row_slot = torch.arange(len(sizes), device=q.device)
            return attend_live(
                self.model,
                q.squeeze(2).transpose(0, 1).unsqueeze(0),
                k,
                v,
                positions,
                held,
                row_slot,
                self.new_positions,
                self.live_table,
            )
        width = max(sizes)
        k, v, positions = k[:, :, :width], v[:, :, :width], positions[:, :width]
        mask = None
        if min(sizes) < width:
            mask = torch.arange(width, device=q.device)[None, :] < torch.tensor(sizes, device=q.device)[:, None]
        if self.live_table is not None:
            live = self.live_table.gather(1, positions.clamp(max=self.live_table.shape[1] - 1))
            mask = live if mask is None else mask & live
        out = attend_slots(self.model, q, k, v, mask)  # [n, H, 1, D]
        return out.squeeze(2).transpose(0, 1).unsqueeze(0)

    def selected(self) -> None:
        """After a stage layer: the live sets as one table, for the masks of the layers below."""
        lives = [self.seqs[i].live for i in self.order]
        if all(live is None for live in lives):
            self.live_table = None
            return
        width = max(seq.new_position + 1 for seq in self.seqs)
        table = torch.ones(len(lives), width, dtype=torch.bool, device=self.model.device)
        for row, live in zip(table, lives):
            if live is not None:
                row[: live.shape[0]] = live
        self.live_table = table

    def finish(self) -> None:
        """The new tokens' depth: every layer (claimed at the start; the slot writes leave it)."""
        layers = self.model.spec.num_layers
        for seq in (self.seqs[i] for i in self.order):
            if seq.depth_written != layers:
                seq.cache.depth[seq.new_position] = layers


def _attend_each(seqs: list[_SequenceStep], index: int, q, k, v, sizes: list[int], last: bool) -> torch.Tensor:
    """Each sequence's write and attention call on its own. Returns [1, H, rows (1 a sequence if last), D]."""
    outs, start = [], 0
    for seq, size in zip(seqs, sizes):
        end = start + size
        seq.write(index, k[:, :, start:end], v[:, :, start:end])
        outs.append(seq.attend(index, q[:, :, start:end], last))
        start = end
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]


@torch.inference_mode()
def decode_batch(
    model: EngineModel, batch: Sequence[tuple[LazyCache, int, PruneConfig]], slots: DecodeSlots | None = None
) -> torch.Tensor:
    """Append each (cache, token, config)'s token at its cache's next position, all in one pass.

    Returns the logits [len(batch), vocab] for each sequence's next token, in batch order. The
    caches must be distinct: a sequence appears at most once per step. slots: where the caches
    decode together (they join it here; the caller has them leave when they finish), for one
    write and one attention call per layer; without it, or with batch invariance on, each
    sequence attends in a call of its own.
    """
    require_compute_thread("a decode step")
    if not batch:
        raise ValueError("an empty batch")
    if len({id(cache) for cache, _, _ in batch}) != len(batch):
        raise ValueError("a cache appears twice in one batch")
    seqs = [_SequenceStep(model, cache, config) for cache, _, config in batch]
    # Batch invariance: the native kernels compute a row alike in any call, so the step runs as
    # without it; on torch's, each row-wise call is a fixed tile and each sequence attends in a
    # call of its own (a slot call's shape depends on the batch).
    native_rows = model.batch_invariant and kernels.native()
    tile = None if native_rows else model.decode_tile
    together = _SlotStep(model, slots, seqs) if slots is not None and tile is None else None
    tokens = torch.tensor([token for _, token, _ in batch], device=model.device)
    h = model.embed_tokens(tokens)  # [batch, hidden]: one row per sequence to start with
    for seq, rows in zip(seqs, h.split(1)):
        seq.h = rows
    with kernels.invariant_rows(native_rows):
        return _layers(model, seqs, together, tile)


def _layers(model: EngineModel, seqs: list[_SequenceStep], together: _SlotStep | None, tile: int | None):
    """decode_batch's pass over the layers: the logits [len(seqs), vocab]."""
    last_layer = model.spec.num_layers - 1
    for index in range(model.spec.num_layers):
        sizes = [seq.rows.shape[0] for seq in seqs]
        h = torch.cat([seq.h for seq in seqs]) if len(seqs) > 1 else seqs[0].h
        rows = torch.cat([seq.rows for seq in seqs]) if len(seqs) > 1 else seqs[0].rows
        q, k, v = project_qkv(model, index, h, rows, tile)
        last = index == last_layer
        if together is not None and model.spec.window_at(index) is None:
            out = together.attend(index, q, k, v, sizes, last)
        else:  # a sliding layer's keys are its window's: per sequence
            out = _attend_each(seqs, index, q, k, v, sizes, last)
        if last:
            # Only each sequence's new token predicts: the other rows needed KV here, nothing more.
            tails = torch.cat([seq.h[-1:] for seq in seqs]) if len(seqs) > 1 else seqs[0].h[-1:]
            if together is not None:
                together.finish()
            return logits_of(model, finish(model, index, tails, out, tile), tile)
        h = finish(model, index, h, out, tile)
        stage = False
        for seq, rows_h in zip(seqs, h.split(sizes)):
            seq.h = rows_h
            stage |= seq.reselect(index)
        if together is not None and stage:
            together.selected()
    raise RuntimeError("unreachable: the last layer returns")


def decode_step(model: EngineModel, cache: LazyCache, token: int, config: PruneConfig) -> torch.Tensor:
    """Append `token` at the next position and return the logits [vocab] for the one after it."""
    return decode_batch(model, [(cache, token, config)])[0]
