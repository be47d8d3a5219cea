"""The REST gateway with the official openai SDK (and plain HTTP) against real workers on loopback."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
from conftest import wait_for
from helpers import random_ids

from services.router.client import DecodeClient
from services.router.workers import StaticWorkers
from shared import kernels
from shared.api.llm import LLM, respond
from shared.api.serving import CHAT_URL, COMPLETIONS_URL, choice_text
from shared.net.registry import WorkerInfo

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
LONG_PROMPT_TOKENS = 700


@pytest.fixture
def stack(tiny_llama, decode_worker, prefill_worker, gateway):
    """A gateway over one prefill and one decode worker (static list); long prompts >= 512 tokens."""
    decode, _ = decode_worker(tiny_llama)
    prefill = prefill_worker(tiny_llama)
    return gateway(prefill_workers=[prefill.address], decode_workers=[decode.address], local_threshold=512), decode


def _in_process(tiny_llama, url, body):
    return respond(LLM(tiny_llama), url, body).model_dump()


def test_chat_completion_matches_the_engine(stack, tiny_llama):
    running, _ = stack
    reply = running.openai().chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0
    )
    expected = _in_process(tiny_llama, CHAT_URL, {"messages": MESSAGES, "max_tokens": 12, "temperature": 0})
    assert reply.choices[0].message.content == choice_text(expected)
    assert reply.choices[0].finish_reason == expected["choices"][0]["finish_reason"]
    assert reply.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert reply.usage.completion_tokens == expected["usage"]["completion_tokens"]
    metrics = reply.model_extra["metrics"]
    assert metrics["pruning"] == "default" and 0 < metrics["computed_fraction"] <= 1


def test_streamed_chat_equals_the_whole_answer_and_ends_with_usage(stack):
    running, _ = stack
    client = running.openai()
    args = dict(model="tiny-llama", messages=MESSAGES, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_text_completion_streamed_and_not(stack, tiny_llama):
    running, _ = stack
    client = running.openai()
    ids = random_ids(tiny_llama, 40)
    whole = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=8, temperature=0)
    expected = _in_process(tiny_llama, COMPLETIONS_URL, {"prompt": ids, "max_tokens": 8, "temperature": 0})
    assert whole.choices[0].text == choice_text(expected)
    streamed = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_sse_wire_format_ends_with_done(stack):
    running, _ = stack
    body = {"messages": MESSAGES, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{running.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


def test_short_prompts_stay_local_and_long_ones_are_disaggregated(stack, tiny_llama):
    running, decode = stack
    client = running.openai()
    short = client.completions.with_raw_response.create(
        model="tiny-llama", prompt=random_ids(tiny_llama, 50), max_tokens=4
    )
    long_ids = random_ids(tiny_llama, LONG_PROMPT_TOKENS)
    long = client.completions.with_raw_response.create(model="tiny-llama", prompt=long_ids, max_tokens=4, temperature=0)
    assert short.headers["x-lazyserve-route"] == "local"
    assert long.headers["x-lazyserve-route"] == "disaggregated"
    expected = _in_process(tiny_llama, COMPLETIONS_URL, {"prompt": long_ids, "max_tokens": 4, "temperature": 0})
    assert long.parse().choices[0].text == choice_text(expected)
    metrics = httpx.get(f"{running.url}/metrics").text
    assert 'lazyserve_routing_decisions_total{kind="local",policy="length"} 1.0' in metrics
    assert 'lazyserve_routing_decisions_total{kind="disaggregated",policy="length"} 1.0' in metrics
    assert "lazyserve_kv_transfer_bytes_total" in metrics and "lazyserve_ttft_seconds_count 2.0" in metrics
    assert 'lazyserve_requests_total{outcome="ok"} 2.0' in metrics


def test_models_health_and_ready(stack, gateway):
    running, _ = stack
    assert [m.id for m in running.openai().models.list()] == ["tiny-llama"]
    assert httpx.get(f"{running.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{running.url}/ready").status_code == 200
    empty = gateway()
    assert httpx.get(f"{empty.url}/ready").status_code == 503


@pytest.mark.parametrize(
    "args, words",
    [
        ({"max_tokens": 5000}, ["5000", "2048"]),
        ({"extra_body": {"pruning": {"mode": "lazy", "stages": [[9, 0.5]]}}}, ["pruning"]),
        ({"extra_body": {"pruning": "sometimes"}}, ["pruning"]),
        ({"temperature": 7}, ["temperature"]),
        ({"top_p": 0}, ["top_p"]),
        ({"messages": []}, ["messages"]),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, ["role"]),
    ],
    ids=["context", "pruning-layer", "pruning-name", "temperature", "top_p", "empty", "role"],
)
def test_bad_requests_get_400_in_openai_format(stack, args, words):
    running, _ = stack
    with pytest.raises(openai.BadRequestError) as error:
        running.openai().chat.completions.create(**{"model": "tiny-llama", "messages": MESSAGES} | args)
    assert error.value.status_code == 400
    message = error.value.body["message"]
    assert all(word in message for word in words), message
    if "5000" in words:
        assert error.value.body["code"] == "context_length_exceeded"


def test_malformed_http_is_refused_cleanly(stack):
    running, _ = stack
    bad_json = httpx.post(f"{running.url}/v1/chat/completions", content=b"{not json", timeout=10)
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    huge = httpx.post(f"{running.url}/v1/completions", content=b"x" * (5 << 20), timeout=10)
    assert huge.status_code == 413
    no_messages = httpx.post(f"{running.url}/v1/chat/completions", json={"model": "x"}, timeout=10)
    assert no_messages.status_code == 400 and "messages" in no_messages.json()["error"]["message"]
    missing = httpx.get(f"{running.url}/v1/nothing", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()


def test_api_key_required_when_configured(tiny_llama, decode_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    running = gateway(decode_workers=[decode.address], api_keys="k-right")
    with pytest.raises(openai.AuthenticationError):
        running.openai(api_key="k-wrong").models.list()
    assert httpx.get(f"{running.url}/v1/models").status_code == 401
    reply = running.openai(api_key="k-right").chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=2
    )
    assert reply.choices[0].message.content is not None


def test_no_worker_is_503(gateway):
    running = gateway()
    with pytest.raises(openai.InternalServerError) as error:
        running.openai().chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2)
    assert error.value.status_code == 503 and "no decode worker" in error.value.body["message"]


def test_a_burst_waits_and_a_full_queue_is_429(tiny_llama, decode_worker, gateway):
    # A worker of one sequence and a queue of one: one request runs, one waits, the next is refused.
    decode, _ = decode_worker(tiny_llama, max_sequences=1)
    running = gateway(decode_workers=[decode.address], max_queued=1)
    client = running.openai()
    stream = client.completions.create(
        model="tiny-llama",
        prompt=random_ids(tiny_llama, 20),
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # one request in progress
    queued: list = []
    waiter = threading.Thread(
        target=lambda: queued.append(client.completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=2))
    )
    waiter.start()
    assert wait_for(lambda: httpx.get(f"{running.url}/status").json()["queue"]["depth"] == 1, timeout=10)
    reply = httpx.post(f"{running.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=10)
    assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["message"] == "1 requests are waiting for a worker already; retry later"
    stream.close()  # the room comes back: the waiting request runs
    waiter.join(timeout=30)
    assert queued and queued[0].usage.completion_tokens == 2
    metrics = httpx.get(f"{running.url}/metrics").text
    assert 'lazyserve_rejections_total{reason="queue_full"} 1.0' in metrics
    assert "lazyserve_queue_depth 0.0" in metrics


def test_deadline_is_504(tiny_llama, decode_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    running = gateway(decode_workers=[decode.address], request_timeout_s=0.3)
    with pytest.raises(openai.APIStatusError) as error:
        # ignore_eos: sampled at temperature 1 from the global generator, an end-of-sequence token
        # could end it within the deadline, depending on which tests ran before (it did).
        running.openai().completions.create(
            model="tiny-llama", prompt=random_ids(tiny_llama, 20), max_tokens=1900, extra_body={"ignore_eos": True}
        )
    assert error.value.status_code == 504


def test_a_client_that_disconnects_frees_its_sequence(stack, tiny_llama):
    running, decode = stack
    status = DecodeClient(decode.address)
    body = {"prompt": random_ids(tiny_llama, 20), "max_tokens": 1900, "stream": True}
    with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(lines), next(lines)
        assert status.status().sequences_active == 1
    # The connection is closed: the gateway cancels, the decode worker frees the sequence.
    final = wait_for(lambda: (s := status.status()).sequences_active == 0 and s, timeout=10)
    assert final and final.bytes_held == 0


def test_a_failed_prefill_is_retried_on_another_worker(tiny_llama, decode_worker, prefill_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    good = prefill_worker(tiny_llama)
    dead = "127.0.0.1:1"  # nothing listens there; sorts first, so it is chosen first
    running = gateway(prefill_workers=[dead, good.address], decode_workers=[decode.address], local_threshold=512)
    ids = random_ids(tiny_llama, LONG_PROMPT_TOKENS)
    reply = running.openai().completions.create(model="tiny-llama", prompt=ids, max_tokens=4, temperature=0)
    expected = _in_process(tiny_llama, COMPLETIONS_URL, {"prompt": ids, "max_tokens": 4, "temperature": 0})
    assert reply.choices[0].text == choice_text(expected)
    assert "lazyserve_retries_total 1.0" in httpx.get(f"{running.url}/metrics").text


def test_a_failure_after_tokens_is_an_error_event(tiny_llama, decode_worker, gateway):
    # The only decode worker dies and does not come back within the migration's wait.
    decode, _ = decode_worker(tiny_llama)
    running = gateway(decode_workers=[decode.address], migration_wait_s=1.0)
    stream = running.openai().completions.create(
        model="tiny-llama", prompt=random_ids(tiny_llama, 20), max_tokens=1900, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    threading.Thread(target=decode.stop, kwargs={"grace": 0}).start()  # the worker dies mid-stream
    with pytest.raises(openai.APIError) as error:
        for _ in chunks:
            pass
    assert "failed" in str(error.value.message) or "UNAVAILABLE" in str(error.value.message)
    assert "no live decode worker within 1 s" in str(error.value.message)


@pytest.mark.parametrize(
    ("url", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800 hi"}]}, "messages.0.content"),
        ("/v1/completions", {"prompt": "\udfff"}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
        ("/v1/completions", {"prompt": "hi", "stop": ["ok", "\ud800"]}, "stop.1"),
        ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
        (
            "/v1/completions",
            {"prompt": "hi", "pruning": {"mode": "lazy", "stages": [[1, 0.5]], "seed": -1}},
            "pruning.seed",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "pruning": {"mode": "lazy", "stages": [[1, 0.5]], "seed": 2**64}},
            "pruning.seed",
        ),
    ],
)
def test_inputs_that_gave_500s_get_a_400_naming_the_field(stack, url, body, param):
    running, _ = stack
    raw = json.dumps(body)  # json.dumps writes a lone surrogate as its \ud800 escape, as clients send it
    reply = httpx.post(running.url + url, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and "function-after" not in error["message"]


def test_request_id_is_honoured_and_health_answers_head(stack, tiny_llama):
    running, _ = stack
    body = {"prompt": random_ids(tiny_llama, 10), "max_tokens": 2}
    reply = httpx.post(f"{running.url}/v1/completions", json=body, headers={"x-request-id": "client-42"}, timeout=30)
    assert reply.headers["x-request-id"] == "client-42"
    odd = httpx.post(f"{running.url}/v1/completions", json=body, headers={"x-request-id": "bad id\t!"}, timeout=30)
    assert odd.headers["x-request-id"].startswith("req-")
    assert httpx.head(f"{running.url}/health", timeout=10).status_code == 200


def test_a_stop_string_keeps_the_metrics_and_chunks_keep_openais_keys(stack, tiny_llama):
    running, _ = stack
    prompt = random_ids(tiny_llama, LONG_PROMPT_TOKENS)  # disaggregated: prefill figures from the transfer
    client = running.openai()
    full = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    cut = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    metrics = cut.model_extra["metrics"]
    assert metrics["ttft_s"] > 0 and len(metrics["kept_per_layer"]) == tiny_llama.engine.spec.num_layers
    body = {"prompt": prompt[:20], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{running.url}/v1/completions", json=body, timeout=60) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    for chunk in chunks:
        for choice in chunk["choices"]:
            assert {"index", "text", "finish_reason", "logprobs"} <= choice.keys()
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][:-1] == [None] * (len(chunks) - 1)


def test_an_unknown_model_is_404_and_aliases_answer(tiny_llama, decode_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    running = gateway(decode_workers=[decode.address], served_model_names=["smol", "team/small"])
    client = running.openai()
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4o", prompt=[1, 2, 3], max_tokens=1)
    assert error.value.body["code"] == "model_not_found" and error.value.body["param"] == "model"
    reply = client.completions.create(model="team/small", prompt=[1, 2, 3], max_tokens=1)
    assert reply.model == "team/small"
    assert [m.id for m in client.models.list()] == ["tiny-llama", "smol", "team/small"]
    assert client.models.retrieve("team/small").id == "team/small"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_content_parts_are_joined_and_other_parts_refused(stack):
    running, _ = stack
    client = running.openai()
    args = dict(model="tiny-llama", max_tokens=6, temperature=0)
    plain = client.chat.completions.create(messages=[{"role": "user", "content": "Hi there"}], **args)
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]
    joined = client.chat.completions.create(messages=[{"role": "user", "content": parts}], **args)
    assert joined.choices[0].message.content == plain.choices[0].message.content
    image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(messages=[{"role": "user", "content": image}], **args)
    assert "image_url" in error.value.body["message"] and error.value.body["param"] == "messages.0.content.0"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_parameters_not_served_are_refused_not_ignored(stack, extra, param):
    running, _ = stack
    with pytest.raises(openai.BadRequestError) as error:
        running.openai().chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert error.value.body["param"] == param and "not supported" in error.value.body["message"]
    neutral = {"tools": [], "tool_choice": "none", "functions": [], "best_of": 1}
    reply = running.openai().chat.completions.create(
        model="tiny-llama", messages=MESSAGES, max_tokens=2, extra_body={param: neutral[param]}
    )
    assert reply.choices


def test_limits_hold_before_the_work(stack, tiny_text):
    running, _ = stack
    # A declared length over the limit is refused before a byte of the body is read.
    port = int(running.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n{")
        assert raw.recv(64).startswith(b"HTTP/1.1 413")  # within the 5 s socket timeout

    # Chunked bodies are counted as they come.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(5 << 10):
            yield b"a" * 1024
        yield b'"}'

    assert httpx.post(f"{running.url}/v1/completions", content=chunks(), timeout=30).status_code == 413
    # Text that cannot fit the context is refused without tokenizing it.
    huge = "word " * (tiny_text.max_text_chars // 5 + 1)
    reply = httpx.post(f"{running.url}/v1/completions", json={"prompt": huge}, timeout=30)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"


def test_tokenize_detokenize_and_version(stack, tiny_text):
    running, _ = stack
    url = running.url
    reply = httpx.post(f"{url}/tokenize", json={"prompt": "Hello world"}, timeout=10).json()
    assert reply["tokens"] == tiny_text.tokenizer("Hello world").input_ids and reply["count"] == len(reply["tokens"])
    assert reply["max_model_len"] == tiny_text.max_positions
    chat = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}, timeout=10).json()
    assert chat["tokens"] == tiny_text.chat_ids(MESSAGES)
    back = httpx.post(f"{url}/detokenize", json={"tokens": reply["tokens"]}, timeout=10).json()
    assert back["prompt"] == "Hello world"
    assert httpx.post(f"{url}/tokenize", json={}, timeout=10).status_code == 400
    empty = httpx.post(f"{url}/tokenize", json={"messages": []}, timeout=10)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
    assert httpx.post(f"{url}/detokenize", json={"tokens": [10**9]}, timeout=10).json()["error"]["param"] == "tokens"
    version = httpx.get(f"{url}/version", timeout=10).json()
    assert version["version"] == "0.1.0"
    [worker] = version["decode_workers"]  # what --dtype auto chose there, and where it runs
    assert (worker["address"], worker["dtype"], worker["device"]) == (stack[1].address, "float32", "cpu")
    assert worker["torch_threads"] >= 1
    assert worker["kernels"] == kernels.status().describe()  # "native (avx512)", or "torch (why)"


class _SlowRelease(StaticWorkers):
    """A store whose give-back takes a while, as a slow Redis's would (not causable for real here)."""

    def release(self, kind: str, field: str, amount: int = 1) -> None:
        time.sleep(0.2)
        super().release(kind, field, amount)


