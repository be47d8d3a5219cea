"""Issue 49's targets on `lazyserve up` with the default model (SmolLM2-135M-Instruct), real
processes and the openai SDK: a decode worker SIGKILLed under 16 streams (two workers, then one
that restarts), a rolling restart under a closed loop, a prefill actor SIGKILLed under load, and
Redis stopped for 20 s. Every stream must end with all its tokens, no error event, no token lost
or repeated (each streamed token is counted by its logprobs entry), and under --batch-invariant
the text the same request gives without the fault. The figures each prints go to docs/reliability.md.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
from conftest import Up, session_members, wait_for

from services.router.auth import add_key
from shared.net.registry import connect

pytestmark = [pytest.mark.slow, pytest.mark.starts_ray]

MAX_TOKENS = 64
TOPICS = ["rivers", "the moon", "bread", "trains", "bees", "glass", "chess", "rain"]
QUESTIONS = [f"Write a short paragraph about {topic}." for topic in TOPICS] + [
    f"Explain {topic} to a child in three sentences." for topic in TOPICS
]


@dataclass
class Answer:
    text: str = ""
    streamed: int = 0  # tokens streamed (one logprobs entry each)
    usage: int = 0
    finish: str | None = None
    error: str | None = None

    @property
    def whole(self) -> bool:
        return self.error is None and self.finish == "length" and self.streamed == self.usage == MAX_TOKENS


class Stack(Up):
    """`lazyserve up` (conftest.Up), --batch-invariant unless told otherwise."""

    def __init__(self, *flags: str, env: dict | None = None, invariant: bool = True):
        super().__init__(*(["--batch-invariant"] if invariant else []), *flags, env=env)

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=300)

    def metric(self, name: str) -> float:
        body = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name))


def chat(client: openai.OpenAI, question: str, started: threading.Event | None = None) -> Answer:
    answer = Answer()
    try:
        stream = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            if chunk.usage is not None:
                answer.usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                answer.text += choice.delta.content or ""
                if choice.logprobs is not None and choice.logprobs.content:
                    answer.streamed += len(choice.logprobs.content)
                    if started is not None:
                        started.set()
                answer.finish = choice.finish_reason or answer.finish
    except Exception as error:  # counted and shown by the test, never hidden
        answer.error = f"{type(error).__name__}: {error}"
    return answer


def burst(client: openai.OpenAI, on_tokens=None) -> list[Answer]:
    """16 chats at once; `on_tokens(count)` is called from a watcher as streams get tokens."""
    flags = [threading.Event() for _ in QUESTIONS]
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        futures = [pool.submit(chat, client, q, flag) for q, flag in zip(QUESTIONS, flags)]
        if on_tokens is not None:
            assert wait_for(lambda: sum(flag.is_set() for flag in flags) >= 8, timeout=120)
            on_tokens()
        return [future.result() for future in futures]


def closed_loop(
    client: openai.OpenAI, streams: int, seconds: float, during=None, questions=QUESTIONS
) -> list[tuple[str, Answer]]:
    """`streams` clients, each sending its next chat when the last ends, for `seconds`; `during()`
    runs meanwhile (the fault). Returns every (question, answer)."""
    stop, results, lock = threading.Event(), [], threading.Lock()

    def client_loop(first: int) -> None:
        for turn in range(first, 10_000):
            if stop.is_set():
                return
            question = questions[turn % len(questions)]
            answer = chat(client, question)
            with lock:
                results.append((question, answer))

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(streams)]
    for thread in threads:
        thread.start()
    ended = time.monotonic() + seconds
    if during is not None:
        during()
    while time.monotonic() < ended:
        time.sleep(0.2)
    stop.set()
    for thread in threads:
        thread.join(timeout=300)
    return results


def _failures(results: list[tuple[str, Answer]], reference: dict[str, str]) -> list[str]:
    return [
        f"{q!r}: {a.error or (a.finish, a.streamed, a.usage)}"
        for q, a in results
        if not a.whole or a.text != reference[q]
    ]


@pytest.fixture
def two_workers():
    up = Stack("--decode-workers", "2", "--drain-seconds", "2")
    try:
        up.wait_ready()
        yield up
    finally:
        up.stop()


def test_killed_and_rolled_decode_workers_lose_no_stream(two_workers):
    up = two_workers
    client = up.client()
    reference = {q: a.text for q, a in zip(QUESTIONS, burst(client))}

    # SIGKILL of one decode worker once 8 of the 16 streams have tokens.
    killed = burst(client, lambda: os.kill(up.decode_pid(0), signal.SIGKILL))
    assert [a.error for a in killed] == [None] * 16
    assert all(a.whole for a in killed), [(a.finish, a.streamed, a.usage) for a in killed]
    assert [a.text for a in killed] == [reference[q] for q in QUESTIONS]
    migrated = up.metric('lazyserve_migrations_total{reason="failed"}')
    assert migrated >= 1
    assert up.wait_line("RESTARTED decode-0", timeout=120), up.lines

    # A rolling restart of both decode workers under a closed loop of 16 streams for 60 s.
    results = closed_loop(client, 16, 60, during=lambda: up.process.send_signal(signal.SIGHUP))
    assert wait_for(lambda: "ROLLED\n" in up.lines, timeout=120), up.lines
    assert _failures(results, reference) == []
    drained = up.metric('lazyserve_migrations_total{reason="drained"}')
    restarts = [line.strip() for line in up.lines if line.startswith("RESTARTED")]
    print(
        f"\nSIGKILL: 16/16 whole and equal, {migrated:.0f} choices migrated; rolling restart: "
        f"{len(results)} chats in 60 s, 0 errors, {drained:.0f} migrated by drain; {restarts}; "
        f"gap p50 {_gap(up)}"
    )


def _gap(up: Stack) -> str:
    count = up.metric("lazyserve_migration_gap_seconds_count")
    total = up.metric("lazyserve_migration_gap_seconds_sum")
    return f"mean {total / count:.2f} s over {count:.0f}" if count else "none"


def test_one_decode_worker_restarting_and_a_killed_prefill_actor_lose_no_stream():
    up = Stack("--decode-workers", "1", "--local-threshold", "60")
    try:
        up.wait_ready()
        client = up.client()
        reference = {q: a.text for q, a in zip(QUESTIONS, burst(client))}
        started = time.monotonic()
        killed = burst(client, lambda: os.kill(up.decode_pid(0), signal.SIGKILL))
        waited = time.monotonic() - started
        assert [a.error for a in killed] == [None] * 16
        assert all(a.whole for a in killed)
        assert [a.text for a in killed] == [reference[q] for q in QUESTIONS]
        assert any(line.startswith("RESTARTED decode-0") for line in up.lines)

        # Prompts over 60 tokens go to the prefill actor: SIGKILL it under a closed loop of 8.
        long_questions = ["Read this first. " * 20 + q for q in QUESTIONS]
        actor = _prefill_actor(up)
        before = up.metric('lazyserve_routing_decisions_total{kind="disaggregated"')
        results = closed_loop(
            client, 8, 20, during=lambda: (time.sleep(5), os.kill(actor, signal.SIGKILL)), questions=long_questions
        )
        assert [a.error for _, a in results if a.error] == []
        assert all(a.whole for _, a in results)
        assert up.metric('lazyserve_routing_decisions_total{kind="disaggregated"') > before
        print(
            f"\none decode worker SIGKILLed under 16 streams: 16/16 whole and equal in {waited:.1f} s "
            f"(restart included); prefill actor SIGKILLed under 8 streams: {len(results)} chats, 0 errors"
        )
    finally:
        up.stop()


def _prefill_actor(up: Stack) -> int:
    for pid in session_members(up.sessions):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                if "PrefillActor" in f.read():
                    return pid
        except OSError:
            continue
    raise LookupError("no PrefillActor process under up")


def test_redis_stopped_for_20_s_under_8_streams_is_served_degraded(own_redis):
    add_key(connect(own_redis.url), "sk-app")
    up = Stack("--decode-workers", "2", env={"LAZYSERVE_REDIS_URL": own_redis.url})
    try:
        up.wait_ready()
        client = up.client("sk-app")
        reference = {q: a.text for q, a in zip(QUESTIONS, burst(client))}  # the key is checked here
        times: dict[str, float] = {}

        def outage():
            time.sleep(5)
            own_redis.stop()
            time.sleep(10)
            times["degraded_during"] = degraded()
            time.sleep(10)
            own_redis.start()
            add_key(connect(own_redis.url), "sk-app")  # a Redis with its data kept (here: restored by hand)
            back = time.monotonic()
            if wait_for(lambda: not degraded(), timeout=10, period=0.1):
                times["reconciled_s"] = time.monotonic() - back

        def degraded() -> bool:
            headers = {"authorization": "Bearer sk-app"}
            return httpx.get(f"{up.url}/status", headers=headers, timeout=10).json()["degraded"]

        results = closed_loop(client, 8, 40, during=lambda: threading.Thread(target=outage).start())
        assert _failures(results, reference) == []  # no error (a 5xx included), every token, the same text
        assert times["degraded_during"] is True
        assert times["reconciled_s"] < 5  # shared counts again: the limits hold across replicas
        assert up.metric("lazyserve_degraded") == 0
        print(
            f"\nRedis stopped 20 s under 8 streams: {len(results)} chats in 40 s, 0 errors, 0 5xx; "
            f"degraded during it, reconciled {times['reconciled_s']:.2f} s after Redis was back"
        )
    finally:
        up.stop()
