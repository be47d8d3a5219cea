"""A real two-node Ray cluster on loopback: `ray start --head` (no CPUs for actors) and a second
`ray start --address` node offering the `prefill` resource, with Ray's token authentication on.
Prefill actors can only be placed on that node; decode worker, gateway and Redis run as their
own processes (Redis mode). A chat completion through the openai SDK goes through all of them."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile

import httpx
import openai
import pytest
from conftest import free_port, kill_sessions, start_process, wait_for

RAY = os.path.join(os.path.dirname(sys.executable), "ray")
pytestmark = pytest.mark.starts_ray


@pytest.fixture
def ray_cluster():
    sessions: set[int] = set()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    port = free_port()
    temp = tempfile.mkdtemp(prefix="lsray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes

    def ray_start(*args):
        process = subprocess.Popen(
            [RAY, "start", *args, "--disable-usage-stats"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        sessions.add(process.pid)
        assert process.wait(timeout=120) == 0, f"ray start {args} failed"

    try:
        ray_start("--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={temp}")
        ray_start(f"--address=127.0.0.1:{port}", "--num-cpus=2", '--resources={"prefill": 1}')
        yield f"127.0.0.1:{port}", env, sessions
    finally:
        kill_sessions(sessions)
        shutil.rmtree(temp, ignore_errors=True)


def _connect_driver(address: str, env: dict) -> subprocess.CompletedProcess:
    code = f"import ray; ray.init(address={address!r}); print('connected', len(ray.nodes()))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a two-node Ray cluster: about a minute; `make test-slow` and CI run it
def test_a_driver_without_the_clusters_token_is_refused(ray_cluster):
    address, ray_env, _ = ray_cluster
    # A refused driver retries its connection about once a second, 20 times by default: 3 is enough.
    quick = {**ray_env, "RAY_NUM_REDIS_GET_RETRIES": "3"}
    wrong = _connect_driver(address, {**quick, "RAY_AUTH_TOKEN": secrets.token_hex(16)})
    assert wrong.returncode != 0 and "AuthenticationError" in wrong.stderr, wrong.stderr[-2000:]
    anonymous = _connect_driver(address, {k: v for k, v in quick.items() if not k.startswith("RAY_AUTH")})
    assert anonymous.returncode != 0 and "AuthenticationError" in anonymous.stderr, anonymous.stderr[-2000:]
    right = _connect_driver(address, ray_env)
    assert right.returncode == 0 and "connected 2" in right.stdout, right.stderr[-2000:]


@pytest.mark.slow
def test_chat_completion_through_a_two_node_ray_cluster(ray_cluster, redis_url, flush_redis):
    address, ray_env, sessions = ray_cluster
    redis_env = {"LAZYSERVE_REDIS_URL": redis_url}
    decode, _ = start_process(
        ["decode-worker", "--model", "tiny-llama", "--port", "0", "--threads", "1"],
        "decode",
        env=redis_env,
        session=True,
    )
    sessions.add(decode.pid)
    prefill, prefill_address = start_process(
        [
            "prefill-worker",
            "--ray-address",
            address,
            "--prefill-resource",
            "1",
            "--model",
            "tiny-llama",
            "--threads",
            "1",
        ],
        "prefill",
        env={**ray_env, **redis_env},
        timeout=180,
        session=True,
    )
    sessions.add(prefill.pid)
    port = free_port()
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "gateway",
            "--model",
            "tiny-llama",
            "--port",
            str(port),
            "--local-threshold",
            "100",
        ],
        env={**os.environ, **redis_env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    sessions.add(gateway.pid)
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            body = httpx.get(f"{url}/ready", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        return body.get("prefill_workers") == 1 and body.get("decode_workers") == 1

    assert wait_for(ready, timeout=120), "the gateway never saw both registered workers"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    long_prompt = " ".join(["the prefill node computes this"] * 30)
    reply = client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": long_prompt}], max_tokens=5
    )
    assert reply.headers["x-lazyserve-route"] == "disaggregated"
    assert reply.parse().usage.completion_tokens == 5
    for process in (gateway, prefill, decode):
        process.terminate()
    for process in (gateway, prefill, decode):
        process.wait(timeout=30)
