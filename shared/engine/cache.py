"""LazyCache: the partial KV cache and the Aux Cache of one generation.

Per layer it holds K and V for exactly the tokens computed at that layer, with their original
positions, in the order they were computed. Per layer it also holds the Aux Cache: the hidden
states of tokens whose computation stopped after that layer, ready to be revived.

`depth[p]` counts the layers at which token p has KV. A token's computed layers are always a
prefix 0..depth-1, so "token p lacks KV at layer l" is `depth[p] <= l`, and computing (p, l)
requires `depth[p] == l`: that check, made on every write, is the at-most-once rule.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from shared.contract import ModelSpec


class InvariantError(AssertionError):
    """A broken cache invariant (a token-layer computed twice, a revival without its state): a bug
    in the caller, raised explicitly so that it also holds under `python -O`."""


class LayerKV:
    """Growable K/V store of one layer. k, v: [1, Hkv, capacity, D]; positions: [capacity].

    Nothing is allocated until the first append, which takes what it writes plus `headroom` rows
    (the tokens decode will add): a pruned layer holds room for its kept tokens, not the prompt's.
    While its sequence decodes in a DecodeSlots (slots.py), the buffers are views of its slot
    there (`binding`: the store, the slot, the layer), and growing asks the store to grow.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, headroom: int = 0):
        shape = (1, spec.num_kv_heads, 0, spec.head_dim)
        self._k = torch.empty(shape, dtype=dtype, device=device)
        self._v = torch.empty(shape, dtype=dtype, device=device)
        self._positions = torch.empty(0, dtype=torch.long, device=device)
        self.headroom = headroom
        self.size = 0
        self.binding: tuple | None = None  # (DecodeSlots, slot, layer) while it is a view of one

    def bind(self, binding: tuple, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Become views of a slot (k, v [1, Hkv, capacity, D], positions [capacity]) that already holds the rows."""
        self.binding, self._k, self._v, self._positions = binding, k, v, positions

    def unbind(self, keep: bool = True) -> None:
        """Leave the slot: the rows and the room move to buffers of its own, or with keep=False
        the layer is emptied (a finished sequence whose stats are taken: nothing reads it again)."""
        if self.binding is None:
            return
        self.binding = None
        rows = slice(0, self.size + self.headroom if keep else 0)  # its rows and its room, not the store's
        self._k, self._v = self._k[:, :, rows].clone(), self._v[:, :, rows].clone()
        self._positions = self._positions[rows].clone()
        self.size = min(self.size, self._positions.shape[0])

    def appended(self, rows: int) -> None:
        """Count `rows` written straight into the slot by DecodeSlots.write."""
        self.size += rows

    def __deepcopy__(self, memo) -> LayerKV:
        """A copy of its own (a fork never shares, nor copies, a DecodeSlots store)."""
        copied = copy.copy(self)
        copied.binding = None
        copied._k, copied._v, copied._positions = self._k.clone(), self._v.clone(), self._positions.clone()
        return copied

    @property
    def capacity(self) -> int:
        return self._positions.shape[0]

    def append(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        m = positions.shape[0]
        if self.size + m > self.capacity:
            growth = self.headroom if self.capacity == 0 else self.capacity  # first fill, then doubling
            self.resize(self.size + m + growth)
        end = self.size + m
        self._k[:, :, self.size : end] = k
        self._v[:, :, self.size : end] = v
        self._positions[self.size : end] = positions
        self.size = end

    def resize(self, capacity: int) -> None:
        """Move to buffers of exactly `capacity` rows (at least the rows held); in a slot, of at least."""
        capacity = max(capacity, self.size)
        if self.binding is not None:
            if capacity > self.capacity:
                slots, _, layer = self.binding
                slots.grow(layer, capacity)  # rebinds this layer's views
            return
        if capacity == self.capacity:
            return
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_empty(old.shape[:2] + (capacity,) + old.shape[3:])
            new[:, :, : self.size] = old[:, :, : self.size]
            setattr(self, name, new)
        positions = self._positions.new_empty(capacity)
        positions[: self.size] = self._positions[: self.size]
        self._positions = positions

    @property
    def k(self) -> torch.Tensor:
        return self._k[:, :, : self.size]

    @property
    def v(self) -> torch.Tensor:
        return self._v[:, :, : self.size]

    @property
    def positions(self) -> torch.Tensor:
        return self._positions[: self.size]

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V rows held."""
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the K/V buffers, room included."""
        return 2 * self._k.numel() * self._k.element_size()


@dataclass
class AuxEntries:
    """Aux Cache of one layer: positions [a] and their hidden states [a, hidden] after that layer."""

    positions: torch.Tensor
    hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size()


@dataclass
class QueryWindow:
    """The last queries seen at one stage layer: positions [w] and q [1, H, w, D], oldest first.
    Decode scores with them plus its new token, so re-selection does not follow one token's whim.

    rows: decode's memo, oldest first, of each query's attention probabilities averaged over the
    heads, float32 [n_i] over the layer's first n_i keys (those held when the query joined). A
    query sees only keys at or before its position, so its row never changes where no earlier key
    is added later (the first stage layer, which holds every prompt token from prefill): decode
    then computes one new row a step instead of w. None until decode first scores there (a
    prefill's or a transfer's window), and whenever it does not hold every query but the newest."""

    positions: torch.Tensor
    q: torch.Tensor
    rows: tuple[torch.Tensor, ...] | None = None

    def push(self, position: torch.Tensor, q: torch.Tensor, size: int) -> QueryWindow:
        """The window after query q [1, H, 1, D] at position [1] joins it, keeping the last `size`.
        The memo keeps the rows of the queries that stay; the new one's row is the caller's."""
        rows = self.rows
        if rows is not None and len(rows) != self.positions.shape[0]:
            rows = None  # a push without scoring left the memo a row short: it no longer lines up
        elif rows is not None and len(rows) >= size:
            rows = rows[1:]
        positions = torch.cat([self.positions, position])[-size:]
        return QueryWindow(positions, torch.cat([self.q, q], dim=2)[:, :, -size:], rows)


class BoundaryStates:
    """Hidden states leaving one layer (the last a prefix cache holds), per position: what a later
    prompt with the same prefix rejoins from. A prefill writes its prompt's rows; once the prompt
    is cached they are dropped (PrefixReuse). Grows like LayerKV."""

    def __init__(self, layer: int, hidden_size: int, dtype: torch.dtype, device: torch.device, capacity: int):
        self.layer = layer
        self.hidden = torch.empty(capacity, hidden_size, dtype=dtype, device=device)
        self.filled = torch.zeros(capacity, dtype=torch.bool, device=device)

    def write(self, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        if positions.shape[0] == 0:
            return
        end = int(positions.max()) + 1
        if end > self.filled.shape[0]:
            capacity = max(end, 2 * self.filled.shape[0])
            grown = self.hidden.new_empty(capacity, self.hidden.shape[1])
            grown[: self.filled.shape[0]] = self.hidden
            filled = self.filled.new_zeros(capacity)
            filled[: self.filled.shape[0]] = self.filled
            self.hidden, self.filled = grown, filled
        self.hidden[positions] = hidden
        self.filled[positions] = True

    def rows(self, count: int) -> torch.Tensor:
        """The states of positions 0..count-1 [count, hidden]; every one must have been written."""
        if count > self.filled.shape[0] or not bool(self.filled[:count].all()):
            raise InvariantError(f"hidden states leaving layer {self.layer} are missing for some of {count} tokens")
        return self.hidden[:count]

    @property
    def nbytes(self) -> int:
        return self.hidden.numel() * self.hidden.element_size()


@dataclass
class LazyCache:
    spec: ModelSpec
    num_prompt: int
    layers: list[LayerKV]
    aux: list[AuxEntries]
    depth: torch.Tensor  # [capacity] int64, layers with KV per position
    length: int = 0  # positions filled: prompt plus generated tokens
    computed_token_layers: int = 0
    revived_token_layers: int = 0
    cached_tokens: int = 0  # prompt tokens whose first layers came from a prefix cache
    # Per layer, the prefill's computed (kept) token count: the schedule as honoured.
    kept_per_layer: list[int] = field(default_factory=list)
    # Per stage layer, the query window of a `lazy` schedule with window > 1.
    windows: dict[int, QueryWindow] = field(default_factory=dict)
    # Per stage layer, the prompt positions decode's last re-selection kept there (bool [prompt]).
    selected: dict[int, torch.Tensor] = field(default_factory=dict)
    # Prompt positions decode revived from an Aux Cache at least once (return_token_depths).
    revived: set[int] = field(default_factory=set)
    # With a prefix cache: the states leaving its last shared layer (None when not kept).
    boundary: BoundaryStates | None = None

    @classmethod
    def empty(cls, spec: ModelSpec, num_prompt: int, extra: int, dtype, device) -> LazyCache:
        """A cache for a prompt of `num_prompt` tokens; each layer keeps room for `extra` decode rows."""
        capacity = num_prompt + extra
        hidden = torch.empty(0, spec.hidden_size, dtype=dtype, device=device)
        none = torch.empty(0, dtype=torch.long, device=device)
        return cls(
            spec=spec,
            num_prompt=num_prompt,
            layers=[LayerKV(spec, dtype, device, headroom=extra) for _ in range(spec.num_layers)],
            aux=[AuxEntries(none, hidden) for _ in range(spec.num_layers)],
            depth=torch.zeros(capacity, dtype=torch.long, device=device),
        )

    def write(
        self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, computed: bool = True
    ) -> None:
        """Store KV computed at `layer` for `positions`; each (token, layer) at most once.
        computed=False: KV taken from a prefix cache, held but not computed here."""
        if positions.shape[0] > 0:
            end = int(positions.max()) + 1
            self._depth_for(end)
            if not bool((self.depth[positions] == layer).all()):
                raise InvariantError(f"a token-layer at layer {layer} computed twice")
            self.length = max(self.length, end)
        self.layers[layer].append(positions, k, v)
        self.depth[positions] = layer + 1
        if computed:
            self.computed_token_layers += positions.shape[0]

    def claim(self, position: int) -> None:
        """Start a token that a decode step writes through DecodeSlots.write at every layer: the
        at-most-once check, made once for the step (it has KV nowhere yet). The step sets its depth
        when it ends."""
        self._depth_for(position + 1)
        if int(self.depth[position]) != 0:
            raise InvariantError(f"token {position} has KV already: a token-layer would be computed twice")
        self.length = max(self.length, position + 1)

    def _depth_for(self, end: int) -> None:
        """Room in `depth` for positions 0..end-1 (doubling, so a step's growth is rare)."""
        if end > self.depth.shape[0]:
            grown = self.depth.new_zeros(max(end, 2 * self.depth.shape[0]))
            grown[: self.depth.shape[0]] = self.depth
            self.depth = grown

    def stash(self, layer: int, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """Put tokens that stop after `layer` into that layer's Aux Cache."""
        if positions.shape[0] == 0:
            return
        entries = self.aux[layer]
        self.aux[layer] = AuxEntries(torch.cat([entries.positions, positions]), torch.cat([entries.hidden, hidden]))

    def revive(self, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Remove `positions` from layer's Aux Cache and return their hidden states, in that order."""
        entries = self.aux[layer]
        if entries.positions.shape[0] == 0:
            raise InvariantError(f"no Aux Cache entries at layer {layer}")
        # Index of each aux position in a position-sized lookup table.
        lookup = torch.full((int(entries.positions.max()) + 1,), -1, dtype=torch.long, device=positions.device)
        lookup[entries.positions] = torch.arange(entries.positions.shape[0], device=positions.device)
        rows = lookup[positions]
        if not bool((rows >= 0).all()):
            raise InvariantError(f"revived token missing from the Aux Cache of layer {layer}")
        keep = torch.ones(entries.positions.shape[0], dtype=torch.bool, device=positions.device)
        keep[rows] = False
        hidden = entries.hidden[rows]
        self.aux[layer] = AuxEntries(entries.positions[keep], entries.hidden[keep])
        return hidden

    def fork(self) -> LazyCache:
        """An independent copy, for another choice decoded from the same prefill. The cache is not
        paged, so the choices cannot share blocks: each holds its own K/V and Aux Cache. The
        boundary states are not copied: only the original's prompt is cached from them."""
        boundary, self.boundary = self.boundary, None
        try:
            return copy.deepcopy(self)
        finally:
            self.boundary = boundary

    def reserve(self, extra: int) -> None:
        """Make each layer's room exactly its rows plus `extra`: done once when a transfer is
        assembled, so the first decode steps neither grow nor copy any layer's buffers."""
        for layer in self.layers:
            layer.headroom = extra
            layer.resize(layer.size + extra)
        if self.depth.shape[0] < self.length + extra:
            grown = self.depth.new_zeros(self.length + extra)
            grown[: self.depth.shape[0]] = self.depth
            self.depth = grown

    def shared_rows(self, layers: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What a prefix cache keeps of the prompt held here from position `start` on: K and V at
        layers 0..layers-1 [layers, Hkv, length - start, D] and, when that is not every layer, the
        hidden states leaving the last of them [length - start, hidden] (`boundary` must hold them)."""
        n = self.length
        expected = torch.arange(n, device=self.depth.device)
        for index, layer in enumerate(self.layers[:layers]):
            if layer.size != n or not torch.equal(layer.positions, expected):
                raise InvariantError(f"layer {index} does not hold every token in order: it cannot be shared")
        hidden = None
        if layers < self.spec.num_layers:
            if self.boundary is None or self.boundary.layer != layers - 1:
                raise InvariantError(f"no hidden states kept leaving layer {layers - 1}")
            hidden = self.boundary.rows(n)[start:]
        k = torch.cat([layer.k[:, :, start:] for layer in self.layers[:layers]])
        v = torch.cat([layer.v[:, :, start:] for layer in self.layers[:layers]])
        return k, v, hidden

    @property
    def kv_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def bytes_held(self) -> int:
        """Memory this cache holds: K/V buffers with their room, the Aux Cache and kept states."""
        boundary = 0 if self.boundary is None else self.boundary.nbytes
        return sum(layer.allocated_bytes for layer in self.layers) + self.aux_bytes + boundary

    @property
    def aux_bytes(self) -> int:
        return sum(entries.nbytes for entries in self.aux)
