"""`lazyserve up` as a supervisor: a dead worker is routed around and restarted, and when `up` is
SIGKILLed its children stop themselves (the lifeline pipe), leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import openai
import pytest
from conftest import child_given, children_of, free_port, kill_sessions, session_members, wait_for


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ")


@pytest.mark.starts_ray
@pytest.mark.slow
def test_up_restarts_a_dead_worker_and_its_children_die_with_it():
    port, decode_port, prefill_port = free_port(), free_port(), free_port()
    args = ["up", "--model", "tiny-llama", "--threads", "1", "--port", str(port), "--decode-workers", "2"]
    args += ["--decode-port", str(decode_port), "--prefill-port", str(prefill_port), "--local-threshold", "100"]
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines: list[str] = []  # stdout: READY / RESTARTED lines
    console: list[str] = []  # stderr: what a person sees, the example to paste among it
    threading.Thread(target=lambda: [lines.append(line) for line in up.stdout], daemon=True).start()
    threading.Thread(target=lambda: [console.append(line) for line in up.stderr], daemon=True).start()
    sessions: set[int] = set()
    try:
        assert wait_for(lambda: any(line.startswith("READY gateway") for line in lines), timeout=240), lines
        sessions = children_of(up.pid)
        assert len(sessions) == 4  # two decode workers, the prefill worker with its Ray, the gateway
        # The example `up` prints works when pasted into a shell as it is.
        assert wait_for(lambda: any(line.lstrip().startswith("-d ") for line in console), timeout=10), console
        start = next(i for i, line in enumerate(console) if line.lstrip().startswith("curl "))
        example = "".join(console[start : start + 2])
        pasted = subprocess.run(["bash", "-c", example], capture_output=True, text=True, timeout=120)
        assert json.loads(pasted.stdout)["object"] == "chat.completion", (example, pasted.stdout, pasted.stderr)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)

        def ask() -> int:
            return client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=2).usage.completion_tokens

        decode_0 = child_given(sessions, "LAZYSERVE_DECODE_PORT", decode_port)
        os.killpg(decode_0, signal.SIGKILL)
        # While it is down, requests are routed around it (a failed first attempt is retried).
        assert [ask() for _ in range(6)] == [2] * 6
        assert wait_for(lambda: "RESTARTED decode-0\n" in lines, timeout=90), lines
        assert [ask() for _ in range(4)] == [2] * 4
        sessions = children_of(up.pid)  # the restarted worker is a new session
        assert len(sessions) == 4
        os.kill(up.pid, signal.SIGKILL)  # no chance to clean up: the children must notice by themselves
        up.wait(timeout=10)
        assert wait_for(lambda: not session_members(sessions), timeout=40), [
            _cmdline(p) for p in session_members(sessions)
        ]
    finally:
        up.kill()
        kill_sessions(sessions)
