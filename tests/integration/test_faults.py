"""Faults caused for real: a decode worker SIGKILLed mid-stream (its stream migrates), a prefill actor
SIGKILLed, Redis stopped and restarted under a running gateway (which serves degraded meanwhile)."""

from __future__ import annotations

import itertools
import os
import signal
import time

import httpx
import openai
import pytest
import ray
from conftest import free_port, start_process, wait_for
from helpers import random_ids

from services.prefill.actor import actor_addresses, launch_prefill_actors
from services.prefill.settings import PrefillSettings
from services.router.auth import add_key
from services.router.workers import RedisWorkers
from shared.net.registry import Heartbeat, WorkerInfo, connect, list_workers
from shared.settings import EngineSettings


def test_a_decode_worker_killed_mid_stream(tiny_llama, gateway, redis_url, flush_redis):
    env = {"LAZYSERVE_REDIS_URL": redis_url, "LAZYSERVE_DECODE_HEARTBEAT_TTL_S": "1.5"}
    workers = {}
    for _ in range(2):
        process, address = start_process(
            ["decode-worker", "--model", "tiny-llama", "--port", "0", "--threads", "1"], "decode", env=env
        )
        workers[address] = process
    try:
        assert wait_for(lambda: len(list_workers(connect(redis_url))) == 2)
        running = gateway(redis_url=redis_url)
        client = running.openai()
        raw = client.completions.with_raw_response.create(
            model="tiny-llama",
            prompt=random_ids(tiny_llama, 30),
            max_tokens=1900,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        victim = raw.headers["x-lazyserve-decode"]
        chunks = iter(raw.parse())
        next(chunks)
        os.kill(workers[victim].pid, signal.SIGKILL)
        started = time.monotonic()
        # The stream migrates to the live worker and ends in full, without an error event
        # (tests/integration/test_stream_migration.py checks the tokens equal a run without the fault).
        *_, last = chunks
        assert last.usage.completion_tokens == 1900
        ended = time.monotonic() - started
        # Still registered for up to its TTL: requests go to the live worker (the gateway found the
        # dead one UNAVAILABLE and leaves it out until its health check answers).
        for _ in range(4):
            reply = client.completions.with_raw_response.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=2)
            assert reply.parse().usage.completion_tokens == 2
        alive = [a for a in workers if a != victim]
        assert wait_for(lambda: [w.address for w in list_workers(connect(redis_url))] == alive, timeout=4)
        gone = time.monotonic() - started
        print(
            f"\ndecode worker SIGKILLed: migrated, ended in full {ended:.2f} s later; "
            f"out of the registry after {gone:.2f} s"
        )
        reply = client.completions.with_raw_response.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=2)
        assert reply.headers["x-lazyserve-decode"] == alive[0]
    finally:
        for process in workers.values():
            process.kill()
            process.wait(timeout=10)


def test_a_killed_prefill_actor_is_restarted_and_no_request_hangs(local_ray, tiny_llama, decode_worker, gateway):
    port = free_port()
    settings = PrefillSettings(engine=EngineSettings(model="tiny-llama", threads=1), port=port)
    [actor] = launch_prefill_actors(settings)
    try:
        decode, _ = decode_worker(tiny_llama)
        [address] = actor_addresses([actor])
        running = gateway(
            prefill_workers=[address], decode_workers=[decode.address], local_threshold=100, request_timeout_s=60
        )
        client = running.openai()
        # A new prompt each time: a repeated one would be sent where it is cached (prefix caching).
        prompts = (random_ids(tiny_llama, 300, seed) for seed in itertools.count(100))
        first = client.completions.with_raw_response.create(model="tiny-llama", prompt=next(prompts), max_tokens=3)
        assert first.headers["x-lazyserve-route"] == "disaggregated"
        pid = ray.get(actor.pid.remote())
        os.kill(pid, signal.SIGKILL)
        # Right after the crash: the prefill call fails, is retried, and with no other prefill
        # worker the retry prefills on the decode worker (said so in the route): an answer, no hang.
        started = time.monotonic()
        during = client.completions.with_raw_response.create(model="tiny-llama", prompt=next(prompts), max_tokens=3)
        assert during.parse().usage.completion_tokens == 3
        assert during.headers["x-lazyserve-route"] == "local"  # the retry's route, said in the header
        answered = time.monotonic() - started
        assert answered < 30
        assert wait_for(lambda: ray.get(actor.pid.remote(), timeout=60) != pid, timeout=90)  # Ray restarted it
        restarted = time.monotonic() - started
        assert actor_addresses([actor]) == [address]  # same fixed port

        def disaggregated_again():
            reply = client.completions.with_raw_response.create(model="tiny-llama", prompt=next(prompts), max_tokens=3)
            return reply.headers["x-lazyserve-route"] == "disaggregated"

        assert wait_for(disaggregated_again, timeout=30)
        print(
            f"\nprefill actor SIGKILLed: answered ({during.headers['x-lazyserve-route']}) in {answered:.2f} s, "
            f"restarted by Ray within {restarted:.2f} s"
        )
    finally:
        ray.kill(actor)


