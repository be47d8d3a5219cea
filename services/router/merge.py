"""Several async iterators read as one: what a request with several streams of events needs
(a completions request's prompts, a broken request's migrating choices)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing


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
        except BaseException as error:  # handed to the consumer, which raises it
            await queue.put(error)
            raise
        await queue.put(done)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:  # a failure or a consumer gone: the other streams stop too
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
