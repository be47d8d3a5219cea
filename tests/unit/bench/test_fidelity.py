"""Fidelity metrics on known inputs, and the teacher-forced run against plain generation."""

from __future__ import annotations

import math

import pytest
import torch

from bench.evalsuite.fidelity import agreement, kl_divergence, reference, run
from bench.evalsuite.intervals import mean_ci, paired_difference_ci
from shared.engine import PruneConfig, SamplingParams, generate


def test_kl_of_equal_distributions_is_zero_and_known_values_match():
    p = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    assert torch.equal(kl_divergence(p, p), torch.zeros(3))
    two = torch.log(torch.tensor([0.5, 0.5]))
    skewed = torch.log(torch.tensor([0.9, 0.1]))
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert float(kl_divergence(two, skewed)) == pytest.approx(expected, rel=1e-6)


def test_agreement_of_identical_runs_is_one():
    p = torch.randn(5, 20, generator=torch.Generator().manual_seed(1))
    assert agreement(p, p).tolist() == [1.0] * 5
    q = p.clone()
    q[2, int(p[2].argmax())] = -100.0
    assert agreement(p, q).tolist() == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_intervals():
    assert mean_ci([0.5] * 10) == (0.5, 0.5, 0.5)
    assert paired_difference_ci([1, 0, 1], [1, 0, 1]) == (0.0, 0.0, 0.0)
    mean, low, high = mean_ci([0, 1] * 20)
    assert mean == 0.5 and low < 0.5 < high and high - low < 0.4
    assert all(math.isnan(x) for x in mean_ci([]))
    with pytest.raises(AssertionError):
        paired_difference_ci([1], [1, 0])


def _ids(loaded, n=120):
    return torch.randint(3, loaded.engine.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(4)).tolist()


def test_the_unpruned_run_agrees_with_its_reference(tiny_llama):
    model, ids = tiny_llama.engine, _ids(tiny_llama)
    ref = reference(model, ids, stop_ids=(), steps=12)
    assert len(ref.tokens) == 12 and ref.logprobs.shape == (12, model.spec.vocab_size)
    got = run(model, ids, PruneConfig(mode="off"), ref, max_tokens=8, stop_ids=())
    assert got.first_kl == pytest.approx(0.0, abs=1e-5) and got.teacher_kl == pytest.approx(0.0, abs=1e-5)
    assert got.first_top1 == got.teacher_top1 == got.prefix_match == 1.0
    assert got.tokens == ref.tokens[:8]
    assert got.computed_fraction == 1.0


@pytest.mark.parametrize(
    "config",
    [
        PruneConfig(stages=((0, 0.1), (2, 0.05))),
        PruneConfig(stages=((1, 0.2),), window=8, pool_kernel=3, recent_tokens=4),
        PruneConfig(mode="static", stages=((0, 0.1),)),
    ],
)
def test_the_pruned_answer_equals_plain_pruned_generation(tiny_llama, config):
    """The answer built from the reference's prefix and a forked cache is what a client would get."""
    model, ids = tiny_llama.engine, _ids(tiny_llama)
    ref = reference(model, ids, stop_ids=(), steps=16)
    got = run(model, ids, config, ref, max_tokens=10, stop_ids=())
    plain = generate(model, ids, config, SamplingParams(max_new_tokens=10))
    assert got.tokens == plain.tokens
    assert got.prefix_match < 1.0 and got.first_kl >= 0.0  # the pruning was severe enough to diverge
    assert got.computed_fraction < 1.0
