"""Running a service in the foreground until SIGINT or SIGTERM, then stopping it cleanly."""

from __future__ import annotations

import signal
import threading


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
