"""The decode worker as a real gRPC server on loopback: validation, leases, cancellation, interleaving."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from conftest import wait_for
from helpers import encode_transfer, random_ids

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from services.router.client import run_local
from shared.engine import OFF, PruneConfig, SamplingParams, generate
from shared.net import rpc
from shared.transfer.tensors import frame_checksum

CONFIG = PruneConfig(stages=((1, 0.5), (3, 0.25)))
PARAMS = SamplingParams(max_new_tokens=8)


def _generate_transfer(client, transfer_id):
    return list(client.generate(pb.GenerateRequest(transfer_id=transfer_id), timeout=30))


def test_health_is_serving(tiny_llama, decode_worker):
    worker, _ = decode_worker(tiny_llama)
    assert rpc.check_health(worker.address)
    assert rpc.check_health(worker.address, service="lazyserve.v1.DecodeService")


def test_a_pushed_transfer_generates_what_the_engine_does(tiny_llama, decode_worker):
    _, client = decode_worker(tiny_llama)
    ids = random_ids(tiny_llama, 120)
    _, messages = encode_transfer(tiny_llama, ids, CONFIG, PARAMS)
    reply = client.stub.PushKV(iter(messages), timeout=30)
    assert reply.num_frames == len(messages) - 2
    responses = _generate_transfer(client, "t1")
    tokens = [t for r in responses for t in r.token_ids]
    expected = generate(tiny_llama.engine, ids, CONFIG, PARAMS)
    assert [expected.tokens[0], *tokens] == expected.tokens
    assert responses[-1].finish_reason == expected.finish_reason
    assert responses[-1].stats.revived_token_layers == expected.stats.revived_token_layers > 0
    status = client.status()
    assert (status.transfers_completed, status.transfers_ready, status.bytes_held) == (1, 0, 0)


def test_a_bad_stream_is_refused_and_the_worker_keeps_serving(tiny_llama, decode_worker):
    _, client = decode_worker(tiny_llama)
    ids = random_ids(tiny_llama, 64)
    _, messages = encode_transfer(tiny_llama, ids, CONFIG, PARAMS)
    frame = messages[3].frame
    frame.positions[-1] = 10_000
    frame.crc32c = frame_checksum(frame)
    with pytest.raises(grpc.RpcError) as error:
        client.stub.PushKV(iter(messages), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the prompt" in error.value.details()
    status = client.status()
    assert (status.transfers_rejected, status.transfers_receiving, status.bytes_held) == (1, 0, 0)
    # Same worker, next request: served.
    assert run_local(client, ids, CONFIG, PARAMS).tokens == generate(tiny_llama.engine, ids, CONFIG, PARAMS).tokens


def test_unknown_transfer_is_not_found(tiny_llama, decode_worker):
    _, client = decode_worker(tiny_llama)
    with pytest.raises(grpc.RpcError) as error:
        _generate_transfer(client, "nobody-sent-this")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_bad_local_request_is_invalid_argument(tiny_llama, decode_worker):
    _, client = decode_worker(tiny_llama)
    request = pb.GenerateRequest(
        prompt=pb.LocalPrompt(prompt_ids=[1, 2, 10**7], sampling=pb.SamplingParams(max_new_tokens=2))
    )
    with pytest.raises(grpc.RpcError) as error:
        list(client.generate(request, timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the vocabulary" in error.value.details()


def test_an_unclaimed_transfer_expires(tiny_llama, decode_worker):
    _, client = decode_worker(tiny_llama, claim_timeout_s=0.5)
    _, messages = encode_transfer(tiny_llama, random_ids(tiny_llama, 64), CONFIG, PARAMS)
    client.stub.PushKV(iter(messages), timeout=30)
    assert client.status().transfers_ready == 1 and client.status().bytes_held > 0
    status = wait_for(lambda: (s := client.status()).transfers_expired == 1 and s, timeout=5)
    assert status and (status.transfers_ready, status.bytes_held) == (0, 0)
    with pytest.raises(grpc.RpcError) as error:
        _generate_transfer(client, "t1")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def _held_back(messages, count, release: threading.Event):
    """Yield the first `count` messages, then wait for `release` before giving up (a stalled sender)."""
    yield from messages[:count]
    release.wait(timeout=30)


def test_a_stream_cut_half_way_is_freed(tiny_llama, decode_worker):
    _, client = decode_worker(tiny_llama)
    _, messages = encode_transfer(tiny_llama, random_ids(tiny_llama, 64), CONFIG, PARAMS)
    release = threading.Event()
    call = client.stub.PushKV.future(_held_back(messages, 4, release), timeout=30)
    # Receiving, with the first frames written (the header alone opens the transfer with 0 bytes).
    assert wait_for(lambda: (s := client.status()).transfers_receiving == 1 and s.bytes_held > 0)
    call.cancel()  # the sender goes away mid-stream
    status = wait_for(lambda: (s := client.status()).transfers_rejected == 1 and s)
    assert status and (status.transfers_receiving, status.bytes_held) == (0, 0)
    release.set()


def test_a_stalled_stream_expires_with_its_lease(tiny_llama, decode_worker):
    _, client = decode_worker(tiny_llama, transfer_timeout_s=0.5)
    _, messages = encode_transfer(tiny_llama, random_ids(tiny_llama, 64), CONFIG, PARAMS)
    release = threading.Event()
    call = client.stub.PushKV.future(_held_back(messages, 4, release), timeout=30)
    status = wait_for(lambda: (s := client.status()).transfers_expired == 1 and s, timeout=5)
    assert status and (status.transfers_receiving, status.bytes_held) == (0, 0)
    release.set()  # the sender's stream ends; the worker answers it with the expiry
    with pytest.raises(grpc.RpcError) as error:
        call.result(timeout=10)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_cancelling_generate_frees_the_sequence(tiny_llama, decode_worker):
    _, client = decode_worker(tiny_llama)
    request = pb.GenerateRequest(
        prompt=pb.LocalPrompt(
            prompt_ids=random_ids(tiny_llama, 64),
            pruning=pb.PruneConfig(mode="off"),
            sampling=pb.SamplingParams(max_new_tokens=1900),
        )
    )
    call = client.generate(request, timeout=60)
    next(call)
    assert client.status().sequences_active == 1
    call.cancel()
    status = wait_for(lambda: (s := client.status()).sequences_active == 0 and s)
    assert status and status.bytes_held == 0


def test_a_long_generation_does_not_block_a_short_one(tiny_llama, decode_worker):
    _, client = decode_worker(tiny_llama)
    ids = random_ids(tiny_llama, 64)
    finished = {}

    def run(name, max_new_tokens):
        result = run_local(client, ids, OFF, SamplingParams(max_new_tokens=max_new_tokens))
        finished[name] = (time.monotonic(), result)

    long = threading.Thread(target=run, args=("long", 400))
    long.start()
    assert wait_for(lambda: client.status().sequences_active == 1)
    run("short", 4)
    long.join(timeout=120)
    assert finished["short"][0] < finished["long"][0]
    assert len(finished["long"][1].tokens) == 400
    expected = generate(tiny_llama.engine, ids, OFF, SamplingParams(max_new_tokens=4)).tokens
    assert finished["short"][1].tokens == expected
