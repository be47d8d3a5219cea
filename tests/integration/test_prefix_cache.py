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
from shared.settings import EngineSettings

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

    # The conversation's next turn: the first question, its answer, a new question. The hit is the
    # first question's blocks; the answer, which decode computed a row at a time, is prefilled.
    assert len(answer) == MAX_TOKENS  # no early stop with these seeds: the answer would fill blocks
    turn = first_question + answer + random_ids(tiny_llama, 15, seed=8)
    second_turn, turn_headers = _ask(client, turn)
    first_blocks = len(first_question) // 32 * 32
    assert second_turn.usage.prompt_tokens_details.cached_tokens == first_blocks
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
    assert hits == 600 // 32 * 32 + first_blocks + again
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


def test_with_several_gateways_the_index_lives_in_redis(flush_redis, tiny_llama):
    """Gateway A routes a conversation's first turn; gateway B, sharing only Redis, sends the next
    turn to the decode worker holding it. The attempts are scripted (no model): this is about
    where the index lives; the test above runs the real workers."""
    import asyncio
    import time

    from services.router.client import Finished, Tokens
    from services.router.dispatch import Dispatcher
    from services.router.metrics import GatewayMetrics
    from services.router.policy import LengthAwarePolicy
    from services.router.prefixes import RedisPrefixIndex
    from services.router.workers import StaticWorkers
    from shared.api.serving import Prepared
    from shared.models.text import TextModel
    from shared.net.registry import WorkerInfo, connect

    calls = []

    async def attempt(channels, decode, prefill, ids, pruning, sampling, request_id, deadline, parent=None, **_):
        calls.append((decode.worker_id, prefill and prefill.worker_id))
        yield Tokens([7], _stats(len(ids)))
        yield Tokens([7] * 39)
        yield Finished("length", _stats(len(ids)))

    def _stats(n):
        from shared.contract import Stats

        return Stats(prompt_tokens=n)

    infos = [WorkerInfo(worker_id=f"d{i}", role="decode", address=f"d{i}:1", model="m") for i in range(2)]
    infos.append(WorkerInfo(worker_id="p0", role="prefill", address="p0:1", model="m"))
    spec = tiny_llama.engine.spec
    gateways = [
        Dispatcher(
            StaticWorkers(infos),
            LengthAwarePolicy(100),
            TextModel("m", None, spec, ()),
            GatewayMetrics(),
            1,
            attempt=attempt,
            prefixes=RedisPrefixIndex(connect(_url(flush_redis))),
        )
        for _ in range(2)
    ]
    config = preset("default", spec.num_layers)

    def ask(dispatcher, ids):
        prepared = Prepared(ids, SamplingParams(max_new_tokens=40), config, "default", [])

        async def run():
            async for _ in dispatcher.run(prepared, "r", time.monotonic() + 30):
                pass
            await asyncio.sleep(0.2)  # the index is written in the background

        asyncio.run(run())

    first = random_ids(tiny_llama, 600, seed=3)
    ask(gateways[0], first)
    holder = calls[-1][0]
    assert calls[-1][1] == "p0"
    assert flush_redis.keys("lazyserve:prefix:*")
    ask(gateways[1], first + [7] * 40 + random_ids(tiny_llama, 20, seed=4))
    assert calls[-1] == (holder, None)


def _url(client) -> str:
    kwargs = client.connection_pool.connection_kwargs
    return f"redis://{kwargs['host']}:{kwargs['port']}/{kwargs.get('db', 0)}"


@pytest.mark.starts_ray
def test_through_up_a_repeated_document_and_a_second_turn_are_cached(tiny_llama):
    """`lazyserve up` as a user runs it (its own processes, the prefill actor on a local Ray), the
    `openai` SDK as the client: chat requests, so the chat template and the tokenizer take part."""
    import openai
    from conftest import free_port, kill_sessions, start_process

    port = free_port()
    args = ["up", "--model", "tiny-llama", "--threads", "1", "--port", str(port), "--local-threshold", "100"]
    args += ["--decode-port", str(free_port()), "--prefill-port", str(free_port())]
    process, url = start_process(args, "gateway", timeout=240, session=True)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        document = " ".join(f"item{i} costs {i * 7 % 13} coins." for i in range(120))

        def chat(messages):
            reply = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=12, temperature=0)
            return reply.choices[0].message.content, reply.usage.prompt_tokens_details.cached_tokens

        first = [{"role": "user", "content": document + "\nWhat does item3 cost?"}]
        answer, cached = chat(first)
        assert cached == 0
        again = [{"role": "user", "content": document + "\nWhat does item7 cost?"}]
        _, cached = chat(again)
        assert cached > 0.8 * len(tiny_llama.tokenizer(document).input_ids)
        turn = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And item9?"}]
        second_answer, cached = chat(turn)
        from shared.models.text import load_text_model

        text = load_text_model("tiny-llama")
        assert cached >= len(text.chat_ids(first)) // 32 * 32 > 0
        # The same answers as the engine gives from scratch.
        config = preset("default", tiny_llama.engine.spec.num_layers)
        for messages, got in ((first, answer), (turn, second_answer)):
            ids = text.chat_ids(messages)
            tokens = generate(tiny_llama.engine, ids, config, SamplingParams(max_new_tokens=12)).tokens
            assert got == text.tokenizer.decode(tokens, skip_special_tokens=True)
    finally:
        process.terminate()
        process.wait(timeout=60)
        kill_sessions({process.pid})


def test_a_short_first_turn_is_found_by_the_long_pruned_turn_after_it(stack, tiny_llama):
    """The default preset leaves prompts under 1024 tokens unpruned; the gateway still files the
    first turn under the preset's layers, so the second turn, over 1024 and pruned, finds it."""
    client = stack().openai()
    first = random_ids(tiny_llama, 700, seed=21)
    reply, _ = _ask(client, first)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    answer = _expected(tiny_llama, first)
    turn = first + answer + random_ids(tiny_llama, 400, seed=22)
    assert len(turn) > preset("default", tiny_llama.engine.spec.num_layers).min_prompt_tokens
    second, _ = _ask(client, turn)
    assert second.usage.prompt_tokens_details.cached_tokens >= 700 // 32 * 32
    assert second.choices[0].text == tiny_llama.tokenizer.decode(_expected(tiny_llama, turn), skip_special_tokens=True)
