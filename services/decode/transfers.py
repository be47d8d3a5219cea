"""Transfers a decode worker holds: receiving, then ready until Generate claims them.

Each transfer has a lease. One still receiving past transfer_timeout_s, or complete but not
claimed within claim_timeout_s, is dropped by the reaper thread, and its memory with it: a sender
that stalls or a router that never calls Generate cannot strand KV here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from shared.net.rpc import AlreadyExists, DeadlineExceeded, NotFound, ResourceExhausted
from shared.transfer import Assembled, TransferAssembler


@dataclass
class Transfer:
    transfer_id: str
    assembler: TransferAssembler | None
    deadline: float
    assembled: Assembled | None = None
    expired: bool = False
    bytes_received: int = 0  # tensor payload

    @property
    def nbytes(self) -> int:
        if self.assembled is not None:
            return self.assembled.cache.kv_bytes + self.assembled.cache.aux_bytes
        return 0 if self.assembler is None else self.assembler.nbytes


@dataclass
class Counters:
    completed: int = 0
    rejected: int = 0
    expired: int = 0


class TransferTable:
    def __init__(self, max_transfers: int, transfer_timeout_s: float, claim_timeout_s: float, period_s: float = 0.2):
        self.max_transfers = max_transfers
        self.transfer_timeout_s, self.claim_timeout_s = transfer_timeout_s, claim_timeout_s
        self.counters = Counters()
        self._transfers: dict[str, Transfer] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, args=(period_s,), name="transfer-reaper", daemon=True)
        self._reaper.start()

    def begin(self, transfer_id: str, assembler: TransferAssembler) -> Transfer:
        with self._lock:
            if transfer_id in self._transfers:
                raise AlreadyExists(f"transfer {transfer_id!r} is already open on this worker")
            if len(self._transfers) >= self.max_transfers:
                raise ResourceExhausted(f"this worker holds {self.max_transfers} transfers already")
            transfer = Transfer(transfer_id, assembler, time.monotonic() + self.transfer_timeout_s)
            self._transfers[transfer_id] = transfer
            return transfer

    def check_alive(self, transfer: Transfer) -> None:
        if transfer.expired:
            raise DeadlineExceeded(
                f"transfer {transfer.transfer_id!r} did not complete within {self.transfer_timeout_s} s"
            )

    def complete(self, transfer: Transfer, assembled: Assembled) -> None:
        with self._lock:
            self.check_alive(transfer)
            transfer.assembler, transfer.assembled = None, assembled
            transfer.deadline = time.monotonic() + self.claim_timeout_s
            self.counters.completed += 1

    def fail(self, transfer: Transfer) -> None:
        """Drop a transfer that was refused or cut off."""
        with self._lock:
            if self._transfers.get(transfer.transfer_id) is transfer:
                del self._transfers[transfer.transfer_id]
                self.counters.rejected += 1
            transfer.assembler = None

    def count_refused(self) -> None:
        """A transfer refused at its header, before it held anything."""
        with self._lock:
            self.counters.rejected += 1

    def claim(self, transfer_id: str) -> Assembled:
        with self._lock:
            transfer = self._transfers.get(transfer_id)
            if transfer is None:
                raise NotFound(f"no transfer {transfer_id!r} on this worker (never sent, expired, or claimed)")
            if transfer.assembled is None:
                raise NotFound(f"transfer {transfer_id!r} is still being received")
            del self._transfers[transfer_id]
            return transfer.assembled

    def snapshot(self) -> tuple[int, int, int]:
        """(receiving, ready, bytes held)."""
        with self._lock:
            transfers = list(self._transfers.values())
        ready = sum(t.assembled is not None for t in transfers)
        return len(transfers) - ready, ready, sum(t.nbytes for t in transfers)

    def close(self) -> None:
        self._stop.set()
        self._reaper.join()

    def _reap(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            now = time.monotonic()
            with self._lock:
                for transfer_id, transfer in list(self._transfers.items()):
                    if transfer.deadline < now:
                        del self._transfers[transfer_id]
                        # The receiving handler, if any, sees this on its next message and stops.
                        transfer.expired, transfer.assembler, transfer.assembled = True, None, None
                        self.counters.expired += 1
