"""One decoder layer's arithmetic on an arbitrary subset of token rows.

The engine calls the model's own modules (norms, projections, MLP) so that, with every token
present, the result equals transformers' forward. What differs is that the rows of a call are any
set of tokens, each carrying its original position for RoPE and the causal mask.
Shapes: h [m, hidden]; q [1, H, m, D]; k, v [1, Hkv, m, D]; positions [m] (int64).
What differs between families (q/k norms, the norms around each sublayer, RoPE per layer type)
is read from `model.family`; which layers slide their window, from `model.spec`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shared import kernels
from shared.engine.invariant import KEY_BLOCK, QUERY_TILE, tiled
from shared.engine.model import EngineModel
from shared.engine.rows import finish_rows, logit_rows, qkv_rows


def project_qkv(
    model: EngineModel, index: int, h: torch.Tensor, positions: torch.Tensor, tile: int | None = None, offset: int = 0
):
    """Norm, q/k/v projections and RoPE at original positions. Returns q, k, v as [1, heads, m, D].
    tile, offset: the rows' calls (invariant.tiled); None, one call of the m rows."""
    spec = model.spec
    m = h.shape[0]
    q, k, v = tiled(functools.partial(qkv_rows, model.layers[index], model.family.qk_norm, spec), tile, offset, h)
    cos, sin = model.rope[index]
    q = kernels.rope(q.view(m, spec.num_heads, spec.head_dim), positions, cos, sin)
    k = kernels.rope(k.view(m, spec.num_kv_heads, spec.head_dim), positions, cos, sin)
    v = v.view(m, spec.num_kv_heads, spec.head_dim)
    return q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


def window_mask(model: EngineModel, index: int, q_positions: torch.Tensor, k_positions: torch.Tensor):
    """bool [m, n], True where a key lies inside layer `index`'s sliding window of a query (the
    last W positions, the query's own included, as transformers' sliding_window_overlay); None at a
    global layer, or where every key does, so that nothing is built or applied."""
    window = model.spec.window_at(index)
    if window is None or int(q_positions.max()) - int(k_positions.min()) < window:
        return None
    return k_positions[None, :] > q_positions[:, None] - window


def causal_mask(q_positions: torch.Tensor, k_positions: torch.Tensor) -> torch.Tensor:
    """bool [m, n]: a query sees the keys at or before its original position."""
    return k_positions[None, :] <= q_positions[:, None]


def mask_and(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The AND of two optional masks (None: no constraint)."""
    if a is None:
        return b
    return a if b is None else a & b


def attend(
    model: EngineModel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    masked_call: bool = False,
) -> torch.Tensor:
    """SDPA with grouped KV heads. mask: bool [m, n] or [n], True = attend. Returns [1, H, m, D].

    masked_call: one query row computed as transformers computes it when it passes a mask (a
    sliding-window layer's decode step): folded heads and a mask even where every key is live."""
    spec = model.spec
    groups = spec.num_heads // spec.num_kv_heads
    if masked_call and mask is None:
        mask = torch.ones(k.shape[2], dtype=torch.bool, device=k.device)
    if q.shape[2] == 1 and groups > 1 and (q.dtype == torch.float32 or masked_call):
        # One query row: fold the query heads of a group into the row axis, so SDPA reads each
        # KV head once instead of repeating it (transformers' pack_gqa does the same where it
        # passes a mask). Otherwise float32 only: in bfloat16 the folded call rounds differently
        # from transformers' unmasked one (enable_gqa; logits a step or two apart, enough to
        # flip a near-tie in greedy decoding), which the call below matches bit for bit.
        qg = q.reshape(1, spec.num_kv_heads, groups, spec.head_dim)
        m = None if mask is None else mask.view(1, 1, 1, -1)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=model.scaling)
        return out.reshape(1, spec.num_heads, 1, spec.head_dim)  # CUDA's SDPA may return it strided
    if mask is not None:
        mask = mask[None, None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=model.scaling, enable_gqa=groups > 1
    )


def attend_slots(
    model: EngineModel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """One query row for each of n sequences in one call: q [n, H, 1, D] over its own keys
    k, v [n, Hkv, L, D] (a DecodeSlots store), mask bool [n, L] or None. Returns [n, H, 1, D].
    Laid out as `attend` lays out one row (heads folded in float32, enable_gqa in bfloat16)."""
    spec = model.spec
    n, groups = q.shape[0], spec.num_heads // spec.num_kv_heads
    mask = None if mask is None else mask[:, None, None, :]
    if groups > 1 and q.dtype == torch.float32:
        qg = q.reshape(n, spec.num_kv_heads, groups, spec.head_dim)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=model.scaling)
        return out.reshape(n, spec.num_heads, 1, spec.head_dim)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=model.scaling, enable_gqa=groups > 1)


def attend_live(
    model: EngineModel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    sizes: torch.Tensor,
    row_slot: torch.Tensor,
    limits: torch.Tensor,
    live: torch.Tensor | None,
) -> torch.Tensor:
    """Decode rows q [1, H, m, D] over the keys of their slots in k, v [S, Hkv, C, D] (positions
    [S, C], sizes [S], row_slot [m]): each row sees its slot's keys at positions up to its limit
    [m] that its live set [S, W] keeps (None: all), and nothing else is read where the native
    kernels run (kernels.decode_attention). Returns [1, H, m, D]."""
    out = kernels.decode_attention(q[0].transpose(0, 1), k, v, positions, sizes, row_slot, limits, live, model.scaling)
    return out.transpose(0, 1).unsqueeze(0)


