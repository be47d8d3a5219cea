"""Property-based fuzzing of the KV frame validator: whatever arrives, it answers with a FrameError
(or accepts a stream that is in fact consistent), never any other exception."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from helpers import assemble, encode_transfer, random_ids
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from shared.engine import PruneConfig, SamplingParams
from shared.transfer import FrameError

CONFIG = PruneConfig(stages=((1, 0.5), (3, 0.25)))


_encoded: list[bytes] = []


def _transfer(loaded) -> list[bytes]:
    """A valid transfer's messages on the wire (made once; not a fixture, so that hypothesis does
    not print 150 kB of it with every example)."""
    if not _encoded:
        _, messages = encode_transfer(
            loaded, random_ids(loaded, 48), CONFIG, SamplingParams(max_new_tokens=4), budget=2048
        )
        _encoded.extend(m.SerializeToString() for m in messages)
    return list(_encoded)


def _mutate(data: bytes, position: int, value: int) -> bytes:
    if not data:
        return data
    position %= len(data)
    return data[:position] + bytes([value]) + data[position + 1 :]


EDITS = st.lists(
    st.tuples(
        st.sampled_from(["flip", "truncate", "drop", "duplicate", "swap", "field"]),
        st.integers(0, 10**6),
        st.integers(0, 255),
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=EDITS)
def test_mutated_streams_are_refused_cleanly(tiny_llama, edits):
    wire = _transfer(tiny_llama)
    for kind, where, value in edits:
        index = where % len(wire)
        if kind == "flip":
            wire[index] = _mutate(wire[index], where // 7, value)
        elif kind == "truncate":
            wire[index] = wire[index][: where % (len(wire[index]) + 1)]
        elif kind == "drop" and len(wire) > 1:
            del wire[index]
        elif kind == "duplicate":
            wire.insert(index, wire[index])
        elif kind == "swap":
            other = value % len(wire)
            wire[index], wire[other] = wire[other], wire[index]
        elif kind == "field":
            try:
                message = pb.TransferMessage.FromString(wire[index])
            except DecodeError:  # an earlier edit broke it
                continue
            if message.WhichOneof("kind") == "frame":
                frame = message.frame
                target = value % 4
                if target == 0:
                    frame.layer = where
                elif target == 1 and frame.positions:
                    frame.positions[where % len(frame.positions)] = where
                elif target == 2:
                    frame.k.shape[:] = [where % 9 for _ in frame.k.shape]
                else:
                    frame.aux_hidden.dtype = ["float32", "float64", "", "int8"][where % 4]
            wire[index] = message.SerializeToString()
    try:
        messages = [pb.TransferMessage.FromString(data) for data in wire]
    except DecodeError:  # not even a protobuf: the gRPC layer answers INVALID_ARGUMENT (tested there)
        return
    try:
        assemble(tiny_llama, messages)
    except FrameError:
        pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layer=st.integers(0, 2**32 - 1),
    positions=st.lists(st.integers(0, 2**32 - 1), max_size=6),
    shape=st.lists(st.integers(0, 2**32 - 1), max_size=5),
    dtype=st.sampled_from(["float32", "bfloat16", "float16", "int64", "", "complex64"]),
    data=st.binary(max_size=512),
    crc=st.integers(0, 2**32 - 1),
)
def test_arbitrary_frames_are_refused_cleanly(tiny_llama, layer, positions, shape, dtype, data, crc):
    header = pb.TransferMessage.FromString(_transfer(tiny_llama)[0])
    tensor = pb.Tensor(dtype=dtype, shape=shape, data=data)
    frame = pb.KVFrame(
        transfer_id="t1",
        layer=layer,
        positions=positions,
        k=tensor,
        v=tensor,
        aux_positions=positions,
        aux_hidden=tensor,
        crc32c=crc,
    )
    with pytest.raises(FrameError):
        assemble(
            tiny_llama,
            [header, pb.TransferMessage(frame=frame), pb.TransferMessage(end=pb.TransferEnd(transfer_id="t1"))],
        )
