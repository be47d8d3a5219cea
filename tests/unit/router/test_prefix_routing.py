"""Routing by what the workers cache (scripted, no timing): the index of what went where, the
price rule, a conversation's turns landing where the conversation is, and dead workers' entries."""

from __future__ import annotations

import asyncio
import time

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from services.router.client import Finished, Prefilled, Tokens
from services.router.dispatch import Dispatcher
from services.router.metrics import GatewayMetrics
from services.router.policy import LengthAwarePolicy
from services.router.prefixes import MemoryPrefixIndex, leading, prompt_keys
from services.router.workers import DECODE_TOKENS, PREFILL_COST, StaticWorkers
from shared.api.serving import Prepared
from shared.contract import ModelSpec, SamplingParams, Stats, preset
from shared.models.text import TextModel
from shared.net.registry import WorkerInfo

MODEL = "m"
SPEC = ModelSpec("llama", 30, 8, 2, 2, 4, 50000, 8192)
DEFAULT = preset("default", 30)


def _infos(decode: int = 2, prefill: int = 1) -> list[WorkerInfo]:
    infos = [WorkerInfo(worker_id=f"d{i}", role="decode", address=f"d{i}:1", model=MODEL) for i in range(decode)]
    return infos + [
        WorkerInfo(worker_id=f"p{i}", role="prefill", address=f"p{i}:1", model=MODEL) for i in range(prefill)
    ]


def test_leading_counts_blocks_from_the_first_without_a_gap():
    assert leading([{"a", "b"}, {"a", "b"}, {"a"}, set(), {"a", "b"}]) == {"a": 3, "b": 2}
    assert leading([]) == {} and leading([set(), {"a"}]) == {}


def test_the_memory_index_forgets_what_expired_and_what_fell_out_of_its_bound():
    keys = prompt_keys(list(range(200)), MODEL, DEFAULT, 30, "")
    index = MemoryPrefixIndex(ttl_s=60)
    index.record(keys[:4], "d0")
    index.record(keys, "d1")
    assert index.matches(keys) == {"d0": 4, "d1": 6}
    expired = MemoryPrefixIndex(ttl_s=0)
    expired.record(keys, "d0")
    assert expired.matches(keys) == {}
    small = MemoryPrefixIndex(ttl_s=60, max_blocks=3)
    small.record(keys, "d0")  # the head's blocks were the least recently recorded: they went
    assert small.matches(keys) == {}


def test_keys_differ_by_tenant_and_by_the_layers_a_schedule_shares():
    ids = list(range(100))
    assert prompt_keys(ids, MODEL, DEFAULT, 30, "a") != prompt_keys(ids, MODEL, DEFAULT, 30, "b")
    assert prompt_keys(ids, MODEL, DEFAULT, 30, "") != prompt_keys(ids, MODEL, preset("off", 30), 30, "")


def test_the_price_rule():
    """Price = the schedule's prefill work less the shared layers of the tokens held (0.6 of the
    model here), plus a transfer's weight on a prefill worker, plus load per unit of capacity."""
    policy = LengthAwarePolicy(local_threshold=1024)
    workers = StaticWorkers(_infos())

    def choose(workers, n, fraction, matched):
        return policy.choose(workers, MODEL, n, fraction, 64, matched=matched, shared=0.6)

    # A 3k-token prompt whose first 2900 tokens d1 holds: prefilled there (2100 - 1740 = 360),
    # not on the prefill worker (2100 + 300 for the transfer).
    local = choose(workers, 3000, 0.7, {"d1": 2900})
    assert (local.kind, local.decode.worker_id) == ("local", "d1")
    assert local.prefill_cost == 3000 * 0.7 - 2900 * 0.6 and "holds 2900 of 3000" in local.reason
    # Holding too little (the uncached part is over the threshold): a prefill worker.
    assert choose(workers, 3000, 0.7, {"d1": 1000}).kind == "disaggregated"
    # The prefill worker that holds the document wins over an idle one (1200 + 300 + 500 < 2400) ...
    two = StaticWorkers(_infos(prefill=2))
    two.add_load(PREFILL_COST, "p1", 500)
    chosen = choose(two, 3000, 0.7, {"p1": 2000})
    assert chosen.prefill.worker_id == "p1" and chosen.prefill_cost == 3000 * 0.7 - 2000 * 0.6
    two.add_load(PREFILL_COST, "p1", 5000)  # ... unless its queue costs more than the work it saves
    assert choose(two, 3000, 0.7, {"p1": 2000}).prefill.worker_id == "p0"
    # A holder buried in work loses to a free prefill worker.
    workers.add_load(DECODE_TOKENS, "d1", 1e6)
    assert choose(workers, 3000, 0.7, {"d1": 2900}).kind == "disaggregated"
    # A short prompt goes to the decode worker that holds part of it.
    short = choose(StaticWorkers(_infos()), 500, 1.0, {"d1": 480})
    assert (short.kind, short.decode.worker_id) == ("local", "d1")