def test_a_finished_request_never_counts_against_its_clients_next_one(tiny_llama, decode_worker, gateway):
    # One request in progress per client, sent back to back: each starts after the previous
    # response has ended, so none may be refused, streamed or not, however slow the give-back.
    decode, _ = decode_worker(tiny_llama)
    workers = _SlowRelease([WorkerInfo(worker_id="decode", role="decode", address=decode.address, model="tiny-llama")])
    running = gateway(workers=workers, max_streams_per_key=1)
    client = running.openai()
    for index in range(6):
        kwargs = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 2}
        if index % 2:
            assert [chunk for chunk in client.completions.create(stream=True, **kwargs)]
        else:
            assert client.completions.create(**kwargs).choices


def test_a_client_at_its_bound_waits_instead_of_being_refused(tiny_llama, decode_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    running = gateway(decode_workers=[decode.address], max_streams_per_key=1)
    client = running.openai()
    stream = client.completions.create(
        model="tiny-llama",
        prompt=random_ids(tiny_llama, 20),
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    # Keys are off: the bound is per client address, whatever token a client sends.
    body = {"prompt": [1, 2], "max_tokens": 1}
    replies: list = []
    waiter = threading.Thread(
        target=lambda: replies.append(httpx.post(f"{running.url}/v1/completions", json=body, timeout=30))
    )
    waiter.start()
    assert wait_for(lambda: httpx.get(f"{running.url}/status").json()["queue"]["depth"] == 1, timeout=10)
    time.sleep(0.5)
    assert not replies  # still waiting, not refused
    stream.close()
    waiter.join(timeout=30)
    assert replies[0].status_code == 200 and replies[0].json()["usage"]["completion_tokens"] == 1
