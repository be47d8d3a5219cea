"""Fixtures that start real servers on 127.0.0.1: decode workers (gRPC), a local Ray with prefill actors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from services.decode.server import start_decode_worker
from services.decode.settings import DecodeSettings
from services.router.disagg import DecodeClient


@pytest.fixture
def decode_worker():
    """start(loaded, **settings) -> (worker, client); everything started is stopped afterwards."""
    started = []

    def start(loaded, **overrides):
        worker = start_decode_worker(DecodeSettings(port=0, **overrides), loaded)
        client = DecodeClient(worker.address)
        started.append((worker, client))
        return worker, client

    yield start
    for worker, client in started:
        client.close()
        worker.stop(grace=0)


def wait_for(predicate, timeout: float = 10.0, period: float = 0.05):
    """Poll until predicate() is truthy; returns its last value (bounded in time)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(period)


@pytest.fixture(scope="session")
def local_ray():
    import ray

    from services.prefill.actor import ensure_ray

    ensure_ray(num_cpus=4, log_to_driver=False)
    yield ray
    ray.shutdown()


def start_process(args: list[str], ready: str, timeout: float = 120.0, env: dict | None = None):
    """Start `lazyserve ARGS` and wait for its READY line; returns (process, the rest of that line)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        match = re.match(rf"READY {ready} (\S+)", line)
        if match:
            return process, match.group(1)
        if time.monotonic() > deadline:
            break
    process.kill()
    raise RuntimeError(f"`lazyserve {' '.join(args)}` did not become ready")
