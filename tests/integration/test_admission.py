"""Admission against a real decode worker: a burst beyond its room waits and is served, a client
that leaves while waiting takes nothing with it, a deadline in the queue says so, and a request
that could never fit is a 400 before any work. Outcomes at the gateway add up."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time

import httpx
import openai
import pytest
from conftest import wait_for
from helpers import random_ids

from services.router.client import DecodeClient
from services.router.workers import SEQUENCES, StaticWorkers
from shared.net.registry import WorkerInfo

MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _metric(text: str, name: str) -> float:
    return sum(float(value) for value in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _outcomes(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    outcomes = {m[0]: float(m[1]) for m in re.findall(r'^lazyserve_requests_total{outcome="(\w+)"} (\S+)$', text, re.M)}
    return {"received": _metric(text, "lazyserve_requests_received_total"), **outcomes}


async def _burst(url: str, bodies: list[tuple[str, dict]]) -> list[tuple[int, int]]:
    """Every body at once, streamed; (status, tokens) for each."""

    async def one(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, int]:
        tokens = 0
        async with client.stream("POST", f"{url}{path}", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                await response.aread()
                return response.status_code, 0
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"error"' not in line[:20]:
                    tokens += line.count('"index"') and 1  # a chunk per token batch and choice
        return response.status_code, tokens

    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(one(client, path, body) for path, body in bodies))


def test_a_burst_beyond_the_workers_room_is_served_in_full(tiny_llama, decode_worker, gateway):
    decode, status = decode_worker(tiny_llama, max_sequences=4)
    running = gateway(decode_workers=[decode.address])
    chats = [("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 24}) for _ in range(12)]
    wide = [("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 16, "n": 4}) for _ in range(3)]
    several = [("/v1/completions", {"prompt": [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]], "max_tokens": 8, "n": 2})]
    results = asyncio.run(_burst(running.url, chats + wide + several))
    assert [code for code, _ in results] == [200] * len(results)
    assert all(tokens > 0 for _, tokens in results)
    # Nothing is held afterwards, on the gateway or on the worker; every request ended once, "ok".
    assert wait_for(lambda: status.status().sequences_active == 0, timeout=10)
    state = httpx.get(f"{running.url}/status").json()
    assert state["queue"]["depth"] == 0 and state["in_flight"] == 0
    assert [(w["sequences"], w["max_sequences"]) for w in state["workers"]] == [(0.0, 4)]
    assert _outcomes(running.url) == {"received": 16.0, "ok": 16.0}
    metrics = httpx.get(f"{running.url}/metrics").text
    assert _metric(metrics, "lazyserve_queue_wait_seconds_count") >= 16  # one per admission step


def test_more_choices_than_any_worker_holds_is_400_before_any_work(tiny_llama, decode_worker, gateway):
    decode, status = decode_worker(tiny_llama, max_sequences=4)
    running = gateway(decode_workers=[decode.address])
    with pytest.raises(openai.BadRequestError) as refused:
        running.openai().completions.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=2, n=5)
    assert refused.value.body["message"] == (
        "n=5 needs 5 sequences on one decode worker at once; the largest live decode worker generates at most 4"
    )
    assert refused.value.body["param"] == "n"
    assert status.status().transfers_completed == 0 and status.status().sequences_active == 0
    assert _outcomes(running.url) == {"received": 1.0, "client_error": 1.0}


@pytest.fixture
def held_room(tiny_llama, decode_worker, gateway):
    """A gateway over one decode worker of 2 sequences whose room the test holds itself (as other
    requests would): take(n) / give_back(n)."""
    decode, status = decode_worker(tiny_llama, max_sequences=2)
    info = WorkerInfo(worker_id="decode", role="decode", address=decode.address, model="tiny-llama")
    workers = StaticWorkers([info])

    def take(n: int = 2) -> None:
        assert workers.acquire(SEQUENCES, "decode", 2, n)

    def give_back(n: int = 2) -> None:
        workers.release(SEQUENCES, "decode", n)

    return workers, take, give_back, status


def test_a_client_that_leaves_the_queue_leaves_nothing_behind(held_room, gateway):
    workers, take, give_back, status = held_room
    running = gateway(workers=workers)
    take()
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}

    def give_up_after_half_a_second():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{running.url}/v1/completions", json=body, timeout=0.5)

    waiting = threading.Thread(target=give_up_after_half_a_second)
    waiting.start()  # the client goes away while its request waits
    assert wait_for(lambda: httpx.get(f"{running.url}/status").json()["queue"]["depth"] == 1, timeout=10)
    waiting.join(timeout=10)
    assert wait_for(lambda: httpx.get(f"{running.url}/status").json()["queue"]["depth"] == 0, timeout=10)
    metrics = httpx.get(f"{running.url}/metrics").text
    assert 'lazyserve_rejections_total{reason="cancelled"} 1.0' in metrics
    give_back()
    time.sleep(0.5)  # had it been placed after all, it would show now
    assert workers.loads(SEQUENCES) == {} and status.status().sequences_active == 0
    assert status.status().transfers_completed == 0
    assert _outcomes(running.url) == {"received": 1.0, "cancelled": 1.0}
    # The room it would have held is there for the next request.
    assert running.openai().completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=2).choices


def test_a_deadline_passed_in_the_queue_is_504_saying_how_long_it_waited(held_room, gateway):
    workers, take, give_back, _ = held_room
    running = gateway(workers=workers, request_timeout_s=1.0)
    take()
    with pytest.raises(openai.APIStatusError) as error:
        running.openai().chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=2)
    assert error.value.status_code == 504
    message = error.value.body["message"]
    assert re.fullmatch(
        r"the request waited 1\.\d s in the queue and its deadline passed \(it needs 1 sequences on one decode "
        r"worker; .* holds 2 of 2\)",
        message,
    ), message
    give_back()
    assert workers.loads(SEQUENCES) == {}
    assert _outcomes(running.url) == {"received": 1.0, "deadline": 1.0}


def test_a_worker_fuller_than_the_gateway_counts_is_waited_for_not_an_error(tiny_llama, decode_worker, gateway):
    # Two gateways on one worker of 1 sequence, neither knowing the other's requests (static lists):
    # the worker refuses the second (RESOURCE_EXHAUSTED), and that gateway tries again later.
    decode, _ = decode_worker(tiny_llama, max_sequences=1)
    first, second = gateway(decode_workers=[decode.address]), gateway(decode_workers=[decode.address])
    stream = first.openai().completions.create(
        model="tiny-llama",
        prompt=random_ids(tiny_llama, 20),
        max_tokens=1500,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    replies: list = []
    waiter = threading.Thread(
        target=lambda: replies.append(second.openai().completions.create(model="tiny-llama", prompt=[1], max_tokens=2))
    )
    waiter.start()
    assert wait_for(lambda: _metric(httpx.get(f"{second.url}/metrics").text, "lazyserve_requeued_total") >= 2, 10)
    stream.close()
    waiter.join(timeout=30)
    assert replies and replies[0].usage.completion_tokens == 2
    assert _outcomes(second.url) == {"received": 1.0, "ok": 1.0}


def test_status_reports_the_workers_capacity(tiny_llama, decode_worker):
    decode, _ = decode_worker(tiny_llama, max_sequences=3)
    client = DecodeClient(decode.address)
    assert client.status().max_sequences == 3
    client.close()


def test_a_client_gone_before_its_body_arrived_is_counted_as_cancelled(tiny_llama, decode_worker, gateway):
    # Under a burst a gateway may reach a request's body after its client has left (0.3 s give-ups
    # in test_burst did): that is a cancelled request, not a server error.
    decode, _ = decode_worker(tiny_llama)
    running = gateway(decode_workers=[decode.address])
    with socket.create_connection(("127.0.0.1", running.port)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": [1, 2'
        )
        time.sleep(0.3)
    assert wait_for(lambda: _outcomes(running.url) == {"received": 1.0, "cancelled": 1.0}, timeout=10), _outcomes(
        running.url
    )
