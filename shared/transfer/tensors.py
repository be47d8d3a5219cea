"""Tensors on the wire: raw little-endian bytes with dtype and shape, and the frame checksum.

Nothing here unpickles: a received tensor is its declared bytes reinterpreted as a known dtype,
after the byte count was checked against the shape.
"""

from __future__ import annotations

import math
import sys
import warnings

import google_crc32c
import numpy as np
import torch

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from shared.contract.wire import FrameError

# The dtypes a model here runs in; anything else on the wire is refused.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
if sys.byteorder != "little":
    raise ImportError("the wire format is little-endian; this host is not")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def fill_tensor(target: pb.Tensor, tensor: torch.Tensor) -> None:
    """Write `tensor` into a Tensor field in place. Sub-messages are filled where they live: passing
    a finished pb.Tensor to its parent's constructor would copy the payload once more per level."""
    host = tensor.detach().cpu()
    if host.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16, a view of any strides
        host = host.view(torch.int16)
    target.dtype = dtype_name(tensor.dtype)
    target.shape[:] = tensor.shape
    # numpy's tobytes gathers a strided slice (a token range of a layer's K or V) in C order in one
    # copy; .contiguous() first would copy twice, and on the sender's thread, a torch copy of that
    # size would enter torch's OpenMP pool, which only the compute thread may (shared.compute).
    target.data = host.numpy().tobytes()


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


def positions_tensor(positions) -> torch.Tensor:
    """A repeated uint32 field as int64 indices (numpy reads the field's buffer; torch.tensor would
    iterate it element by element)."""
    return torch.from_numpy(np.asarray(positions, dtype=np.int64))


def frame_checksum(frame: pb.KVFrame) -> int:
    """CRC-32C of a frame's payload, chained in the order the .proto documents. google-crc32c
    uses the CPU's CRC instructions: about 4x zlib.crc32's speed, which every byte of KV pays
    twice (sender and receiver) on cores that prefill is computing on."""
    crc = google_crc32c.value(positions_bytes(frame.positions))
    parts = (
        frame.k.data,
        frame.v.data,
        positions_bytes(frame.aux_positions),
        frame.aux_hidden.data,
        positions_bytes(frame.query_positions),
        frame.queries.data,
        positions_bytes(frame.boundary_positions),
        frame.boundary_hidden.data,
    )
    for part in parts:
        crc = google_crc32c.extend(crc, part)
    return crc
