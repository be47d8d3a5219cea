"""The cache and the route change no bit: a token's numbers do not depend on what else is
computed with it or before it.

Each check is `torch.equal`, not a tolerance, in float32 and bfloat16, on tiny random models (one
with sliding-window layers) and on SmolLM2:
- the rows of a prompt do not depend on the tokens after it (the prefix cache keeps rows that a
  shorter or longer prompt computed);
- a prefill from a prefix-cache hit equals one from scratch, logits and the decode after it, with
  pruning off and on, also when the hit leaves only a few tokens to compute;
- each sequence of a batch of 16 decodes as it does alone;
- a cache sent by a prefill worker decodes as the receiver's own prefill does.
What makes them hold, with batch invariance on (as every model here runs): calls of fixed shapes,
a prompt row at a fixed offset of its tile (shared/engine/invariant.py has the argument); the
checks of its premises are here too. Off, the engine makes one plain call of each step's rows.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assemble, encode_transfer

from shared.engine import OFF, DecodeSlots, PrefillRun, PruneConfig, SamplingParams, decode_batch, prefill
from shared.engine.invariant import DECODE_TILE, PROMPT_TILE, cancelling_rows, check_decode_tile, tiled
from shared.engine.prefix import PrefixCache, block_keys, held_layers, namespace
from shared.engine.rows import row_steps
from tests.conftest import NATIVE_BFLOAT16

DTYPES = ["float32", "bfloat16"]


@pytest.fixture
def load(load):
    """The session's loader, with batch invariance turned on for every model this file uses (off
    again after each test: it is off by default)."""
    turned = []

    def loader(name, dtype):
        loaded = load(name, dtype)
        if not loaded.engine.batch_invariant:
            loaded.engine.set_batch_invariant(True)
            turned.append(loaded.engine)
        return loaded

    yield loader
    for model in turned:
        model.set_batch_invariant(False)


LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)), window=4)
STEPS = 4


def _ids(loaded, n: int, seed: int) -> torch.Tensor:
    if loaded.name.startswith("tiny"):
        generator = torch.Generator().manual_seed(seed)
        return torch.randint(3, loaded.engine.spec.vocab_size, (n,), generator=generator)
    from pydoc_data.topics import topics  # real prose for a real model: its attention is not uniform

    text = " ".join(topics.values())[seed * 9000 :]
    ids = loaded.tokenizer(text[: 8 * n]).input_ids[:n]
    assert len(ids) == n
    return torch.tensor(ids)


def _configs(loaded):
    if loaded.name.startswith("tiny"):
        return {"off": OFF, "pruned": LAZY}
    # The default preset; its floor of 1,024 prompt tokens lowered for the batch's short prompts.
    return {"off": OFF, "pruned": loaded.engine.spec.preset("default").model_copy(update={"min_prompt_tokens": 0})}


def _run(model, ids, config, prefix=None) -> PrefillRun:
    run = PrefillRun(model, ids, config, reserve=STEPS + 1, prefix=prefix, keep_boundary=True)
    while not run.done:
        run.step()
    return run


def _decode(model, cache, logits, config) -> list[torch.Tensor]:
    rows = [logits]
    for _ in range(STEPS):
        rows.append(decode_batch(model, [(cache, int(rows[-1].argmax()), config)])[0])
    return rows


def _assert_rows_equal(mine: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    for step, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        assert torch.equal(a, b), f"step {step}: logits differ by {float((a - b).abs().max())}"


# (cached document, first prompt, second prompt): whole blocks of 16 cached, prompts of lengths
# that end inside the kernel's blocks of 512 keys and of 32 queries.
SIZES = {"tiny": (160, 211, 229), "SmolLM2-135M-Instruct": (1056, 1387, 1413)}


SLOW = pytest.mark.slow


def models(smollm2_bfloat16_fast: bool = False) -> list:
    """(model, dtype) cases: the tiny models in both dtypes; SmolLM2 in bfloat16 (the dtype `auto`
    picks on hosts with AVX512-BF16 or AMX) in `make test` where asked (the issue's two targets: a
    pruned hit, a batch of 16 unpruned) and the host computes bfloat16 natively, the rest of
    SmolLM2 in the slow tier."""
    cases = []
    for dtype in DTYPES:
        cases.append(pytest.param("tiny-llama", dtype, id=f"tiny-llama-{dtype}"))
        cases.append(pytest.param("tiny-gemma3", dtype, id=f"tiny-gemma3-{dtype}"))  # windows of 16
        fast = smollm2_bfloat16_fast and dtype == "bfloat16" and NATIVE_BFLOAT16
        cases.append(pytest.param("SmolLM2-135M-Instruct", dtype, id=f"smollm2-{dtype}", marks=() if fast else SLOW))
    return cases


def _sizes(name):
    return SIZES.get(name, SIZES["tiny"])


@pytest.mark.parametrize(("name", "dtype"), models())
def test_a_prompts_rows_do_not_depend_on_what_follows(load, name, dtype):
    loaded = load(name, dtype)
    model = loaded.engine
    cached, short, long = _sizes(name)
    ids = _ids(loaded, long, 1)
    a, b = _run(model, ids[:short], OFF), _run(model, ids, OFF)
    for layer, (mine, theirs) in enumerate(zip(a.cache.layers, b.cache.layers)):
        assert torch.equal(mine.k[:, :, :short], theirs.k[:, :, :short]), f"K at layer {layer}"
        assert torch.equal(mine.v[:, :, :short], theirs.v[:, :, :short]), f"V at layer {layer}"


def _hit_cases() -> list:
    """SmolLM2 in bfloat16 in `make test` for the issue's case alone (a question's rows, pruned)."""
    cases = []
    for config_name in ("off", "pruned"):
        for new_tokens in ("question", "few"):
            headline = (config_name, new_tokens) == ("pruned", "question")
            for case in models(smollm2_bfloat16_fast=headline):
                name, dtype = case.values
                ident = f"{new_tokens}-{case.id}-{config_name}"
                cases.append(pytest.param(name, dtype, config_name, new_tokens, id=ident, marks=case.marks))
    return cases


@pytest.mark.parametrize(("name", "dtype", "config_name", "new_tokens"), _hit_cases())
def test_a_hit_equals_a_prefill_from_scratch(load, name, dtype, config_name, new_tokens):
    """The cached rows come from another prompt, of another length, with the same start (a
    document and its first question); the prompt (the document and another question) is computed
    from them and from scratch."""
    loaded = load(name, dtype)
    model = loaded.engine
    config = _configs(loaded)[config_name]
    cached, short, long = _sizes(name)
    document = _ids(loaded, cached, 2)
    first = torch.cat([document, _ids(loaded, short - cached, 3)])
    if new_tokens == "question":
        prompt = torch.cat([document, _ids(loaded, long - cached, 4)])
    else:  # five rows: one tile, mostly zero rows, where scratch has the document's
        prompt = torch.cat([document, _ids(loaded, 5, 4)])
    block = 16
    root = namespace(loaded.name, dtype, held_layers(config, model.spec.num_layers))
    store = PrefixCache(1 << 32, block_tokens=block)
    store.insert(block_keys(first.tolist(), root, block), *_run(model, first, config).shared_rows())
    hit = store.lookup(block_keys(prompt.tolist(), root, block), prompt.shape[0] - max(config.window, 1))
    window = max(config.for_prompt(prompt.shape[0]).window, 1)
    assert hit is not None and hit.tokens == min(cached, (prompt.shape[0] - window) // block * block)
    warm, cold = _run(model, prompt, config, prefix=hit), _run(model, prompt, config)
    store.release(hit)
    assert warm.cache.kept_per_layer == cold.cache.kept_per_layer
    _assert_rows_equal(_decode(model, warm.cache, warm.logits, config), _decode(model, cold.cache, cold.logits, config))


@pytest.mark.parametrize(
    ("name", "dtype", "config_name"),
    [
        pytest.param(*case.values, config_name, id=f"{case.id}-{config_name}", marks=case.marks)
        for config_name in ("off", "pruned")
        for case in models(smollm2_bfloat16_fast=config_name == "off")
    ],
)
def test_each_of_a_batch_of_16_decodes_as_it_does_alone(load, name, dtype, config_name):
    loaded = load(name, dtype)
    model = loaded.engine
    config = _configs(loaded)[config_name]
    together, alone = [], []
    for i in range(16):
        cache, logits = prefill(model, _ids(loaded, 40 + 13 * i, 10 + i), config, reserve=STEPS)
        together.append([cache, int(logits.argmax()), config])
        alone.append([copy.deepcopy(cache), int(logits.argmax()), config])
    # The batch decodes as a decode worker's does, from its DecodeSlots: with the switch on, each
    # sequence still attends in a call of its own, whose shape does not depend on the batch.
    slots = DecodeSlots(model.spec, model.dtype, model.device)
    for step in range(STEPS):
        rows = decode_batch(model, [tuple(item) for item in together], slots)
        for i, item in enumerate(alone):
            single = decode_batch(model, [tuple(item)])[0]
            assert torch.equal(rows[i], single), f"step {step}, sequence {i}"
            together[i][1] = item[1] = int(single.argmax())
    if config_name == "pruned" and name.startswith("tiny"):
        # Revived rows were computed inside the batch's calls too (SmolLM2's default revives
        # nothing in these four steps of short prompts: it re-selects every 8).
        assert sum(item[0].revived_token_layers for item in together) > 0


@pytest.mark.parametrize("config_name", ["off", "pruned"])
@pytest.mark.parametrize(("name", "dtype"), models())
def test_a_transferred_cache_decodes_as_the_receivers_own_prefill(load, name, dtype, config_name):
    loaded = load(name, dtype)
    model = loaded.engine
    config = _configs(loaded)[config_name]
    ids = _ids(loaded, _sizes(name)[1], 5)
    sent, messages = encode_transfer(loaded, ids.tolist(), config, SamplingParams(max_new_tokens=STEPS))
    received = assemble(loaded, messages)
    local, logits = prefill(model, ids, config, reserve=STEPS)
    assert received.first_tokens == [int(logits.argmax())]
    _assert_rows_equal(_decode(model, received.cache, logits, config), _decode(model, local, logits, config))


@pytest.mark.parametrize(("name", "dtype"), models())
def test_every_row_of_a_decode_tile_computes_alike(load, name, dtype):
    """The premise of batch invariance (invariant.py, property 3) on this host, on the model's
    own weights: every shift of a tile through the row-wise steps gives the same rows, shifted."""
    model = load(name, dtype).engine
    check_decode_tile(row_steps(model))


def test_the_tile_check_refuses_a_kernel_that_sums_a_row_by_its_position():
    """A product that sums the last row of a call in the other order, as a BLAS's kernel for a
    partial block of rows may: the check must refuse it, in bfloat16 too, where the rounding of
    the outputs hides most such differences from random rows."""
    generator = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        weight = torch.randn(64, 256, generator=generator).to(dtype)

        def product(x, weight=weight):
            rows = x @ weight.T
            rows[-1] = (x[-1].float().flip(0) @ weight.float().flip(1).T).to(x.dtype)
            return rows

        with pytest.raises(RuntimeError, match="by their position"):
            check_decode_tile({"product": (product, (cancelling_rows(weight, generator),))})


def test_a_tiled_call_puts_each_row_at_its_offset_in_calls_of_one_shape():
    seen = []

    def rows(x):
        seen.append(x.clone())
        return x * 2, x + 1

    x = torch.arange(1, 8, dtype=torch.float32)[:, None].repeat(1, 3)  # 7 rows at positions 45..51
    doubled, shifted = tiled(rows, 16, 45, x)
    assert torch.equal(doubled, x * 2) and torch.equal(shifted, x + 1)
    assert [tile.shape[0] for tile in seen] == [16, 16]  # 45 mod 16 = 13: rows 13..15, then 0..3
    assert torch.equal(seen[0][13:], x[:3]) and torch.equal(seen[1][:4], x[3:])
    assert not seen[0][:13].any() and not seen[1][4:].any()
    assert tiled(rows, None, 45, x)[0] is not None and len(seen) == 3  # None: one plain call


def test_batch_invariance_turns_the_fixed_tiles_on_and_off(load):
    model = load("tiny-llama", "float32").engine
    assert model.batch_invariant and (model.prompt_tile, model.decode_tile) == (PROMPT_TILE, DECODE_TILE)
    model.set_batch_invariant(False)
    try:
        assert not model.batch_invariant and model.prompt_tile is None and model.decode_tile is None
    finally:
        model.set_batch_invariant(True)
