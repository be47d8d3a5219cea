"""The schedule as published: kept counts, always-kept tokens, original positions, baselines."""

import math

import pytest
import torch
from pydantic import ValidationError

from shared.engine import PruneConfig, SamplingParams, decode_step, generate, prefill, select

N = 200


def _ids(loaded, n=N, seed=0):
    return torch.randint(3, loaded.engine.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _kept(cache, layer):
    return set(cache.layers[layer].positions.tolist())


def test_schedule_is_honoured(tiny_llama):
    config = PruneConfig(stages=((1, 0.5), (3, 0.25)))
    cache, _ = prefill(tiny_llama.engine, _ids(tiny_llama), config)
    assert cache.kept_per_layer == [N, N, N // 2, N // 2, N // 4, N // 4]
    for layer in range(1, 6):
        assert _kept(cache, layer) <= _kept(cache, layer - 1)
    # Tokens that stopped after a stage wait in that stage's Aux Cache, and nowhere else.
    assert set(cache.aux[1].positions.tolist()) == _kept(cache, 1) - _kept(cache, 2)
    assert set(cache.aux[3].positions.tolist()) == _kept(cache, 3) - _kept(cache, 4)
    assert all(cache.aux[layer].positions.numel() == 0 for layer in (0, 2, 4, 5))
    assert cache.computed_token_layers == sum(cache.kept_per_layer)


@pytest.mark.parametrize("keep", [0.01, 0.3])
def test_last_token_and_sinks_always_kept(tiny_llama, keep):
    config = PruneConfig(stages=((0, keep),), sink_tokens=4)
    cache, _ = prefill(tiny_llama.engine, _ids(tiny_llama), config)
    last_layer = _kept(cache, 5)
    assert N - 1 in last_layer
    assert {0, 1, 2, 3} <= last_layer
    assert len(last_layer) == max(math.ceil(keep * N), 5)


def _hf_layers(hf, h, positions, layers):
    """Reference: transformers' own decoder layers on a token subset at the given original positions."""
    cos, sin = hf.model.rotary_emb(h, positions[None])
    mask = (positions[None, :] <= positions[:, None])[None, None]
    for index in layers:
        h = hf.model.layers[index](h, attention_mask=mask, position_embeddings=(cos, sin), position_ids=positions[None])
        h = h[0] if isinstance(h, tuple) else h
    return h


def test_original_positions_feed_rope_and_mask(tiny_llama):
    model, hf = tiny_llama.engine, tiny_llama.engine.hf
    ids = _ids(tiny_llama)
    cache, logits = prefill(model, ids, PruneConfig(mode="static", stages=((0, 0.4),)))
    kept = cache.layers[1].positions
    assert not torch.equal(kept, torch.arange(kept.shape[0]))  # pruning left gaps
    with torch.inference_mode():
        h0 = _hf_layers(hf, hf.model.embed_tokens(ids)[None], torch.arange(N), [0])
        rest = range(1, model.spec.num_layers)
        expected = hf.lm_head(hf.model.norm(_hf_layers(hf, h0[:, kept], kept, rest)))[0, -1]
        renumbered = hf.lm_head(hf.model.norm(_hf_layers(hf, h0[:, kept], torch.arange(kept.shape[0]), rest)))[0, -1]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    assert (logits - renumbered).abs().max() > 1e-3  # the check above can tell positions apart


def test_static_keeps_prefill_selection(tiny_llama):
    config = PruneConfig(mode="static", stages=((1, 0.5), (3, 0.25)))
    model = tiny_llama.engine
    cache, logits = prefill(model, _ids(tiny_llama), config, reserve=8)
    before = [cache.layers[layer].size for layer in range(6)]
    for _ in range(8):
        logits = decode_step(model, cache, int(logits.argmax()), config)
    assert cache.revived_token_layers == 0
    assert [cache.layers[layer].size for layer in range(6)] == [b + 8 for b in before]


def test_random_drop_matches_budget_and_seed(tiny_llama):
    model, ids = tiny_llama.engine, _ids(tiny_llama)
    attention, _ = prefill(model, ids, PruneConfig(mode="static", stages=((1, 0.3),)))
    first, _ = prefill(model, ids, PruneConfig(mode="random", stages=((1, 0.3),), seed=7))
    again, _ = prefill(model, ids, PruneConfig(mode="random", stages=((1, 0.3),), seed=7))
    other, _ = prefill(model, ids, PruneConfig(mode="random", stages=((1, 0.3),), seed=8))
    assert first.kept_per_layer == attention.kept_per_layer == other.kept_per_layer
    assert _kept(first, 2) == _kept(again, 2)
    assert _kept(first, 2) != _kept(other, 2)
    assert _kept(first, 2) != _kept(attention, 2)


def test_block_granularity_keeps_whole_blocks():
    positions = torch.arange(100)
    scores = torch.rand(100, generator=torch.Generator().manual_seed(3))
    config = PruneConfig(stages=((1, 0.3),), granularity="block", block_size=8)
    chosen = select(config, 0.3, scores, positions, 100)
    kept = positions[chosen]
    blocks = set((kept // 8).tolist())
    for block in blocks - {99 // 8}:
        assert set(range(block * 8, min(block * 8 + 8, 100))) <= set(kept.tolist())
    assert 30 <= chosen.sum() < 30 + 8 + 1
    # The best-scoring token's block is kept.
    assert int(torch.argmax(scores)) // 8 in blocks


def test_block_granularity_in_prefill(tiny_llama):
    config = PruneConfig(stages=((1, 0.3),), granularity="block", block_size=16)
    cache, _ = prefill(tiny_llama.engine, _ids(tiny_llama), config)
    kept = cache.layers[2].positions
    full_blocks = {int(b) for b in kept // 16 if int(b) != (N - 1) // 16}
    for block in full_blocks:
        assert set(range(block * 16, block * 16 + 16)) <= set(kept.tolist())


@pytest.mark.parametrize(
    "stages, error",
    [
        (((3, 0.5), (1, 0.4)), "strictly increase"),
        (((1, 0.3), (3, 0.5)), "must not increase"),
        (((1, 0.0),), "in \\(0, 1\\]"),
        (((1, 1.5),), "in \\(0, 1\\]"),
        (((-1, 0.5),), ">= 0"),
        ((), "at least one stage"),
    ],
)
def test_bad_schedules_are_refused(stages, error):
    with pytest.raises(ValidationError, match=error):
        PruneConfig(stages=stages)


def test_stage_beyond_model_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="below the last layer"):
        generate(tiny_llama.engine, _ids(tiny_llama), PruneConfig(stages=((5, 0.5),)), SamplingParams(max_new_tokens=1))
    with pytest.raises(ValidationError):
        PruneConfig(stages=((1, 0.5),), unknown=1)


def test_computed_fraction_matches_prefill(tiny_llama):
    config = PruneConfig(stages=((1, 0.5), (3, 0.25)))
    cache, _ = prefill(tiny_llama.engine, _ids(tiny_llama), config)
    assert config.computed_fraction(6) == pytest.approx(cache.computed_token_layers / (6 * N))


def test_layer_frames_carry_exactly_what_the_cache_holds(tiny_llama):
    frames = []
    config = PruneConfig(stages=((1, 0.5), (3, 0.25)))
    cache, _ = prefill(tiny_llama.engine, _ids(tiny_llama), config, on_layer=frames.append)
    assert [frame.layer for frame in frames] == list(range(6))
    for frame in frames:
        kv = cache.layers[frame.layer]
        assert torch.equal(frame.positions, kv.positions)
        assert torch.equal(frame.k, kv.k) and torch.equal(frame.v, kv.v)
        assert torch.equal(frame.aux_positions, cache.aux[frame.layer].positions)
        assert torch.equal(frame.aux_hidden, cache.aux[frame.layer].hidden)
    assert sum(frame.aux_positions.numel() for frame in frames) == N - cache.kept_per_layer[-1]
