"""Load through the whole service on loopback: 300 requests, 16 at a time, mixed prompt lengths,
streamed and not, through the gateway to 2 prefill actors (local Ray) and 2 decode worker
processes. Every request must end with a full answer or a clear error within its deadline, and
the decode workers must end holding nothing but their prefix cache (bounded by its budget), their
memory less that cache back within 10% of the baseline."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
import ray
from conftest import start_process

from services.prefill.actor import actor_addresses, launch_prefill_actors
from services.prefill.settings import PrefillSettings
from services.router.client import DecodeClient
from shared.settings import EngineSettings

REQUESTS, CONCURRENCY, DEADLINE_S = 300, 16, 60.0


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _workload(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    bodies = []
    for index in range(count):
        length = int(rng.choice([rng.uniform(10, 200), rng.uniform(200, 1500)]))
        bodies.append(
            {
                "prompt": [rng.randrange(3, 49152) for _ in range(length)],
                "max_tokens": rng.randint(1, 48),
                "temperature": 0,
                "stream": index % 2 == 0,
            }
        )
    return bodies


async def _one(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.monotonic()
    outcome = {"ok": False, "tokens": 0, "error": None, "route": None}
    try:
        if body["stream"]:
            async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=DEADLINE_S) as response:
                outcome["route"] = response.headers.get("x-lazyserve-route")
                if response.status_code != 200:
                    outcome["error"] = json.loads(await response.aread())["error"]["message"]
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        if "error" in data:
                            outcome["error"] = data["error"]["message"]
                        elif data.get("metrics"):
                            outcome["ok"] = True
                            outcome["finish"] = data["choices"][0]["finish_reason"]
        else:
            response = await client.post(f"{url}/v1/completions", json=body, timeout=DEADLINE_S)
            outcome["route"] = response.headers.get("x-lazyserve-route")
            data = response.json()
            if response.status_code == 200:
                outcome["ok"], outcome["tokens"] = True, data["usage"]["completion_tokens"]
                outcome["finish"] = data["choices"][0]["finish_reason"]
            else:
                outcome["error"] = data["error"]["message"]
    except httpx.HTTPError as error:  # a hang or a dropped connection: the test fails on it
        outcome["error"] = f"transport: {type(error).__name__}"
    outcome["seconds"] = time.monotonic() - start
    return outcome


async def _replay(url: str, bodies: list[dict]) -> list[dict]:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=CONCURRENCY * 2)) as client:

        async def run(body):
            async with gate:
                return await _one(client, url, body)

        return await asyncio.gather(*(run(body) for body in bodies))


@pytest.mark.slow
def test_300_requests_end_cleanly_and_leave_nothing_behind(local_ray, gateway):
    settings = PrefillSettings(engine=EngineSettings(model="tiny-llama", threads=1), num_actors=2, num_cpus=0.5)
    actors = launch_prefill_actors(settings)
    decoders = [
        start_process(["decode-worker", "--model", "tiny-llama", "--port", "0", "--threads", "1"], "decode")
        for _ in range(2)
    ]
    try:
        running = gateway(
            prefill_workers=actor_addresses(actors),
            decode_workers=[address for _, address in decoders],
            local_threshold=256,
            request_timeout_s=DEADLINE_S,
        )
        warm = asyncio.run(_replay(running.url, _workload(48, seed=1)))
        assert all(o["ok"] for o in warm), [o["error"] for o in warm if not o["ok"]][:3]
        baseline = {pid: _rss_mib(pid) for pid in (process.pid for process, _ in decoders)}
        started = time.monotonic()
        outcomes = asyncio.run(_replay(running.url, _workload(REQUESTS, seed=2)))
        wall = time.monotonic() - started
        failures = [o for o in outcomes if not o["ok"]]
        assert len(outcomes) == REQUESTS
        assert not failures, f"{len(failures)} failed, e.g. {failures[:3]}"
        assert max(o["seconds"] for o in outcomes) < DEADLINE_S
        routes = {route: sum(o["route"] == route for o in outcomes) for route in ("local", "disaggregated")}
        assert routes["local"] > 0 and routes["disaggregated"] > 0
        cached_mib = {}
        for process, address in decoders:
            status = DecodeClient(address).status()
            assert (status.transfers_receiving, status.transfers_ready, status.sequences_active, status.bytes_held) == (
                0,
                0,
                0,
                0,
            )
            assert status.prefix_bytes_held <= status.prefix_budget_bytes
            cached_mib[process.pid] = status.prefix_bytes_held / 2**20  # distinct prompts: cached, not leaked
        after = {pid: _rss_mib(pid) - cached_mib[pid] for pid in baseline}
        growth = {pid: after[pid] / baseline[pid] - 1 for pid in baseline}
        print(
            f"\n{REQUESTS} requests in {wall:.1f} s, routes {routes}, "
            f"p50 {sorted(o['seconds'] for o in outcomes)[REQUESTS // 2]:.2f} s, "
            f"max {max(o['seconds'] for o in outcomes):.2f} s, decode RSS MiB before/after "
            f"{[round(baseline[p]) for p in baseline]} / {[round(after[p]) for p in baseline]} "
            f"(less the prefix caches' {[round(cached_mib[p]) for p in baseline]})"
        )
        assert all(g <= 0.10 for g in growth.values()), f"decode worker memory grew {growth}"
    finally:
        for process, _ in decoders:
            process.terminate()
            process.wait(timeout=30)
        for actor in actors:
            ray.kill(actor)
