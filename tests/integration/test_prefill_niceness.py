"""The prefill actor's niceness (a priority between prefill and a decode loop on one host) holds
for every thread that computes: those there when the actor is ready and those a prefill starts
(gRPC handlers, torch's pool), on a real local Ray. Against other sessions (Linux's autogroups)
the prefill-worker command sets its session's value, and only as the session's leader."""

from __future__ import annotations

import os

import ray
from helpers import random_ids

from services.prefill.actor import actor_addresses, autogroup_niceness, launch_prefill_actors
from services.prefill.settings import PrefillSettings
from services.router.client import PrefillClient, run_disaggregated
from shared.engine import OFF, SamplingParams, generate
from shared.settings import EngineSettings


def _thread_niceness(pid: int) -> dict[int, int]:
    return {int(tid): os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def test_every_thread_of_the_actor_runs_at_its_niceness(local_ray, tiny_llama, decode_worker):
    # 17: above Ray's 15, so no privilege is needed to set it wherever the test runs.
    settings = PrefillSettings(engine=EngineSettings(model="tiny-llama", threads=2), num_cpus=0.5, niceness=17)
    [actor] = launch_prefill_actors(settings)
    try:
        pid = ray.get(actor.pid.remote())
        ready = _thread_niceness(pid)
        assert set(ready.values()) == {17}, ready
        assert autogroup_niceness(pid) == autogroup_niceness()  # the actor leaves its session's alone
        _, decode = decode_worker(tiny_llama)
        ids = random_ids(tiny_llama, 300)
        params = SamplingParams(max_new_tokens=4)
        result = run_disaggregated(PrefillClient(actor_addresses([actor])[0]), decode, ids, OFF, params)
        assert result.tokens == generate(tiny_llama.engine, ids, OFF, params).tokens
        after = _thread_niceness(pid)
        assert set(after) - set(ready), "the prefill started no thread: the inheritance is not exercised"
        assert set(after.values()) == {17}, after
    finally:
        ray.kill(actor)


def test_only_a_session_leader_sets_its_sessions_niceness():
    """A process inside another's session (a test, a driver hosting actors) leaves the session's
    priority alone; one in a session of its own (the prefill-worker command under up) sets it."""
    import subprocess
    import sys

    code = (
        "from services.prefill.actor import autogroup_niceness as a, set_session_niceness as s;"
        "before = a(); took = s(9); print(took, before, a())"
    )
    inside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert inside.returncode == 0, inside.stderr
    took, before, after = inside.stdout.split()
    assert took == "False" and after == before
    alone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, start_new_session=True)
    assert alone.returncode == 0, alone.stderr
    took, _, after = alone.stdout.split()
    assert (took, after) in (("True", "9"), ("False", "None"))  # None: a kernel without autogroups
