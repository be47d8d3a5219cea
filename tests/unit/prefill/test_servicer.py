"""The prefill servicer without a network: a fake Sender assembles what would be sent, in process."""

from __future__ import annotations

import pytest
import torch
from helpers import assemble, random_ids

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from services.prefill.settings import PrefillSettings
from services.prefill.worker import PrefillServicer
from shared.contract.wire import pruning_to_pb, sampling_to_pb
from shared.engine import OFF, PruneConfig, SamplingParams, generate, prefill
from shared.net.rpc import Cancelled
from shared.transfer import frame_messages

LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)), window=4)


class FakeSender:
    """Keeps the messages a KVSender would stream; `finish` assembles them like a decode worker."""

    def __init__(self, loaded, address, header, frame_bytes, queue_layers, timeout_s, auth):
        self.loaded, self.address, self.frame_bytes = loaded, address, frame_bytes
        self.messages = [header]
        self.num_frames = self.kv_bytes = self.aux_bytes = self.bytes_sent = 0
        self.aborted = False
        self.assembled = None

    def put(self, frame) -> None:
        for message in frame_messages(self.messages[0].header.transfer_id, frame, self.frame_bytes):
            self.messages.append(message)
            self.num_frames += 1

    def finish(self, make_end) -> pb.PushKVReply:
        self.messages.append(make_end(self.num_frames))
        self.assembled = assemble(self.loaded, self.messages)
        return pb.PushKVReply(num_frames=self.num_frames)

    def abort(self) -> None:
        self.aborted = True


class Context:
    """The parts of a grpc.ServicerContext the servicer reads; `active` turns False after `calls`."""

    def __init__(self, active_for: int = 1 << 30):
        self.calls, self.active_for = 0, active_for

    def is_active(self) -> bool:
        self.calls += 1
        return self.calls <= self.active_for

    def time_remaining(self):
        return 60.0

    def invocation_metadata(self):
        return ()


@pytest.fixture
def servicer(tiny_llama):
    senders = []

    def make(*args):
        senders.append(FakeSender(tiny_llama, *args))
        return senders[-1]

    servicer = PrefillServicer(tiny_llama, PrefillSettings(), sender=make)
    servicer.senders = senders
    return servicer


def _request(ids, config, params) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        transfer_id="t-1",
        decode_address="decode:1",
        prompt_ids=ids,
        pruning=pruning_to_pb(config),
        sampling=sampling_to_pb(params),
    )


@pytest.mark.parametrize("config", [OFF, LAZY], ids=["off", "lazy"])
def test_the_transfer_is_the_in_process_prefill(tiny_llama, servicer, config):
    ids, params = random_ids(tiny_llama, 200), SamplingParams(max_new_tokens=5)
    reply = servicer.Prefill(_request(ids, config, params), Context())
    sender = servicer.senders[-1]
    cache, logits = prefill(tiny_llama.engine, torch.tensor(ids), config)
    expected = generate(tiny_llama.engine, ids, config, params).tokens[:1]
    assert list(reply.first_tokens) == [int(logits.argmax())] == expected
    assert reply.stats.prefill_token_layers == cache.computed_token_layers
    assert list(reply.stats.kept_per_layer) == cache.kept_per_layer
    got = sender.assembled.cache
    for layer in range(tiny_llama.engine.spec.num_layers):
        assert torch.equal(got.layers[layer].positions, cache.layers[layer].positions)
        assert torch.equal(got.layers[layer].k, cache.layers[layer].k)
    assert sender.assembled.first_tokens == list(reply.first_tokens) and not sender.aborted
    assert servicer.counters.completed == 1


def test_a_caller_that_leaves_stops_the_prefill_and_the_transfer(tiny_llama, servicer):
    ids = random_ids(tiny_llama, 120)
    with pytest.raises(Cancelled):
        servicer.Prefill(_request(ids, OFF, SamplingParams(max_new_tokens=3)), Context(active_for=3))
    sender = servicer.senders[-1]
    assert sender.aborted and sender.assembled is None
    # The caller was seen active at three layers: the fourth never ran, nor the rest.
    assert servicer.counters.failed == 1 and servicer.counters.layers_computed == 3
    # Its slot was given back: the next request runs.
    servicer.Prefill(_request(ids, OFF, SamplingParams(max_new_tokens=3)), Context())
    assert servicer.counters.completed == 1
