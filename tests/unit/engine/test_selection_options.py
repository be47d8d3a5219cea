"""The selection options that keep answers: query window, score pooling, protected tokens, mass
budget, a minimum prompt length. Their defaults must be today's LazyLLM to the bit."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError

from shared.engine import PruneConfig, decode_step, prefill, select
from shared.engine.layer import project_qkv, window_scores
from shared.engine.pruning import pool_scores
from tests.unit.engine.selection_snapshot import CONFIGS, GOLDEN, fingerprint

N = 200


def _ids(loaded, n=N, seed=0):
    return torch.randint(3, loaded.engine.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_defaults_reproduce_the_published_selection(tiny_llama, name):
    """Kept tokens, revivals and greedy tokens as recorded before the options existed."""
    golden = json.loads(GOLDEN.read_text())[name]
    got = fingerprint(tiny_llama.engine, PruneConfig(**CONFIGS[name]))
    assert got["kept"] == golden["kept"]
    assert got["aux"] == golden["aux"]
    assert got["revived_token_layers"] == golden["revived_token_layers"]
    assert got["computed_token_layers"] == golden["computed_token_layers"]
    for mine, theirs in zip(got["steps"], golden["steps"]):
        assert mine["token"] == theirs["token"] and mine["top_ids"] == theirs["top_ids"]
        assert mine["top_logits"] == pytest.approx(theirs["top_logits"], abs=1e-5)


@torch.inference_mode()
def test_window_scores_equal_the_summed_rows_of_full_attention(tiny_llama):
    model = tiny_llama.engine
    n, w = 50, 7
    h = model.embed_tokens(_ids(tiny_llama, n))
    positions = torch.arange(n)
    q, k, _ = project_qkv(model, 0, h, positions)
    got = window_scores(model, q[:, :, -w:], k, None, positions[-w:], positions)
    # Reference: the full causal attention matrix, every head, keys repeated per query group.
    groups = model.spec.num_heads // model.spec.num_kv_heads
    keys = k.repeat_interleave(groups, dim=1)
    logits = (q @ keys.transpose(-1, -2))[0] * model.scaling  # [H, n, n]
    logits = logits.masked_fill(~(positions[None, :] <= positions[:, None]), float("-inf"))
    expected = torch.softmax(logits, dim=-1)[:, -w:].sum(dim=1).mean(dim=0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert float(got.sum()) == pytest.approx(w, rel=1e-5)  # each query's row sums to 1
    # One row is the last query's attention alone.
    one = window_scores(model, q[:, :, -1:], k)
    torch.testing.assert_close(one, torch.softmax(logits, dim=-1)[:, -1].mean(dim=0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("pool", ["max", "avg"])
def test_pooling_keeps_a_run_of_neighbours(pool):
    config = PruneConfig(stages=((1, 0.06),), pool_kernel=5, pool=pool)
    positions = torch.arange(100)
    scores = torch.rand(100, generator=torch.Generator().manual_seed(1)) * 0.01
    scores[40] = 1.0  # one strong token: unpooled, its neighbours are noise
    chosen = select(config, 0.06, scores, positions, 100)  # 6 tokens: the last one and a run of 5
    assert set(positions[chosen].tolist()) == {38, 39, 40, 41, 42, 99}
    unpooled = select(PruneConfig(stages=((1, 0.06),)), 0.06, scores, positions, 100)
    assert not {38, 39, 41, 42} <= set(positions[unpooled].tolist())


def test_pooling_counts_only_live_neighbours():
    positions = torch.tensor([0, 1, 2, 5, 6, 9])
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    maxed = pool_scores(PruneConfig(stages=((1, 0.5),), pool_kernel=3), scores, positions, 10)
    assert maxed.tolist() == [2.0, 3.0, 3.0, 5.0, 5.0, 6.0]
    averaged = pool_scores(PruneConfig(stages=((1, 0.5),), pool_kernel=3, pool="avg"), scores, positions, 10)
    torch.testing.assert_close(averaged, torch.tensor([1.5, 2.0, 2.5, 4.5, 4.5, 6.0]))


@pytest.mark.parametrize("mode", ["lazy", "static"])
def test_protected_tokens_always_survive(tiny_llama, mode):
    config = PruneConfig(mode=mode, stages=((0, 0.01), (2, 0.01)), sink_tokens=3, recent_tokens=16)
    model = tiny_llama.engine
    cache, logits = prefill(model, _ids(tiny_llama), config)
    protected = set(range(3)) | set(range(N - 16, N))
    assert set(cache.layers[5].positions.tolist()) == protected
    for _ in range(3):
        logits = decode_step(model, cache, int(logits.argmax()), config)
    assert protected <= set(cache.layers[5].positions.tolist())


def test_a_mass_budget_keeps_the_stated_mass():
    generator = torch.Generator().manual_seed(2)
    mass = torch.softmax(torch.randn(400, generator=generator) * 3, dim=0)
    positions = torch.arange(400)
    config = PruneConfig(stages=((1, 1.0),), keep_mass=0.9)
    chosen = select(config, 1.0, mass, positions, 400, mass=mass)
    kept = float(mass[chosen].sum())
    assert kept >= 0.9
    # The fewest tokens: without its weakest kept token (the last one is forced) the mass falls short.
    weakest = float(mass[chosen & (positions != 399)].min())
    assert kept - weakest < 0.9 or int(chosen.sum()) == 1
    assert 1 < int(chosen.sum()) < 400
    # Clipped to [min_keep, keep] of the prompt.
    capped = select(config.model_copy(update={"keep_mass": 0.999}), 0.1, mass, positions, 400, mass=mass)
    assert int(capped.sum()) == 40
    floored = select(
        config.model_copy(update={"keep_mass": 0.01, "min_keep": 0.2}), 1.0, mass, positions, 400, mass=mass
    )
    assert int(floored.sum()) == 80


def test_a_mass_budget_in_prefill_keeps_less_where_attention_is_peaked(tiny_llama):
    config = PruneConfig(stages=((1, 0.9),), keep_mass=0.5, window=4)
    cache, _ = prefill(tiny_llama.engine, _ids(tiny_llama), config)
    assert 1 <= cache.kept_per_layer[2] < math.ceil(0.9 * N)
    assert cache.computed_token_layers == sum(cache.kept_per_layer)


def test_decode_reselects_with_the_query_window(tiny_llama):
    model, w = tiny_llama.engine, 6
    # The window is the last live queries at each stage; protecting the prompt's tail keeps it whole.
    config = PruneConfig(stages=((1, 0.3), (3, 0.15)), window=w, recent_tokens=w)
    cache, logits = prefill(model, _ids(tiny_llama), config)
    assert sorted(cache.windows) == [1, 3]
    assert cache.windows[1].positions.tolist() == list(range(N - w, N))
    for _ in range(4):
        logits = decode_step(model, cache, int(logits.argmax()), config)
    # The window slides: the generated tokens' queries joined it, the oldest prompt ones left.
    assert cache.windows[3].positions.tolist() == list(range(N - 2, N + 4))
    assert cache.windows[3].q.shape == (1, model.spec.num_heads, w, model.spec.head_dim)
    # At most once: every position's depth counts exactly the KV rows it has.
    for position in range(N + 4):
        rows = sum(int((layer.positions == position).sum()) for layer in cache.layers)
        assert rows == int(cache.depth[position])


def test_a_wider_window_changes_the_selection(tiny_llama):
    ids = _ids(tiny_llama)
    one, _ = prefill(tiny_llama.engine, ids, PruneConfig(stages=((1, 0.2),)))
    many, _ = prefill(tiny_llama.engine, ids, PruneConfig(stages=((1, 0.2),), window=32))
    assert not torch.equal(one.layers[2].positions, many.layers[2].positions)


def test_short_prompts_are_not_pruned(tiny_llama):
    model = tiny_llama.engine
    config = PruneConfig(stages=((1, 0.2),), min_prompt_tokens=N + 1)
    cache, logits = prefill(model, _ids(tiny_llama), config)
    assert cache.kept_per_layer == [N] * model.spec.num_layers
    decode_step(model, cache, int(logits.argmax()), config)
    assert cache.revived_token_layers == 0
    pruned, _ = prefill(model, _ids(tiny_llama), config.model_copy(update={"min_prompt_tokens": N}))
    assert pruned.kept_per_layer[2] == math.ceil(0.2 * N)
    assert config.computed_fraction(6, num_prompt=N) == 1.0
    assert config.computed_fraction(6, num_prompt=N + 1) < 1.0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"pool_kernel": 4}, "odd"),
        ({"window": 0}, "window"),
        ({"mode": "random", "keep_mass": 0.9}, "keep_mass"),
        ({"keep_mass": 0.0}, "keep_mass"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"pool": "median"}, "pool"),
        ({"recent_tokens": -1}, "recent_tokens"),
    ],
)
def test_bad_options_are_refused(fields, message):
    with pytest.raises(ValidationError, match=message):
        PruneConfig(**({"stages": ((1, 0.5),)} | fields))
