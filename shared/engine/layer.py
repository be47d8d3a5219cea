"""One decoder layer's arithmetic on an arbitrary subset of token rows.

The engine calls the model's own modules (norms, projections, MLP) so that, with every token
present, the result equals transformers' forward. What differs is that the rows of a call are any
set of tokens, each carrying its original position for RoPE and the causal mask.
Shapes: h [m, hidden]; q [1, H, m, D]; k, v [1, Hkv, m, D]; positions [m] (int64).
What differs between families (q/k norms, the norms around each sublayer, RoPE per layer type)
is read from `model.family`; which layers slide their window, from `model.spec`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.engine.model import EngineModel


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same expression as transformers' apply_rotary_pos_emb, so results match to the bit.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def padded(model: EngineModel, x: torch.Tensor) -> torch.Tensor:
    """x [m, d] with zero rows appended up to the row count at which this host's matrix products
    compute each row as a large call does (`model.rows`, shared/engine/invariant.py): a row's
    numbers then do not depend on how many rows were computed with it. The caller keeps [:m]."""
    m = x.shape[0]
    target = model.rows[m] if m < len(model.rows) else m
    return x if target == m else torch.cat([x, x.new_zeros(target - m, x.shape[1])])


def project_qkv(model: EngineModel, index: int, h: torch.Tensor, positions: torch.Tensor):
    """Norm, q/k/v projections and RoPE at original positions. Returns q, k, v as [1, heads, m, D]."""
    layer = model.layers[index]
    attn = layer.self_attn
    spec = model.spec
    m = h.shape[0]
    x = layer.input_layernorm(padded(model, h))
    q = attn.q_proj(x)[:m].view(1, m, spec.num_heads, spec.head_dim)
    k = attn.k_proj(x)[:m].view(1, m, spec.num_kv_heads, spec.head_dim)
    v = attn.v_proj(x)[:m].view(1, m, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    if model.family.qk_norm:  # over each head's D, the last axis either side of the transpose
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    cos_table, sin_table = model.rope[index]
    cos, sin = cos_table[positions], sin_table[positions]  # [m, D], broadcast over heads
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


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


def both(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
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


# Prefill attention over the prompt is one SDPA call whose shapes do not let the prompt's length
# or where the computed rows start change a row's sums. PyTorch's CPU kernel (cpu_flash_attention
# in aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) walks the keys in blocks of KEY_BLOCK, so
# the length of the last block depends on the prompt's: a prompt of 3,041 tokens against one of
# 3,043 moved SmolLM2's bfloat16 logits by 0.4. It takes the queries in blocks of 32, 64 or 256
# (by their count), and a small last block goes to another kernel. On hosts with AMX, in bfloat16,
# it switches to packed brgemm at MIN_QUERIES queries. So: keys padded with zero keys (masked) to a
# whole number of blocks, queries with zero rows to a whole number of QUERY_BLOCK, and where the
# kernel packs (`model.sdpa_packs`) at least MIN_QUERIES query rows. A prefix-cache hit, which computes
# only the new rows over cached keys that another prompt computed, then gets the numbers of a
# prefill from scratch, whatever each prompt's length.
KEY_BLOCK = 512
QUERY_BLOCK = 32  # the smallest of the kernel's query blocks; the others (64, 256) are multiples
MIN_QUERIES = 64


def _query_rows(model: EngineModel, m: int) -> int:
    """The query rows a call of m computed rows is padded to: a whole number of the kernel's
    smallest query block, so that no block is a small one (its product with the keys takes another
    BLAS kernel, as small projections do: a last block of 2 rows parted 3 of 22 answers of
    `bench prefix` from a prefill from scratch)."""
    rows = max(m, MIN_QUERIES) if model.sdpa_packs else m
    return -(-rows // QUERY_BLOCK) * QUERY_BLOCK


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
    masks: a memo of the masks by (start, rows, keys, window), which a run keeps for its layers.
    Returns [1, H, n - start, D]."""
    n, m = keys.shape[2], q.shape[2]
    padded_keys = -(-n // KEY_BLOCK) * KEY_BLOCK
    rows = _query_rows(model, m)
    if rows > m:  # zero queries after the real ones: their outputs are dropped
        q = F.pad(q, (0, 0, 0, rows - m))
    if padded_keys > n:  # zero keys after every real row's position: masked
        keys, values = F.pad(keys, (0, 0, 0, padded_keys - n)), F.pad(values, (0, 0, 0, padded_keys - n))
    window = model.spec.window_at(index)
    if start == 0 and window is None:  # causal from the first key: is_causal, top-left aligned, says it all
        return attend(model, q, keys, values, is_causal=True)[:, :, :m]
    key = (start, rows, padded_keys, window)
    mask = masks.get(key)
    if mask is None:
        q_positions = torch.arange(start, start + rows, device=q.device)
        k_positions = torch.arange(padded_keys, device=q.device)
        sliding = window_mask(model, index, q_positions, k_positions)
        mask = masks[key] = both(causal_mask(q_positions, k_positions), sliding)
    return attend(model, q, keys, values, mask=mask)[:, :, :m]


def finish(model: EngineModel, index: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Output projection, residual, post-attention norm, MLP, residual. h [m, hidden] -> [m, hidden]."""
    layer = model.layers[index]
    m = h.shape[0]
    h = padded(model, h)  # every row-wise step below on the padded rows; [:m] at the end
    out = layer.self_attn.o_proj(padded(model, attn_out.transpose(1, 2).reshape(m, -1)))
    if model.family.sandwich_norm:
        h = h + layer.post_attention_layernorm(out)
        return (h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h))))[:m]
    h = h + out
    return (h + layer.mlp(layer.post_attention_layernorm(h)))[:m]


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


def logits_of(model: EngineModel, h: torch.Tensor) -> torch.Tensor:
    """Final norm and lm_head on rows that each predict a next token. [m, hidden] -> [m, vocab]."""
    logits = model.lm_head(model.norm(padded(model, h)))[: h.shape[0]]
    if model.final_softcap is not None:  # as the LM's forward applies it, in the model's dtype
        logits = torch.tanh(logits / model.final_softcap) * model.final_softcap
    return logits.float()
