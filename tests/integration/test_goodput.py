"""A burst of short prompts through a real gateway, decode worker and prefill worker (issue 48):
behind a decode worker whose prefill queue is long, the route sends them to the idle prefill
worker (shortest predicted wait); every answer is whole and equals the same prompt's answer
prefilled on the decode worker afterwards; nothing is left in any queue; the workers report their
prefill rates and the gateway its prefill waits per worker."""

from __future__ import annotations

import asyncio
import re
from collections import Counter

import httpx
from conftest import wait_for
from helpers import random_ids

from services.router.workers import PREFILL_QUEUED, StaticWorkers
from shared.net.registry import WorkerInfo

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


def test_behind_a_backed_up_decode_worker_short_prompts_go_to_the_idle_prefill_worker(
    tiny_llama, decode_worker, prefill_worker, gateway
):
    decode, status = decode_worker(tiny_llama)
    prefill = prefill_worker(tiny_llama)
    workers = StaticWorkers(
        [
            WorkerInfo(worker_id="decode", role="decode", address=decode.address, model=tiny_llama.name),
            WorkerInfo(worker_id="prefill", role="prefill", address=prefill.address, model=tiny_llama.name),
        ]
    )
    # route_by_wait "all": both workers run in this process, on one host.
    running = gateway(workers, local_threshold=1024, route_by_wait="all")
    prompts = [random_ids(tiny_llama, 300 + 7 * i, seed=100 + i) for i in range(12)]
    # Prompts another gateway placed on the decode worker and that wait for their first tokens
    # there, as the shared load counts show them (a tiny model prefills this gateway's own burst
    # faster than it arrives, so its own queue would not hold still).
    workers.add_load(PREFILL_QUEUED, "decode", 100_000)
    results = asyncio.run(_burst(running.url, prompts))
    assert [code for code, _, _ in results] == [200] * 12
    # Short prompts (300 tokens < 1024) the length rule would prefill on the decode worker.
    assert Counter(route for _, route, _ in results) == {"disaggregated": 12}
    workers.add_load(PREFILL_QUEUED, "decode", -100_000)
    # Idle again: the length rule; each answer equals the one its prompt got through the actor.
    alone = [httpx.post(f"{running.url}/v1/completions", json=_body(prompt), timeout=60) for prompt in prompts]
    assert {reply.headers["x-lazyserve-route"] for reply in alone} == {"local"}
    assert [answer for _, _, answer in results] == [reply.json()["choices"][0]["text"] for reply in alone]
    assert all(reply.json()["usage"]["completion_tokens"] == MAX_TOKENS for reply in alone)
    metrics = httpx.get(f"{running.url}/metrics").text
    assert _metric(metrics, "lazyserve_prefill_wait_seconds_count", worker=prefill.address) == 12
    assert _metric(metrics, "lazyserve_prefill_wait_seconds_count", worker=decode.address) == 12
    assert _metric(metrics, "lazyserve_routing_decisions_total", kind="disaggregated") == 12
    # Every prompt left its worker's queue at its first token.
    assert wait_for(lambda: _metric(httpx.get(f"{running.url}/metrics").text, "lazyserve_prefill_queued") == 0)
    assert not any(workers.loads(PREFILL_QUEUED).values())
    reported = status.status()
    assert reported.prefills_waiting == 0 and reported.prefill_rate > 0 and reported.prefill_rows_per_round > 0
    views = {w["role"]: w for w in httpx.get(f"{running.url}/status").json()["workers"]}
    assert views["decode"]["prefill_queued"] == 0 and views["decode"]["prefill_rate"] > 0
    assert views["prefill"]["prefill_rate"] > 0  # as the prefill worker reported it with its replies
