"""What a request keeps so that its streams outlive their worker (NVIDIA Dynamo's request migration).

The gateway streams every generated token anyway; `Kept` holds each choice's ids and whether it
has finished, so that when its decode worker fails or drains after the first token, the
dispatcher can place a continuation (the prompt, the tokens so far, the same sampling) on a live
worker and the client's stream goes on without an error or a repeated token. `Broken` is such a
failure; `Migrations` continues one choice (within the limits, counted and traced).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc
from opentelemetry import trace

from services.router.client import Finished, Tokens, UpstreamError, WorkerFailed
from services.router.metrics import GatewayMetrics
from services.router.policy import NoWorkerError
from shared.api.serving import Prepared
from shared.net.rpc import DRAINING

log = logging.getLogger(__name__)

# Codes after which a choice goes on elsewhere: its worker went away (killed, restarting,
# draining) or broke. The request itself was fine; INVALID_ARGUMENT and the deadline end it.
MIGRATED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED}


class Broken(Exception):
    """An attempt's worker failed after the request's first token: its open choices may migrate."""

    def __init__(self, failure: WorkerFailed):
        super().__init__(str(failure))
        self.failure = failure
        self.at = time.monotonic()
        error = failure.error
        self.message = f"worker {failure.worker.address} failed: {error.code().name}: {error.details()}"
        # drained: the worker handed its streams over on purpose (SIGTERM, a rolling restart).
        self.reason = "drained" if (error.details() or "").startswith(DRAINING) else "failed"


class Kept:
    """Each choice's tokens streamed so far and whether it finished; a choice past `max_tokens`
    is no longer kept (its continuation would cost more than the bound allows)."""

    def __init__(self, choices: int, max_tokens: int):
        self.max_tokens = max_tokens
        self.tokens: list[list[int] | None] = [[] for _ in range(choices)]
        self.finished = [False] * choices

    def note(self, event) -> None:
        if isinstance(event, Tokens):
            kept = self.tokens[event.index]
            if kept is not None:
                kept.extend(event.ids)
                if len(kept) > self.max_tokens:
                    self.tokens[event.index] = None
        elif isinstance(event, Finished):
            self.finished[event.index] = True

    def unfinished(self) -> list[int]:
        return [index for index, finished in enumerate(self.finished) if not finished]


class Migrations:
    """How a broken request's choices go on: the limits, the metrics and the span events."""

    def __init__(self, metrics: GatewayMetrics, limit: int, max_tokens: int):
        self.metrics, self.limit, self.max_tokens = metrics, limit, max_tokens

    async def choice(
        self,
        attempts: Callable[[Prepared, str, list[int]], AsyncIterator],
        prepared: Prepared,
        index: int,
        kept: Kept,
        broken: Broken,
        request_id: str,
        parent,
    ) -> AsyncIterator:
        """Choice `index` continued on a live worker: its own parameters (n 1, seed + index), its
        tokens so far replayed there (`attempts(choice, request id, tokens)`: the dispatcher's
        placements), its events put back at its index; again after each failure, up to `limit`."""
        choice = dataclasses.replace(prepared, sampling=prepared.sampling.choices()[index])
        for migration in itertools.count(1):
            tokens = kept.tokens[index]
            if migration > self.limit or tokens is None:
                why = "kept too many tokens" if tokens is None else f"migrated {migration - 1} times already"
                raise UpstreamError(broken.message + ("" if self.limit == 0 else f"; not migrated again: it {why}"))
            self._count(broken, index, len(tokens), migration, request_id, parent)
            new = True
            try:
                async with aclosing(attempts(choice, f"{request_id}-c{index}-m{migration}", list(tokens))) as events:
                    async for event in events:
                        if isinstance(event, Tokens | Finished):
                            event = dataclasses.replace(event, index=index)
                            if new:
                                new = False
                                self.metrics.migration_gap.observe(time.monotonic() - broken.at)
                        kept.note(event)
                        yield event
                return
            except Broken as again:
                broken = again
            except (NoWorkerError, UpstreamError) as error:  # nowhere to go on: the first failure, and why
                raise UpstreamError(f"{broken.message}; its continuation failed: {error}") from None

    def _count(self, broken: Broken, index: int, tokens: int, migration: int, request_id: str, parent) -> None:
        log.warning(
            "request %s choice %d: %s after %d tokens; migrating (%d of at most %d)",
            request_id,
            index,
            broken.message,
            tokens,
            migration,
            self.limit,
        )
        self.metrics.migrations.labels(broken.reason).inc()
        self.metrics.migrated_tokens.inc(tokens)
        attributes = {
            "lazyserve.migration.reason": broken.reason,
            "lazyserve.migration.from": broken.failure.worker.address,
            "lazyserve.migration.choice": index,
            "lazyserve.migration.tokens": tokens,
            "lazyserve.migration.count": migration,
        }
        trace.get_current_span(parent).add_event("migration", attributes)
