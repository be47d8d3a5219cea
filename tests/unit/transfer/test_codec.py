"""KV transfer codec: what the sender encodes, the assembler rebuilds exactly; anything else is refused
with a FrameError that says what was wrong."""

from __future__ import annotations

import pytest
import torch
from helpers import assemble, encode_transfer, random_ids

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from shared.engine import PruneConfig, SamplingParams
from shared.transfer import FrameError
from shared.transfer.tensors import frame_checksum

CONFIG = PruneConfig(stages=((1, 0.5), (3, 0.25)))
N = 96


FOUR_TOKENS = SamplingParams(max_new_tokens=4)


def _encode(loaded, config=CONFIG, budget=1 << 20, params=FOUR_TOKENS):
    return encode_transfer(loaded, random_ids(loaded, N), config, params, budget=budget)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3"])  # gemma: sliding-window layers, window < N
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("budget", [1 << 20, 2048], ids=["one-frame-per-layer", "chunked"])
def test_assembled_cache_equals_the_senders(load, budget, dtype, name):
    loaded = load(name, dtype)
    cache, messages = _encode(loaded, budget=budget)
    if budget == 2048:
        assert len(messages) > 2 + 2 * loaded.engine.spec.num_layers  # layers really span several frames
    assert messages[0].header.dtype == dtype
    got = assemble(loaded, messages).cache
    assert got.layers[0].k.dtype == getattr(torch, dtype)
    for mine, theirs in zip(got.layers, cache.layers):
        assert torch.equal(mine.positions, theirs.positions)
        assert torch.equal(mine.k, theirs.k) and torch.equal(mine.v, theirs.v)
    for mine, theirs in zip(got.aux, cache.aux):
        assert torch.equal(mine.positions, theirs.positions)
        assert torch.equal(mine.hidden, theirs.hidden)
    assert torch.equal(got.depth[:N], cache.depth[:N])
    assert got.kept_per_layer == cache.kept_per_layer
    assert got.computed_token_layers == cache.computed_token_layers


# The selection options travel in the pruning config, and a lazy schedule's query windows in the
# stage layers' frames: decode on the receiving side re-selects exactly as in one process.
WINDOWED = PruneConfig(
    stages=((1, 0.5), (3, 0.25)),
    window=8,
    pool_kernel=5,
    pool="avg",
    recent_tokens=6,
    sink_tokens=2,
    keep_mass=0.9,
    min_keep=0.1,
    min_prompt_tokens=10,
    revive_budget=4,
    reselect_every=3,
)


@pytest.mark.parametrize("budget", [1 << 20, 2048], ids=["one-frame-per-layer", "chunked"])
def test_query_windows_and_options_arrive(tiny_llama, budget):
    cache, messages = _encode(tiny_llama, config=WINDOWED, budget=budget)
    got = assemble(tiny_llama, messages)
    assert got.config == WINDOWED
    assert sorted(got.cache.windows) == sorted(cache.windows) == [1, 3]
    for layer, window in cache.windows.items():
        assert torch.equal(got.cache.windows[layer].positions, window.positions)
        assert torch.equal(got.cache.windows[layer].q, window.q)


def test_a_query_window_of_the_wrong_shape_is_refused(tiny_llama):
    _, messages = _encode(tiny_llama, config=WINDOWED)
    frame = _frame(messages, 1)
    frame.queries.shape[1] = 1
    _reseal(frame)
    with pytest.raises(FrameError, match="queries: shape"):
        assemble(tiny_llama, messages)


def test_a_flipped_bit_in_a_query_window_fails_the_checksum(tiny_llama):
    _, messages = _encode(tiny_llama, config=WINDOWED)
    frame = _frame(messages, 3)
    frame.queries.data = bytes([frame.queries.data[0] ^ 1]) + frame.queries.data[1:]
    with pytest.raises(FrameError, match="checksum"):
        assemble(tiny_llama, messages)


def test_frames_stay_under_the_budget(smollm2):
    budget = 1 << 20
    _, messages = _encode(smollm2, config=PruneConfig(mode="off"), budget=budget)
    for message in messages[1:-1]:
        frame = message.frame
        assert len(frame.k.data) + len(frame.v.data) <= budget
        assert len(frame.aux_hidden.data) <= budget
        assert message.ByteSize() < 4 << 20


def _frame(messages, layer, nth=0):
    return [m.frame for m in messages if m.WhichOneof("kind") == "frame" and m.frame.layer == layer][nth]


def _reseal(frame):
    frame.crc32c = frame_checksum(frame)


def _shuffle_positions(frame):
    frame.positions[0], frame.positions[1] = frame.positions[1], frame.positions[0]
    _reseal(frame)


def _position_outside(frame):
    frame.positions[-1] = N + 5
    _reseal(frame)


def _truncate_k(frame):
    frame.k.data = frame.k.data[:-4]
    _reseal(frame)


def _wrong_shape(frame):
    frame.k.shape[1] += 1
    _reseal(frame)


def _wrong_dtype(frame):
    frame.v.dtype = "float16"
    _reseal(frame)


def _flip_bit(frame):
    data = bytearray(frame.k.data)
    data[7] ^= 1
    frame.k.data = bytes(data)


def _layer_out_of_range(frame):
    frame.layer = 99


