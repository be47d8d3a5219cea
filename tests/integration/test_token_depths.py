"""`return_token_depths` (lazyserve's): each prompt token's depth at the end of the request and the
positions decode revived, equal to the cache's own after the same request in one process, on both
routes (local prefill, prefill worker to decode worker) and in run-batch; nothing when not asked.
And `GET /status`, the small JSON view of the service the page will poll."""

from __future__ import annotations

import pytest
import torch
from helpers import random_ids

from shared.api.llm import LLM, respond
from shared.api.serving import COMPLETIONS_URL
from shared.contract import PruneConfig
from shared.engine import Generation, SamplingParams, decode_tokens, prefill

# Pruned from the first token on (no minimum), with decode re-selection: revivals happen.
SCHEDULE = {"stages": [[2, 0.3]], "window": 4, "min_prompt_tokens": 0}
TOKENS = 12


def _in_process(loaded, ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    config = PruneConfig(**SCHEDULE)
    cache, logits = prefill(loaded.engine, torch.tensor(ids), config, reserve=TOKENS)
    params = SamplingParams(max_new_tokens=TOKENS, stop_token_ids=loaded.stop_token_ids)
    tokens = list(decode_tokens(loaded.engine, cache, logits, config, params, Generation()))
    return cache.depth[: len(ids)].tolist(), sorted(cache.revived), tokens


@pytest.fixture
def running(tiny_llama, decode_worker, prefill_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    prefill = prefill_worker(tiny_llama)
    return gateway(prefill_workers=[prefill.address], decode_workers=[decode.address], local_threshold=200)


@pytest.mark.parametrize(("length", "route"), [(120, "local"), (400, "disaggregated")])
def test_depths_on_both_routes_equal_the_caches(running, tiny_llama, length, route):
    client = running.openai()
    ids = random_ids(tiny_llama, length, seed=length)
    body = {"pruning": SCHEDULE, "return_token_depths": True}
    raw = client.completions.with_raw_response.create(
        model="tiny-llama", prompt=ids, max_tokens=TOKENS, temperature=0, extra_body=body
    )
    assert raw.headers["x-lazyserve-route"] == route
    metrics = raw.parse().model_extra["metrics"]
    depths, revived, _ = _in_process(tiny_llama, ids)
    assert metrics["token_depths"] == depths and len(depths) == length
    assert metrics["revived_positions"] == revived
    assert revived, "this schedule revives tokens during decode"
    assert min(depths) == 3 and max(depths) == tiny_llama.engine.spec.num_layers  # cut after layer 2
    # Not asked: not there.
    plain = client.completions.create(model="tiny-llama", prompt=ids, max_tokens=2, extra_body={"pruning": SCHEDULE})
    assert "token_depths" not in plain.model_extra["metrics"]
    assert "revived_positions" not in plain.model_extra["metrics"]


def test_run_batch_reports_them_too(tiny_llama):
    ids = random_ids(tiny_llama, 150, seed=3)
    body = {"prompt": ids, "max_tokens": TOKENS, "temperature": 0, "pruning": SCHEDULE, "return_token_depths": True}
    metrics = respond(LLM(tiny_llama), COMPLETIONS_URL, body).model_dump()["metrics"]
    depths, revived, _ = _in_process(tiny_llama, ids)
    assert (metrics["token_depths"], metrics["revived_positions"]) == (depths, revived)


def test_too_long_a_prompt_for_depths_is_a_400():
    from shared.api.serving import MAX_DEPTH_TOKENS, RequestError, parse_request, prepare
    from shared.models.text import load_text_model

    text = load_text_model("SmolLM2-135M-Instruct")  # a context over the limit
    request = parse_request(COMPLETIONS_URL, {"prompt": [5] * (MAX_DEPTH_TOKENS + 1), "return_token_depths": True})
    with pytest.raises(RequestError) as error:
        prepare(text, request)
    assert error.value.status_code == 400 and error.value.param == "return_token_depths"
    request = parse_request(COMPLETIONS_URL, {"prompt": [5] * MAX_DEPTH_TOKENS, "return_token_depths": True})
    assert prepare(text, request).token_depths


def test_the_status_endpoint_shows_the_last_minute_and_the_workers(running, tiny_llama):
    import httpx

    client = running.openai()
    # Sampled at the API's default temperature, a random-weight model may end a request at its
    # end-of-text token before 4 tokens: the window counts what the answers' usage says.
    generated = 0
    for seed in (1, 2, 3):
        prompt = random_ids(tiny_llama, 50, seed=seed)
        answer = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=4)
        tokens, reason = answer.usage.completion_tokens, answer.choices[0].finish_reason
        assert (tokens, reason) == (4, "length") or (tokens < 4 and reason == "stop"), (seed, tokens, reason)
        generated += tokens
    status = httpx.get(f"{running.url}/status", timeout=10).json()
    recent = status["recent"]
    assert recent["requests"] == 3 and 0 < recent["ttft_p50_s"] <= recent["ttft_p95_s"]
    assert recent["tokens_per_s"] == pytest.approx(generated / recent["window_s"])
    assert status["in_flight"] == 0 and status["pruning_preset"] == "default"
    assert (status["shared_state"], status["degraded"]) == ("memory", False)  # no --redis-url
    roles = sorted((w["role"], w["healthy"]) for w in status["workers"])
    assert roles == [("decode", True), ("prefill", None)]
    # A statically listed decode worker's dtype comes from its own Status answer.
    assert [w["dtype"] for w in status["workers"] if w["role"] == "decode"] == ["float32"]
    # What the page's controls need: the model's layers, the presets, the depths' limit.
    spec = tiny_llama.engine.spec
    assert status["model"] == {
        "name": "tiny-llama",
        "num_layers": spec.num_layers,
        "max_model_len": spec.max_positions,
        "chat_template": True,
        "stage_layers": None,  # no sliding-window layer: a stage may sit at any layer
    }
    assert status["pruning_presets"] == ["off", "default", "fast", "lazyllm"]
    assert status["max_depth_tokens"] == 4096
