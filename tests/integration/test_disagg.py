"""Prefill actor on a real local Ray -> KV frames over gRPC -> decode worker: the same tokens as one process."""

from __future__ import annotations

import os
import signal

import grpc
import pytest
import ray
from conftest import start_process, wait_for
from helpers import random_ids, text_ids

from services.prefill.actor import actor_addresses, launch_prefill_actors
from services.prefill.settings import PrefillSettings
from services.router.client import DecodeClient, PrefillClient, run_disaggregated
from shared.compute import OPENMP_ENV
from shared.contract import preset
from shared.engine import OFF, SamplingParams, generate
from shared.net import rpc
from shared.settings import EngineSettings

SAMPLINGS = {
    "greedy": SamplingParams(max_new_tokens=12),
    "seeded": SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7),
}


@pytest.fixture(scope="module")
def actors(local_ray):
    """One prefill actor per model, placed by Ray."""
    handles = {}
    for name in ("tiny-llama", "SmolLM2-135M-Instruct"):
        settings = PrefillSettings(engine=EngineSettings(model=name, threads=1), num_cpus=1)
        handles[name] = launch_prefill_actors(settings)[0]
    yield handles
    for handle in handles.values():
        ray.kill(handle)


@pytest.fixture(scope="module")
def tiny_decode_process():
    """A decode worker started as its own process through the CLI, as deployments run it."""
    process, address = start_process(
        ["decode-worker", "--model", "tiny-llama", "--port", "0", "--threads", "1"], "decode"
    )
    yield address
    process.terminate()
    process.wait(timeout=30)


def _prompt(loaded) -> list[int]:
    return text_ids(loaded, 3000) if loaded.name.startswith("SmolLM2") else random_ids(loaded, 300)


# The codec tests and the decode-worker tests prove token equality case by case; here, end to end
# through a Ray actor and a worker process, the two cases that add to them: the CLI-started worker
# unpruned and greedy, and the real model pruned (query windows and revival on the wire) with
# seeded sampling (token k drawn from (seed, k) on either worker). And a migrated stream's
# continuation through a transfer: its tokens so far replayed after the prefill, the rest equal.
@pytest.mark.parametrize(
    ("model", "pruning", "sampling"), [("tiny-llama", "off", "greedy"), ("SmolLM2-135M-Instruct", "default", "seeded")]
)
def test_disaggregated_tokens_equal_in_process(
    model, pruning, sampling, actors, load, decode_worker, tiny_decode_process
):
    loaded = load(model)
    if model == "tiny-llama":
        decode = DecodeClient(tiny_decode_process)
    else:
        decode = decode_worker(loaded)[1]
    prefill = PrefillClient(actor_addresses([actors[model]])[0])
    # The default preset, also below its minimum prompt length: its query windows travel too; and
    # re-selecting every step without a revival budget, so that 12 tokens surely revive some.
    revive_every_step = {"min_prompt_tokens": 0, "reselect_every": 1, "revive_budget": None}
    config = (
        OFF
        if pruning == "off"
        else preset("default", loaded.engine.spec.num_layers).model_copy(update=revive_every_step)
    )
    params = SAMPLINGS[sampling]
    ids = _prompt(loaded)
    expected = generate(loaded.engine, ids, config, params)
    result = run_disaggregated(prefill, decode, ids, config, params)
    assert result.tokens == expected.tokens
    assert result.finish_reason == expected.finish_reason
    stats, reply = result.stats, result.prefill
    assert stats.revived_token_layers == expected.stats.revived_token_layers
    assert stats.token_layers_computed == expected.stats.token_layers_computed
    assert stats.kept_per_layer == expected.stats.kept_per_layer
    # Only computed token-layers travel: KV bytes are exactly prefill's token-layers' worth.
    spec = loaded.engine.spec
    assert reply.kv_bytes_sent == reply.stats.prefill_token_layers * spec.kv_bytes_per_token_layer
    if pruning == "default":
        assert reply.kv_bytes_sent < len(ids) * spec.num_layers * spec.kv_bytes_per_token_layer
        assert reply.aux_bytes_sent > 0
    if model != "tiny-llama" and pruning == "default":
        assert stats.revived_token_layers > 0  # decode really revived pruned tokens on this prompt
    continued = run_disaggregated(prefill, decode, ids, config, params, generated=expected.tokens[:5])
    assert continued.tokens == expected.tokens[5:]
    assert continued.stats.completion_tokens == len(expected.tokens)  # usage counts the answer once


def test_the_actor_computes_only_on_its_compute_thread(actors):
    """After the tests above served prefills through it: no gRPC handler and not Ray's own thread
    (which loaded nothing) ever ran engine work, so one OpenMP pool serves every prefill."""
    threads = ray.get(actors["SmolLM2-135M-Instruct"].threads.remote())
    assert threads["computing"] == [threads["compute"]]
    assert threads["compute"] != threads["ray"]
    # The OpenMP settings reached the actor's process (its raylet did not have them: this test's Ray).
    assert threads["openmp_env"] == OPENMP_ENV


def test_prefill_stops_when_the_decode_worker_refuses(actors, smollm2, tiny_decode_process):
    handle = actors["SmolLM2-135M-Instruct"]
    before = ray.get(handle.counters.remote())
    prefill = PrefillClient(actor_addresses([handle])[0])
    # A SmolLM2 transfer to a tiny-llama decode worker: refused at the header.
    with pytest.raises(grpc.RpcError) as error:
        run_disaggregated(prefill, DecodeClient(tiny_decode_process), text_ids(smollm2, 6000), OFF, SAMPLINGS["greedy"])
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "header model" in error.value.details()
    after = ray.get(handle.counters.remote())
    assert after["failed"] == before["failed"] + 1
    # It stopped early instead of computing all 30 layers of a ~1.3k-token prompt.
    assert after["layers_computed"] - before["layers_computed"] < smollm2.engine.spec.num_layers


def test_prefill_workers_are_healthy(actors):
    for address in actor_addresses(list(actors.values())):
        assert rpc.check_health(address, service="lazyserve.v1.PrefillService")


def test_a_crashed_prefill_actor_is_restarted(actors, tiny_llama, tiny_decode_process):
    handle = actors["tiny-llama"]
    pid = ray.get(handle.pid.remote())
    os.kill(pid, signal.SIGKILL)  # a real crash of the actor's process (same host)
    # Calls made while Ray restarts it are retried on the new process (max_task_retries).
    assert wait_for(lambda: ray.get(handle.pid.remote(), timeout=60) != pid, timeout=90)
    address = actor_addresses([handle])[0]
    ids = random_ids(tiny_llama, 100)
    result = run_disaggregated(PrefillClient(address), DecodeClient(tiny_decode_process), ids, OFF, SAMPLINGS["greedy"])
    assert result.tokens == generate(tiny_llama.engine, ids, OFF, SAMPLINGS["greedy"]).tokens
