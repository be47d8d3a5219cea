"""The decode worker's engine thread: every active sequence advances one step per round.

Only this thread touches the model. Sequences take turns (round-robin), so a long generation
never holds up another's steps; a local prefill (short prompts only, by the router's choice)
runs as one turn. Batching several sequences into one forward pass is not done: the steps are
interleaved, not fused.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

from shared.engine import Generation, LazyCache
from shared.rpc import ResourceExhausted

log = logging.getLogger(__name__)

TOKEN, DONE, FAILED = "token", "done", "failed"


@dataclass
class Sequence:
    request_id: str
    tokens: Iterator[int]  # a generator: one next() is one engine step
    generation: Generation
    cache: LazyCache | None = None  # known once prefilled; for the bytes-held figure
    outbox: queue.Queue = field(default_factory=queue.Queue)  # (TOKEN, id) ... then (DONE|FAILED, detail)
    cancelled: threading.Event = field(default_factory=threading.Event)


# Tokens a sequence may have made that its client has not taken yet. A slow reader pauses its
# own sequence here (its steps are skipped) instead of buffering without bound or holding the
# engine; the others keep their turns.
MAX_UNSENT_TOKENS = 256


class Scheduler:
    def __init__(self, max_sequences: int, max_unsent: int = MAX_UNSENT_TOKENS):
        self.max_sequences, self.max_unsent = max_sequences, max_unsent
        self.revived_token_layers = 0  # over finished sequences
        self._active: list[Sequence] = []
        self._lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
        self._thread.start()

    def submit(self, sequence: Sequence) -> None:
        with self._lock:
            if len(self._active) >= self.max_sequences:
                raise ResourceExhausted(f"this worker is generating {self.max_sequences} sequences already")
            self._active.append(sequence)
            self._lock.notify()

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    def bytes_held(self) -> int:
        with self._lock:
            caches = [s.cache for s in self._active if s.cache is not None]
        return sum(cache.kv_bytes + cache.aux_bytes for cache in caches)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._active and not self._stop:
                    self._lock.wait()
                if self._stop:
                    for sequence in self._active:
                        sequence.outbox.put((FAILED, "the decode worker is shutting down"))
                    return
                turn = list(self._active)
            ready = [s for s in turn if s.cancelled.is_set() or s.outbox.qsize() < self.max_unsent]
            if not ready:
                time.sleep(0.005)  # every client is behind: wait for one to read
            for sequence in ready:
                if not self._step(sequence):
                    with self._lock:
                        self._active.remove(sequence)

    def _step(self, sequence: Sequence) -> bool:
        """Advance one sequence by one token; False when it has finished."""
        if sequence.cancelled.is_set():
            sequence.tokens.close()  # runs the generator's finally: stats filled, nothing held
            sequence.outbox.put((DONE, "cancelled"))
            return False
        try:
            sequence.outbox.put((TOKEN, next(sequence.tokens)))
            return True
        except StopIteration:
            self.revived_token_layers += sequence.generation.stats.revived_token_layers
            sequence.outbox.put((DONE, sequence.generation.finish_reason))
        except Exception as error:  # a failed request must not stop the engine thread
            log.exception("sequence %s failed", sequence.request_id)
            sequence.outbox.put((FAILED, f"generation failed: {type(error).__name__}"))
        return False
