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


@dataclass
class Entry:
    """One block: K/V at the held layers [layers, Hkv, B, D] and, when not every layer is held,
    the hidden states leaving the last held layer [B, hidden]."""

    k: torch.Tensor
    v: torch.Tensor
    hidden: torch.Tensor | None
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

    def insert(self, keys: list[bytes], k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor | None) -> int:
        """Add the blocks of one prompt not yet held. k, v: [layers, Hkv, >= blocks x B, D] in
        position order; hidden: [>= blocks x B, hidden] or None. Returns the blocks added."""
        b, added = self.block_tokens, 0
        with self._lock:
            # Tail first, so that the chain's head ends up the most recently used.
            for i, key in reversed(list(enumerate(keys))):
                if key in self._entries:
                    self._entries.move_to_end(key)
                    continue
                rows = slice(i * b, (i + 1) * b)
                # Copies: a slice would keep the whole prompt's buffers alive.
                entry = Entry(
                    k[:, :, rows].clone(), v[:, :, rows].clone(), None if hidden is None else hidden[rows].clone()
                )
                if entry.nbytes > self.budget_bytes:
                    break
                self._entries[key] = entry
                self.bytes_held += entry.nbytes
                added += 1
            self._evict()
        return added

    def _evict(self) -> None:
        """Drop unpinned entries, least recently used first, until within the budget."""
        if self.bytes_held <= self.budget_bytes:
            return
        for key in [key for key, entry in self._entries.items() if entry.pins == 0]:
            if self.bytes_held <= self.budget_bytes:
                return
            self.bytes_held -= self._entries.pop(key).nbytes
            self.evictions += 1
