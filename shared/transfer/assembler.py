"""The receiving side of a KV transfer: every message checked, then written into a LazyCache.

A transfer is a header, frames in non-decreasing layer order, and an end. Each check failure is a
FrameError naming what was wrong; the caller drops the partial cache. What is checked: the header
matches the receiver's model; every frame belongs to this transfer, has a layer in range and in
order, sorted unique positions inside the prompt, tensors of the model's dtype and shape, and a
correct checksum; a (token, layer) arrives at most once and only after the token's earlier
layers; at the end, every token was computed at layer 0, the last token at every layer, and each
token that stopped early sits in the Aux Cache of the layer it stopped after (so decode can
revive it). A stage layer's query window, when sent, must be the model's query shape. The hidden
states of the tokens that went on past the prefix cache's last layer, when sent, must be at that
layer and be exactly those tokens; with them the cache can be given to a prefix cache. Only then
is the cache handed to decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from shared.compute import require_compute_thread
from shared.contract.pruning import MAX_WINDOW
from shared.contract.wire import check_token_ids, pruning_from_pb, sampling_from_pb, stats_from_pb
from shared.engine import LazyCache, ModelSpec, PruneConfig, QueryWindow, SamplingParams, Stats, held_layers
from shared.engine.cache import BoundaryStates
from shared.transfer.tensors import FrameError, dtype_name, frame_checksum, positions_tensor, tensor_from_pb

MAX_TRANSFER_ID = 128


@dataclass
class Assembled:
    """A complete transfer, ready to decode."""

    cache: LazyCache
    prompt_ids: list[int]
    first_tokens: list[int]  # one per choice (params.n)
    config: PruneConfig
    params: SamplingParams
    prefill_stats: Stats


def verify_checksum(frame: pb.KVFrame) -> None:
    """A frame's CRC-32C against its payload; FrameError when they differ. It reads every byte and
    needs no torch, so a receiver checks it on the thread that read the frame."""
    if frame_checksum(frame) != frame.crc32c:
        raise FrameError(f"checksum mismatch in a frame of layer {frame.layer}")


def _check_positions(positions: torch.Tensor, limit: int, name: str) -> None:
    if positions.numel() == 0:
        return
    if bool((positions[1:] <= positions[:-1]).any()):
        raise FrameError(f"{name} must be strictly increasing (sorted, unique)")
    if int(positions[-1]) >= limit:
        raise FrameError(f"{name}: position {int(positions[-1])} is outside the prompt of {limit} tokens")


class TransferAssembler:
    def __init__(self, model_name: str, spec: ModelSpec, dtype: torch.dtype, device, max_prompt: int):
        self.model_name, self.spec, self.dtype, self.device = model_name, spec, dtype, device
        self.max_prompt = max_prompt
        self.transfer_id: str | None = None
        self.cache: LazyCache | None = None
        self.layer = 0
        self.num_frames = 0
        self.kept_at_layer = 0
        self.boundary_layer: int | None = None  # where boundary rows came, if any
        self.boundary: list[tuple[torch.Tensor, torch.Tensor]] = []  # (positions, hidden) pieces

    @property
    def nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.bytes_held

    def header(self, header: pb.TransferHeader) -> None:
        require_compute_thread("assembling a transfer")
        if self.transfer_id is not None:
            raise FrameError("a second header in one transfer")
        if not 0 < len(header.transfer_id) <= MAX_TRANSFER_ID:
            raise FrameError(f"transfer_id must have 1 to {MAX_TRANSFER_ID} characters")
        spec, dtype = self.spec, dtype_name(self.dtype)
        expected = {
            "model": self.model_name,
            "num_layers": spec.num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_dim": spec.head_dim,
            "hidden_size": spec.hidden_size,
            "dtype": dtype,
        }
        for name, value in expected.items():
            if getattr(header, name) != value:
                raise FrameError(f"header {name} is {getattr(header, name)!r}; this worker runs {value!r}")
        n = header.num_prompt_tokens
        if not 1 <= n <= self.max_prompt:
            raise FrameError(f"num_prompt_tokens must be in [1, {self.max_prompt}], got {n}")
        self.transfer_id = header.transfer_id
        self.cache = LazyCache.empty(spec, n, 0, self.dtype, self.device)

    def frame(self, frame: pb.KVFrame, checksum_verified: bool = False) -> None:
        """checksum_verified: the caller ran verify_checksum on this frame already."""
        require_compute_thread("assembling a transfer")
        cache, spec = self._started(frame.transfer_id), self.spec
        if frame.layer >= spec.num_layers:
            raise FrameError(f"layer {frame.layer} is out of range for a {spec.num_layers}-layer model")
        if frame.layer < self.layer:
            raise FrameError(f"layer {frame.layer} after layer {self.layer}: frames must not go back")
        if not checksum_verified:
            verify_checksum(frame)
        while self.layer < frame.layer:
            self._close_layer()
        n, dtype = cache.num_prompt, dtype_name(self.dtype)
        positions = positions_tensor(frame.positions)
        aux_positions = positions_tensor(frame.aux_positions)
        _check_positions(positions, n, "positions")
        _check_positions(aux_positions, n, "aux_positions")
        kv_shape = (1, spec.num_kv_heads, positions.shape[0], spec.head_dim)
        k = tensor_from_pb(frame.k, "k", dtype, kv_shape)
        v = tensor_from_pb(frame.v, "v", dtype, kv_shape)
        hidden = tensor_from_pb(frame.aux_hidden, "aux_hidden", dtype, (aux_positions.shape[0], spec.hidden_size))
        if positions.numel():
            depth = cache.depth[positions]
            if bool((depth != frame.layer).any()):
                bad = int(positions[depth != frame.layer][0])
                raise FrameError(
                    f"token {bad} at layer {frame.layer}: it has KV at {int(cache.depth[bad])} layers "
                    f"(a token-layer twice, or a layer skipped)"
                )
        cache.write(frame.layer, positions.to(self.device), k.to(self.device), v.to(self.device))
        cache.stash(frame.layer, aux_positions.to(self.device), hidden.to(self.device))
        if frame.query_positions:
            self._window(cache, frame)
        if frame.boundary_positions:
            self._boundary(frame)
        self.kept_at_layer += positions.shape[0]
        self.num_frames += 1

    def end(self, end: pb.TransferEnd) -> Assembled:
        require_compute_thread("assembling a transfer")
        cache, spec = self._started(end.transfer_id), self.spec
        if end.num_frames != self.num_frames:
            raise FrameError(f"end says {end.num_frames} frames; {self.num_frames} arrived")
        while self.layer < spec.num_layers:
            self._close_layer()
        n = cache.num_prompt
        depth = cache.depth[:n]
        if bool((depth == 0).any()):
            raise FrameError(f"token {int((depth == 0).nonzero()[0])} was never computed (no KV at layer 0)")
        if int(depth[n - 1]) != spec.num_layers:
            raise FrameError("the last prompt token must have KV at every layer")
        for layer in range(spec.num_layers):
            stopped = (depth == layer + 1).nonzero().flatten() if layer < spec.num_layers - 1 else depth[:0]
            stashed = torch.sort(cache.aux[layer].positions.cpu()).values
            if not torch.equal(stashed, stopped.cpu()):
                raise FrameError(
                    f"Aux Cache of layer {layer} must hold exactly the {stopped.numel()} tokens that stop after it; "
                    f"it holds {stashed.numel()}"
                )
        if len(end.prompt_ids) != n:
            raise FrameError(f"prompt_ids has {len(end.prompt_ids)} tokens; the header announced {n}")
        check_token_ids(end.prompt_ids, spec.vocab_size, "prompt_ids")
        check_token_ids(end.first_tokens, spec.vocab_size, "first_tokens")
        config = pruning_from_pb(end.pruning, spec)
        params = sampling_from_pb(end.sampling, spec.vocab_size)
        if len(end.first_tokens) != params.n:
            raise FrameError(f"sampling.n is {params.n}: {len(end.first_tokens)} first_tokens (one per choice)")
        if n + params.max_new_tokens > self.max_prompt:
            raise FrameError(
                f"{n} prompt tokens + max_new_tokens {params.max_new_tokens} exceed the context of {self.max_prompt}"
            )
        if self.boundary_layer is not None:
            self._close_boundary(cache, config, params.max_new_tokens)
        # Room for the generated tokens now, on the receiving thread, not at the first decode steps.
        cache.reserve(params.max_new_tokens)
        return Assembled(
            cache,
            list(end.prompt_ids),
            list(end.first_tokens),
            config,
            params,
            stats_from_pb(end.prefill_stats),
        )

    def _window(self, cache: LazyCache, frame: pb.KVFrame) -> None:
        spec = self.spec
        if frame.layer in cache.windows:
            raise FrameError(f"a second query window for layer {frame.layer}")
        positions = positions_tensor(frame.query_positions)
        if positions.shape[0] > MAX_WINDOW:
            raise FrameError(f"query window of {positions.shape[0]} queries; at most {MAX_WINDOW}")
        _check_positions(positions, cache.num_prompt, "query_positions")
        shape = (1, spec.num_heads, positions.shape[0], spec.head_dim)
        q = tensor_from_pb(frame.queries, "queries", dtype_name(self.dtype), shape)
        cache.windows[frame.layer] = QueryWindow(positions.to(self.device), q.to(self.device).clone())

    def _boundary(self, frame: pb.KVFrame) -> None:
        if self.boundary_layer not in (None, frame.layer):
            raise FrameError(f"boundary states at layer {frame.layer} after layer {self.boundary_layer}")
        positions = positions_tensor(frame.boundary_positions)
        _check_positions(positions, self.cache.num_prompt, "boundary_positions")
        if self.boundary and int(positions[0]) <= int(self.boundary[-1][0][-1]):
            raise FrameError("boundary_positions must increase across the frames of a layer")
        shape = (positions.shape[0], self.spec.hidden_size)
        hidden = tensor_from_pb(frame.boundary_hidden, "boundary_hidden", dtype_name(self.dtype), shape)
        self.boundary_layer = frame.layer
        self.boundary.append((positions, hidden))

    def _close_boundary(self, cache: LazyCache, config: PruneConfig, extra: int) -> None:
        """Every prompt token's state leaving the prefix cache's last layer: the Aux Cache holds
        those that stopped there, the boundary rows those that went on."""
        layer, n = self.boundary_layer, cache.num_prompt
        if layer != held_layers(config, self.spec.num_layers) - 1:
            raise FrameError(f"boundary states at layer {layer}; this schedule's prefix cache ends at another")
        positions = torch.cat([piece[0] for piece in self.boundary])
        went_on = (cache.depth[:n].cpu() > layer + 1).nonzero().flatten()
        if not torch.equal(positions, went_on):
            raise FrameError(
                f"boundary states must be those of the {went_on.numel()} tokens that went past layer {layer}"
            )
        states = BoundaryStates(layer, self.spec.hidden_size, self.dtype, self.device, n + extra)
        states.write(positions.to(self.device), torch.cat([piece[1] for piece in self.boundary]).to(self.device))
        aux = cache.aux[layer]
        states.write(aux.positions, aux.hidden)
        cache.boundary = states
        self.boundary = []

    def _started(self, transfer_id: str) -> LazyCache:
        if self.cache is None:
            raise FrameError("a transfer must start with its header")
        if transfer_id != self.transfer_id:
            raise FrameError(f"transfer_id {transfer_id[:MAX_TRANSFER_ID]!r} inside transfer {self.transfer_id!r}")
        return self.cache

    def _close_layer(self) -> None:
        self.cache.kept_per_layer.append(self.kept_at_layer)
        self.kept_at_layer = 0
        self.layer += 1
