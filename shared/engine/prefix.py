"""Prefix cache: the part of a prompt's prefill that any later prompt with the same prefix may reuse.

With a schedule whose first cut is after layer c, nothing at layers 0..c ever sees a pruned
context: every token's K/V there, and its hidden state leaving layer c, are the unpruned model's.
Those are what an entry holds, per block of `block_tokens` prompt tokens. Deep-layer K/V was
computed for the tokens one question selected, in a context without the others, and is never
held. With pruning off every layer is exact: an entry holds K/V at every layer and no hidden state.

A block's key is a SHA-256 chained over the keys of the blocks before it and its own token ids,
under a namespace of what changes K/V: the model, the dtype, the layers held and a salt (per
tenant, made by the server). The same on every process, unlike Python's `hash`.

Entries in use by a prefill are pinned; the rest are evicted least recently used within a byte
budget. A hit touches its blocks from the chain's tail to its head, so under the same age the
tail goes first and a chain never loses its head while its tail stays. Thread-safe: a decode
worker's scheduler and its gRPC threads share one cache. No I/O.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from shared.contract.prefix import BLOCK_TOKENS, block_keys, held_layers, namespace

__all__ = ["BLOCK_TOKENS", "Entry", "PrefixCache", "PrefixHit", "block_keys", "held_layers", "namespace"]


@dataclass(eq=False)
class Chunk:
    """The blocks one insert added share one allocation per tensor; an entry's tensors are views.

    Why not a copy per block: thousands of long-lived half-megabyte tensors fragment the C heap,
    and every later prefill then takes its temporaries from fresh pages (measured: 2.6x the page
    faults of seven 3k-token prefills without a cache, and 5-10% slower prefills; one copy per
    insert: 1.07x). Its bytes are held until its last entry goes."""

    nbytes: int
    keys: set[bytes]


@dataclass
class Entry:
    """One block: K/V at the held layers [layers, Hkv, B, D] and, when not every layer is held,
    the hidden states leaving the last held layer [B, hidden]; views into its chunk."""

    k: torch.Tensor
    v: torch.Tensor
    hidden: torch.Tensor | None
    chunk: Chunk | None = None
    pins: int = 0

    @property
    def nbytes(self) -> int:
        tensors = [self.k, self.v] + ([self.hidden] if self.hidden is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class PrefixHit:
    """The cached start of a prompt, ready for a prefill: `tokens` positions at `layers` layers.
    k, v: [layers, Hkv, tokens, D]; hidden: [tokens, hidden] or None."""

    tokens: int
    layers: int
    k: torch.Tensor
    v: torch.Tensor
    hidden: torch.Tensor | None
    keys: list[bytes]  # the blocks it came from, pinned until released


class PrefixCache:
    def __init__(self, budget_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if budget_bytes < 0 or block_tokens < 1:
            raise ValueError("a prefix cache needs budget_bytes >= 0 and block_tokens >= 1")
        self.budget_bytes, self.block_tokens = budget_bytes, block_tokens
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.bytes_held = 0
        self.hits = self.misses = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, keys: list[bytes], limit_tokens: int) -> PrefixHit | None:
        """The longest run of cached blocks from the start, at most `limit_tokens` tokens, pinned;
        None on a miss. Release it with `release` once the prefill no longer needs it."""
        limit = limit_tokens // self.block_tokens
        with self._lock:
            found = []
            for key in keys[:limit]:
                entry = self._entries.get(key)
                if entry is None:
                    break
                found.append((key, entry))
            if not found:
                self.misses += 1
                return None
            self.hits += 1
            for key, entry in reversed(found):  # tail first: the head ends up the most recent
                entry.pins += 1
                self._entries.move_to_end(key)
        entries = [entry for _, entry in found]
        hidden = None if entries[0].hidden is None else torch.cat([e.hidden for e in entries])
        return PrefixHit(
            tokens=len(found) * self.block_tokens,
            layers=entries[0].k.shape[0],
            k=torch.cat([e.k for e in entries], dim=2),
            v=torch.cat([e.v for e in entries], dim=2),
            hidden=hidden,
            keys=[key for key, _ in found],
        )

    def release(self, hit: PrefixHit | None) -> None:
        if hit is None:
            return
        with self._lock:
            for key in hit.keys:
                entry = self._entries.get(key)
                if entry is not None:
                    entry.pins -= 1
            self._evict()

    def first_missing(self, keys: list[bytes]) -> int:
        """The index of the first block of `keys` not held (len(keys) when all are): rows before
        it need not be gathered for an insert."""
        with self._lock:
            return next((i for i, key in enumerate(keys) if key not in self._entries), len(keys))

    def touch(self, keys: list[bytes]) -> None:
        """Mark the held blocks of `keys` used, tail first (the head ends up the most recent)."""
        with self._lock:
            self._touch(keys)

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            if key in self._entries:
                self._entries.move_to_end(key)

    def insert(
        self, keys: list[bytes], k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, first: int = 0
    ) -> int:
        """Add the blocks of one prompt not yet held. k, v: [layers, Hkv, rows, D] in position
        order from block `first` on; hidden: [rows, hidden] or None. Blocks before `first` are
        only touched. Returns the blocks added."""
        b = self.block_tokens
        with self._lock:
            fresh = [i for i in range(first, len(keys)) if keys[i] not in self._entries]
            per_block = _block_bytes(k, v, hidden, b)
            fresh = fresh[: self.budget_bytes // per_block] if per_block else fresh  # the head first
            if fresh:
                self._add(keys, fresh, first, k, v, hidden)
            self._touch(keys)  # tail first, so that the chain's head ends up the most recently used
            self._evict()
        return len(fresh)

    def _add(self, keys: list[bytes], fresh: list[int], first: int, k, v, hidden) -> None:
        b = self.block_tokens
        rows = torch.cat([torch.arange((i - first) * b, (i - first + 1) * b) for i in fresh]).to(k.device)
        # One copy per tensor for every new block (a slice would keep the prompt's buffers alive).
        chunk_k, chunk_v = k.index_select(2, rows), v.index_select(2, rows)
        chunk_h = None if hidden is None else hidden.index_select(0, rows)
        self._place([keys[i] for i in fresh], chunk_k, chunk_v, chunk_h)

    def _evict(self) -> None:
        """Drop unpinned entries, least recently used first, until within the budget. A chunk that
        keeps some entries is copied down to them, so that every eviction frees its bytes."""
        if self.bytes_held <= self.budget_bytes:
            return
        victims, freed = [], 0
        for key, entry in self._entries.items():
            if self.bytes_held - freed <= self.budget_bytes:
                break
            if entry.pins == 0:
                victims.append(key)
                freed += entry.nbytes
        touched: dict[int, Chunk] = {}
        for key in victims:
            entry = self._entries.pop(key)
            self.evictions += 1
            entry.chunk.keys.discard(key)
            touched[id(entry.chunk)] = entry.chunk
        for chunk in touched.values():
            self.bytes_held -= chunk.nbytes
            if chunk.keys:
                self._compact(chunk)

    def _compact(self, chunk: Chunk) -> None:
        """The survivors of a partly evicted chunk into one of their own size (pins kept)."""
        keys = list(chunk.keys)
        entries = [self._entries[key] for key in keys]
        chunk_k = torch.cat([e.k for e in entries], dim=2)
        chunk_v = torch.cat([e.v for e in entries], dim=2)
        chunk_h = None if entries[0].hidden is None else torch.cat([e.hidden for e in entries])
        self._place(keys, chunk_k, chunk_v, chunk_h, [e.pins for e in entries])

    def _place(self, keys: list[bytes], k, v, hidden, pins: list[int] | None = None) -> None:
        """Entries for `keys`, views of consecutive blocks of one new chunk (an existing key keeps
        its place in the LRU order)."""
        chunk = Chunk(sum(t.numel() * t.element_size() for t in (k, v, hidden) if t is not None), set(keys))
        b = self.block_tokens
        for j, key in enumerate(keys):
            block = slice(j * b, (j + 1) * b)
            view_h = None if hidden is None else hidden[block]
            self._entries[key] = Entry(k[:, :, block], v[:, :, block], view_h, chunk, pins[j] if pins else 0)
        self.bytes_held += chunk.nbytes


def _block_bytes(k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None, block: int) -> int:
    per_token = (k.shape[0] * k.shape[1] * k.shape[3]) * (k.element_size() + v.element_size())
    if hidden is not None:
        per_token += hidden.shape[-1] * hidden.element_size()
    return per_token * block
