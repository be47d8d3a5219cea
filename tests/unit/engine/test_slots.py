"""DecodeSlots: the running sequences' K/V in one store per layer, a slot each.

What a member's cache holds does not change when it joins, when the store grows, when another
member leaves (the last one moves into its slot) or when it leaves itself; a fork of a member is a
cache of its own; the store is given back when the last member leaves.
"""

from __future__ import annotations

import copy

import pytest
import torch

from shared.engine import DecodeSlots, PruneConfig, decode_batch, prefill
from shared.engine.cache import InvariantError

LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)))


def _rows(cache):
    """Everything a cache's layers hold: (positions, k, v) per layer, copied."""
    return [(layer.positions.clone(), layer.k.clone(), layer.v.clone()) for layer in cache.layers]


def _same(cache, rows):
    for layer, (positions, k, v) in zip(cache.layers, rows):
        assert torch.equal(layer.positions, positions)
        assert torch.equal(layer.k, k) and torch.equal(layer.v, v)


@pytest.fixture
def caches(tiny_llama):
    model = tiny_llama.engine
    out = []
    for i, length in enumerate([30, 200, 90]):
        ids = torch.randint(3, model.spec.vocab_size, (length,), generator=torch.Generator().manual_seed(i))
        cache, logits = prefill(model, ids, LAZY if i % 2 else PruneConfig(mode="off"), reserve=1)
        out.append(cache)
    return out


def test_members_keep_their_rows_through_join_growth_and_leave(tiny_llama, caches):
    model = tiny_llama.engine
    slots = DecodeSlots(model.spec, model.dtype, model.device)
    before = [_rows(cache) for cache in caches]
    for cache in caches:
        slots.join(cache)
    assert [slots.slot_of(cache) for cache in caches] == [0, 1, 2]
    for cache, rows in zip(caches, before):
        _same(cache, rows)
    # A member that needs more room than the layer has makes the store grow for every slot.
    capacity = slots.capacity(2)
    caches[0].layers[2].resize(capacity + 5)
    assert slots.capacity(2) >= capacity + 5
    for cache, rows in zip(caches, before):
        _same(cache, rows)
    slots.leave(caches[0])  # the last member moves into slot 0
    assert slots.slot_of(caches[2]) == 0 and slots.slot_of(caches[1]) == 1
    assert slots.slot_of(caches[0]) is None
    for cache, rows in zip(caches, before):
        _same(cache, rows)
    spec = model.spec
    row = torch.zeros(1, spec.num_kv_heads, 1, spec.head_dim, dtype=model.dtype)
    with torch.inference_mode():  # as the engine writes
        caches[0].layers[0].append(torch.tensor([999]), row, row)
    _same(caches[2], before[2])  # a cache that left writes into buffers of its own
    for cache in caches[1:]:
        slots.leave(cache)
    assert slots.num_slots == 0 and slots.allocated_bytes == 0


def test_a_fork_of_a_member_is_a_cache_of_its_own(tiny_llama, caches):
    model = tiny_llama.engine
    slots = DecodeSlots(model.spec, model.dtype, model.device)
    for cache in caches:
        slots.join(cache)
    fork = copy.deepcopy(caches[1])
    assert all(layer.binding is None for layer in fork.layers)
    assert slots.slot_of(fork) is None
    _same(fork, _rows(caches[1]))
    assert fork.layers[0].allocated_bytes < slots.allocated_bytes / 3  # not a copy of the store


def test_a_decode_step_claims_each_new_token_once(tiny_llama, caches):
    """The slots' write skips the per-layer check: the step checks once that the token is new."""
    model = tiny_llama.engine
    slots = DecodeSlots(model.spec, model.dtype, model.device)
    batch = [(cache, 5, PruneConfig(mode="off")) for cache in caches]
    decode_batch(model, batch, slots)
    for cache in caches:
        position = cache.length - 1
        assert int(cache.depth[position]) == model.spec.num_layers
        assert all(int(layer.positions[-1]) == position for layer in cache.layers if layer.size)
        with pytest.raises(InvariantError, match="twice"):
            cache.claim(position)


