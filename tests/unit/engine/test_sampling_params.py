"""The sampler's parameters against transformers' own logits processors and warpers (an outside
reference), on random logits and through whole generations of a real model."""

from __future__ import annotations

import pytest
import torch
from helpers import OpenAIPenalties
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shared.engine import OFF, PruneConfig, Sampler, SamplingParams, generate
from shared.engine.sampling import probabilities

VOCAB = 500


def _reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """transformers' warpers in generate()'s order, as probabilities."""
    scores = logits.double()[None]
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    for warper in warpers:
        scores = warper(None, scores)
    return torch.softmax(scores[0], dim=-1)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(1.0, 10, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (1.3, 50, 0.8, 0.02), (0.5, 1, 1.0, 0.0)],
)
def test_cuts_equal_transformers_warpers(temperature, top_k, top_p, min_p):
    generator = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    for _ in range(20):
        logits = torch.randn(VOCAB, generator=generator) * 3
        ours = probabilities(logits, params)
        ours = ours / ours.sum()
        torch.testing.assert_close(ours, _reference(logits, temperature, top_k, top_p, min_p), atol=1e-9, rtol=0)


def test_repetition_penalty_equals_transformers():
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (40,), generator=generator)
    sampler = Sampler(SamplingParams(repetition_penalty=1.4), prompt_ids=prompt.tolist())
    generated = [int(t) for t in torch.randint(0, VOCAB, (10,), generator=generator)]
    for token in generated:
        sampler.observe(token)
    logits = torch.randn(VOCAB, generator=generator)
    reference = RepetitionPenaltyLogitsProcessor(1.4)(torch.cat([prompt, torch.tensor(generated)])[None], logits[None])
    torch.testing.assert_close(sampler.process(logits), reference[0])


def test_a_repetition_penalty_near_zero_samples_among_the_infinite_logits():
    """Positive logits of seen tokens divided by 1e-300 overflow float32 to +inf; sampling then
    draws among exactly those tokens, evenly (it was a NaN distribution and a 500)."""
    logits = torch.full((VOCAB,), -1.0)
    logits[[3, 7, 11]] = torch.tensor([2.0, 0.5, -4.0])  # seen; 11's negative logit is multiplied, not divided
    logits[20] = 5.0  # not seen: stays finite, and loses to the infinite ones
    params = SamplingParams(temperature=1.0, repetition_penalty=1e-300)
    sampler = Sampler(params, prompt_ids=[3, 7, 11])
    processed = sampler.process(logits)
    assert processed[3] == processed[7] == float("inf")
    probs = probabilities(processed, params)
    expected = torch.zeros(VOCAB, dtype=torch.float64)
    expected[[3, 7]] = 0.5
    torch.testing.assert_close(probs, expected, atol=0, rtol=0)
    seeded = [SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=seed) for seed in range(40)]
    assert {Sampler(each, prompt_ids=[3, 7, 11]).choose(logits).token for each in seeded} == {3, 7}


def test_presence_and_frequency_follow_openai_definition():
    sampler = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt_ids=[1, 2, 3])
    for token in (4, 4, 4, 7):
        sampler.observe(token)
    logits = torch.zeros(10)
    expected = torch.zeros(10)
    expected[4] = -(3 * 0.25 + 0.5)
    expected[7] = -(1 * 0.25 + 0.5)  # the prompt's tokens are not penalized
    torch.testing.assert_close(sampler.process(logits), expected)


def _hf_greedy(loaded, ids: torch.Tensor, max_new_tokens: int, **kwargs) -> list[int]:
    with torch.inference_mode():
        out = loaded.engine.hf.generate(
            ids[None], max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs
        )
    tokens = out[0, ids.shape[0] :].tolist()
    eos = set(loaded.stop_token_ids)
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))]