def prompt_attention(
    model: EngineModel,
    index: int,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    masks: dict,
) -> torch.Tensor:
    """Causal attention of the queries at original positions start..n-1 (q [1, H, n - start, D])
    over the keys at 0..n-1 ([1, Hkv, n, D]), within layer `index`'s sliding window if it has one.
    One SDPA call per tile of QUERY_TILE positions, each over the keys before its end rounded up to
    KEY_BLOCK, so that a call's shape depends on where its tile lies and nothing else (the argument
    is in shared/engine/invariant.py). masks: a memo of each tile's mask by (tile start, window),
    which a run keeps for its layers. Returns [1, H, n - start, D]."""
    spec = model.spec
    n, m = keys.shape[2], q.shape[2]
    first = start // QUERY_TILE * QUERY_TILE
    end = -(-n // QUERY_TILE) * QUERY_TILE
    # Zero queries around the computed ones (outputs dropped), laid out token-major as _spread's keys.
    q = F.pad(q.transpose(1, 2), (0, 0, 0, 0, start - first, end - n)).transpose(1, 2)
    width = -(-end // KEY_BLOCK) * KEY_BLOCK
    keys, values = _spread(keys, spec.num_heads, width), _spread(values, spec.num_heads, width)
    window = spec.window_at(index)
    outs = []
    for tile_start in range(first, end, QUERY_TILE):
        seen = -(-(tile_start + QUERY_TILE) // KEY_BLOCK) * KEY_BLOCK
        mask = masks.get((tile_start, window))
        if mask is None:
            q_positions = torch.arange(tile_start, tile_start + QUERY_TILE, device=q.device)
            k_positions = torch.arange(seen, device=q.device)
            sliding = window_mask(model, index, q_positions, k_positions)
            mask = masks[(tile_start, window)] = mask_and(causal_mask(q_positions, k_positions), sliding)
        rows = slice(tile_start - first, tile_start - first + QUERY_TILE)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, rows], keys[:, :, :seen], values[:, :, :seen], attn_mask=mask, scale=model.scaling
            )
        )
    return torch.cat(outs, dim=2)[:, :, start - first : start - first + m]


def _spread(kv: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """[1, Hkv, n, D] -> [1, heads, width, D]: each KV head repeated for its group of query heads
    (once per layer, not in every tile's call), zero keys after the n real ones (masked). Laid out
    token-major ([1, width, heads, D] in memory), so that a tile's slice [:, :, :k] has the same
    strides whatever the prompt's length: its call is the same call (invariant.py, property 1)."""
    _, kv_heads, n, dim = kv.shape
    out = kv.new_zeros(1, width, kv_heads, heads // kv_heads, dim)
    out[:, :n] = kv.transpose(1, 2)[:, :, :, None]
    return out.view(1, width, heads, dim).transpose(1, 2)


def finish(
    model: EngineModel, index: int, h: torch.Tensor, attn_out: torch.Tensor, tile: int | None = None, offset: int = 0
) -> torch.Tensor:
    """Output projection, residual, post-attention norm, MLP, residual. h [m, hidden] -> [m, hidden].
    tile, offset: as project_qkv's."""
    m = h.shape[0]
    rows = functools.partial(finish_rows, model.layers[index], model.family.sandwich_norm)
    return tiled(rows, tile, offset, h, attn_out.transpose(1, 2).reshape(m, -1))


def window_scores(
    model: EngineModel,
    q: torch.Tensor,
    k: torch.Tensor,
    key_mask: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention probabilities from the last query rows to each key, summed over the rows and
    averaged over all query heads (SnapKV's observation window; one row is LazyLLM's score).

    q [1, H, w, D]; k [1, Hkv, n, D]; key_mask bool [n] or None. With w > 1, q_positions [w] and
    k_positions [n] give the causal mask (a query sees keys at or before it). Returns [n]. Only
    these w rows are built, never an n x n matrix.
    """
    if q.shape[2] > 1:
        return window_probs(model, q, k, key_mask, q_positions, k_positions).sum(dim=2).mean(dim=(0, 1))
    # The last query sees every key: no causal mask, bit for bit the published LazyLLM score.
    logits = _window_logits(model, q, k)
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask, float("-inf"))
    return torch.softmax(logits, dim=-1).mean(dim=(0, 1))


def _window_logits(model: EngineModel, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [1, H, w, D] against k [1, Hkv, n, D]: [Hkv, G * w, n], each KV head's query rows together."""
    spec = model.spec
    groups, w = spec.num_heads // spec.num_kv_heads, q.shape[2]
    # Scores in float32 whatever the model's dtype (a no-op for float32 models): bfloat16 logits
    # carry 8 bits of mantissa, enough to reorder close tokens, and these rows are cheap.
    qg = q.reshape(spec.num_kv_heads, groups * w, spec.head_dim).float()
    return torch.matmul(qg, k[0].float().transpose(1, 2)) * model.scaling


def window_probs(
    model: EngineModel,
    q: torch.Tensor,
    k: torch.Tensor,
    key_mask: torch.Tensor | None,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
) -> torch.Tensor:
    """Each query row's causal attention probabilities in float32, per head: [Hkv, G, w, n].
    `window_scores` sums them over the rows and averages over the heads."""
    spec = model.spec
    groups, w = spec.num_heads // spec.num_kv_heads, q.shape[2]
    logits = _window_logits(model, q, k)
    visible = k_positions[None, :] <= q_positions[:, None]  # [w, n]
    if key_mask is not None:
        visible = visible & key_mask[None, :]
    logits = logits.view(spec.num_kv_heads, groups, w, -1).masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1)


def logits_of(model: EngineModel, h: torch.Tensor, tile: int | None = None) -> torch.Tensor:
    """Final norm and lm_head on rows that each predict a next token. [m, hidden] -> [m, vocab]
    in float32. tile: as project_qkv's (offset 0)."""
    return tiled(functools.partial(logit_rows, model), tile, 0, h).float()
