"""Decode under lazy: re-selection every step, revival from the Aux Cache, each token-layer at most once."""

import copy

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from shared.engine import PruneConfig, decode_step, prefill

CONFIG = PruneConfig(stages=((1, 0.5), (3, 0.2)))
STEPS = 16


def _ids(loaded, n=160):
    return torch.randint(3, loaded.engine.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(5))


def _run(loaded, config=CONFIG, steps=STEPS, inspect=None):
    model = loaded.engine
    cache, logits = prefill(model, _ids(loaded), config, reserve=steps)
    for _ in range(steps):
        before = copy.deepcopy(cache.aux), cache.depth.clone()
        logits = decode_step(model, cache, int(logits.argmax()), config)
        if inspect is not None:
            inspect(cache, *before)
    return cache


def test_decode_revives_and_computes_each_token_layer_once(tiny_llama):
    cache = _run(tiny_llama)
    layers = tiny_llama.engine.spec.num_layers
    assert cache.revived_token_layers > 0
    # depth[p] = layers where p has KV; the write check refuses any (token, layer) computed twice,
    # so the counter equals the sum of depths exactly.
    assert cache.computed_token_layers == int(cache.depth[: cache.length].sum())
    assert cache.computed_token_layers <= layers * cache.length
    for layer in range(layers):
        positions = cache.layers[layer].positions
        assert positions.unique().numel() == positions.numel()
    # Generated tokens are computed at every layer.
    assert bool((cache.depth[cache.num_prompt : cache.length] == layers).all())


def test_computing_a_token_layer_twice_is_refused(tiny_llama):
    model = tiny_llama.engine
    cache, _ = prefill(model, _ids(tiny_llama), CONFIG)
    k = torch.zeros(1, model.spec.num_kv_heads, 1, model.spec.head_dim)
    with pytest.raises(AssertionError, match="computed twice"):
        cache.write(0, torch.tensor([3]), k, k)


def test_revived_kv_equals_the_layer_applied_to_its_aux_hidden_state(tiny_llama):
    hf = tiny_llama.engine.hf
    checked = []

    def inspect(cache, aux_before, depth_before):
        for layer, entries in enumerate(aux_before):
            for row, position in enumerate(entries.positions.tolist()):
                if cache.depth[position] > layer + 1 and depth_before[position] == layer + 1:
                    # Revived this step: computed at layer+1 from its Aux Cache hidden state.
                    target = cache.layers[layer + 1]
                    slot = int((target.positions == position).nonzero())
                    h = entries.hidden[row][None, None]
                    block = hf.model.layers[layer + 1]
                    attn = block.self_attn
                    x = block.input_layernorm(h)
                    shape = (1, 1, -1, attn.head_dim)
                    k = attn.k_proj(x).view(shape).transpose(1, 2)
                    v = attn.v_proj(x).view(shape).transpose(1, 2)
                    cos, sin = hf.model.rotary_emb(h, torch.tensor([[position]]))
                    _, k = apply_rotary_pos_emb(k, k, cos, sin)
                    torch.testing.assert_close(target.k[:, :, slot], k[:, :, 0], atol=1e-5, rtol=0)
                    torch.testing.assert_close(target.v[:, :, slot], v[:, :, 0], atol=1e-5, rtol=0)
                    checked.append((position, layer))

    with torch.inference_mode():
        _run(tiny_llama, inspect=inspect)
    assert len(checked) > 5


def test_revived_tokens_never_restart_from_layer_zero(tiny_llama):
    revived = []

    def inspect(cache, aux_before, depth_before):
        grown = cache.depth[: depth_before.shape[0]] > depth_before
        grown[cache.length - 1] = False  # the new token itself starts at layer 0
        # A token computed again this step continues from where it stopped, never from layer 0.
        assert bool((depth_before[grown] > 0).all())
        revived.append(int(grown.sum()))

    cache = _run(tiny_llama, inspect=inspect)
    assert sum(revived) > 0
    # Layer 0 only ever gained the generated tokens: nothing was recomputed from the embedding.
    assert cache.layers[0].size == cache.num_prompt + STEPS


def test_real_model_revives_on_real_text(smollm2):
    from pydoc_data.topics import topics

    ids = torch.tensor(smollm2.tokenizer(topics["assignment"][:3000]).input_ids)
    config = PruneConfig(stages=((3, 0.5), (8, 0.3), (14, 0.15)))
    model = smollm2.engine
    cache, logits = prefill(model, ids, config, reserve=8)
    for _ in range(8):
        logits = decode_step(model, cache, int(logits.argmax()), config)
    assert cache.revived_token_layers > 0
    assert cache.computed_token_layers == int(cache.depth[: cache.length].sum())
    assert cache.computed_token_layers < model.spec.num_layers * cache.length
