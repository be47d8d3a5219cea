"""Bursts against a real `lazyserve up` (its defaults: one decode worker of 64 sequences, keys off):
128 concurrent streams with n up to 16, three times the worker's room, all served; clients that
give up while queued leave nothing; the decode worker's memory comes back after each burst."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import httpx
import pytest
from conftest import Up, wait_for

MESSAGES = [{"role": "user", "content": "Say something about rivers."}]


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def quantile_from_histogram(text: str, name: str, q: float) -> float:
    """The upper bound of the bucket that holds quantile q of a Prometheus histogram."""
    buckets = [
        (math.inf if bound == "+Inf" else float(bound), float(count))
        for bound, count in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)
    ]
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= q * total)


async def _one(client: httpx.AsyncClient, url: str, path: str, body: dict):
    """(status, choices that got tokens, seconds)."""
    start, seen = time.monotonic(), set()
    async with client.stream("POST", f"{url}{path}", json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, 0, time.monotonic() - start
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                assert '"error"' not in line, line
                seen.update(int(i) for i in re.findall(r'"index": ?(\d+)', line))
    return 200, len(seen), time.monotonic() - start


async def _leave(url: str, body: dict, after_s: float) -> tuple[int, int, float]:
    """A client that sends its request and goes away `after_s` later unless an answer began: the
    clock starts once the request is on the wire, so on a busy host it is not the client's own
    connecting that runs out the time. (status, 0, seconds); status 0: it gave up."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        start = time.monotonic()
        try:
            async with asyncio.timeout(after_s):
                status_line = await reader.readline()
        except TimeoutError:
            return 0, 0, time.monotonic() - start
        return int(status_line.split()[1]), 0, time.monotonic() - start
    finally:
        writer.close()


async def _burst(url: str, streams: int, wide: int, leaving: int) -> list[tuple[int, int, float]]:
    bodies = [("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 32}) for _ in range(streams)]
    bodies += [("/v1/completions", {"prompt": "Rivers", "max_tokens": 16, "n": 16}) for _ in range(wide)]
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        before = await _received(client, url)
        served = [asyncio.create_task(_one(client, url, path, body)) for path, body in bodies]
        # Clients that give up 0.3 s after sending, sent once the gateway has every request of the
        # burst: they wait behind them (first come, first served), so they are still queued then.
        deadline = time.monotonic() + 60
        while await _received(client, url) < before + len(bodies) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        leavers = [_leave(url, {"prompt": "Lakes", "max_tokens": 64}, 0.3) for _ in range(leaving)]
        return await asyncio.gather(*served, *leavers)


async def _received(client: httpx.AsyncClient, url: str) -> float:
    """Completion requests the gateway has counted so far."""
    metrics = (await client.get(f"{url}/metrics")).text
    return float(re.search(r"^lazyserve_requests_received_total (\S+)$", metrics, re.M).group(1))


@pytest.mark.starts_ray
@pytest.mark.slow
def test_bursts_through_up_are_served_in_full_and_leave_nothing_behind():
    up = Up("--model", "tiny-llama", "--threads", "1")
    url = up.url
    try:
        up.wait_ready(timeout=240)
        decode_pid = up.decode_pid(0)
        rss = []
        for streams, wide, leaving in ((64, 2, 8), (128, 4, 8)):  # 96 and 192 sequences; the worker holds 64
            results = asyncio.run(_burst(url, streams, wide, leaving))
            served = results[: streams + wide]
            assert [code for code, _, _ in served] == [200] * len(served)
            assert [choices for _, choices, _ in served] == [1] * streams + [16] * wide  # every choice has tokens
            assert [code for code, _, _ in results[streams + wide :]] == [0] * leaving
            metrics = httpx.get(f"{url}/metrics").text
            p99 = quantile_from_histogram(metrics, "lazyserve_queue_wait_seconds", 0.99)
            print(f"burst of {streams}+{wide}x16 streams: queue wait p99 <= {p99} s")
            assert p99 > 0  # a burst three times the room did wait
            # Nothing held: no queue, no sequences on the gateway's books or on the worker.
            state = httpx.get(f"{url}/status").json()
            assert state["queue"]["depth"] == 0 and state["in_flight"] == 0
            assert [w["sequences"] for w in state["workers"] if w["role"] == "decode"] == [0.0]
            assert wait_for(
                lambda: (
                    [
                        (w["sequences_active"], w["bytes_held"])
                        for w in httpx.get(f"{url}/version").json()["decode_workers"]
                    ]
                    == [(0, 0)]
                ),
                timeout=30,
            )
            rss.append(_rss_bytes(decode_pid))
        # The second burst, twice the first, leaves the worker no bigger than it left it (allocator
        # slack aside): what a burst took came back.
        assert rss[1] <= rss[0] * 1.25 + (64 << 20), rss
        received = float(re.search(r"^lazyserve_requests_received_total (\S+)$", metrics, re.M).group(1))
        outcomes = {
            outcome: float(count)
            for outcome, count in re.findall(r'^lazyserve_requests_total{outcome="(\w+)"} (\S+)$', metrics, re.M)
        }
        # Every request counted ended once: served, or cancelled by the clients that left.
        assert outcomes == {"ok": 198.0, "cancelled": 16.0} and received == 214.0, (outcomes, received)
    finally:
        up.stop()
