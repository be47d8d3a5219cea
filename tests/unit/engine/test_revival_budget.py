"""Decode's two knobs on revival: `revive_budget` caps the prompt tokens a re-selection revives
(best first, the freed slots going to tokens that already have KV deeper), `reselect_every` keeps
each stage's live set between re-selections. Both at their defaults are LazyLLM's rule, unchanged:
tests/unit/engine/test_selection_options.py holds that against the golden fingerprints."""

import pytest
import torch

from shared.engine import PruneConfig, decode_step, prefill

LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)), window=4)
STEPS = 16


def _ids(loaded, n=200):
    return torch.randint(3, loaded.engine.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(9))


def _decode(loaded, config, steps=STEPS):
    """Greedy steps; per step, the prompt positions revived and each stage's live set after it."""
    model = loaded.engine
    cache, logits = prefill(model, _ids(loaded), config, reserve=steps)
    revived, selected = [], []
    for _ in range(steps):
        before = set(cache.revived), cache.revived_token_layers
        logits = decode_step(model, cache, int(logits.argmax()), config)
        revived.append((len(cache.revived - before[0]), cache.revived_token_layers - before[1]))
        selected.append({layer: held.clone() for layer, held in cache.selected.items()})
    return cache, revived, selected


def _at_most_once(cache):
    # The write check refuses any (token, layer) computed twice, so the counter equals the depths' sum.
    assert cache.computed_token_layers == int(cache.depth[: cache.length].sum())


def test_without_a_budget_this_prompt_revives(tiny_llama):
    cache, revived, _ = _decode(tiny_llama, LAZY)
    assert sum(tokens for tokens, _ in revived) > 8, "the cases below need a prompt that revives"
    _at_most_once(cache)


def test_a_budget_of_zero_revives_nothing_and_keeps_the_stage_full(tiny_llama):
    config = LAZY.model_copy(update={"revive_budget": 0})
    cache, revived, selected = _decode(tiny_llama, config)
    assert cache.revived_token_layers == 0 and not cache.revived
    # Every live prompt token past a stage has KV there, and the stage still keeps its fraction.
    num_prompt = cache.num_prompt
    for layer, _ in config.stages:
        for held in (step[layer] for step in selected):
            assert bool((cache.depth[:num_prompt][held] > layer + 1).all())
    assert int(selected[-1][3].sum()) >= int(0.2 * num_prompt)
    _at_most_once(cache)


@pytest.mark.parametrize("budget", [1, 3])
def test_each_reselection_revives_at_most_the_budget(tiny_llama, budget):
    config = LAZY.model_copy(update={"revive_budget": budget})
    stages = len(config.stages)
    cache, revived, _ = _decode(tiny_llama, config)
    assert all(tokens <= budget * stages for tokens, _ in revived), revived
    _, unbounded, _ = _decode(tiny_llama, LAZY)
    assert max(tokens for tokens, _ in unbounded) > budget * stages, "the budget binds on this prompt"
    _at_most_once(cache)


def test_a_block_budget_revives_a_block_a_stage_and_step(tiny_llama):
    config = LAZY.model_copy(update={"granularity": "block", "block_size": 4, "revive_budget": 4})
    cache, revived, _ = _decode(tiny_llama, config)
    assert sum(tokens for tokens, _ in revived) > 0
    assert all(tokens <= 4 * len(config.stages) for tokens, _ in revived)
    _at_most_once(cache)


@pytest.mark.parametrize("every", [2, 5])
def test_between_reselections_the_live_sets_hold_and_nothing_revives(tiny_llama, every):
    config = LAZY.model_copy(update={"reselect_every": every})
    cache, revived, selected = _decode(tiny_llama, config)
    for step in range(STEPS):
        if step % every:
            assert revived[step] == (0, 0), f"step {step} revived"
            for layer, held in selected[step].items():
                assert torch.equal(held, selected[step - 1][layer])
    assert any(tokens for tokens, _ in revived), "the re-selection steps still revive"
    _at_most_once(cache)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="reselect_every"):
        PruneConfig(stages=((1, 0.5),), reselect_every=0)
    with pytest.raises(ValueError, match="revive_budget"):
        PruneConfig(stages=((1, 0.5),), revive_budget=-1)


@pytest.mark.parametrize(
    "config",
    [
        LAZY,
        LAZY.model_copy(update={"window": 6, "pool_kernel": 3, "granularity": "block", "block_size": 4}),
        LAZY.model_copy(update={"reselect_every": 3}),
    ],
    ids=["two-stages", "block-pooled", "every-3"],
)
def test_the_window_memo_scores_as_scoring_afresh(tiny_llama, config):
    """Decode keeps each window query's probabilities at the first stage and computes one new row a
    step; a run that drops the memo after every step (so it scores the whole window afresh) makes
    the same selections, so the same logits, bit for bit (the scores agree to rounding)."""
    model = tiny_llama.engine
    runs = []
    for forget in (False, True):
        cache, logits = prefill(model, _ids(tiny_llama), config, reserve=STEPS)
        steps = []
        for _ in range(STEPS):
            logits = decode_step(model, cache, int(logits.argmax()), config)
            steps.append((logits, {layer: held.clone() for layer, held in cache.selected.items()}))
            if forget:
                for window in cache.windows.values():
                    window.rows = None
        runs.append(steps)
        assert (cache.windows[1].rows is None) == forget
    for (logits, selected), (fresh_logits, fresh_selected) in zip(*runs):
        assert torch.equal(logits, fresh_logits)
        assert all(torch.equal(selected[layer], fresh_selected[layer]) for layer in selected)