def test_a_cache_decodes_from_one_store_at_a_time(tiny_llama, caches):
    model = tiny_llama.engine
    first, second = (DecodeSlots(model.spec, model.dtype, model.device) for _ in range(2))
    first.join(caches[0])
    with pytest.raises(ValueError, match="one DecodeSlots"):
        second.join(caches[0])


def test_a_cache_that_would_waste_the_store_decodes_alone_in_the_same_step(tiny_llama, monkeypatch):
    """A prompt far longer than the members' would widen every slot: it is left out of the store
    and attends in a call of its own, in the same step, with the same logits as alone."""
    model = tiny_llama.engine
    monkeypatch.setattr("shared.engine.slots.WASTE_SLACK_BYTES", 0)
    slots = DecodeSlots(model.spec, model.dtype, model.device)
    generator = torch.Generator().manual_seed(5)
    together, alone = [], []
    for length in (40, 50, 60, 1500):
        ids = torch.randint(3, model.spec.vocab_size, (length,), generator=generator)
        cache, logits = prefill(model, ids, LAZY, reserve=4)
        together.append([cache, int(logits.argmax()), LAZY])
        alone.append([copy.deepcopy(cache), int(logits.argmax()), LAZY])
    for _ in range(4):
        rows = decode_batch(model, [tuple(item) for item in together], slots)
        for i, item in enumerate(alone):
            single = decode_batch(model, [tuple(item)])[0]
            assert torch.allclose(rows[i], single, atol=1e-5, rtol=1e-5)
            together[i][1] = item[1] = int(single.argmax())
    assert [slots.slot_of(item[0]) for item in together] == [0, 1, 2, None]
    for (cache, _, _), (solo, _, _) in zip(together, alone):
        assert torch.equal(cache.depth, solo.depth)
        assert cache.computed_token_layers == solo.computed_token_layers


def test_a_batch_of_some_members_steps_as_each_alone(tiny_llama):
    """A step that takes members 0 and 2 but not 1 (more run than one step takes) is no run of
    slots: each attends in a call of its own, from its slot, and the skipped one is untouched."""
    model = tiny_llama.engine
    slots = DecodeSlots(model.spec, model.dtype, model.device)
    generator = torch.Generator().manual_seed(9)
    together, alone = [], []
    for length in (40, 70, 100):
        ids = torch.randint(3, model.spec.vocab_size, (length,), generator=generator)
        cache, logits = prefill(model, ids, LAZY, reserve=4)
        together.append([cache, int(logits.argmax()), LAZY])
        alone.append([copy.deepcopy(cache), int(logits.argmax()), LAZY])
    decode_batch(model, [tuple(item) for item in together], slots)  # all three join
    decode_batch(model, [tuple(item) for item in alone])
    skipped = _rows(together[1][0])
    for _ in range(3):
        picked, solos = [together[0], together[2]], [alone[0], alone[2]]
        rows = decode_batch(model, [tuple(item) for item in picked], slots)
        for row, item, solo in zip(rows, picked, solos):
            single = decode_batch(model, [tuple(solo)])[0]
            assert torch.allclose(row, single, atol=1e-5, rtol=1e-5)
            item[1] = solo[1] = int(single.argmax())
    _same(together[1][0], skipped)
    assert [slots.slot_of(item[0]) for item in together] == [0, 1, 2]


def test_a_finished_sequence_leaves_without_a_copy(tiny_llama, caches):
    """keep=False (the Scheduler's retire, after the stats are taken): the cache's layers are
    emptied, not copied back, and the others keep their rows."""
    model = tiny_llama.engine
    slots = DecodeSlots(model.spec, model.dtype, model.device)
    before = [_rows(cache) for cache in caches]
    for cache in caches:
        slots.join(cache)
    slots.leave(caches[0], keep=False)
    assert all(layer.size == 0 and layer.allocated_bytes == 0 for layer in caches[0].layers)
    assert slots.slot_of(caches[0]) is None
    for cache, rows in zip(caches[1:], before[1:]):
        _same(cache, rows)
