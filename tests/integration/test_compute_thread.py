"""Each in-process worker computes on its compute thread only; its gRPC handlers never do.

A door of the engine reached from a handler thread raises ComputeThreadError, so every request
below would fail if a handler computed; and the threads that ran engine work are exactly the
workers' compute threads (shared.compute says why it matters: one OpenMP pool per process).
"""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from helpers import random_ids

from shared.compute import ComputeThreadError, computing_threads, forget_computing_threads, mark_io_thread
from shared.engine import OFF, decode_batch, prefill
from shared.transfer import TransferAssembler


def test_served_requests_compute_only_on_the_workers_compute_threads(
    tiny_llama, decode_worker, prefill_worker, gateway
):
    decode, _ = decode_worker(tiny_llama)
    prefill_ = prefill_worker(tiny_llama)
    running = gateway(prefill_workers=[prefill_.address], decode_workers=[decode.address], local_threshold=100)
    forget_computing_threads()
    long, short = random_ids(tiny_llama, 300), random_ids(tiny_llama, 40)
    # A transfer (prefill worker -> decode worker), a local prefill, and each again (prefix hits), n=2.
    for prompt in (long, short, long, short):
        reply = httpx.post(
            f"{running.url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 4, "n": 2, "pruning": "lazyllm"},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
    workers = {decode.servicer.scheduler.compute.ident, prefill_.servicer.compute.ident}
    assert computing_threads() == workers


def _on_io_thread(fn):
    result = []

    def run():
        mark_io_thread()
        try:
            fn()
        except ComputeThreadError as error:
            result.append(error)

    thread = threading.Thread(target=run, name="io")
    thread.start()
    thread.join()
    return result


@pytest.mark.parametrize("door", ["prefill", "decode", "transfer"])
def test_each_door_refuses_an_io_thread(tiny_llama, door):
    model, ids = tiny_llama.engine, torch.tensor(random_ids(tiny_llama, 20))
    cache, _ = prefill(model, ids, OFF, reserve=2)
    calls = {
        "prefill": lambda: prefill(model, ids, OFF),
        "decode": lambda: decode_batch(model, [(cache, 1, OFF)]),
        "transfer": lambda: TransferAssembler("tiny-llama", model.spec, model.dtype, "cpu", 100).header(None),
    }
    [error] = _on_io_thread(calls[door])
    assert "ran on I/O thread 'io'" in str(error)
