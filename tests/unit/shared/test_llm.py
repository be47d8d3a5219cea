"""Text generation over the engine: sampling, stop strings, streamed deltas."""

import pytest
import torch

from shared.api.llm import LLM, respond
from shared.engine import OFF, SamplingParams, sample


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM(smollm2)


def test_greedy_and_seeded_sampling():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    assert sample(logits, SamplingParams(), None) == 1
    params = SamplingParams(temperature=1.0, seed=0)
    draws = [sample(logits, params, torch.Generator().manual_seed(11)) for _ in range(2)]
    assert draws[0] == draws[1]
    nucleus = SamplingParams(temperature=1.0, top_p=0.5)
    generator = torch.Generator().manual_seed(0)
    assert {sample(logits, nucleus, generator) for _ in range(50)} == {1, 3}


def test_stream_deltas_join_to_the_text(llm):
    ids = llm.chat_ids([{"role": "user", "content": "List three colours."}])
    from shared.api.llm import Completion

    completion = Completion()
    deltas = list(llm.stream_text(ids, SamplingParams(max_new_tokens=20), OFF, None, completion))
    assert "".join(deltas) == completion.text
    assert len(deltas) > 3
    assert completion.generation.stats.completion_tokens == 20


def test_stop_string_cuts_the_text(llm):
    ids = llm.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    full = llm.complete(ids, SamplingParams(max_new_tokens=12), OFF)
    word = full.text.split()[2]
    cut = llm.complete(ids, SamplingParams(max_new_tokens=12), OFF, stop=[word])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(word)]
    assert cut.generation.stats.token_layers_full > 0  # stats filled even when stopped early


def test_a_vanishing_temperature_samples_the_argmax():
    logits = torch.tensor([0.5, 3.0, 2.9, -1.0])
    for temperature in (1e-300, 5e-324, 1e-12):
        params = SamplingParams(temperature=temperature, seed=0)
        assert sample(logits, params, torch.Generator().manual_seed(0)) == 1


def test_a_vanishing_repetition_penalty_is_answered(llm):
    """repetition_penalty=1e-300 (in range: > 0) sends seen tokens' logits to +inf: a 200, not a NaN 500."""
    body = {"prompt": "Lists and tuples", "max_tokens": 3, "temperature": 1.0, "seed": 0, "ignore_eos": True}
    reply = respond(llm, "/v1/completions", body | {"repetition_penalty": 1e-300})
    assert reply.usage.completion_tokens == 3 and reply.choices[0].text


def test_a_short_question_gets_the_unpruned_answer_by_default(llm):
    """The paper's rule changed this 31-token question's greedy answer; the default preset leaves
    prompts under its minimum length unpruned."""
    ids = llm.chat_ids([{"role": "user", "content": "What is 2+2?"}])
    params = SamplingParams(max_new_tokens=16)
    unpruned = llm.complete(ids, params, OFF)
    default = llm.complete(ids, params, llm.resolve_pruning(None))
    assert llm.default_preset == "default"
    assert default.text == unpruned.text
    stats = default.generation.stats
    assert stats.token_layers_computed == stats.token_layers_full


def test_run_batch_lines_sharing_a_document_prefill_it_once(tiny_llama):
    """The in-process model (run-batch) with a prefix cache: the second line on a document reports
    its cached tokens in `usage` and answers as without the cache."""
    from helpers import random_ids

    from shared.api.serving import COMPLETIONS_URL
    from shared.engine import PrefixReuse

    document = random_ids(tiny_llama, 300, seed=3)
    cached = LLM(tiny_llama, prefix=PrefixReuse(tiny_llama.engine, tiny_llama.name, 1 << 30))
    plain = LLM(tiny_llama)
    for question in (random_ids(tiny_llama, 20, seed=4), random_ids(tiny_llama, 20, seed=5)):
        body = {"prompt": document + question, "max_tokens": 8, "temperature": 0}
        got, expected = respond(cached, COMPLETIONS_URL, body), respond(plain, COMPLETIONS_URL, body)
        assert got.choices[0].text == expected.choices[0].text
    assert got.usage.prompt_tokens_details.cached_tokens == 288
    assert expected.usage.prompt_tokens_details.cached_tokens == 0
