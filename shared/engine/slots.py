"""DecodeSlots: the running sequences' K/V in one preallocated store per layer, one slot each.

A layer's store is K and V [slots, Hkv, capacity, D] and positions [slots, capacity]; sequence s
holds its rows of that layer at [s, :, :size] (its LayerKV is a view of that slot, so every
other reader of the cache sees what it always saw). What this layout buys is that one layer of a
decode step is a fixed number of calls whatever the batch size (decode.py): one write of every
sequence's new K/V row, one attention call over the slots of the batch (keys beyond a slot's
size, and keys its selection left out, masked), as gpt-fast's static cache does. A pruned layer's
slots are only as wide as the most any sequence holds there, so a pruned step reads fewer bytes.

The slots of a step's batch are contiguous when the batch is every member (`leave` moves the last
member into the freed slot), so the attention call reads a slice of the store, not a copy.
Capacity per layer is the most any member needs (its rows plus its reserved room); a layer that
runs out grows for every slot (doubling), a rare copy. Members of very different lengths would
waste the difference in every slot (vLLM's paged cache avoids it with a paged attention kernel
that torch's CPU build does not have), so `join` leaves out a cache that would make the store
more than twice what its members need: it decodes in the same step, attending alone.

It knows LayerKV's fields (cache.py) and nothing of models, pruning or requests.
"""

from __future__ import annotations

import torch

from shared.contract import ModelSpec
from shared.engine.cache import LayerKV, LazyCache

# Rows a store may hold beyond twice what its members need, in bytes, before a cache is left out.
WASTE_SLACK_BYTES = 64 << 20


