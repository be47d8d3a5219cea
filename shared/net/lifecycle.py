"""Running a service in the foreground until SIGINT or SIGTERM, then stopping it cleanly; and, in a
process `lazyserve up` started, stopping when `up` is gone."""

from __future__ import annotations

import os
import signal
import threading
import time


def wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM; returns the signal number.

    Later signals are ignored from then on, so that a second Ctrl-C (or a supervisor forwarding
    the same signal to the whole process group) does not interrupt the clean shutdown.
    """
    received: list[int] = []
    stop = threading.Event()

    def handler(signum, frame):
        received.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    while not stop.wait(0.5):
        pass
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return received[0]


# The read end of a pipe whose write end only `lazyserve up` holds: when `up` is gone, however it
# went (SIGKILL included), the pipe reads EOF and the child stops itself and its process group.
LIFELINE_ENV = "LAZYSERVE_LIFELINE_FD"


def watch_lifeline(grace_s: float = 10.0) -> None:
    """In a process started by `lazyserve up`: stop when `up` is gone. SIGTERM to itself first (the
    usual clean stop); whatever is left of its process group (a local Ray) after `grace_s` is killed."""
    fd = os.environ.pop(LIFELINE_ENV, None)
    if fd is None:
        return

    def watch() -> None:
        try:
            while os.read(int(fd), 1):  # `up` never writes: this returns b"" when it is gone
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