def _prompt(loaded, n=60, seed=0):
    return torch.randint(3, loaded.engine.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "config", [OFF, PruneConfig(mode="lazy", stages=((1, 1.0), (3, 1.0)))], ids=["off", "keep-all"]
)
def test_greedy_generation_with_processors_equals_transformers_generate(tiny_llama, config):
    ids, eos = _prompt(tiny_llama), tiny_llama.stop_token_ids
    model = tiny_llama.engine
    # Repetition penalty.
    ours = generate(model, ids, config, SamplingParams(max_new_tokens=24, repetition_penalty=1.5, stop_token_ids=eos))
    assert ours.tokens == _hf_greedy(tiny_llama, ids, 24, repetition_penalty=1.5)
    # Logit bias: push one token up, another (the unbiased greedy's first) out.
    plain = generate(model, ids, config, SamplingParams(max_new_tokens=12, stop_token_ids=eos)).tokens
    bias = ((plain[0], -100.0), (1234, 5.0))
    ours = generate(model, ids, config, SamplingParams(max_new_tokens=12, logit_bias=bias, stop_token_ids=eos))
    assert ours.tokens != plain
    assert ours.tokens == _hf_greedy(tiny_llama, ids, 12, sequence_bias={(t,): b for t, b in bias})
    # min_tokens with an end-of-sequence token made the likeliest: exactly min_tokens come out.
    params = SamplingParams(max_new_tokens=12, min_tokens=5, logit_bias=((eos[0], 100.0),), stop_token_ids=eos)
    ours = generate(model, ids, config, params)
    reference = _hf_greedy(tiny_llama, ids, 12, min_new_tokens=5, sequence_bias={(eos[0],): 100.0})
    assert len(ours.tokens) == 5 and ours.finish_reason == "stop" and ours.tokens == reference
    # Presence and frequency penalties through transformers' generate loop.
    params = SamplingParams(max_new_tokens=24, presence_penalty=1.0, frequency_penalty=2.0, stop_token_ids=eos)
    processors = LogitsProcessorList([OpenAIPenalties(len(ids), 1.0, 2.0)])
    assert generate(model, ids, config, params).tokens == _hf_greedy(tiny_llama, ids, 24, logits_processor=processors)


def test_logprobs_are_the_models_and_survive_processing(tiny_llama):
    model, ids = tiny_llama.engine, _prompt(tiny_llama, seed=1)
    params = SamplingParams(max_new_tokens=6, logprobs=3, repetition_penalty=1.3, temperature=0.8, seed=5)
    result = generate(model, ids, OFF, params)
    assert len(result.logprobs) == len(result.tokens) == 6
    sequence = ids.tolist()
    with torch.inference_mode():
        for sampled in result.logprobs:
            expected = torch.log_softmax(model.hf(torch.tensor([sequence])).logits[0, -1].float(), dim=-1)
            assert sampled.logprob == pytest.approx(float(expected[sampled.token]), abs=1e-4)
            values, top = torch.topk(expected, 3)
            assert [t for t, _ in sampled.top] == top.tolist()
            assert [lp for _, lp in sampled.top] == pytest.approx(values.tolist(), abs=1e-4)
            sequence.append(sampled.token)
    # Without logprobs asked, nothing is computed or kept.
    assert generate(model, ids, OFF, SamplingParams(max_new_tokens=3)).logprobs == []


def test_top_k_one_samples_the_greedy_tokens(tiny_llama):
    model, ids, eos = tiny_llama.engine, _prompt(tiny_llama, seed=2), tiny_llama.stop_token_ids
    greedy = generate(model, ids, OFF, SamplingParams(max_new_tokens=16, stop_token_ids=eos)).tokens
    sampled = generate(model, ids, OFF, SamplingParams(max_new_tokens=16, temperature=1.5, top_k=1, seed=9))
    assert sampled.tokens[: len(greedy)] == greedy


def test_contract_refuses_out_of_range_values():
    for bad in (
        {"top_k": -1},
        {"min_p": 1.5},
        {"presence_penalty": 3.0},
        {"frequency_penalty": float("nan")},
        {"repetition_penalty": 0.0},
        {"logit_bias": ((1, 101.0),)},
        {"min_tokens": 65},
        {"logprobs": 21},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
