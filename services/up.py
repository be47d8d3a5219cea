"""`lazyserve up`: the whole system on one host, with one command, supervised.

Starts decode workers, prefill actors on a local Ray (the prefill-worker command starts Ray) and
the gateway over them, each as its own process running its own `lazyserve` subcommand, with the
embedded defaults: the static worker list, no Redis. Waits for each to be ready (with progress),
prints the URL and an example request, then supervises:
- a child that dies is started again on the same port, after a backoff that doubles from 1 s to
  30 s; meanwhile the gateway routes around a dead worker (a request that fails on it before its
  first token is retried on another). Too many restarts in a row (5 within 5 minutes) stop the
  stack and `up` exits 1;
- on SIGHUP it restarts every decode worker, one at a time (a rolling restart: a new setting, a
  new build): each drains (SIGTERM: no new request, its streams' grace period, then the rest
  handed to the gateway, which continues them on another worker) and is started again, and the
  next one goes only once it is ready;
- on Ctrl-C or SIGTERM every child stops, process group and all (a child's local Ray too);
- if `up` itself dies, even by SIGKILL, each child sees its lifeline pipe close and stops itself
  (shared.net.lifecycle.watch_lifeline), so nothing is left holding the ports.
"""

from __future__ import annotations

import os
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from rich.console import Console

from services.decode.settings import DecodeSettings
from services.options import Option, engine_options, environment, fields_of, of
from services.prefill.settings import PrefillSettings
from services.router.settings import GatewaySettings
from shared.net.lifecycle import LIFELINE_ENV
from shared.settings import EngineSettings

console = Console(stderr=True)

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
MAX_RESTARTS, RESTART_WINDOW_S = 5, 300.0


@dataclass(eq=False)
class Child:
    name: str
    command: str
    env: dict[str, str]  # its own settings, over the stack's
    process: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)  # when each restart happened
    restart_at: float | None = None  # scheduled restart, while it is down
    ready: bool = False  # came up once: a READY line from now on is a restart's
    lines: queue.Queue = field(default_factory=queue.Queue)  # this run's stdout until ready; None: it exited


