"""The KV transfer codec: lazy prefill's partial KV and Aux Cache as protobuf messages and back.

The sender turns LayerFrames into frames (frames.py); the receiver validates every message and
assembles a LazyCache (assembler.py). Protobuf types stop here: the engine never sees them.
"""

from shared.contract.wire import (
    pruning_from_pb,
    pruning_to_pb,
    sampling_from_pb,
    sampling_to_pb,
    stats_from_pb,
    stats_to_pb,
)
from shared.transfer.assembler import Assembled, TransferAssembler, verify_checksum
from shared.transfer.frames import DEFAULT_FRAME_BYTES, end_message, frame_messages, header_message, payload_bytes
from shared.transfer.tensors import FrameError

__all__ = [
    "DEFAULT_FRAME_BYTES",
    "Assembled",
    "FrameError",
    "TransferAssembler",
    "end_message",
    "frame_messages",
    "header_message",
    "payload_bytes",
    "pruning_from_pb",
    "pruning_to_pb",
    "sampling_from_pb",
    "sampling_to_pb",
    "stats_from_pb",
    "stats_to_pb",
    "verify_checksum",
]