class DecodeSlots:
    """One store per layer for the caches that decode together; `join` before a step, `leave` after the last."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device):
        self.spec, self.dtype, self.device = spec, dtype, device
        self.members: list[LazyCache] = []  # by slot
        self._k: list[torch.Tensor] = []  # per layer [slots, Hkv, capacity, D]
        self._v: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []  # per layer [slots, capacity], int64

    @property
    def num_slots(self) -> int:
        return self._k[0].shape[0] if self._k else 0

    def capacity(self, layer: int) -> int:
        return self._k[layer].shape[2] if self._k else 0

    def slot_of(self, cache: LazyCache) -> int | None:
        binding = cache.layers[0].binding
        return binding[1] if binding is not None and binding[0] is self else None

    @torch.inference_mode()
    def join(self, cache: LazyCache) -> int | None:
        """Move `cache`'s K/V into a free slot (a copy, once); its layers become views of it.
        None, and nothing moves, where the store would then hold more than twice what its members
        need (a prompt much longer or shorter than the others): that cache attends alone."""
        if self.slot_of(cache) is not None:
            return self.slot_of(cache)
        if any(layer.binding is not None for layer in cache.layers):
            raise ValueError("a cache decodes from one DecodeSlots at a time")
        slot = len(self.members)
        needs = [max(layer.capacity, layer.size + layer.headroom, 1) for layer in cache.layers]
        if self.members and not self._fits(needs):
            return None
        self._allocate(max(slot + 1, self.num_slots), needs)
        self.members.append(cache)
        for index, layer in enumerate(cache.layers):
            k, v, positions = layer.k, layer.v, layer.positions
            size = layer.size
            self._k[index][slot, :, :size] = k[0]
            self._v[index][slot, :, :size] = v[0]
            self._positions[index][slot, :size] = positions
            self._bind(index, slot, layer)
        return slot

    @torch.inference_mode()
    def leave(self, cache: LazyCache, keep: bool = True) -> None:
        """Take `cache` out: its rows are copied back into buffers of its own (keep=False: dropped,
        for a finished sequence whose stats are taken), and the last member moves into its slot so
        that the members stay contiguous. Nothing happens to a non-member."""
        slot = self.slot_of(cache)
        if slot is None:
            return
        for layer in cache.layers:
            layer.unbind(keep)
        last = len(self.members) - 1
        moved = self.members.pop()
        if slot != last:
            self.members[slot] = moved
            for index, layer in enumerate(moved.layers):
                size = layer.size
                self._k[index][slot, :, :size] = self._k[index][last, :, :size]
                self._v[index][slot, :, :size] = self._v[index][last, :, :size]
                self._positions[index][slot, :size] = self._positions[index][last, :size]
                self._bind(index, slot, layer)
        if not self.members:  # nothing held: give the memory back
            self._k, self._v, self._positions = [], [], []

    @torch.inference_mode()
    def _fits(self, needs: list[int]) -> bool:
        """Whether the store, grown for a cache that needs `needs[l]` rows at layer l, holds at most
        twice the rows its members and that cache need (or WASTE_SLACK_BYTES more, for small stores)."""
        slots = max(len(self.members) + 1, self.num_slots)
        rows = sum(max(need, self.capacity(index)) for index, need in enumerate(needs)) * slots
        needed = sum(needs) + sum(layer.size + layer.headroom for cache in self.members for layer in cache.layers)
        row_bytes = 2 * self.spec.num_kv_heads * self.spec.head_dim * torch.finfo(self.dtype).bits // 8
        return rows <= 2 * needed or (rows - needed) * row_bytes <= WASTE_SLACK_BYTES

    def grow(self, layer: int, capacity: int) -> None:
        """Room for `capacity` rows in every slot of `layer` (LayerKV.resize asks for it)."""
        needs = [self.capacity(index) for index in range(self.spec.num_layers)]
        needs[layer] = max(capacity, 2 * needs[layer])
        self._allocate(self.num_slots, needs)

    def store(self, layer: int, slots: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [n, Hkv, capacity, D] and positions [n, capacity] of a range of slots at `layer`."""
        return self._k[layer][slots], self._v[layer][slots], self._positions[layer][slots]

    def write(self, layer: int, slots: torch.Tensor, rows: torch.Tensor, positions, k, v) -> None:
        """One row per slot: K, V [n, Hkv, D] and positions [n] at row `rows` [n] of `slots` [n].
        The caller keeps each LayerKV's size (LayerKV.appended)."""
        self._k[layer][slots, :, rows] = k
        self._v[layer][slots, :, rows] = v
        self._positions[layer][slots, rows] = positions

    @property
    def allocated_bytes(self) -> int:
        return sum(
            2 * k.numel() * k.element_size() + p.numel() * p.element_size() for k, p in zip(self._k, self._positions)
        )

    def _allocate(self, slots: int, needs: list[int]) -> None:
        """Stores of at least `slots` slots and `needs[l]` rows at layer l, keeping what is held."""
        spec = self.spec
        if slots <= self.num_slots and all(need <= self.capacity(i) for i, need in enumerate(needs)):
            return
        held = self.num_slots
        if slots > held:
            slots = max(slots, 2 * held)
        fresh = not self._k
        for index in range(spec.num_layers):
            old = 0 if fresh else self.capacity(index)
            capacity = max(needs[index], old)
            if not fresh and slots == held and capacity == old:
                continue
            k = torch.zeros(slots, spec.num_kv_heads, capacity, spec.head_dim, dtype=self.dtype, device=self.device)
            v = torch.zeros_like(k)
            positions = torch.zeros(slots, capacity, dtype=torch.long, device=self.device)
            if fresh:
                self._k.append(k), self._v.append(v), self._positions.append(positions)
                continue
            k[:held, :, :old] = self._k[index]
            v[:held, :, :old] = self._v[index]
            positions[:held, :old] = self._positions[index]
            self._k[index], self._v[index], self._positions[index] = k, v, positions
        for slot, cache in enumerate(self.members):
            for index, layer in enumerate(cache.layers):
                self._bind(index, slot, layer)

    def _bind(self, index: int, slot: int, layer: LayerKV) -> None:
        layer.bind(
            (self, slot, index),
            self._k[index][slot : slot + 1],
            self._v[index][slot : slot + 1],
            self._positions[index][slot],
        )
