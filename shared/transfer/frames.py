"""The sending side of a KV transfer: header, layer frames (chunked under a size budget), end."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from shared.contract.wire import pruning_to_pb, sampling_to_pb, stats_to_pb
from shared.engine import LayerFrame, ModelSpec, PruneConfig, SamplingParams, Stats
from shared.net.transport import DEFAULT_FRAME_BYTES
from shared.transfer.tensors import dtype_name, fill_tensor, frame_checksum


def header_message(
    transfer_id: str, model: str, spec: ModelSpec, dtype: torch.dtype, num_prompt: int
) -> pb.TransferMessage:
    return pb.TransferMessage(
        header=pb.TransferHeader(
            transfer_id=transfer_id,
            model=model,
            num_layers=spec.num_layers,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            hidden_size=spec.hidden_size,
            dtype=dtype_name(dtype),
            num_prompt_tokens=num_prompt,
        )
    )


def _chunks(count: int, row_bytes: int, budget: int) -> list[tuple[int, int]]:
    rows = max(1, budget // max(row_bytes, 1))
    return [(start, min(start + rows, count)) for start in range(0, count, rows)]


def frame_messages(transfer_id: str, frame: LayerFrame, budget: int = DEFAULT_FRAME_BYTES) -> list[pb.TransferMessage]:
    """One layer's output as one or more frames, each holding at most `budget` bytes of KV and of Aux."""
    k, v, hidden = frame.k, frame.v, frame.aux_hidden
    kv_row = 2 * k.shape[1] * k.shape[3] * k.element_size()
    aux_row = hidden.shape[-1] * hidden.element_size()
    kv_chunks = _chunks(frame.positions.shape[0], kv_row, budget)
    aux_chunks = _chunks(frame.aux_positions.shape[0], aux_row, budget)
    boundary = frame.boundary_positions
    boundary_chunks = [] if boundary is None else _chunks(boundary.shape[0], aux_row, budget)
    messages = []
    for index in range(max(len(kv_chunks), len(aux_chunks), len(boundary_chunks), 1)):
        a, b = kv_chunks[index] if index < len(kv_chunks) else (0, 0)
        c, d = aux_chunks[index] if index < len(aux_chunks) else (0, 0)
        wrapper = pb.TransferMessage()
        message = wrapper.frame  # filled in place: no copy of the payload per nesting level
        message.transfer_id = transfer_id
        message.layer = frame.layer
        message.positions[:] = frame.positions[a:b].tolist()
        fill_tensor(message.k, k[:, :, a:b])
        fill_tensor(message.v, v[:, :, a:b])
        message.aux_positions[:] = frame.aux_positions[c:d].tolist()
        fill_tensor(message.aux_hidden, hidden[c:d])
        if index == 0 and frame.window is not None:
            message.query_positions[:] = frame.window.positions.tolist()
            fill_tensor(message.queries, frame.window.q)
        if index < len(boundary_chunks):
            e, f = boundary_chunks[index]
            message.boundary_positions[:] = boundary[e:f].tolist()
            fill_tensor(message.boundary_hidden, frame.boundary_hidden[e:f])
        message.crc32c = frame_checksum(message)
        messages.append(wrapper)
    return messages


def end_message(
    transfer_id: str,
    prompt_ids: Sequence[int],
    first_tokens: Sequence[int],
    config: PruneConfig,
    params: SamplingParams,
    num_frames: int,
    prefill_stats: Stats,
) -> pb.TransferMessage:
    return pb.TransferMessage(
        end=pb.TransferEnd(
            transfer_id=transfer_id,
            prompt_ids=list(prompt_ids),
            first_tokens=list(first_tokens),
            pruning=pruning_to_pb(config),
            sampling=sampling_to_pb(params),
            num_frames=num_frames,
            prefill_stats=stats_to_pb(prefill_stats),
        )
    )


def payload_bytes(message: pb.TransferMessage) -> tuple[int, int]:
    """(KV bytes, hidden-state bytes: Aux Cache and the prefix cache's boundary) of a frame
    message; (0, 0) for a header or end."""
    if message.WhichOneof("kind") != "frame":
        return 0, 0
    frame = message.frame
    return len(frame.k.data) + len(frame.v.data), len(frame.aux_hidden.data) + len(frame.boundary_hidden.data)