class Conversation:
    """A scripted attempt: each answers with `reply` tokens, with the prefill's figures."""

    def __init__(self):
        self.calls: list[tuple[str, str | None, str]] = []  # (decode, prefill, salt)

    async def __call__(self, channels, decode, prefill, ids, *_, cache_salt="", **__):  # as client.generate_on
        self.calls.append((decode.worker_id, prefill and prefill.worker_id, cache_salt))
        if prefill is not None:
            yield Prefilled(pb.PrefillReply(transfer_id="t"))
        reply = [7] * 40
        yield Tokens(reply[:1], Stats(prompt_tokens=len(ids)))
        yield Tokens(reply[1:])
        yield Finished("stop", Stats(prompt_tokens=len(ids), completion_tokens=len(reply)))


def _dispatcher(workers, script, index):
    text = TextModel(MODEL, None, SPEC, ())
    return Dispatcher(workers, LengthAwarePolicy(1024), text, GatewayMetrics(), 1, attempt=script, prefixes=index)


def _ask(dispatcher, ids: list[int], salt: str = "") -> None:
    prepared = Prepared(ids, SamplingParams(max_new_tokens=40), DEFAULT, "default", [], cache_salt=salt)

    async def run():
        async for _ in dispatcher.run(prepared, "r", time.monotonic() + 30):
            pass
        await asyncio.sleep(0.05)  # the index is written in the background

    asyncio.run(run())


def test_a_conversations_turns_land_on_the_decode_worker_holding_it():
    workers, script, index = StaticWorkers(_infos()), Conversation(), MemoryPrefixIndex()
    dispatcher = _dispatcher(workers, script, index)
    document = list(range(1000, 4000))
    _ask(dispatcher, document + [1, 2, 3])  # cold: prefilled by the prefill worker, sent to a decode worker
    (first_decode, first_prefill, _) = script.calls[0]
    assert first_prefill == "p0"
    # Make the other decode worker the less loaded one: the holder must win on what it holds.
    workers.add_load(DECODE_TOKENS, first_decode, 100)
    turn = document + [1, 2, 3] + [7] * 40
    for question in range(3):
        turn = turn + [50 + question] * 20
        _ask(dispatcher, turn)
        assert script.calls[-1][:2] == (first_decode, None), script.calls
        turn = turn + [7] * 40
    # Another question on the document alone: the prefill worker and the decode worker hold it.
    _ask(dispatcher, document + [9] * 30)
    assert script.calls[-1][:2] == (first_decode, None)


def test_another_tenant_is_not_sent_to_where_the_first_ones_prompt_is():
    workers, script, index = StaticWorkers(_infos()), Conversation(), MemoryPrefixIndex()
    dispatcher = _dispatcher(workers, script, index)
    document = list(range(1000, 4000))
    _ask(dispatcher, document, salt="tenant-a")
    _ask(dispatcher, document + [1] * 20, salt="tenant-b")
    assert script.calls[-1][1] == "p0" and script.calls[-1][2] == "tenant-b"  # no hit: a full prefill


def test_a_dead_workers_entries_stop_attracting_requests():
    infos = _infos()
    workers, script, index = StaticWorkers(infos), Conversation(), MemoryPrefixIndex()
    dispatcher = _dispatcher(workers, script, index)
    document = list(range(1000, 4000))
    _ask(dispatcher, document)
    holder = script.calls[-1][0]
    workers.workers = [w for w in infos if w.worker_id != holder]  # it died: gone from the live list
    _ask(dispatcher, document + [1] * 20)
    assert script.calls[-1][0] != holder and script.calls[-1][1] == "p0"  # the prefill worker still holds it