class Stack:
    """The children of `up`: each a `lazyserve` subcommand whose settings come from its environment."""

    def __init__(self, env: dict[str, str]):
        self.children: list[Child] = []
        # Internal gRPC calls need this token: only processes of this stack can reach the workers.
        self.token = os.environ.get("LAZYSERVE_INTERNAL_TOKEN") or secrets.token_urlsafe(24)
        self.env = {**os.environ, "LAZYSERVE_INTERNAL_TOKEN": self.token, **env}
        # Children hold the read end; only this process holds the write end.
        self._lifeline, self._lifeline_w = os.pipe()
        self.program = [sys.executable, "-m", "services.cli"]  # a child runs PROGRAM COMMAND

    @property
    def processes(self) -> list[tuple[str, subprocess.Popen]]:
        return [(child.name, child.process) for child in self.children if child.process is not None]

    def start(self, name: str, command: str, values: dict[Option, object]) -> Child:
        """Start `lazyserve COMMAND` with these options in its environment."""
        child = Child(name, command, environment(values))
        self.children.append(child)
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> None:
        # Own session: Ctrl-C in the terminal reaches only `up`, which stops the children in order.
        child.process = subprocess.Popen(  # noqa: S603 -- this interpreter running our own CLI, no shell
            [*self.program, child.command],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            pass_fds=(self._lifeline,),
            env={**self.env, **child.env, LIFELINE_ENV: str(self._lifeline)},
        )
        child.lines = queue.Queue()
        threading.Thread(target=self._read, args=(child, child.process, child.lines), daemon=True).start()

    def wait_ready(self, child: Child, kind: str, count: int, timeout: float) -> list[str]:
        """The addresses in the child's first `count` READY lines, waited for until `timeout` even
        while it prints nothing (a prefill worker whose actors Ray cannot place); an error if it
        exits or the time runs out first. Later READY lines announce a restart."""
        addresses: list[str] = []
        deadline = time.monotonic() + timeout
        while len(addresses) < count:
            try:
                line = child.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{child.name} did not become ready in {timeout:.0f} s; see its log above") from None
            if line is None:  # its stdout closed: it exited
                try:
                    code = child.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    code = None
                raise RuntimeError(f"{child.name} exited ({code}) before it was ready; see its log above")
            match = re.match(rf"READY {kind} (\S+)", line)
            if match:
                addresses.append(match.group(1))
        child.ready = True
        return addresses

    def _read(self, child: Child, process: subprocess.Popen, lines: queue.Queue) -> None:
        """Read a child's stdout as it comes, so it never blocks on a full pipe: lines for
        wait_ready until it is ready; after that a READY line says it is back from a restart."""
        for line in process.stdout:
            if child.ready and line.startswith("READY"):
                console.print(f"[green]{child.name} is back: {line.strip()}")
                print(f"RESTARTED {child.name}", flush=True)
            elif not child.ready:
                lines.put(line)
        lines.put(None)

    def supervise(self, stop: threading.Event, roll: threading.Event | None = None) -> int:
        """Restart children that die, until asked to stop (0) or restarts keep failing (1); a
        rolling restart of the decode workers whenever `roll` is set."""
        while not stop.wait(0.25):
            if roll is not None and roll.is_set():
                roll.clear()
                self.roll("decode-worker", "decode", stop)
            now = time.monotonic()
            for child in self.children:
                if child.restart_at is not None:
                    if now >= child.restart_at:
                        child.restart_at = None
                        child.restarts.append(now)
                        console.print(f"[yellow]restarting {child.name} (restart {len(child.restarts)})")
                        self._spawn(child)  # ready already: its READY line announces it
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

    def roll(self, command: str, kind: str, stop: threading.Event, timeout: float = 600.0) -> None:
        """Restart the running children of `command` one at a time, each drained by SIGTERM and
        waited for until ready before the next. One that does not come back is left to the
        supervisor's restarts."""
        for child in [c for c in self.children if c.command == command and c.restart_at is None]:
            if stop.is_set():
                return
            console.print(f"[yellow]rolling restart: draining {child.name}")
            started = time.monotonic()
            _signal_group(child.process, signal.SIGTERM)
            try:
                child.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                console.print(f"[red]{child.name} did not drain in {timeout:.0f} s: killed")
            _signal_group(child.process, signal.SIGKILL)
            child.process.wait()
            drained = time.monotonic() - started
            child.ready = False  # its READY line is this wait's, not a supervisor's restart
            self._spawn(child)
            try:
                address = self.wait_ready(child, kind, 1, timeout)[0]
            except RuntimeError as error:
                console.print(f"[red]rolling restart: {error}")
                child.ready = True  # left to the supervisor, whose restart it will announce
                continue
            console.print(f"[green]{child.name} is back on {address} (drained in {drained:.1f} s)")
            print(f"RESTARTED {child.name} drained_s={drained:.2f}", flush=True)
        print("ROLLED", flush=True)

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


class UpSettings(BaseSettings):
    """What `up` itself decides: how many workers it starts and on which ports. Everything else is
    the services' own settings, handed to each child through its environment (services.options)."""

    model_config = SettingsConfigDict(env_prefix="LAZYSERVE_UP_", extra="ignore")

    decode_workers: int = Field(1, ge=1, description="decode worker processes")
    decode_port: int = Field(50061, ge=1, le=65535, description="the first decode worker's port (then +1 each)")
    prefill_actors: int = Field(1, ge=1, description="prefill actors on the local Ray")
    prefill_port: int = Field(50071, ge=1, le=65535, description="the first prefill actor's port (then +1 each)")
    timeout_s: float = Field(600.0, gt=0, description="how long each process may take to become ready")


