"""The compute thread: the one thread of a process that runs the engine's torch work.

Why there must be one. torch's CPU wheel runs its intra-op parallelism on GNU OpenMP (libgomp).
Every thread that enters a parallel region becomes the master of a team of its own, with a pool of
worker threads that lives as long as that thread. libgomp counts the threads it manages over all
pools (`gomp_managed_threads`, team.c), and while that count exceeds the CPUs the process may use,
an idle worker spins only `gomp_throttled_spin_count_var` (100) times before it sleeps on a futex
(`do_spin`, config/linux/wait.h): every parallel region then wakes its workers through the kernel.
A process whose main thread has run one parallel op (loading the weights does) and whose decode
loop runs on a second thread has crossed that line on a host with as many cores as torch threads;
GOMP_SPINCOUNT and OMP_WAIT_POLICY do not reach the throttled count. So: in each process one
thread loads the model and runs every torch op of the engine; the other threads (gRPC handlers,
stream readers, reapers) move bytes and hand it work through `call` / `submit`. The figures are in
docs/results.md ("One compute thread per process").

The guard: a thread marked as an I/O thread (`mark_io_thread`, the gRPC servers' pools do it for
each of their threads) that reaches an engine door (`require_compute_thread`) gets a
ComputeThreadError at once, instead of a silent slowdown.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

# A driver is a loop that runs between jobs: it does one round of work and says how long the
# thread may wait for the next job before it wants another round (None: until a job comes).
Driver = Callable[[], float | None]

_STOP = object()
_role = threading.local()


# libgomp's idle workers spin GOMP_SPINCOUNT pause loops (300,000 by default: milliseconds) after
# every parallel region before they sleep. Inside a step the next region comes within
# microseconds, which 10,000 spins cover; after a step, or a job of a process that mostly waits,
# a worker spinning for milliseconds takes a core from the host's other processes, such as the
# prefill actor beside a decode worker under `up` (docs/results.md, "One compute thread per process").
OPENMP_ENV = {"GOMP_SPINCOUNT": "10000"}


def openmp_env() -> dict[str, str]:
    """OPENMP_ENV, less what this process's environment sets otherwise: for a process to start."""
    return {name: os.environ.get(name, value) for name, value in OPENMP_ENV.items()}


def set_openmp_env() -> None:
    """Set OPENMP_ENV in this process, where the environment does not say otherwise. libgomp reads
    it once, when torch loads it: call this before anything imports torch."""
    if "torch" in sys.modules:
        log.warning("torch is loaded already: its OpenMP runtime keeps the settings it started with")
    for name, value in OPENMP_ENV.items():
        os.environ.setdefault(name, value)


class ComputeThreadError(RuntimeError):
    """Engine work reached from a thread that must only move bytes."""


def mark_io_thread() -> None:
    """Mark the calling thread as one that never computes (a gRPC server's pool initializer)."""
    _role.io = True


def require_compute_thread(what: str) -> None:
    """Refuse engine work on an I/O thread: there it would start a second OpenMP pool. Every
    thread that passes is remembered (`computing_threads`)."""
    if getattr(_role, "io", False):
        raise ComputeThreadError(
            f"{what} ran on I/O thread {threading.current_thread().name!r}; "
            "hand it to the process's ComputeThread (call/submit)"
        )
    _computing.add(threading.get_ident())


_computing: set[int] = set()


def computing_threads() -> set[int]:
    """The threads of this process that have run engine work (the doors that check) since the
    start or the last `forget_computing_threads`."""
    return set(_computing)


def forget_computing_threads() -> None:
    """Start a new record (a thread's ident is reused once it ends, so a record is read whole)."""
    _computing.clear()


class ComputeThread:
    """A thread that runs jobs one at a time, in order, and between them its drivers' rounds.
    OpenMP keeps torch's thread count per thread: set it with a job (`apply_threads`, load_engine)."""

    def __init__(self, name: str = "lazyserve-compute"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._drivers: list[Driver] = []
        self._ready = threading.Event()
        self.ident: int | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def is_current(self) -> bool:
        return threading.get_ident() == self.ident

    def submit(self, fn: Callable[..., T], /, *args, **kwargs) -> Future[T]:
        """Queue `fn(*args, **kwargs)`; its Future holds the result or the exception."""
        if not self._thread.is_alive():
            raise RuntimeError("the compute thread has stopped")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def call(self, fn: Callable[..., T], /, *args, **kwargs) -> T:
        """Run `fn` on this thread and return its result (at once when already on it)."""
        if self.is_current:
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def drive(self, driver: Driver) -> None:
        """Run `driver` between jobs from now on (a scheduler's rounds)."""
        self.call(self._drivers.append, driver)

    def undrive(self, driver: Driver) -> None:
        self.call(self._drivers.remove, driver)

    def close(self) -> None:
        """Stop after the jobs queued so far."""
        if self._thread.is_alive():
            self._jobs.put(_STOP)
            if not self.is_current:
                self._thread.join()

    def _serve(self) -> None:
        self.ident = threading.get_ident()
        self._ready.set()
        wait: float | None = None
        while True:
            try:
                job = self._jobs.get(timeout=wait) if wait != 0 else self._jobs.get_nowait()
            except queue.Empty:
                job = None
            if job is _STOP:
                return
            if job is not None:
                self._run(*job)
                wait = 0  # every queued job before the next round
                continue
            wait = self._rounds()

    def _rounds(self) -> float | None:
        waits = []
        for driver in list(self._drivers):
            try:
                waits.append(driver())
            except Exception:  # a driver's bug must not stop the thread every other caller waits on
                log.exception("a compute-thread driver failed")
                waits.append(0.01)
        timed = [w for w in waits if w is not None]
        return min(timed) if timed else None

    @staticmethod
    def _run(future: Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as error:  # handed to the caller, who raises it
            future.set_exception(error)
        else:
            future.set_result(result)
