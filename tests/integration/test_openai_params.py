"""OpenAI and vLLM sampling parameters through the gateway with the openai SDK, against
transformers' own generate() on the same weights (pruning off, so the two models are the same).

Short prompts run on the decode worker (local prefill); prompts of 512 tokens or more go through
the prefill worker, whose first token (and its log-probabilities) travels in the prefill reply.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from helpers import OpenAIPenalties, random_ids
from transformers import LogitsProcessorList

from shared.api.llm import LLM, respond
from shared.api.serving import CHAT_URL
from shared.models.text import Detokenizer

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
LONG = 600  # tokens: over the stack's local threshold, so disaggregated


@pytest.fixture
def stack(tiny_llama, decode_worker, prefill_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    prefill = prefill_worker(tiny_llama)
    return gateway(
        prefill_workers=[prefill.address], decode_workers=[decode.address], local_threshold=512, pruning_preset="off"
    )


def _hf_tokens(tiny_llama, ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' greedy generate(); tokens up to (not including) an end-of-sequence token."""
    with torch.inference_mode():
        out = tiny_llama.engine.hf.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs
        )
    tokens = out[0, len(ids) :].tolist()
    stops = set(kwargs.get("eos_token_id") or tiny_llama.stop_token_ids)
    return tokens[: next((i for i, t in enumerate(tokens) if t in stops), len(tokens))]


def _text(tiny_text, tokens: list[int]) -> str:
    detokenizer = Detokenizer(tiny_text.tokenizer)
    detokenizer.add(tokens)
    detokenizer.flush()
    return detokenizer.text


@pytest.mark.parametrize("n", [40, LONG], ids=["local", "disaggregated"])
def test_parameters_equal_transformers_processors(stack, tiny_llama, tiny_text, n):
    client = stack.openai()
    ids = random_ids(tiny_llama, n, seed=n)
    eos = tiny_llama.stop_token_ids[0]

    def ours(max_tokens=12, **kwargs):
        reply = client.completions.create(
            model="tiny-llama", prompt=ids, max_tokens=max_tokens, temperature=0, **kwargs
        )
        return reply.choices[0]

    def theirs(max_tokens=12, **kwargs):
        return _text(tiny_text, _hf_tokens(tiny_llama, ids, max_tokens, **kwargs))

    plain = _hf_tokens(tiny_llama, ids, 12)
    assert ours().text == theirs()
    assert ours(extra_body={"repetition_penalty": 1.5}).text == theirs(repetition_penalty=1.5)
    penalized = ours(max_tokens=16, presence_penalty=1.0, frequency_penalty=2.0).text
    processors = LogitsProcessorList([OpenAIPenalties(len(ids), 1.0, 2.0)])
    assert penalized == theirs(max_tokens=16, logits_processor=processors)
    bias = {str(plain[0]): -100, "1234": 5}
    assert ours(logit_bias=bias).text == theirs(sequence_bias={(int(k),): float(v) for k, v in bias.items()})
    # The end-of-sequence token made the likeliest: min_tokens holds it off for exactly that many.
    choice = ours(logit_bias={str(eos): 100}, extra_body={"min_tokens": 4})
    assert choice.finish_reason == "stop"
    assert choice.text == theirs(min_new_tokens=4, sequence_bias={(eos,): 100.0})
    # ignore_eos: the same bias, and it runs to max_tokens.
    reply = client.completions.create(
        model="tiny-llama",
        prompt=ids,
        max_tokens=6,
        temperature=0,
        logit_bias={str(eos): 100},
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 6
    # stop_token_ids: the greedy output's fourth token ends it after three.
    choice = ours(extra_body={"stop_token_ids": [plain[3]]})
    assert choice.finish_reason == "stop" and choice.text == theirs(eos_token_id=[plain[3]])
    # top_k 1 at a high temperature is greedy.
    assert ours(max_tokens=12, extra_body={"top_k": 1}).text == ours().text
    sampled = client.completions.create(
        model="tiny-llama", prompt=ids, max_tokens=12, temperature=1.8, seed=3, extra_body={"top_k": 1}
    )
    assert sampled.choices[0].text == ours().text


def _reference_logprobs(tiny_llama, ids: list[int], tokens: list[int], k: int) -> list[tuple[float, list[int]]]:
    """transformers' log-softmax at each generated position: (chosen token's logprob, top-k ids)."""
    out = []
    with torch.inference_mode():
        logits = tiny_llama.engine.hf(torch.tensor([ids + tokens])).logits[0].float()
    for i, token in enumerate(tokens):
        logprobs = torch.log_softmax(logits[len(ids) - 1 + i], dim=-1)
        out.append((float(logprobs[token]), torch.topk(logprobs, k).indices.tolist()))
    return out


@pytest.mark.parametrize("n", [40, LONG], ids=["local", "disaggregated"])
def test_completion_logprobs_are_the_models(stack, tiny_llama, tiny_text, n):
    client = stack.openai()
    ids = random_ids(tiny_llama, n, seed=n + 1)
    raw = client.completions.with_raw_response.create(
        model="tiny-llama", prompt=ids, max_tokens=8, temperature=0, logprobs=3
    )
    assert raw.headers["x-lazyserve-route"] == ("local" if n < 512 else "disaggregated")
    choice = raw.parse().choices[0]
    logprobs = choice.logprobs
    tokens = _hf_tokens(tiny_llama, ids, 8)
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(tokens)
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(tokens))]
    reference = _reference_logprobs(tiny_llama, ids, tokens, 3)
    for got, top, (expected, expected_top) in zip(logprobs.token_logprobs, logprobs.top_logprobs, reference):
        assert got == pytest.approx(expected, abs=1e-4)
        assert list(top) == [tiny_text.tokenizer.decode([t]) for t in expected_top]