# `up`'s flags: the engine's go to every process; the gateway's, the prefill actors' and its own.
UP_OPTIONS = [
    *engine_options(
        "model",
        "threads",
        "dtype",
        "enable_prefix_caching",
        "prefix_cache_bytes",
        "batch_invariant",
        "kernels",
        "chat_template",
        pruning_flag="--pruning",
    ),
    Option(EngineSettings, "ttft_slo_s", "--ttft-slo"),
    Option(EngineSettings, "itl_slo_s", "--itl-slo"),
    Option(GatewaySettings, "host"),
    Option(GatewaySettings, "port"),
    Option(GatewaySettings, "api_keys", "--api-key", repeat=True),
    Option(GatewaySettings, "local_threshold"),
    Option(GatewaySettings, "route_by_wait"),
    Option(PrefillSettings, "niceness", "--prefill-niceness"),
    Option(DecodeSettings, "prefill_growth"),
    Option(DecodeSettings, "drain_seconds"),
    Option(GatewaySettings, "migration_limit"),
    *(Option(UpSettings, field) for field in ("decode_workers", "decode_port", "prefill_actors", "prefill_port")),
]


def up(values: dict[Option, object]) -> int:
    """Start the stack with these options (services.options.given) and supervise it."""
    plan = UpSettings(**fields_of(values, UpSettings))
    gateway_values = of(values, GatewaySettings)
    gateway = GatewaySettings(**fields_of(values, GatewaySettings))
    stack = Stack(environment(of(values, EngineSettings)))  # every process: all agree on the engine
    stop, roll = threading.Event(), threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: roll.set())
    try:
        with console.status("starting decode workers and prefill actors (the first start converts the model, ~30 s)"):
            decoders = [
                stack.start(
                    f"decode-{i}",
                    "decode-worker",
                    {**of(values, DecodeSettings), Option(DecodeSettings, "port"): plan.decode_port + i},
                )
                for i in range(plan.decode_workers)
            ]
            prefill_values = {
                Option(PrefillSettings, "port"): plan.prefill_port,
                Option(PrefillSettings, "num_actors"): plan.prefill_actors,
                **of(values, PrefillSettings),
            }
            prefill = stack.start("prefill", "prefill-worker", prefill_values)
            decode_addresses = [stack.wait_ready(child, "decode", 1, plan.timeout_s)[0] for child in decoders]
            console.print(f"decode workers ready: {', '.join(decode_addresses)}")
            prefill_addresses = stack.wait_ready(prefill, "prefill", plan.prefill_actors, plan.timeout_s)
            console.print(f"prefill actors ready: {', '.join(prefill_addresses)}")
        gateway_values[Option(GatewaySettings, "decode_workers")] = decode_addresses
        gateway_values[Option(GatewaySettings, "prefill_workers")] = prefill_addresses
        with console.status("starting the gateway"):
            child = stack.start("gateway", "gateway", gateway_values)
            child.ready = True  # it prints no READY line: /ready says
            host = gateway.host
            shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host  # noqa: S104 -- a check, not a bind
            url = f"http://{shown}:{gateway.port}"
            wait_for_gateway(url, plan.timeout_s, stop)
        print(f"READY gateway {url}", flush=True)
        auth = " -H 'Authorization: Bearer YOUR_KEY'" if gateway.api_keys else ""
        console.print(
            f"\n[bold]lazyserve is up[/bold] at {url}/v1 (Ctrl-C stops everything)\n\n"
            f"  in a browser: {url}/  (playground, compare, where the prompt went, the service)\n\n"
            f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
            f'    -d \'{{"messages": [{{"role": "user", "content": "Say hello"}}], "max_tokens": 32}}\'\n\n'
            f"  metrics: {url}/metrics   health: {url}/health\n"
            f"  rolling restart of the decode workers: kill -HUP {os.getpid()}\n",
            highlight=False,
            soft_wrap=True,  # never wrapped at the console's width: the example must paste as it is
        )
        return stack.supervise(stop, roll)
    except RuntimeError as error:
        console.print(f"[red]{error}")
        return 1
    finally:
        with console.status("stopping"):
            stack.stop()
        console.print("stopped")
