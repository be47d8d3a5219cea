"""Batched decode: a sequence's tokens, work and cache do not depend on what it is batched with.

Each sequence of a mixed batch (prompt lengths 10 to 2000, pruning off, lazy with and without the
selection options, static, random, block; greedy and seeded sampling; different max_tokens; one
joining mid-way and one cancelled) is compared with its own unbatched run through `generate`.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from shared.engine import (
    OFF,
    DecodeSlots,
    Decoding,
    Generation,
    PrefillRun,
    PruneConfig,
    SamplingParams,
    decode_batch,
    generate,
    prefill,
)

LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)))


@dataclass
class Case:
    name: str
    length: int
    config: PruneConfig
    params: SamplingParams
    join_at: int = 0  # the batched step at which it joins
    cancel_after: int | None = None  # tokens after which its client goes away


CASES = [
    Case("off-10-greedy", 10, OFF, SamplingParams(max_new_tokens=12)),
    Case("lazy-2000-greedy", 2000, LAZY, SamplingParams(max_new_tokens=20)),
    Case(
        "lazy-options-400-seeded",
        400,
        LAZY.model_copy(update={"window": 8, "pool_kernel": 5, "recent_tokens": 16, "sink_tokens": 4}),
        SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7),
    ),
    Case(
        "static-300-seeded",
        300,
        PruneConfig(mode="static", stages=LAZY.stages),
        SamplingParams(max_new_tokens=9, temperature=1.0, seed=3),
    ),
    Case(
        "random-250-greedy",
        250,
        PruneConfig(mode="random", stages=LAZY.stages, seed=11),
        SamplingParams(max_new_tokens=14),
    ),
    Case(
        "block-500-joins",
        500,
        LAZY.model_copy(update={"granularity": "block", "block_size": 8}),
        SamplingParams(max_new_tokens=10),
        join_at=5,
    ),
    Case(
        "budget-every-700-greedy",
        700,
        LAZY.model_copy(update={"window": 4, "revive_budget": 8, "reselect_every": 3}),
        SamplingParams(max_new_tokens=12),
        join_at=2,
    ),
    Case("lazy-600-cancelled", 600, LAZY, SamplingParams(max_new_tokens=30, temperature=0.7, seed=5), cancel_after=6),
]


def _ids(model, case: Case) -> torch.Tensor:
    seed = sum(map(ord, case.name))
    return torch.randint(3, model.spec.vocab_size, (case.length,), generator=torch.Generator().manual_seed(seed))


def _run_batched(model, cases: list[Case], slots: DecodeSlots | None):
    """Drive decode_batch as a scheduler does (with its DecodeSlots, or each sequence attending
    alone); returns per case (tokens, stats, cache, steps it shared)."""
    pending = sorted(cases, key=lambda case: case.join_at)
    running: dict[str, Decoding] = {}
    out, shared_steps, step = {}, {case.name: 0 for case in cases}, 0

    def retire(name):
        decoding = running.pop(name)
        if slots is not None:
            slots.leave(decoding.cache)
        decoding.close(model.spec.num_layers)
        out[name] = decoding

    by_name = {case.name: case for case in cases}
    while pending or running:
        while pending and pending[0].join_at <= step:
            case = pending.pop(0)
            cache, logits = prefill(model, _ids(model, case), case.config, reserve=case.params.max_new_tokens)
            decoding = running[case.name] = Decoding(cache, case.config, case.params, Generation())
            decoding.advance(logits)
            if decoding.done:
                retire(case.name)
        for name in [n for n, d in running.items() if by_name[n].cancel_after == len(d.generation.tokens)]:
            retire(name)  # the client went away: the sequence leaves at once
        if running:
            names = list(running)
            steps = [(running[n].cache, running[n].next_token, running[n].config) for n in names]
            logits = decode_batch(model, steps, slots)
            for name, row in zip(names, logits):
                shared_steps[name] += len(names) > 1
                running[name].advance(row)
                if running[name].done:
                    retire(name)
        step += 1
    return out, shared_steps


# The batch must not change a token: with a call per sequence in each dtype the engine serves in;
# through a DecodeSlots in float32. In bfloat16 the slots' one call a layer (keys padded to the
# longest and masked) rounds otherwise than a sequence's own call, a step or two of bfloat16 on a
# logit (test_batched_logits_match_each_sequence_alone), enough to flip a near tie of this random
# model: a batch equal bit for bit to each sequence alone is the --batch-invariant switch's
# promise (test_invariance.py), and the switch keeps a call per sequence.
LAYOUTS = [("float32", "per-sequence"), ("bfloat16", "per-sequence"), ("float32", "slots")]


@pytest.fixture(scope="module", params=LAYOUTS, ids=["-".join(layout) for layout in LAYOUTS])
def layout(request, load):
    dtype, kind = request.param
    return load("tiny-llama", dtype), kind


@pytest.fixture(scope="module")
def batched(layout):
    """The mixed batch through a DecodeSlots (one attention call a layer) or with a call per sequence."""
    loaded, kind = layout
    model = loaded.engine
    slots = DecodeSlots(model.spec, model.dtype, model.device) if kind == "slots" else None
    results = _run_batched(model, CASES, slots)
    assert slots is None or slots.num_slots == 0  # every sequence left: the store is given back
    return results


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_sequence_of_a_mixed_batch_equals_its_own_run(layout, batched, case):
    model = layout[0].engine
    results, shared_steps = batched
    got = results[case.name]
    alone = generate(model, _ids(model, case), case.config, case.params)
    assert shared_steps[case.name] > 0  # it did run beside others
    if case.cancel_after is not None:
        assert got.generation.tokens == alone.tokens[: case.cancel_after]
        return
    assert got.generation.tokens == alone.tokens
    assert got.generation.finish_reason == alone.finish_reason
    stats, solo = got.generation.stats, alone.stats
    assert stats.revived_token_layers == solo.revived_token_layers
    assert stats.token_layers_computed == solo.token_layers_computed
    cache = got.cache
    # At most once: the write check refuses a second computation, so the counter is the depth sum.
    assert cache.computed_token_layers == int(cache.depth[: cache.length].sum())


def test_lazy_sequences_revive_inside_the_batch(batched):
    results, _ = batched
    assert results["lazy-2000-greedy"].generation.stats.revived_token_layers > 0
    assert results["lazy-options-400-seeded"].generation.stats.revived_token_layers > 0


@pytest.mark.parametrize(
    ("dtype", "kind", "tolerance"),
    [("float32", "slots", 1e-5), ("float32", "per-sequence", 1e-5), ("bfloat16", "slots", 2**-6)],
)
def test_batched_logits_match_each_sequence_alone(load, dtype, kind, tolerance):
    """Step by step, a batch row's logits equal the same step run alone, to the dtype's rounding
    (bfloat16: two steps of 2^-7 at the logits' scale, where the slots round otherwise)."""
    model = load("tiny-llama", dtype).engine
    slots = DecodeSlots(model.spec, model.dtype, model.device) if kind == "slots" else None
    cases = [CASES[0], CASES[1], CASES[2], CASES[6]]
    together, alone = [], []
    for case in cases:
        for store in (together, alone):
            cache, logits = prefill(model, _ids(model, case), case.config, reserve=2)  # the slots grow
            store.append([cache, int(logits.argmax()), case.config])
    for _ in range(8):
        rows = decode_batch(model, [tuple(item) for item in together], slots)
        for i, item in enumerate(alone):
            single = decode_batch(model, [tuple(item)])[0]
            assert torch.allclose(rows[i], single, atol=tolerance, rtol=tolerance)
            together[i][1] = item[1] = int(single.argmax())  # both go on from the same token
            if dtype == "float32":
                assert int(rows[i].argmax()) == item[1]
    for (cache_b, _, _), (cache_a, _, _) in zip(together, alone):
        assert torch.equal(cache_b.depth, cache_a.depth)
        assert cache_b.computed_token_layers == cache_a.computed_token_layers
        assert cache_b.revived_token_layers == cache_a.revived_token_layers
        for layer_b, layer_a in zip(cache_b.layers, cache_a.layers):
            assert torch.equal(layer_b.positions, layer_a.positions)
            assert torch.allclose(layer_b.k, layer_a.k, atol=tolerance)


def test_a_cache_twice_in_one_batch_is_refused(tiny_llama):
    model = tiny_llama.engine
    cache, logits = prefill(model, _ids(model, CASES[0]), OFF, reserve=4)
    with pytest.raises(ValueError, match="twice"):
        decode_batch(model, [(cache, 5, OFF), (cache, 6, OFF)])


@pytest.mark.parametrize(
    "config", [OFF, LAZY, LAZY.model_copy(update={"window": 8})], ids=["off", "lazy", "lazy-window"]
)
def test_a_prefill_stepped_between_decode_steps_equals_one_in_one_go(tiny_llama, config):
    model = tiny_llama.engine
    ids = _ids(model, CASES[4])
    whole, whole_logits = prefill(model, ids, config, reserve=3)
    other, logits = prefill(model, _ids(model, CASES[0]), OFF, reserve=16)
    token = int(logits.argmax())
    run = PrefillRun(model, ids, config, reserve=3)
    rows = []
    while not run.done:
        rows.append(run.step())
        token = int(decode_batch(model, [(other, token, OFF)])[0].argmax())  # another stream steps between layers
    assert rows == whole.kept_per_layer and len(rows) == model.spec.num_layers
    assert torch.equal(run.logits, whole_logits)
    chunked = run.cache
    for layer in range(model.spec.num_layers):
        assert torch.equal(chunked.layers[layer].positions, whole.layers[layer].positions)
        assert torch.equal(chunked.layers[layer].k, whole.layers[layer].k)
        assert torch.equal(chunked.layers[layer].v, whole.layers[layer].v)
        assert torch.equal(chunked.aux[layer].positions, whole.aux[layer].positions)
        assert torch.equal(chunked.aux[layer].hidden, whole.aux[layer].hidden)
    assert chunked.windows.keys() == whole.windows.keys()


def test_room_is_reserved_per_layer_for_the_generated_tokens(tiny_llama):
    """A pruned layer holds room for its kept tokens plus the reserve, not for the whole prompt;
    decoding `reserve` tokens unpruned never grows a buffer."""
    model = tiny_llama.engine
    ids = _ids(model, CASES[4])
    cache, _ = prefill(model, ids, LAZY, reserve=8)
    assert [layer.capacity for layer in cache.layers] == [kept + 8 for kept in cache.kept_per_layer]
    assert cache.kept_per_layer[-1] < cache.kept_per_layer[0]
    cache, logits = prefill(model, ids, OFF, reserve=8)
    held = cache.bytes_held
    token = int(logits.argmax())
    for _ in range(8):
        token = int(decode_batch(model, [(cache, token, OFF)])[0].argmax())
    assert cache.bytes_held == held and all(layer.size == layer.capacity for layer in cache.layers)
