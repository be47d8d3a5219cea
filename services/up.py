"""`lazyserve up`: the whole system on one host, with one command, supervised.

Starts decode workers, prefill actors on a local Ray (the prefill-worker command starts Ray) and
the gateway over them, each as its own process running its own `lazyserve` subcommand, with the
embedded defaults: the static worker list, no Redis. Waits for each to be ready (with progress),
prints the URL and an example request, then supervises:
- a child that dies is started again on the same port, after a backoff that doubles from 1 s to
  30 s; meanwhile the gateway routes around a dead worker (a request that fails on it before its
  first token is retried on another). Too many restarts in a row (5 within 5 minutes) stop the
  stack and `up` exits 1;
- on Ctrl-C or SIGTERM every child stops, process group and all (a child's local Ray too);
- if `up` itself dies, even by SIGKILL, each child sees its lifeline pipe close and stops itself
  (shared.net.lifecycle.watch_lifeline), so nothing is left holding the ports.
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
from dataclasses import dataclass, field

import httpx
from rich.console import Console

from shared.net.lifecycle import LIFELINE_ENV

console = Console(stderr=True)

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
MAX_RESTARTS, RESTART_WINDOW_S = 5, 300.0


@dataclass(eq=False)
class Child:
    name: str
    args: list[str]
    process: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)  # when each restart happened
    restart_at: float | None = None  # scheduled restart, while it is down


class Stack:
    def __init__(self, pruning_preset: str | None = None, extra_env: dict[str, str] | None = None):
        self.children: list[Child] = []
        # Internal gRPC calls need this token: only processes of this stack can reach the workers.
        self.token = os.environ.get("LAZYSERVE_INTERNAL_TOKEN") or secrets.token_urlsafe(24)
        self.env = {**os.environ, "LAZYSERVE_INTERNAL_TOKEN": self.token, **(extra_env or {})}
        if pruning_preset is not None:  # every process of the stack, so all agree on the default
            self.env["LAZYSERVE_PRUNING_PRESET"] = pruning_preset
        # Children hold the read end; only this process holds the write end.
        self._lifeline, self._lifeline_w = os.pipe()

    @property
    def processes(self) -> list[tuple[str, subprocess.Popen]]:
        return [(child.name, child.process) for child in self.children if child.process is not None]

    def start(self, name: str, args: list[str]) -> Child:
        child = Child(name, args)
        self.children.append(child)
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> None:
        # Own session: Ctrl-C in the terminal reaches only `up`, which stops the children in order.
        child.process = subprocess.Popen(  # noqa: S603 -- this interpreter running our own CLI, no shell
            [sys.executable, "-m", "services.cli", *child.args],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            pass_fds=(self._lifeline,),
            env={**self.env, LIFELINE_ENV: str(self._lifeline)},
        )

    def wait_ready(self, child: Child, kind: str, count: int, timeout: float) -> list[str]:
        process = child.process
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
            raise RuntimeError(f"{child.name} did not become ready (exit code {process.poll()}); see its log above")
        self._drain(child)
        return addresses

    def _drain(self, child: Child, announce: bool = False) -> None:
        """Keep reading a child's stdout so it never blocks on a full pipe; say when it is back."""
        process = child.process

        def drain():
            for line in process.stdout:
                if announce and line.startswith("READY"):
                    console.print(f"[green]{child.name} is back: {line.strip()}")
                    print(f"RESTARTED {child.name}", flush=True)

        threading.Thread(target=drain, daemon=True).start()

    def supervise(self, stop: threading.Event) -> int:
        """Restart children that die, until asked to stop (0) or restarts keep failing (1)."""
        while not stop.wait(0.25):
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        child.restart_at = None
                        child.restarts.append(now)
                        console.print(f"[yellow]restarting {child.name} (restart {len(child.restarts)})")
                        self._spawn(child)
                        self._drain(child, announce=True)
                    continue
                code = child.process.poll()
                if code is None:
                    continue
                _signal_group(child.process, signal.SIGKILL)  # what it left in its group goes too
                recent = [t for t in child.restarts if now - t < RESTART_WINDOW_S]
                if len(recent) >= MAX_RESTARTS:
                    console.print(f"[red]{child.name} exited ({code}) {len(recent)} times in a row; stopping")
                    return 1
                delay = BACKOFF_S[min(len(recent), len(BACKOFF_S) - 1)]
                console.print(f"[red]{child.name} exited ({code}); restarting in {delay:.0f} s")
                child.restart_at = now + delay
        return 0

    def stop(self, timeout: float = 20.0) -> None:
        live = [(child.name, child.process) for child in reversed(self.children) if child.process is not None]
        for _name, process in live:  # gateway first, workers last
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, process in live:
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


