"""Security at the edges: the internal gRPC token, API keys by default off loopback, per-key
stream limits, bytes that are not a request, oversized messages, and no unpickling of network data."""

from __future__ import annotations

import concurrent.futures

import grpc
import httpx
import openai
import pytest
from helpers import encode_transfer, random_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from services.router.client import DecodeClient, PrefillClient, run_disaggregated
from shared.engine import OFF, PruneConfig, SamplingParams, generate
from shared.net import rpc
from shared.net.transport import MAX_MESSAGE_BYTES, NO_AUTH, InternalAuth

TOKEN = "internal-secret-for-tests"
AUTH = InternalAuth(token=TOKEN)
CONFIG = PruneConfig(stages=((1, 0.5), (3, 0.25)))


def test_a_kv_stream_without_the_internal_token_is_refused(tiny_llama, decode_worker):
    worker, _ = decode_worker(tiny_llama, internal_token=TOKEN)
    _, messages = encode_transfer(tiny_llama, random_ids(tiny_llama, 40), CONFIG, SamplingParams(max_new_tokens=3))
    anonymous = DecodeClient(worker.address)
    with pytest.raises(grpc.RpcError) as error:
        anonymous.stub.PushKV(iter(messages), timeout=10)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as error:
        DecodeClient(worker.address, InternalAuth(token="wrong")).status()
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert rpc.check_health(worker.address)  # probes stay open
    trusted = DecodeClient(worker.address, AUTH)
    assert trusted.stub.PushKV(iter(messages), timeout=10, metadata=trusted.metadata).num_frames > 0
    assert trusted.status().transfers_ready == 1


def test_the_whole_path_carries_the_token(tiny_llama, decode_worker, prefill_worker, gateway):
    decode, _ = decode_worker(tiny_llama, internal_token=TOKEN)
    prefill = prefill_worker(tiny_llama, internal_token=TOKEN)
    ids = random_ids(tiny_llama, 200)
    params = SamplingParams(max_new_tokens=4)
    with pytest.raises(grpc.RpcError) as error:
        run_disaggregated(PrefillClient(prefill.address), DecodeClient(decode.address), ids, OFF, params)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    result = run_disaggregated(
        PrefillClient(prefill.address, AUTH), DecodeClient(decode.address, AUTH), ids, OFF, params
    )
    assert result.tokens == generate(tiny_llama.engine, ids, OFF, params).tokens
    running = gateway(
        prefill_workers=[prefill.address], decode_workers=[decode.address], local_threshold=100, internal_token=TOKEN
    )
    reply = running.openai().completions.with_raw_response.create(model="tiny-llama", prompt=ids, max_tokens=3)
    assert reply.headers["x-lazyserve-route"] == "disaggregated"


def test_api_keys_are_required_by_default_off_loopback(tiny_llama, decode_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    exposed = gateway(decode_workers=[decode.address], host="0.0.0.0")  # bound to loopback here all the same
    with pytest.raises(openai.AuthenticationError):
        exposed.openai().completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1)
    local = gateway(decode_workers=[decode.address])  # 127.0.0.1: local development, open
    assert (
        local.openai().completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1).usage.completion_tokens == 1
    )


def test_concurrent_streams_per_key_are_limited(tiny_llama, decode_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    running = gateway(decode_workers=[decode.address], api_keys="key-a,key-b", max_streams_per_key=1)
    stream = running.openai(api_key="key-a").completions.create(
        model="tiny-llama", prompt=[1, 2, 3], max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))
    # Key A is at its bound: its next request waits (not refused) while key B is served.
    waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
        running.openai(api_key="key-a").completions.create, model="tiny-llama", prompt=[1, 2], max_tokens=1
    )
    assert running.openai(api_key="key-b").completions.create(model="tiny-llama", prompt=[1, 2], max_tokens=1).choices
    assert not waiting.done()
    status = httpx.get(f"{running.url}/status", headers={"Authorization": "Bearer key-b"}).json()
    assert status["queue"]["depth"] == 1
    stream.close()
    assert waiting.result(timeout=30).usage.completion_tokens == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(chunks=st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=4))
def test_bytes_that_are_not_messages_get_invalid_argument(tiny_llama, decode_worker_session, chunks):
    address = decode_worker_session(tiny_llama)
    with NO_AUTH.channel(address) as channel:
        push = channel.stream_unary("/lazyserve.v1.DecodeService/PushKV")  # raw bytes, no serializer
        try:
            push(iter(chunks), timeout=10)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        else:
            raise AssertionError("random bytes were accepted as a transfer")
    assert rpc.check_health(address)


def test_oversized_messages_are_refused_and_the_worker_keeps_serving(tiny_llama, decode_worker):
    worker, client = decode_worker(tiny_llama)
    huge = pb.TransferMessage(header=pb.TransferHeader(transfer_id="x", model="y" * (MAX_MESSAGE_BYTES + 1024)))
    with pytest.raises(grpc.RpcError) as error:
        client.stub.PushKV(iter([huge]), timeout=30)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _, messages = encode_transfer(tiny_llama, random_ids(tiny_llama, 40), CONFIG, SamplingParams(max_new_tokens=3))
    assert client.stub.PushKV(iter(messages), timeout=10).num_frames > 0
