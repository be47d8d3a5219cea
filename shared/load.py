"""What a worker reports of its prefill load, for the router to predict where a prompt starts soonest.

A worker's prefill rate is full-model prompt tokens (token-layers computed / the model's layers)
per second of wall time while it had prompts to prefill, over its last `window_s` busy seconds.
The router keeps each worker's queue in the same unit (prompt tokens x the schedule's computed
fraction, services.router.policy), so queue / rate is the predicted wait. Wall time, not compute
time: a decode worker's rounds also run decode steps, and a prefill actor shares the host's cores;
the rate is what a prompt sent there actually got.
"""

from __future__ import annotations

import threading
from collections import deque


class PrefillRate:
    """Busy intervals and the work done in them, over a sliding window of busy time."""

    def __init__(self, num_layers: int, window_s: float = 30.0):
        self.num_layers, self.window_s = num_layers, window_s
        self._spans: deque[tuple[int, float]] = deque()  # (token-layers, busy seconds)
        self._token_layers, self._busy_s = 0, 0.0
        self._lock = threading.Lock()  # added on the compute thread, read by gRPC handlers

    def add(self, token_layers: int, busy_s: float) -> None:
        """`token_layers` computed in `busy_s` seconds of wall time with prefill work waiting."""
        if busy_s <= 0:
            return
        with self._lock:
            self._spans.append((token_layers, busy_s))
            self._token_layers += token_layers
            self._busy_s += busy_s
            while len(self._spans) > 1 and self._busy_s - self._spans[0][1] >= self.window_s:
                done, spent = self._spans.popleft()
                self._token_layers -= done
                self._busy_s -= spent

    @property
    def tokens_per_s(self) -> float:
        """Full-model prompt tokens a second; 0.0 before anything was measured."""
        with self._lock:
            if self._busy_s <= 0:
                return 0.0
            return self._token_layers / self.num_layers / self._busy_s