@dataclass
class UpOptions:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    decode_workers: int = 1
    decode_port: int = 50061
    prefill_actors: int = 1
    prefill_port: int = 50071
    threads: int | None = None  # None: each worker sizes itself to the host's cores
    dtype: str | None = None  # None: LAZYSERVE_DTYPE, else auto
    enable_prefix_caching: bool | None = None  # None: LAZYSERVE_ENABLE_PREFIX_CACHING, else on
    batch_invariant: bool | None = None  # the workers'; None: LAZYSERVE_BATCH_INVARIANT, else off
    prefix_cache_bytes: str | None = None  # each worker's; None: LAZYSERVE_PREFIX_CACHE_BYTES, else 2 GiB
    local_threshold: int | None = None
    pruning_preset: str | None = None
    prefill_niceness: int | None = None  # None: LAZYSERVE_PREFILL_NICENESS, else 0
    chat_template: str | None = None  # a file; the gateway templates chat requests
    api_keys: list[str] = field(default_factory=list)
    timeout: float = 600.0


def up(options: UpOptions) -> int:
    extra_env = {"LAZYSERVE_GATEWAY_API_KEYS": ",".join(options.api_keys)} if options.api_keys else {}
    stack = Stack(options.pruning_preset, extra_env)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    o = options
    common = (["--model", o.model] if o.model else []) + (["--threads", str(o.threads)] if o.threads else [])
    if o.enable_prefix_caching is not None:  # the gateway too: it routes by what the workers cache
        common.append("--enable-prefix-caching" if o.enable_prefix_caching else "--no-enable-prefix-caching")
    engine = common + (["--dtype", o.dtype] if o.dtype else [])  # the gateway loads no weights
    if o.prefix_cache_bytes is not None:
        engine += ["--prefix-cache-bytes", o.prefix_cache_bytes]
    if o.batch_invariant is not None:
        engine.append("--batch-invariant" if o.batch_invariant else "--no-batch-invariant")
    try:
        with console.status("starting decode workers and prefill actors (the first start converts the model, ~30 s)"):
            decoders = [
                stack.start(f"decode-{i}", ["decode-worker", "--port", str(o.decode_port + i), *engine])
                for i in range(o.decode_workers)
            ]
            prefill_args = ["prefill-worker", "--port", str(o.prefill_port), "--num-actors", str(o.prefill_actors)]
            prefill_args += ["--niceness", str(o.prefill_niceness)] if o.prefill_niceness is not None else []
            prefill = stack.start("prefill", [*prefill_args, *engine])
            decode_addresses = [stack.wait_ready(child, "decode", 1, o.timeout)[0] for child in decoders]
            console.print(f"decode workers ready: {', '.join(decode_addresses)}")
            prefill_addresses = stack.wait_ready(prefill, "prefill", o.prefill_actors, o.timeout)
            console.print(f"prefill actors ready: {', '.join(prefill_addresses)}")
        gateway_args = ["gateway", "--host", o.host, "--port", str(o.port), *common]
        gateway_args += ["--decode-workers", ",".join(decode_addresses)]
        gateway_args += ["--prefill-workers", ",".join(prefill_addresses)]
        if o.local_threshold is not None:
            gateway_args += ["--local-threshold", str(o.local_threshold)]
        if o.chat_template is not None:
            gateway_args += ["--chat-template", os.path.abspath(o.chat_template)]
        with console.status("starting the gateway"):
            gateway = stack.start("gateway", gateway_args)
            stack._drain(gateway, announce=True)
            shown = "127.0.0.1" if o.host in ("0.0.0.0", "::") else o.host  # noqa: S104 -- a check, not a bind
            url = f"http://{shown}:{o.port}"
            wait_for_gateway(url, o.timeout, stop)
        print(f"READY gateway {url}", flush=True)
        auth = " -H 'Authorization: Bearer YOUR_KEY'" if o.api_keys else ""
        console.print(
            f"\n[bold]lazyserve is up[/bold] at {url}/v1 (Ctrl-C stops everything)\n\n"
            f"  in a browser: {url}/  (playground, compare, where the prompt went, the service)\n\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f'    -d \'{{"messages": [{{"role": "user", "content": "Say hello"}}], "max_tokens": 32}}\'\n\n'
            f"  metrics: {url}/metrics   health: {url}/health\n",
            highlight=False,
            soft_wrap=True,  # never wrapped at the console's width: the example must paste as it is
        )
        return stack.supervise(stop)
    except RuntimeError as error:
        console.print(f"[red]{error}")
        return 1
    finally:
        with console.status("stopping"):
            stack.stop()
        console.print("stopped")
