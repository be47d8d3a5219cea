"""Prefix caching through the real stack: gateway, prefill worker and two decode workers on
127.0.0.1, driven by the `openai` SDK. A repeated document and a conversation's next turn come
from the cache (usage.prompt_tokens_details.cached_tokens), land where the cache is, and give the
answers the engine gives without any cache; tenants never share entries."""

from __future__ import annotations

import re

import httpx
import pytest
from helpers import random_ids

from shared.contract import preset
from shared.engine import SamplingParams, generate
from shared.net.settings import EngineSettings

MAX_TOKENS = 40


@pytest.fixture
def stack(tiny_llama, decode_worker, prefill_worker, gateway):
    def start(caching: bool = True, **overrides):
        engine = EngineSettings(model="tiny-llama", threads=1, enable_prefix_caching=caching)
        decoders = [decode_worker(tiny_llama, engine=engine)[0] for _ in range(2)]
        prefill = prefill_worker(tiny_llama, engine=engine)
        return gateway(
            prefill_workers=[prefill.address],
            decode_workers=[d.address for d in decoders],
            local_threshold=100,
            engine=engine,
            **overrides,
        )

    return start


def _expected(tiny_llama, ids: list[int]) -> list[int]:
    """The engine's greedy answer from scratch, no cache anywhere."""
    config = preset("default", tiny_llama.engine.spec.num_layers)
    return generate(tiny_llama.engine, ids, config, SamplingParams(max_new_tokens=MAX_TOKENS)).tokens


def _ask(client, ids: list[int]):
    raw = client.completions.with_raw_response.create(
        model="tiny-llama", prompt=ids, max_tokens=MAX_TOKENS, temperature=0
    )
    return raw.parse(), raw.headers


def test_a_repeated_document_and_a_next_turn_come_from_the_cache(stack, tiny_llama):
    running = stack()
    client = running.openai()
    document = random_ids(tiny_llama, 600, seed=5)
    first_question = document + random_ids(tiny_llama, 20, seed=6)
    cold, cold_headers = _ask(client, first_question)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold_headers["x-lazyserve-route"] == "disaggregated"
    holder = cold_headers["x-lazyserve-decode"]
    tokenizer = tiny_llama.tokenizer
    answer = _expected(tiny_llama, first_question)
    assert cold.choices[0].text == tokenizer.decode(answer, skip_special_tokens=True)

    # Another question on the same document: prefilled where the document is, from the cache.
    second_question = document + random_ids(tiny_llama, 25, seed=7)
    warm, warm_headers = _ask(client, second_question)
    assert warm.usage.prompt_tokens_details.cached_tokens == 600 // 32 * 32
    assert (warm_headers["x-lazyserve-route"], warm_headers["x-lazyserve-decode"]) == ("local", holder)
    assert warm.choices[0].text == tokenizer.decode(_expected(tiny_llama, second_question), skip_special_tokens=True)

    # The conversation's next turn: the first question, its answer, a new question. The decode
    # worker cached the finished sequence, so the hit reaches into the answer.
    assert len(answer) == MAX_TOKENS  # no early stop with these seeds: the answer fills blocks
    turn = first_question + answer + random_ids(tiny_llama, 15, seed=8)
    second_turn, turn_headers = _ask(client, turn)
    fed = len(first_question) + len(answer) - 1  # the last answer token was never fed to the model
    assert second_turn.usage.prompt_tokens_details.cached_tokens == fed // 32 * 32 > len(first_question)
    assert turn_headers["x-lazyserve-decode"] == holder
    assert second_turn.choices[0].text == tokenizer.decode(_expected(tiny_llama, turn), skip_special_tokens=True)

    # Streamed: the usage chunk says it too.
    chunks = list(
        client.completions.create(
            model="tiny-llama",
            prompt=second_question,
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    again = len(second_question) // 32 * 32  # the whole question now: it was asked before
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == again
    metrics = httpx.get(f"{running.url}/metrics").text
    hits = sum(float(v) for v in re.findall(r"^lazyserve_prefix_cache_hit_tokens_total\{[^}]*\} (\S+)", metrics, re.M))
    assert hits == 600 // 32 * 32 + fed // 32 * 32 + again
    assert re.search(r"^lazyserve_prefix_cache_bytes\{[^}]*\} [1-9]", metrics, re.M)  # the prefill worker's


def test_with_the_cache_off_nothing_is_cached_and_the_answers_are_the_same(stack, tiny_llama):
    client = stack(caching=False).openai()
    document = random_ids(tiny_llama, 600, seed=5)
    for seed in (6, 7):
        question = document + random_ids(tiny_llama, 20, seed=seed)
        reply, headers = _ask(client, question)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
        assert headers["x-lazyserve-route"] == "disaggregated"
        assert reply.choices[0].text == tiny_llama.tokenizer.decode(
            _expected(tiny_llama, question), skip_special_tokens=True
        )


def test_two_api_keys_never_share_entries(stack, tiny_llama):
    running = stack(api_keys="key-a,key-b")
    a, b = running.openai(api_key="key-a"), running.openai(api_key="key-b")
    prompt = random_ids(tiny_llama, 300, seed=9)
    assert _ask(a, prompt)[0].usage.prompt_tokens_details.cached_tokens == 0
    assert _ask(a, prompt)[0].usage.prompt_tokens_details.cached_tokens == 288
    # The same prompt under another key: nothing of the first key's entries, on any worker.
    assert _ask(b, prompt)[0].usage.prompt_tokens_details.cached_tokens == 0
    assert _ask(b, prompt)[0].usage.prompt_tokens_details.cached_tokens == 288
