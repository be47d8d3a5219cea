"""The prefix cache's keys: the same on every worker and every router (SHA-256, not Python's
`hash`), and torch-free, so the router computes them too.

A block's key is a SHA-256 chained over the keys of the blocks before it and its own token ids,
under a namespace of what changes K/V: the model, the dtype, the layers held and a salt (per
tenant, made by the server).
"""

from __future__ import annotations

import hashlib

from shared.contract.pruning import PruneConfig

BLOCK_TOKENS = 32  # the default preset's selection block: a block is either reused whole or not at all


def held_layers(config: PruneConfig, num_layers: int) -> int:
    """How many layers an entry holds for prompts prefilled under `config` (its first cut + 1;
    every layer when it never cuts). A schedule's short prompts (under min_prompt_tokens, so not
    pruned) hold the same layers, so a conversation's later, pruned turns find its early ones."""
    if config.mode == "off" or not config.stages:
        return num_layers
    return config.stages[0][0] + 1


def namespace(model: str, dtype: str, layers: int, salt: str = "") -> bytes:
    return hashlib.sha256(f"lazyserve-prefix-v1|{model}|{dtype}|{layers}|{salt}".encode()).digest()


def block_keys(ids: list[int], root: bytes, block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """The chained key of every full block of `ids`."""
    keys, previous = [], root
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        block = ids[start : start + block_tokens]
        previous = hashlib.sha256(previous + b"".join(t.to_bytes(4, "little") for t in block)).digest()
        keys.append(previous)
    return keys
