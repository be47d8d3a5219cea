"""`lazyserve up`: the whole system on one host, with one command.

Starts decode workers, prefill actors on a local Ray (the prefill-worker command starts Ray) and
the gateway over them, each as its own process running its own `lazyserve` subcommand, with the
embedded defaults: the static worker list, no Redis. Waits for each to be ready (with progress),
prints the URL and an example request, and on Ctrl-C or SIGTERM stops every process it started,
process group and all, so nothing is left behind.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time

import httpx
from rich.console import Console

console = Console(stderr=True)


class Stack:
    def __init__(self, pruning_preset: str | None = None):
        self.processes: list[tuple[str, subprocess.Popen]] = []
        # Internal gRPC calls need this token: only processes of this stack can reach the workers.
        self.token = os.environ.get("LAZYSERVE_INTERNAL_TOKEN") or secrets.token_urlsafe(24)
        self.env = {**os.environ, "LAZYSERVE_INTERNAL_TOKEN": self.token}
        if pruning_preset is not None:  # every process of the stack, so all agree on the default
            self.env["LAZYSERVE_PRUNING_PRESET"] = pruning_preset

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        # Own session: Ctrl-C in the terminal reaches only `up`, which stops the children in order.
        process = subprocess.Popen(  # noqa: S603 -- this interpreter running our own CLI, no shell
            [sys.executable, "-m", "services.cli", *args],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=self.env,
        )
        self.processes.append((name, process))
        return process

    def wait_ready(self, name: str, process: subprocess.Popen, kind: str, count: int, timeout: float) -> list[str]:
        addresses: list[str] = []
        deadline = time.monotonic() + timeout
        for line in process.stdout:
            match = re.match(rf"READY {kind} (\S+)", line)
            if match:
                addresses.append(match.group(1))
                if len(addresses) == count:
                    break
            if time.monotonic() > deadline:
                break
        if len(addresses) < count:
            raise RuntimeError(f"{name} did not become ready (exit code {process.poll()}); see its log above")
        # Keep draining its stdout so the child never blocks on a full pipe.
        threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
        return addresses

    def stop(self, timeout: float = 20.0) -> None:
        for _name, process in reversed(self.processes):  # gateway first, workers last
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, process in reversed(self.processes):
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                console.print(f"[yellow]{name} did not stop in time: killed")
            # Whatever the child left in its group (Ray's own processes, say) goes too.
            _signal_group(process, signal.SIGKILL)
            process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def up(
    model: str | None,
    port: int,
    decode_workers: int,
    prefill_actors: int,
    threads: int | None,
    local_threshold: int | None,
    timeout: float = 600.0,
    pruning_preset: str | None = None,
) -> int:
    stack = Stack(pruning_preset)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    common = (["--model", model] if model else []) + (["--threads", str(threads)] if threads else [])
    try:
        with console.status("starting decode workers and prefill actors (the first start converts the model, ~30 s)"):
            decoders = [
                stack.start(f"decode-{i}", ["decode-worker", "--port", str(50061 + i), *common])
                for i in range(decode_workers)
            ]
            prefill = stack.start(
                "prefill", ["prefill-worker", "--port", "50071", "--num-actors", str(prefill_actors), *common]
            )
            decode_addresses = [
                stack.wait_ready(f"decode-{i}", p, "decode", 1, timeout)[0] for i, p in enumerate(decoders)
            ]
            console.print(f"decode workers ready: {', '.join(decode_addresses)}")
            prefill_addresses = stack.wait_ready("prefill", prefill, "prefill", prefill_actors, timeout)
            console.print(f"prefill actors ready: {', '.join(prefill_addresses)}")
        gateway_args = [
            "gateway",
            "--port",
            str(port),
            "--decode-workers",
            ",".join(decode_addresses),
            "--prefill-workers",
            ",".join(prefill_addresses),
            *common,
        ]
        if local_threshold is not None:
            gateway_args += ["--local-threshold", str(local_threshold)]
        with console.status("starting the gateway"):
            stack.start("gateway", gateway_args)
            url = f"http://127.0.0.1:{port}"
            wait_for_gateway(url, timeout, stop)
        print(f"READY gateway {url}", flush=True)
        console.print(
            f"\n[bold]lazyserve is up[/bold] at {url}/v1 (Ctrl-C stops everything)\n\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"messages": [{{"role": "user", "content": "Say hello"}}], "max_tokens": 32}}\'\n\n'
            f"  metrics: {url}/metrics   health: {url}/health\n",
            highlight=False,
            soft_wrap=True,  # never wrapped at the console's width: the example must paste as it is
        )
        while not stop.wait(0.5):
            dead = [name for name, process in stack.processes if process.poll() is not None]
            if dead:
                console.print(f"[red]{', '.join(dead)} exited; stopping the rest")
                return 1
        return 0
    except RuntimeError as error:
        console.print(f"[red]{error}")
        return 1
    finally:
        with console.status("stopping"):
            stack.stop()
        console.print("stopped")


def wait_for_gateway(url: str, timeout: float, stop: threading.Event | None = None) -> None:
    """Poll the gateway's /ready until it answers 200 (bounded by timeout, or until stop is set)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (stop and stop.is_set()):
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the gateway at {url} did not become ready")
