"""Tensors on the wire: raw little-endian bytes with dtype and shape, and the frame checksum.

Nothing here unpickles: a received tensor is its declared bytes reinterpreted as a known dtype,
after the byte count was checked against the shape.
"""

from __future__ import annotations

import math
import sys
import warnings
import zlib

import numpy as np
import torch

from proto.lazyserve.v1 import lazyserve_pb2 as pb

# The dtypes a model here runs in; anything else on the wire is refused.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
assert sys.byteorder == "little", "the wire format is little-endian"


class FrameError(ValueError):
    """A transfer message that is malformed or inconsistent with the receiver's model."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_to_pb(tensor: torch.Tensor) -> pb.Tensor:
    data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return pb.Tensor(dtype=dtype_name(tensor.dtype), shape=list(tensor.shape), data=data)


def tensor_from_pb(message: pb.Tensor, name: str, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode a tensor that must have exactly `dtype` and `shape`; FrameError otherwise."""
    if message.dtype != dtype:
        raise FrameError(f"{name}: dtype {message.dtype!r}, expected {dtype!r}")
    if tuple(message.shape) != shape:
        raise FrameError(f"{name}: shape {list(message.shape)}, expected {list(shape)}")
    torch_dtype = DTYPES[dtype]
    expected = math.prod(shape) * torch_dtype.itemsize
    if len(message.data) != expected:
        raise FrameError(f"{name}: {len(message.data)} bytes, expected {expected} for shape {list(shape)}")
    if expected == 0:
        return torch.empty(shape, dtype=torch_dtype)
    # A read-only view of the message's bytes, no copy: callers copy it into the cache at once
    # (LazyCache.write / stash) and never write through it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(message.data, dtype=torch_dtype).reshape(shape)


def positions_bytes(positions) -> bytes:
    return np.asarray(positions, dtype="<u4").tobytes()


def frame_checksum(frame: pb.KVFrame) -> int:
    """CRC-32 of a frame's payload, chained in the order the .proto documents."""
    crc = zlib.crc32(positions_bytes(frame.positions))
    for part in (frame.k.data, frame.v.data, positions_bytes(frame.aux_positions), frame.aux_hidden.data):
        crc = zlib.crc32(part, crc)
    return crc