def test_chat_logprobs_streamed_and_not(stack, tiny_llama, tiny_text):
    client = stack.openai()
    args = dict(model="tiny-llama", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**args).choices[0]
    content = whole.logprobs.content
    assert "".join(item.token for item in content) == whole.message.content
    ids = tiny_text.chat_ids(MESSAGES)
    tokens = _hf_tokens(tiny_llama, ids, 10)
    for item, token, (expected, top) in zip(content, tokens, _reference_logprobs(tiny_llama, ids, tokens, 2)):
        assert item.token == tiny_text.tokenizer.decode([token])
        assert item.logprob == pytest.approx(expected, abs=1e-4)
        assert [alt.token for alt in item.top_logprobs] == [tiny_text.tokenizer.decode([t]) for t in top]
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    chunks = list(client.chat.completions.create(**args, stream=True))
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    # The second request starts from the first's cached prefix (new rows over cached keys, another
    # attention call than one causal pass): the same tokens, logprobs within float32 rounding.
    assert [(i.token, pytest.approx(i.logprob, abs=1e-5)) for i in streamed] == [(i.token, i.logprob) for i in content]
    # The in-process path (run-batch) gives the same figures.
    body = {k: v for k, v in args.items() if k != "model"}
    local = respond(LLM(tiny_llama), CHAT_URL, body).model_dump()["choices"][0]["logprobs"]["content"]
    assert [(i["token"], pytest.approx(i["logprob"], abs=1e-5)) for i in local] == [
        (i.token, i.logprob) for i in content
    ]
    # Without logprobs asked: null, as OpenAI.
    assert (
        client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None}).choices[0].logprobs is None
    )


