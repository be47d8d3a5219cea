"""The admission queue and placement by room, without servers: scripted takes and attempts, so
each rule (turns, blocking, deadlines, leaving, a full worker) is met exactly where it is about."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.router.admission import AdmissionQueue, Full, QueueTimeout
from services.router.client import Finished, Tokens, UpstreamError, WorkerFailed
from services.router.dispatch import Dispatcher
from services.router.metrics import GatewayMetrics
from services.router.policy import LengthAwarePolicy
from services.router.workers import SEQUENCES, StaticWorkers
from shared.api.serving import Prepared, RequestError
from shared.contract import OFF, ModelSpec, SamplingParams, Stats
from shared.models.text import TextModel
from shared.net.registry import WorkerInfo

MODEL = "m"


class Pool:
    """`size` units to take; a take raises Full("workers") when none is left, or Full("caller")
    when its caller already holds `per_caller`."""

    def __init__(self, size: int, per_caller: int = 1_000):
        self.free, self.per_caller = size, per_caller
        self.held: dict[str, int] = {}
        self.order: list[str] = []

    def taker(self, caller: str, name: str):
        async def take():
            await asyncio.sleep(0)  # a take awaits (Redis, in a thread): others may run meanwhile
            if self.held.get(caller, 0) >= self.per_caller:
                raise Full("caller", f"{caller} holds {self.per_caller}")
            if self.free == 0:
                raise Full("workers", "no room")
            self.free -= 1
            self.held[caller] = self.held.get(caller, 0) + 1
            self.order.append(name)
            return name

        return take

    def undo(self, caller: str):
        def give_back(_):
            self.free += 1
            self.held[caller] -= 1

        return give_back

    def give_back(self, queue: AdmissionQueue, caller: str) -> None:
        self.undo(caller)(None)
        queue.wake()


def _queue(max_queued: int = 100) -> AdmissionQueue:
    return AdmissionQueue(GatewayMetrics(), max_queued, poll_s=0.05)


def test_waiters_take_turns_between_callers_and_keep_their_order_within_one():
    async def main():
        queue, pool = _queue(), Pool(1)
        deadline = time.monotonic() + 10
        first = await queue.take("a", pool.taker("a", "a0"), pool.undo("a"), deadline)
        waiting = [
            asyncio.create_task(queue.take(caller, pool.taker(caller, name), pool.undo(caller), deadline))
            for caller, name in [("a", "a1"), ("a", "a2"), ("a", "a3"), ("b", "b1"), ("c", "c1"), ("b", "b2")]
        ]
        await asyncio.sleep(0.01)
        assert queue.depth == 6
        names = [first]
        for _ in waiting:  # one unit: each finishes, the next in turn gets it
            pool.give_back(queue, names[-1][0])
            done, _ = await asyncio.wait([t for t in waiting if not t.done()], return_when=asyncio.FIRST_COMPLETED)
            names.append(done.pop().result())
        return names, queue.depth

    names, depth = asyncio.run(main())
    # a's second request waits one turn after every other caller's first: a1 b1 c1, then a2 b2, then a3.
    assert names == ["a0", "a1", "b1", "c1", "a2", "b2", "a3"] and depth == 0


def test_no_room_holds_everyone_behind_but_a_callers_own_bound_lets_others_pass():
    async def main():
        queue, pool = _queue(), Pool(2, per_caller=1)
        deadline = time.monotonic() + 10
        assert await queue.take("a", pool.taker("a", "a0"), pool.undo("a"), deadline) == "a0"
        a1 = asyncio.create_task(queue.take("a", pool.taker("a", "a1"), pool.undo("a"), deadline))
        b1 = asyncio.create_task(queue.take("b", pool.taker("b", "b1"), pool.undo("b"), deadline))
        # a is at its bound: a1 waits and b1, behind it, passes.
        assert await asyncio.wait_for(b1, 5) == "b1" and not a1.done()
        c1 = asyncio.create_task(queue.take("c", pool.taker("c", "c1"), pool.undo("c"), deadline))
        await asyncio.sleep(0.2)
        assert not c1.done()  # no room: c1 waits
        pool.give_back(queue, "a")  # a gives back: a1 (the older waiter) gets the room, not c1
        assert await asyncio.wait_for(a1, 5) == "a1"
        await asyncio.sleep(0.1)
        assert not c1.done()
        pool.give_back(queue, "b")
        return await asyncio.wait_for(c1, 5)

    assert asyncio.run(main()) == "c1"


def test_a_deadline_in_the_queue_says_how_long_it_waited_and_leaves_nothing_held():
    async def main():
        queue, pool = _queue(), Pool(1)
        await queue.take("a", pool.taker("a", "a0"), pool.undo("a"), time.monotonic() + 10)
        with pytest.raises(QueueTimeout, match=r"waited 0\.[0-9] s in the queue .*\(no room\)"):
            await queue.take("b", pool.taker("b", "b1"), pool.undo("b"), time.monotonic() + 0.3)
        return queue.depth, pool.free, queue.metrics.rejections.labels("deadline")._value.get()

    assert asyncio.run(main()) == (0, 0, 1)


def test_a_waiter_that_leaves_holds_nothing_even_when_granted_as_it_left():
    async def main():
        queue, pool = _queue(), Pool(1)
        deadline = time.monotonic() + 10
        await queue.take("a", pool.taker("a", "a0"), pool.undo("a"), deadline)
        gone = asyncio.create_task(queue.take("b", pool.taker("b", "b1"), pool.undo("b"), deadline))
        await asyncio.sleep(0.01)
        gone.cancel()  # the client went away while waiting
        await asyncio.gather(gone, return_exceptions=True)
        assert queue.depth == 0
        pool.give_back(queue, "a")
        await asyncio.sleep(0.1)
        assert pool.free == 1  # nobody took the room for the waiter that left
        # Granted in the same turn of the loop as its cancellation: the grant is given back.
        pool.free = 0
        racing = asyncio.create_task(queue.take("c", pool.taker("c", "c1"), pool.undo("c"), deadline))
        await asyncio.sleep(0.01)
        pool.free = 1
        queue.wake()
        while pool.free:  # the serving task takes it for c1 ...
            await asyncio.sleep(0)
        racing.cancel()  # ... and c1 leaves before it resumes
        await asyncio.gather(racing, return_exceptions=True)
        await asyncio.sleep(0.1)  # the undo runs in a thread
        return pool.free

    assert asyncio.run(main()) == 1


def test_a_full_queue_is_429():
    async def main():
        queue, pool = _queue(max_queued=1), Pool(0)
        waiter = asyncio.create_task(queue.take("a", pool.taker("a", "a1"), pool.undo("a"), time.monotonic() + 10))
        await asyncio.sleep(0.01)
        with pytest.raises(RequestError) as refused:
            queue.check_room()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        queue.check_room()  # room again
        return refused.value

    refused = asyncio.run(main())
    assert refused.status_code == 429 and "1 requests are waiting" in refused.message


# ---------------------------------------------------------------------- placement by room


class Held:
    """Attempts that hold their worker until `release` is set; plan[n]: a failure code for attempt n, or None."""

    def __init__(self, *plan):
        self.plan, self.calls = list(plan), []
        self.release = asyncio.Event()

    async def __call__(self, channels, decode, prefill, ids, pruning, sampling, *_, **__):
        failure = self.plan[len(self.calls)] if len(self.calls) < len(self.plan) else None
        self.calls.append(decode.worker_id)
        if failure is not None:
            raise WorkerFailed(decode, grpc.aio.AioRpcError(failure, grpc.aio.Metadata(), grpc.aio.Metadata(), "x"))
        for index in range(sampling.n):
            yield Tokens([7], index=index)
        await self.release.wait()
        for index in range(sampling.n):
            yield Finished("length", Stats(completion_tokens=1), index)


def _dispatcher(attempt, capacity: int = 2, decoders: int = 1) -> Dispatcher:
    infos = [WorkerInfo(worker_id=f"d{i}", role="decode", address=f"d{i}:1", model=MODEL) for i in range(decoders)]
    workers = StaticWorkers(infos, ask_capacity=lambda worker: capacity)
    text = TextModel(MODEL, None, ModelSpec("llama", 2, 8, 2, 2, 4, 100, 64), ())
    queue = AdmissionQueue(GatewayMetrics(), 100, poll_s=0.05)
    return Dispatcher(workers, LengthAwarePolicy(1000), text, queue.metrics, 1, attempt=attempt, queue=queue)


def _prepared(n: int = 1) -> Prepared:
    return Prepared([1, 2, 3], SamplingParams(max_new_tokens=4, n=n), OFF, "off", [])


async def _first_token(dispatcher: Dispatcher, prepared: Prepared, caller: str = "c"):
    events = dispatcher.run(prepared, "r", time.monotonic() + 30, caller=caller)
    async for event in events:
        if isinstance(event, Tokens):
            return events


def test_a_request_waits_for_room_and_runs_when_room_is_given_back():
    async def main():
        attempt = Held()
        dispatcher = _dispatcher(attempt, capacity=2)
        running = await _first_token(dispatcher, _prepared(n=2))  # both sequences of the worker
        held = dispatcher.workers.loads(SEQUENCES)
        waiting = asyncio.create_task(_first_token(dispatcher, _prepared(n=1)))
        await asyncio.sleep(0.3)
        blocked = not waiting.done() and dispatcher.queue.depth == 1
        attempt.release.set()  # the first request ends: its room comes back
        async for _ in running:
            pass
        second = await asyncio.wait_for(waiting, 5)
        async for _ in second:
            pass
        await asyncio.sleep(0.1)  # give-backs run in threads
        return held, blocked, attempt.calls, dispatcher.workers.loads(SEQUENCES)

    held, blocked, calls, after = asyncio.run(main())
    assert held == {"d0": 2} and blocked and calls == ["d0", "d0"] and after == {}


def test_a_worker_that_says_it_is_full_puts_the_request_back_in_the_queue_not_in_error():
    async def main():
        attempt = Held(grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
        attempt.release.set()
        dispatcher = _dispatcher(attempt, decoders=1)
        events = [event async for event in dispatcher.run(_prepared(), "r", time.monotonic() + 30)]
        return attempt.calls, events, dispatcher.metrics

    calls, events, metrics = asyncio.run(main())
    # Asked again, the same worker (the only one), without using up the one retry.
    assert calls == ["d0", "d0", "d0"] and isinstance(events[-1], Finished)
    assert metrics.requeued._value.get() == 2 and metrics.retries._value.get() == 0


def test_a_failed_retry_with_no_worker_left_says_what_failed():
    async def main():
        dispatcher = _dispatcher(Held(grpc.StatusCode.UNAVAILABLE), decoders=1)
        dispatcher.migration_wait_s = 0.6  # it waits this long for the worker to come back, then says so
        return [event async for event in dispatcher.run(_prepared(), "r", time.monotonic() + 30)]

    with pytest.raises(UpstreamError, match=r"worker d0:1 failed: UNAVAILABLE: x; no other worker is live"):
        asyncio.run(main())


def test_more_choices_than_any_worker_holds_is_400_before_any_work():
    dispatcher = _dispatcher(Held(), capacity=4, decoders=2)
    dispatcher.placement.check_fits([_prepared(n=4), _prepared(n=1)])
    with pytest.raises(RequestError) as refused:
        dispatcher.placement.check_fits([_prepared(n=1), _prepared(n=5)])
    assert refused.value.status_code == 400
    assert refused.value.message == (
        "n=5 needs 5 sequences on one decode worker at once; the largest live decode worker generates at most 4"
    )
    # Unknown capacity (a worker that has not answered): it decides for itself.
    unknown = _dispatcher(Held(), capacity=None)
    unknown.placement.check_fits([_prepared(n=16)])
