"""A burst of short prompts through a real gateway, decode worker and prefill worker (issue 48):
while the decode worker's own prompts queue up, the route sends the next ones to the idle prefill
worker (shortest predicted wait, said in the reason); every answer is whole and equals the same
prompt's answer sent alone afterwards; nothing is left in any queue; the workers report their
prefill rates and the gateway its prefill waits."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import httpx
from conftest import wait_for
from helpers import random_ids

MAX_TOKENS = 6


def _metric(text: str, name: str, **labels) -> float:
    found = 0.0
    for label_text, value in re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M):
        if all(f'{key}="{want}"' in label_text for key, want in labels.items()):
            found += float(value)
    return found


def _body(prompt: list[int]) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


async def _burst(url: str, prompts: list[list[int]]) -> list[tuple[int, str, str]]:
    """Every prompt at once, greedy: (status, route header, text) each."""

    async def one(client: httpx.AsyncClient, prompt: list[int]):
        response = await client.post(f"{url}/v1/completions", json=_body(prompt))
        route = response.headers.get("x-lazyserve-route", "")
        if response.status_code != 200:
            return response.status_code, route, ""
        return 200, route, response.json()["choices"][0]["text"]

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client, prompt) for prompt in prompts))


def test_a_burst_of_short_prompts_fills_both_sides_and_leaves_no_queue(
    tiny_llama, decode_worker, prefill_worker, gateway
):
    decode, status = decode_worker(tiny_llama)
    prefill = prefill_worker(tiny_llama)
    running = gateway(
        decode_workers=[decode.address],
        prefill_workers=[prefill.address],
        local_threshold=1024,
        route_by_wait="all",  # both in this process, on one host
    )
    prompts = [random_ids(tiny_llama, 300 + 7 * i, seed=100 + i) for i in range(12)]
    results = asyncio.run(_burst(running.url, prompts))
    assert [code for code, _, _ in results] == [200] * 12
    routes = Counter(route for _, route, _ in results)
    # Idle, a 300-token prompt stays on the decode worker (under the 1024 threshold); behind a
    # queue there, the prefill worker is the shorter wait.
    assert routes["local"] >= 1 and routes["disaggregated"] >= 1, routes
    alone = [httpx.post(f"{running.url}/v1/completions", json=_body(prompt), timeout=60).json() for prompt in prompts]
    assert [answer for _, _, answer in results] == [reply["choices"][0]["text"] for reply in alone]
    assert all(reply["usage"]["completion_tokens"] == MAX_TOKENS for reply in alone)
    metrics = httpx.get(f"{running.url}/metrics").text
    assert _metric(metrics, "lazyserve_prefill_wait_seconds_count") == 24
    assert _metric(metrics, "lazyserve_prefill_wait_seconds_count", worker=prefill.address) == routes["disaggregated"]
    assert _metric(metrics, "lazyserve_routing_decisions_total", kind="disaggregated") == routes["disaggregated"]
    # Every prompt left its worker's queue at its first token.
    assert wait_for(lambda: _metric(httpx.get(f"{running.url}/metrics").text, "lazyserve_prefill_queued") == 0)
    reported = status.status()
    assert reported.prefills_waiting == 0 and reported.prefill_rate > 0 and reported.prefill_rows_per_round > 0
    workers = {w["role"]: w for w in httpx.get(f"{running.url}/status").json()["workers"]}
    assert workers["decode"]["prefill_queued"] == 0 and workers["decode"]["prefill_rate"] > 0
    assert workers["prefill"]["prefill_rate"] > 0  # as the prefill worker reported it with its replies