def test_echo_puts_the_prompt_first(stack):
    client = stack.openai()
    prompt = "The capital of France is"
    whole = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=5, temperature=0, echo=True)
    plain = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=5, temperature=0)
    assert whole.choices[0].text == prompt + plain.choices[0].text
    streamed = client.completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=5, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"messages": MESSAGES, "logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": MESSAGES, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({"messages": MESSAGES, "max_tokens": 3, "min_tokens": 4}, "min_tokens"),
        ({"messages": MESSAGES, "stop_token_ids": [10**12]}, "stop_token_ids"),
        ({"messages": MESSAGES, "top_k": -2}, "top_k"),
        ({"messages": MESSAGES, "min_p": 1.5}, "min_p"),
        ({"messages": MESSAGES, "presence_penalty": 2.5}, "presence_penalty"),
        ({"messages": MESSAGES, "repetition_penalty": 0}, "repetition_penalty"),
        ({"messages": MESSAGES, "ignore_eos": "yes"}, "ignore_eos"),
        ({"messages": MESSAGES, "logprobs": 1}, "logprobs"),
        ({"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "c1"}]}, "messages.0.role"),
        ({"messages": MESSAGES, "response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_bad_parameters_are_a_400_naming_them(stack, body, param):
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.json()


def test_bad_completion_parameters(stack):
    for body, param in [
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "logprobs": 1, "echo": True}, "echo"),
        ({"prompt": "hi", "echo": 1}, "echo"),
    ]:
        reply = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.fixture
def workers(tiny_llama, decode_worker, prefill_worker, gateway):
    decode, client = decode_worker(tiny_llama)
    prefill = prefill_worker(tiny_llama)
    running = gateway(
        prefill_workers=[prefill.address], decode_workers=[decode.address], local_threshold=512, pruning_preset="off"
    )
    return running, prefill, client


@pytest.mark.parametrize("n", [40, LONG], ids=["local", "disaggregated"])
def test_n_choices_share_one_prefill(workers, tiny_llama, n):
    running, prefill, decode = workers
    client = running.openai()
    ids = random_ids(tiny_llama, n, seed=n + 2)
    args = dict(model="tiny-llama", prompt=ids, max_tokens=8, temperature=1.0, extra_body={"ignore_eos": True})
    prefills = prefill.servicer.counters.completed
    reply = client.completions.create(n=3, seed=11, **args)
    assert prefill.servicer.counters.completed == prefills + (n >= 512)  # one prefill for three choices
    assert [c.index for c in reply.choices] == [0, 1, 2]
    # Choice i samples as a single request seeded seed + i (vLLM's parallel sampling).
    singles = [client.completions.create(seed=11 + i, **args).choices[0].text for i in range(3)]
    assert [c.text for c in reply.choices] == singles
    assert len(set(singles)) > 1
    assert reply.usage.completion_tokens == 24 and reply.usage.prompt_tokens == n
    # Streamed: each chunk names its choice; put together they are the same three texts.
    texts = ["", "", ""]
    finishes = {}
    for chunk in client.completions.create(n=3, seed=11, stream=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert texts == singles and finishes == {0: "length", 1: "length", 2: "length"}
    # The in-process path (run-batch) gives the same choices.
    body = {"prompt": ids, "max_tokens": 8, "temperature": 1.0, "ignore_eos": True, "n": 3, "seed": 11}
    local = respond(LLM(tiny_llama), "/v1/completions", body).model_dump()
    assert [c["text"] for c in local["choices"]] == singles
    # Nothing is left held on the decode worker.
    status = decode.status()
    assert status.sequences_active == 0 and status.bytes_held == 0


def test_n_chat_choices_with_a_stop_string_end_each_on_its_own(workers):
    running, _, _ = workers
    client = running.openai()
    args = dict(model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=5)
    singles = [client.chat.completions.create(**{**args, "seed": 5 + i}).choices[0].message.content for i in range(4)]
    # A stop string taken from the middle of one choice's text cuts that one (and any other that has it).
    word = singles[1][len(singles[1]) // 2 :][:3]
    reply = client.chat.completions.create(n=4, stop=[word], **args)
    for choice, single in zip(reply.choices, singles):
        if word in single:
            assert choice.message.content == single[: single.index(word)] and choice.finish_reason == "stop"
        else:
            assert choice.message.content == single
    assert reply.choices[1].finish_reason == "stop"
    with pytest.raises(Exception) as error:
        client.chat.completions.create(n=17, **args)
    assert "n" == error.value.body["param"]


def test_a_list_of_prompts_gives_one_choice_each_in_order(workers, tiny_llama):
    running, _, _ = workers
    client = running.openai()
    prompts = ["The sky is", "Two plus two is", "Paris is the capital of"]
    args = dict(model="tiny-llama", max_tokens=6, temperature=0)
    singles = [client.completions.create(prompt=p, **args).choices[0].text for p in prompts]
    reply = client.completions.create(prompt=prompts, **args)
    assert [c.index for c in reply.choices] == [0, 1, 2] and [c.text for c in reply.choices] == singles
    single_usage = [client.completions.create(prompt=p, **args).usage.prompt_tokens for p in prompts]
    assert reply.usage.prompt_tokens == sum(single_usage)
    # Token-id lists, one long enough to go through the prefill worker, with n = 2: choices
    # numbered prompt by prompt.
    ids = [random_ids(tiny_llama, 30, seed=1), random_ids(tiny_llama, LONG, seed=2)]
    reply = client.completions.create(prompt=ids, n=2, **args)
    expected = [client.completions.create(prompt=p, **args).choices[0].text for p in ids]
    assert [c.text for c in reply.choices] == [expected[0], expected[0], expected[1], expected[1]]
    # Streamed, with echo: each choice's text is its prompt's, then its completion.
    texts = [""] * 3
    for chunk in client.completions.create(prompt=prompts, stream=True, echo=True, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [p + s for p, s in zip(prompts, singles)]
    # run-batch's in-process path gives the same.
    local = respond(LLM(tiny_llama), "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    assert [c["text"] for c in local.model_dump()["choices"]] == singles


def test_bad_prompt_lists_are_a_400(workers, tiny_text):
    running, _, _ = workers
    url = f"{running.url}/v1/completions"
    for prompt in ([1, "a"], [["a"]], [], ["ok", ""], ["x"] * 17, [[1], [10**9]]):
        reply = httpx.post(url, json={"prompt": prompt, "max_tokens": 2}, timeout=30)
        assert reply.status_code == 400, (prompt, reply.text)
        assert reply.json()["error"]["param"].startswith("prompt"), reply.json()


COLOUR_SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["colour", "count"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("n", [40, LONG], ids=["local", "disaggregated"])
def test_json_schema_output_matches_the_schema(workers, tiny_llama, n):
    """Even a random-weight model writes valid JSON of the schema: the grammar leaves it no other
    choice, from the prefill worker's first token to the decode worker's last, then only a stop."""
    running, _, _ = workers
    client = running.openai()
    response_format = {"type": "json_schema", "json_schema": {"name": "colour", "schema": COLOUR_SCHEMA}}
    reply = client.completions.create(
        model="tiny-llama",
        prompt=random_ids(tiny_llama, n, seed=n + 3),
        max_tokens=40,
        temperature=1.0,
        seed=1,
        n=3,
        extra_body={"response_format": response_format},
    )
    for choice in reply.choices:
        value = json.loads(choice.text)
        assert set(value) == {"colour", "count"} and value["colour"] in {"red", "green", "blue"}, value
        assert 0 <= value["count"] <= 9 and choice.finish_reason == "stop"
    streamed = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=40, stream=True, response_format=response_format
    )
    value = json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices))
    assert value["colour"] in {"red", "green", "blue"}


def test_json_object_starts_an_object_and_bad_formats_are_a_400(workers):
    running, _, _ = workers
    client = running.openai()
    reply = client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=8, response_format={"type": "json_object"}
    )
    assert reply.choices[0].message.content.startswith("{")
    for response_format in (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {"type": "json_schema"},
        {"type": "xml"},
        {"type": "json_object", "json_schema": {"name": "x", "schema": {}}},
    ):
        raw = httpx.post(
            f"{running.url}/v1/chat/completions",
            json={"messages": MESSAGES, "response_format": response_format},
            timeout=30,
        )
        assert raw.status_code == 400 and raw.json()["error"]["param"].startswith("response_format"), raw.text
