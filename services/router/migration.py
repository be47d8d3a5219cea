"""What a request keeps so that its streams outlive their worker (NVIDIA Dynamo's request migration).

The gateway streams every generated token anyway; `Kept` holds each choice's ids and whether it
has finished, so that when its decode worker fails or drains after the first token, the
dispatcher can place a continuation (the prompt, the tokens so far, the same sampling) on a live
worker and the client's stream goes on without an error or a repeated token. `Broken` is such a
failure; `merged` runs the continuations of several choices side by side.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc

from services.router.client import Finished, Tokens, WorkerFailed
from shared.net.rpc import DRAINING

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


async def merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """The events of several async iterators as they come. The first failure ends them all and is
    raised; leaving early (or being cancelled) closes every one, which cancels their calls."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async with aclosing(stream) as events:
                async for event in events:
                    await queue.put(event)
        except Exception as error:  # handed to the consumer, which raises it
            await queue.put(error)
            return
        await queue.put(done)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