def _foreign_transfer(frame):
    frame.transfer_id = "someone-else"


CORRUPTIONS = {
    "unsorted positions": (2, _shuffle_positions, "strictly increasing"),
    "position outside the prompt": (0, _position_outside, "outside the prompt"),
    "byte count": (0, _truncate_k, "bytes, expected"),
    "shape": (1, _wrong_shape, "shape"),
    "dtype": (1, _wrong_dtype, "dtype"),
    "checksum": (3, _flip_bit, "checksum"),
    "layer out of range": (5, _layer_out_of_range, "out of range"),
    "foreign transfer_id": (2, _foreign_transfer, "transfer_id"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_corrupt_frame_is_refused(tiny_llama, name):
    layer, corrupt, reason = CORRUPTIONS[name]
    _, messages = _encode(tiny_llama)
    corrupt(_frame(messages, layer))
    with pytest.raises(FrameError, match=reason):
        assemble(tiny_llama, messages)


def test_frames_out_of_layer_order_are_refused(tiny_llama):
    _, messages = _encode(tiny_llama)
    swapped = messages[:2] + [messages[3], messages[2]] + messages[4:]
    with pytest.raises(FrameError, match="layer skipped"):
        assemble(tiny_llama, swapped)
    back = messages[:4] + [messages[2]] + messages[4:]
    with pytest.raises(FrameError, match="must not go back"):
        assemble(tiny_llama, back)


def test_a_token_layer_sent_twice_is_refused(tiny_llama):
    _, messages = _encode(tiny_llama)
    messages.insert(2, messages[1])
    with pytest.raises(FrameError, match="a token-layer twice"):
        assemble(tiny_llama, messages)


def test_a_missing_layer_is_refused(tiny_llama):
    _, messages = _encode(tiny_llama)
    del messages[2]  # layer 1's frame
    messages[-1].end.num_frames -= 1
    with pytest.raises(FrameError, match="layer skipped"):
        assemble(tiny_llama, messages)


def test_a_missing_aux_entry_is_refused(tiny_llama):
    _, messages = _encode(tiny_llama)
    frame = _frame(messages, 1)
    assert len(frame.aux_positions) > 0
    del frame.aux_positions[0]
    frame.aux_hidden.shape[0] -= 1
    row = len(frame.aux_hidden.data) // (frame.aux_hidden.shape[0] + 1)
    frame.aux_hidden.data = frame.aux_hidden.data[row:]
    _reseal(frame)
    with pytest.raises(FrameError, match="Aux Cache of layer 1"):
        assemble(tiny_llama, messages)


def test_frame_count_mismatch_is_refused(tiny_llama):
    _, messages = _encode(tiny_llama)
    messages[-1].end.num_frames += 1
    with pytest.raises(FrameError, match="frames; .* arrived"):
        assemble(tiny_llama, messages)


def test_a_model_that_does_not_match_is_refused(tiny_llama, smollm2):
    _, messages = _encode(tiny_llama)
    with pytest.raises(FrameError, match="header model"):
        assemble(smollm2, messages)
    messages[0].header.model = smollm2.name
    with pytest.raises(FrameError, match="num_layers"):
        assemble(smollm2, messages)


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda end: end.prompt_ids.__setitem__(0, 10**6), "outside the vocabulary"),
        (lambda end: end.prompt_ids.pop(), "prompt_ids has"),
        (lambda end: end.first_tokens.__setitem__(0, 10**6), "first_tokens"),
        (lambda end: end.pruning.stages.add(layer=5, keep_fraction=0.1), "pruning"),
        (lambda end: setattr(end.pruning, "mode", "sometimes"), "pruning"),
        (lambda end: setattr(end.sampling, "top_p", 1.5), "top_p"),
        (lambda end: setattr(end.sampling, "max_new_tokens", 0), "max_new_tokens"),
        (lambda end: setattr(end.sampling, "temperature", float("nan")), "temperature"),
        (lambda end: end.first_tokens.append(5), "one per choice"),
    ],
    ids=[
        "prompt id",
        "prompt length",
        "first token",
        "stage layer",
        "mode",
        "top_p",
        "max_new_tokens",
        "nan",
        "choices",
    ],
)
def test_bad_end_is_refused(tiny_llama, edit, reason):
    _, messages = _encode(tiny_llama)
    edit(messages[-1].end)
    with pytest.raises(FrameError, match=reason):
        assemble(tiny_llama, messages)


def test_a_stream_must_start_with_its_header(tiny_llama):
    _, messages = _encode(tiny_llama)
    with pytest.raises(FrameError, match="header"):
        assemble(tiny_llama, messages[1:])
    bad = pb.TransferMessage(header=pb.TransferHeader(transfer_id="x" * 500))
    with pytest.raises(FrameError, match="transfer_id"):
        assemble(tiny_llama, [bad])


def test_a_negative_seed_crosses_the_wire_as_the_same_generator():
    import torch

    from shared.transfer import sampling_from_pb, sampling_to_pb

    params = SamplingParams(max_new_tokens=2, temperature=0.7, seed=-18024)
    back = sampling_from_pb(sampling_to_pb(params), vocab_size=100)
    mine, theirs = torch.Generator().manual_seed(params.seed), torch.Generator().manual_seed(back.seed)
    assert torch.equal(mine.get_state(), theirs.get_state())
