"""A model with sliding-window and global layers (tiny-gemma3: window 16, layers 1, 3, 5 global)
under pruning: exact against transformers' own layers, each token-layer at most once, revival,
batching, stages only where the last query sees the whole prompt."""

import copy

import pytest
import torch

from shared.contract import ModelSpec
from shared.engine import PruneConfig, decode_batch, decode_step, prefill
from shared.engine.layer import window_mask
from shared.models.catalog import TINY_WINDOW, tiny_config

N = 160  # ten windows
LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)))


@pytest.fixture(scope="module")
def gemma(load):
    return load("tiny-gemma3")


def _ids(loaded, n=N, seed=0):
    return torch.randint(3, loaded.engine.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _hf_layers(hf, h, positions, layers):
    """Reference: transformers' own Gemma 3 layers on a token subset at its original positions,
    each with its own RoPE table and, at a sliding layer, the window by original position."""
    config = hf.config
    causal = positions[None, :] <= positions[:, None]
    for index in layers:
        kind = config.layer_types[index]
        mask = causal
        if kind == "sliding_attention":
            mask = causal & (positions[None, :] > positions[:, None] - config.sliding_window)
        cos, sin = hf.model.rotary_emb(h, positions[None], kind)
        h = hf.model.layers[index](
            h, attention_mask=mask[None, None], position_embeddings=(cos, sin), position_ids=positions[None]
        )
        h = h[0] if isinstance(h, tuple) else h
    return h


def test_the_window_is_the_last_w_positions_by_original_position(gemma):
    model = gemma.engine
    q = torch.tensor([40, 100])
    k = torch.tensor([0, 24, 25, 40, 85, 99, 100])
    assert window_mask(model, 1, q, k) is None  # a global layer
    mask = window_mask(model, 0, q, k)
    # 40 sees 25..40 (16 positions, itself included); 100 sees 85..100.
    assert mask.tolist() == [
        [False, False, True, True, True, True, True],
        [False, False, False, False, True, True, True],
    ]
    assert window_mask(model, 0, torch.tensor([15]), torch.arange(16)) is None  # all inside: no mask


def test_pruned_prefill_equals_transformers_layers_at_original_positions(gemma):
    model, hf = gemma.engine, gemma.engine.hf
    ids = _ids(gemma)
    cache, logits = prefill(model, ids, PruneConfig(mode="static", stages=((1, 0.4),)))
    kept = cache.layers[2].positions
    assert not torch.equal(kept, torch.arange(kept.shape[0]))  # pruning left gaps
    with torch.inference_mode():
        h = _hf_layers(hf, hf.model.embed_tokens(ids)[None], torch.arange(N), [0, 1])
        rest = range(2, model.spec.num_layers)
        expected = hf.lm_head(hf.model.norm(_hf_layers(hf, h[:, kept], kept, rest)))[0, -1]
        renumbered = hf.lm_head(hf.model.norm(_hf_layers(hf, h[:, kept], torch.arange(kept.shape[0]), rest)))[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert (logits - renumbered).abs().max() > 1e-3  # the check above can tell positions apart


def test_lazy_decode_revives_and_computes_each_token_layer_once(gemma):
    model = gemma.engine
    steps = 16
    cache, logits = prefill(model, _ids(gemma), LAZY, reserve=steps)
    revived_from_aux = 0
    for _ in range(steps):
        aux_before, depth_before = copy.deepcopy(cache.aux), cache.depth.clone()
        logits = decode_step(model, cache, int(logits.argmax()), LAZY)
        for layer, entries in enumerate(aux_before):
            for position in entries.positions.tolist():
                if cache.depth[position] > depth_before[position]:
                    assert depth_before[position] == layer + 1  # computed on from where it stopped
                    revived_from_aux += 1
    assert revived_from_aux > 0 and cache.revived_token_layers > 0
    assert cache.computed_token_layers == int(cache.depth[: cache.length].sum())
    for layer in cache.layers:
        assert layer.positions.unique().numel() == layer.positions.numel()
    assert bool((cache.depth[cache.num_prompt : cache.length] == model.spec.num_layers).all())


def test_batched_decode_equals_each_sequence_alone(gemma):
    model = gemma.engine
    configs = [LAZY, PruneConfig(mode="off"), LAZY.model_copy(update={"window": 4, "revive_budget": 8})]
    together, alone = [], []
    for seed, config in enumerate(configs):
        for store in (together, alone):
            cache, logits = prefill(model, _ids(gemma, N + 7 * seed, seed), config, reserve=8)
            store.append([cache, int(logits.argmax()), config])
    for _ in range(6):
        rows = decode_batch(model, [tuple(item) for item in together])
        for i, item in enumerate(alone):
            single = decode_batch(model, [tuple(item)])[0]
            torch.testing.assert_close(rows[i], single, atol=1e-5, rtol=1e-5)
            together[i][1] = item[1] = int(single.argmax())
    for (cache_b, _, _), (cache_a, _, _) in zip(together, alone):
        assert torch.equal(cache_b.depth, cache_a.depth)


def _gemma_spec(num_layers=18) -> ModelSpec:
    config = tiny_config("tiny-gemma3")
    config.num_hidden_layers = num_layers
    config.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]
    return ModelSpec.from_config(config)


def test_presets_stage_at_global_layers_only():
    spec = _gemma_spec()  # Gemma 3 270M's layout: layers 5, 11 and 17 are global
    assert spec.stage_layers == (5, 11, 17)
    assert spec.preset("default").stages == ((11, 0.2),)  # round(0.6 * 18) = 11, already global
    # The paper's cuts at 10%, 20% and 40% depth (layers 2, 4, 7) move to the next global layer.
    assert spec.preset("lazyllm").stages == ((5, 0.5), (11, 0.15))
    assert spec.window_at(0) == TINY_WINDOW and spec.window_at(5) is None


def test_a_stage_at_a_sliding_layer_is_refused_with_the_layers_allowed():
    spec = _gemma_spec()
    with pytest.raises(ValueError, match=r"stage layer 7 is a sliding-window layer.*\[5, 11\]"):
        spec.check(PruneConfig(stages=((7, 0.3),)))
    assert spec.check(PruneConfig(stages=((5, 0.3),))).stages == ((5, 0.3),)


def test_a_request_naming_a_sliding_stage_is_a_400_that_lists_the_global_layers():
    from shared.api.serving import RequestError, parse_request, prepare
    from shared.models.text import load_text_model

    text = load_text_model("tiny-gemma3")
    body = {"model": "tiny-gemma3", "prompt": "hello", "pruning": {"stages": [[2, 0.5]]}}
    with pytest.raises(RequestError) as refused:
        prepare(text, parse_request("/v1/completions", body))
    assert refused.value.status_code == 400 and refused.value.param == "pruning"
    assert "stage layer 2 is a sliding-window layer" in refused.value.message and "[1, 3]" in refused.value.message
    # default's 60% of 6 layers is layer 4: no global layer after it but the last, so the one before.
    assert text.resolve_pruning("default").stages == ((3, 0.2),)