@pytest.fixture
def degradable(own_redis, tiny_llama, decode_worker, gateway):
    """A gateway on a Redis of this test's own, with one decode worker registered there."""
    worker, _ = decode_worker(tiny_llama)
    info = WorkerInfo(role="decode", address=worker.address, model="tiny-llama")
    heartbeat = Heartbeat(own_redis.url, info, ttl_s=2.0)
    assert wait_for(lambda: RedisWorkers(own_redis.url).list(), timeout=5)
    yield gateway(redis_url=own_redis.url)
    heartbeat.stop()


def test_the_gateway_serves_degraded_while_redis_is_down_and_reconciles(own_redis, degradable):
    running = degradable
    add_key(connect(own_redis.url), "sk-known")
    known, unknown = running.openai(api_key="sk-known"), running.openai(api_key="sk-never-seen")

    def ask(client) -> int:
        return client.completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1).usage.completion_tokens

    assert ask(known) == 1  # Redis vouches for the key, and the gateway remembers it did
    own_redis.stop()
    started = time.monotonic()
    # Served on the worker it last saw, with its own counts: no 503 for a key it checked before.
    assert [ask(known) for _ in range(4)] == [1] * 4
    served = time.monotonic() - started
    status = httpx.get(f"{running.url}/status", headers={"authorization": "Bearer sk-known"}).json()
    assert (status["shared_state"], status["degraded"]) == ("redis", True)
    assert "lazyserve_degraded 1.0" in httpx.get(f"{running.url}/metrics").text
    # A key it never checked cannot be: a 503 that says so, not a 401 calling it bad.
    with pytest.raises(openai.InternalServerError) as error:
        ask(unknown)
    assert error.value.status_code == 503 and "cannot be checked" in error.value.body["message"]
    own_redis.start()  # back, empty: keys are restored, the heartbeat registers the worker
    add_key(connect(own_redis.url), "sk-known")
    back = time.monotonic()
    assert wait_for(lambda: not running.app.state.gateway.degraded, timeout=5)
    reconciled = time.monotonic() - back
    assert "lazyserve_degraded 0.0" in httpx.get(f"{running.url}/metrics").text
    assert ask(known) == 1
    with pytest.raises(openai.AuthenticationError):  # checked in Redis again: unknown is refused
        ask(unknown)
    print(
        f"\nRedis down: {4 / served:.0f} requests/s served degraded; back and reconciled {reconciled:.2f} s after"
        " Redis restarted"
    )


def test_a_stalled_redis_makes_the_gateway_degraded_not_slow(own_redis, degradable):
    """Redis that hangs instead of refusing (CLIENT PAUSE): the first request waits out the
    connection's timeout once; from then on nothing waits on Redis until it answers again."""
    running = degradable
    client = running.openai()

    def ask() -> float:
        started = time.monotonic()
        assert client.completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1).usage.completion_tokens
        return time.monotonic() - started

    ask()
    connect(own_redis.url).execute_command("CLIENT", "PAUSE", "8000", "ALL")
    paused = time.monotonic()
    took = [ask() for _ in range(6)]
    assert running.app.state.gateway.degraded
    assert max(took[1:]) < 1.0, took  # only the first paid the dead connection's timeout
    assert wait_for(lambda: not running.app.state.gateway.degraded, timeout=15)
    print(
        f"\nRedis paused: first request {took[0]:.2f} s, then {max(took[1:]):.2f} s at most; back after "
        f"{time.monotonic() - paused:.1f} s (paused for 8)"
    )
