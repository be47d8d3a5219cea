"""`lazyserve up` as a supervisor: a dead worker is routed around and restarted, and when `up` is
SIGKILLed its children stop themselves (the lifeline pipe), leaving no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import openai
import pytest
from conftest import Up, children_of, kill_sessions, session_members, wait_for


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ")


@pytest.mark.starts_ray
@pytest.mark.slow
def test_up_restarts_a_dead_worker_and_its_children_die_with_it():
    up = Up("--model", "tiny-llama", "--threads", "1", "--decode-workers", "2", "--local-threshold", "100")
    lines, console = up.lines, up.console  # READY / RESTARTED lines; what a person sees, the example among it
    sessions: set[int] = set()
    try:
        up.wait_ready(timeout=240)
        sessions = up.sessions
        assert len(sessions) == 4  # two decode workers, the prefill worker with its Ray, the gateway
        # The example `up` prints works when pasted into a shell as it is.
        assert wait_for(lambda: any(line.lstrip().startswith("-d ") for line in console), timeout=10), console
        start = next(i for i, line in enumerate(console) if line.lstrip().startswith("curl "))
        example = "".join(console[start : start + 2])
        pasted = subprocess.run(["bash", "-c", example], capture_output=True, text=True, timeout=120)
        assert json.loads(pasted.stdout)["object"] == "chat.completion", (example, pasted.stdout, pasted.stderr)
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="none", max_retries=0)

        def ask() -> int:
            return client.completions.create(model="tiny-llama", prompt=[5, 6, 7], max_tokens=2).usage.completion_tokens

        decode_0 = up.decode_pid(0)
        os.killpg(decode_0, signal.SIGKILL)
        # While it is down, requests are routed around it (a failed first attempt is retried).
        assert [ask() for _ in range(6)] == [2] * 6
        assert wait_for(lambda: "RESTARTED decode-0\n" in lines, timeout=90), lines
        assert [ask() for _ in range(4)] == [2] * 4
        sessions = children_of(up.pid)  # the restarted worker is a new session
        assert len(sessions) == 4
        os.kill(up.pid, signal.SIGKILL)  # no chance to clean up: the children must notice by themselves
        up.process.wait(timeout=10)
        assert wait_for(lambda: not session_members(sessions), timeout=40), [
            _cmdline(p) for p in session_members(sessions)
        ]
    finally:
        up.process.kill()
        kill_sessions(sessions)
