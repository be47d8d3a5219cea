"""Workers in bfloat16 over real gRPC: the disaggregated path gives the tokens of the in-process
engine at that dtype, the decode worker reports its dtype, and a transfer in another dtype is
refused with a reason, not silently converted."""

from __future__ import annotations

import grpc
import pytest
from helpers import encode_transfer, random_ids

from services.router.client import DecodeClient, PrefillClient, run_disaggregated
from shared.engine import PruneConfig, SamplingParams, generate

CONFIG = PruneConfig(stages=((1, 0.5), (3, 0.25)))
PARAMS = SamplingParams(max_new_tokens=10)


@pytest.fixture(scope="module")
def bf16_llama(load):
    return load("tiny-llama", "bfloat16")


def test_a_bfloat16_transfer_decodes_what_the_engine_does(bf16_llama, decode_worker, prefill_worker):
    decode, _ = decode_worker(bf16_llama)
    prefill = prefill_worker(bf16_llama)
    ids = random_ids(bf16_llama, 300)
    result = run_disaggregated(PrefillClient(prefill.address), DecodeClient(decode.address), ids, CONFIG, PARAMS)
    expected = generate(bf16_llama.engine, ids, CONFIG, PARAMS)
    assert result.tokens == expected.tokens
    assert result.stats.revived_token_layers == expected.stats.revived_token_layers > 0


def test_the_decode_worker_reports_its_dtype(bf16_llama, tiny_llama, decode_worker):
    _, narrow = decode_worker(bf16_llama)
    _, wide = decode_worker(tiny_llama)
    assert (narrow.status().dtype, narrow.status().device) == ("bfloat16", "cpu")
    assert wide.status().dtype == "float32" and wide.status().torch_threads >= 1


def test_a_float32_transfer_to_a_bfloat16_worker_is_refused(bf16_llama, tiny_llama, decode_worker):
    _, client = decode_worker(bf16_llama)
    _, messages = encode_transfer(tiny_llama, random_ids(tiny_llama, 64), CONFIG, PARAMS)  # float32 frames
    with pytest.raises(grpc.RpcError) as error:
        client.stub.PushKV(iter(messages), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details() == "header dtype is 'float32'; this worker runs 'bfloat16'"
    status = client.status()
    assert (status.transfers_rejected, status.transfers_ready, status.bytes_held) == (1, 0, 0)
