"""The compute thread: jobs in order on one thread, drivers between them, and the I/O-thread guard."""

from __future__ import annotations

import threading
import time

import pytest

from shared.compute import (
    ComputeThread,
    ComputeThreadError,
    computing_threads,
    forget_computing_threads,
    mark_io_thread,
    require_compute_thread,
)


@pytest.fixture
def compute():
    thread = ComputeThread("test-compute")
    yield thread
    thread.close()


def test_call_runs_on_the_thread_and_returns_or_raises(compute):
    assert compute.call(threading.get_ident) == compute.ident != threading.get_ident()
    with pytest.raises(KeyError, match="missing"):
        compute.call({}.__getitem__, "missing")
    # From the thread itself a call runs at once (a job that calls again must not wait on itself).
    assert compute.call(lambda: compute.call(lambda: 7)) == 7


def test_jobs_run_one_at_a_time_in_order(compute):
    seen, busy = [], []

    def job(i):
        busy.append(i)
        assert len(busy) == 1, busy
        time.sleep(0.001)
        seen.append(i)
        busy.pop()

    futures = [compute.submit(job, i) for i in range(50)]
    for future in futures:
        future.result(timeout=10)
    assert seen == list(range(50))


def test_a_driver_runs_between_jobs_and_sleeps_when_idle(compute):
    rounds, work = [], [3]

    def driver():
        rounds.append(threading.get_ident())
        if work[0] == 0:
            return None  # nothing to do: wait for a job
        work[0] -= 1
        return 0

    compute.drive(driver)
    deadline = time.monotonic() + 5
    while work[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert work[0] == 0 and set(rounds) == {compute.ident}
    idle = len(rounds)
    time.sleep(0.2)
    assert len(rounds) == idle  # idle: no busy loop
    work[0] = 1
    compute.call(lambda: None)  # a job wakes it; the driver runs again after it
    deadline = time.monotonic() + 5
    while work[0] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert work[0] == 0
    compute.undrive(driver)


def test_a_failing_driver_does_not_stop_the_thread(compute):
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("a bug in a round")

    compute.drive(broken)
    time.sleep(0.05)
    compute.undrive(broken)
    assert calls and compute.call(lambda: 1) == 1


def test_an_io_thread_is_refused_engine_work_and_others_are_recorded():
    # A new record: an ident is reused once its thread ends, and earlier tests' compute threads
    # have ended, so the I/O thread below may get the ident of one the old record holds.
    forget_computing_threads()
    errors, ident = [], []

    def io():
        mark_io_thread()
        try:
            require_compute_thread("a decode step")
        except ComputeThreadError as error:
            errors.append(str(error))
        ident.append(threading.get_ident())

    thread = threading.Thread(target=io, name="grpc-handler")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "a decode step ran on I/O thread 'grpc-handler'" in errors[0]
    assert ident[0] not in computing_threads()
    require_compute_thread("a prefill")
    assert threading.get_ident() in computing_threads()


def _spincount_after(code: str, env: dict) -> str:
    import os
    import subprocess
    import sys

    script = f"import os\n{code}\nprint(os.environ.get('GOMP_SPINCOUNT'))"
    environ = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"} | env
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=environ, timeout=120)
    assert out.returncode == 0, out.stderr[-1000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_cli_sets_the_openmp_spin_before_torch_loads_unless_the_environment_says():
    # The CLI's entry sets it first: every process `up`, Ray and the workers start inherits it.
    code = "from services import cli\ntry:\n    cli.main(['certs', '--help'])\nexcept SystemExit:\n    pass"
    assert _spincount_after(code, {}) == "10000"
    assert _spincount_after(code, {"GOMP_SPINCOUNT": "5"}) == "5"
