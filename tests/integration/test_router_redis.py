"""Redis mode against a real redis-server: registration and expiry, shared load across router
replicas, hashed API keys, request records."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import start_process, wait_for
from helpers import random_ids

from services.router.auth import API_KEYS, add_key, hash_key
from services.router.fallback import FallbackWorkers, SharedState
from services.router.workers import DECODE_TOKENS, STREAMS, RedisWorkers
from shared.net.registry import Heartbeat, WorkerInfo, connect, list_workers


@pytest.fixture
def registered(redis_url, flush_redis):
    """register(worker, info) -> Heartbeat for an in-process worker; all stopped afterwards."""
    beats = []

    def register(address: str, role: str = "decode", model: str = "tiny-llama", ttl_s: float = 2.0):
        beats.append(Heartbeat(redis_url, WorkerInfo(role=role, address=address, model=model, capacity=4), ttl_s))
        return beats[-1]

    yield register
    for beat in beats:
        beat.stop()


def test_a_killed_worker_drops_out_within_its_ttl(redis_url, flush_redis):
    env = {"LAZYSERVE_REDIS_URL": redis_url, "LAZYSERVE_DECODE_HEARTBEAT_TTL_S": "1.5"}
    process, address = start_process(["decode-worker", "--model", "tiny-llama", "--port", "0"], "decode", env=env)
    try:
        client = connect(redis_url)
        workers = wait_for(lambda: list_workers(client), timeout=10)
        assert [(w.role, w.address, w.model) for w in workers] == [("decode", address, "tiny-llama")]
        os.kill(process.pid, signal.SIGKILL)  # no goodbye: only the TTL can remove it
        assert wait_for(lambda: list_workers(client) == [], timeout=5), "a dead worker is still listed"
    finally:
        process.kill()
        process.wait(timeout=10)


def test_router_replicas_share_load(tiny_llama, decode_worker, gateway, registered, redis_url):
    first, _ = decode_worker(tiny_llama)
    second, _ = decode_worker(tiny_llama)
    for worker in (first, second):
        registered(worker.address)
    replica_a = gateway(redis_url=redis_url)
    replica_b = gateway(redis_url=redis_url)
    ids = random_ids(tiny_llama, 30)
    # A long generation through replica A occupies one decode worker...
    stream = replica_a.openai().completions.with_raw_response.create(
        model="tiny-llama", prompt=ids, max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    busy = stream.headers["x-lazyserve-decode"]
    chunks = iter(stream.parse())
    next(chunks)
    loads = RedisWorkers(redis_url).loads(DECODE_TOKENS)
    assert max(loads.values()) == 1500
    # ...and replica B, seeing the shared counter, sends the next request to the other one.
    reply = replica_b.openai().completions.with_raw_response.create(model="tiny-llama", prompt=ids, max_tokens=2)
    assert reply.headers["x-lazyserve-decode"] != busy
    stream.parse().close()
    assert wait_for(lambda: all(v == 0 for v in RedisWorkers(redis_url).loads(DECODE_TOKENS).values()), timeout=10)


def test_api_keys_are_stored_hashed(tiny_llama, decode_worker, gateway, registered, redis_url, flush_redis):
    worker, _ = decode_worker(tiny_llama)
    registered(worker.address)
    add_key(flush_redis, "sk-lazy-123")
    assert flush_redis.smembers(API_KEYS) == {hash_key("sk-lazy-123")}
    assert "sk-lazy-123" not in str(flush_redis.smembers(API_KEYS))
    running = gateway(redis_url=redis_url)
    with pytest.raises(openai.AuthenticationError):
        running.openai(api_key="sk-wrong").completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1)
    reply = running.openai(api_key="sk-lazy-123").completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1)
    assert reply.usage.completion_tokens == 1


def test_requests_are_recorded_with_a_ttl(tiny_llama, decode_worker, gateway, registered, redis_url, flush_redis):
    worker, _ = decode_worker(tiny_llama)
    registered(worker.address)
    running = gateway(redis_url=redis_url, request_record_ttl_s=600)
    reply = running.openai().completions.with_raw_response.create(model="tiny-llama", prompt=[1, 2, 3], max_tokens=3)
    key = f"lazyserve:request:{reply.headers['x-request-id']}"
    record = wait_for(lambda: flush_redis.hgetall(key).get("outcome") == "ok" and flush_redis.hgetall(key))
    assert record and record["route"] == "local" and int(record["completion_tokens"]) == 3
    assert float(record["ttft_s"]) > 0 and float(record["e2e_s"]) >= float(record["ttft_s"])
    assert 0 < flush_redis.ttl(key) <= 600


def test_a_dead_routers_load_expires_and_a_live_ones_stays(redis_url, flush_redis):
    dead, live, reader = RedisWorkers(redis_url, ttl_s=1.0), RedisWorkers(redis_url, ttl_s=1.0), RedisWorkers(redis_url)
    dead.add_load(DECODE_TOKENS, "w1", 100)
    live.add_load(DECODE_TOKENS, "w1", 50)
    assert reader.loads(DECODE_TOKENS) == {"w1": 150}
    dead.close()  # as if that router process were killed mid-request: it never subtracts its 100
    assert wait_for(lambda: reader.loads(DECODE_TOKENS) == {"w1": 50}, timeout=5)
    time.sleep(1.5)  # past the TTL: the live router keeps its share alive
    assert reader.loads(DECODE_TOKENS) == {"w1": 50}
    assert flush_redis.smembers("lazyserve:routers") == {live.router_id}
    live.close()
    reader.close()


def test_a_keys_stream_limit_holds_across_gateway_replicas(
    tiny_llama, decode_worker, gateway, registered, redis_url, flush_redis
):
    worker, _ = decode_worker(tiny_llama)
    registered(worker.address)
    replica_a = gateway(redis_url=redis_url, api_keys="key-a,key-b", max_streams_per_key=1)
    replica_b = gateway(redis_url=redis_url, api_keys="key-a,key-b", max_streams_per_key=1)
    stream = replica_a.openai(api_key="key-a").completions.create(
        model="tiny-llama", prompt=[1, 2, 3], max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    # Key A's one slot is taken on replica A: on replica B its next request waits, and key B is served.
    waiting = ThreadPoolExecutor(1).submit(
        replica_b.openai(api_key="key-a").completions.create, model="tiny-llama", prompt=[1, 2], max_tokens=1
    )
    assert replica_b.openai(api_key="key-b").completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1).choices
    status = httpx.get(f"{replica_b.url}/status", headers={"Authorization": "Bearer key-b"}).json()
    assert status["queue"]["depth"] == 1 and not waiting.done()

    # Only the key's hash is held in Redis, and the slot comes back when the stream ends. Key B's
    # slot was given back before its answer was sent.
    def held():
        shares = [flush_redis.hgetall(key) for key in flush_redis.scan_iter("lazyserve:load:streams:*")]
        return {field for share in shares for field in share}

    assert held() == {hash_key("key-a")}
    stream.close()
    # Replica A's give-back shows only in Redis: replica B's queue finds it at its next poll.
    assert waiting.result(timeout=30).usage.completion_tokens == 1
    assert wait_for(
        lambda: not any(flush_redis.hgetall(k) for k in flush_redis.scan_iter("lazyserve:load:streams:*")), timeout=10
    )


def test_concurrent_acquires_on_two_replicas_never_overshoot_the_limit(redis_url, flush_redis):
    replicas = [RedisWorkers(redis_url), RedisWorkers(redis_url)]
    start = threading.Barrier(16)

    def take(replica) -> bool:
        start.wait(timeout=10)
        return replica.acquire(STREAMS, "caller", 5)

    with ThreadPoolExecutor(16) as pool:
        taken = list(pool.map(take, [replicas[i % 2] for i in range(16)]))
    reader = RedisWorkers(redis_url)
    assert sum(taken) == 5
    assert reader.loads(STREAMS) == {"caller": 5}
    for replica, got in zip([replicas[i % 2] for i in range(16)], taken):
        if got:
            replica.release(STREAMS, "caller")
    assert reader.loads(STREAMS) == {}
    for workers in (*replicas, reader):
        workers.close()


@pytest.mark.latency
def test_a_stalled_redis_does_not_stall_a_running_stream(tiny_llama, decode_worker, gateway, registered, redis_url):
    """Redis paused for 3 s (CLIENT PAUSE) while another stream ends, so the gateway must give back
    its slot and load: those Redis calls wait in threads, and the running stream keeps flowing."""
    worker, _ = decode_worker(tiny_llama)
    registered(worker.address, ttl_s=10.0)
    running = gateway(redis_url=redis_url)
    ids = random_ids(tiny_llama, 20)
    client = running.openai()
    arrivals: list[float] = []
    # ignore_eos: a sampled stream of tiny-llama meets its stop token within 1,800 tokens often
    # enough (1 seed in 20 within 1,500) to end before the pause.
    long = {"max_tokens": 1800, "stream": True, "extra_body": {"ignore_eos": True}}
    main = client.completions.create(model="tiny-llama", prompt=ids, **long)
    other = client.completions.create(model="tiny-llama", prompt=ids, **long)
    next(iter(other))

    stop = threading.Event()

    def read():
        for _ in main:
            arrivals.append(time.monotonic())
            if stop.is_set():
                break
        main.close()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert wait_for(lambda: len(arrivals) > 20, timeout=20)
    pauser = connect(redis_url)
    paused_at = time.monotonic()
    pauser.execute_command("CLIENT", "PAUSE", "3000", "ALL")
    other.close()  # its end gives back a stream slot and decode load: Redis calls, now stalled
    time.sleep(2.5)  # the window in which a blocking call on the event loop would stall `main`
    during = [t for t in arrivals if paused_at <= t <= paused_at + 2.5]
    gaps = [b - a for a, b in zip(during, during[1:])]
    stop.set()
    reader.join(timeout=10)
    assert len(during) > 10, "the running stream stopped while Redis was paused"
    assert max(gaps) < 1.0, f"the running stream stalled for {max(gaps):.2f} s"


def test_a_replicas_share_is_written_back_when_redis_returns(own_redis):
    """Redis stopped under a replica (FallbackWorkers): it goes on with its own counts and the
    workers it last saw; when Redis returns (empty), its share is what it holds now, so another
    replica's limits count it again within seconds."""
    url = own_redis.url
    info = WorkerInfo(role="decode", address="127.0.0.1:1", model="m")
    beat = Heartbeat(url, info, ttl_s=2.0)
    replica = FallbackWorkers(RedisWorkers(url), SharedState(retry_s=0.2))
    try:
        assert wait_for(lambda: replica.list(), timeout=5)
        assert replica.acquire(STREAMS, "key-a", 1)  # in Redis
        beat.stop()
        own_redis.stop()
        assert replica.acquire(STREAMS, "key-b", 1)  # Redis down: this replica's own count
        assert replica.state.degraded
        assert not replica.acquire(STREAMS, "key-b", 1)  # its own bound still holds
        replica.release(STREAMS, "key-a")  # given back while Redis is away
        assert [w.address for w in replica.list()] == [info.address]  # the workers last seen
        own_redis.start()
        back = time.monotonic()
        assert wait_for(lambda: not replica.state.degraded, timeout=5)
        other = RedisWorkers(url)
        assert other.loads(STREAMS) == {"key-b": 1.0}  # what it holds now, not what it held
        assert not other.acquire(STREAMS, "key-b", 1)  # the limit holds across replicas again
        print(f"\nRedis back: this replica's share written back {time.monotonic() - back:.2f} s later")
        replica.release(STREAMS, "key-b")
        assert other.loads(STREAMS) == {}
        other.close()
    finally:
        replica.close()
