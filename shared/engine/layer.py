"""One decoder layer's arithmetic on an arbitrary subset of token rows.

The engine calls the model's own modules (norms, projections, MLP) so that, with every token
present, the result equals transformers' forward. What differs is that the rows of a call are any
set of tokens, each carrying its original position for RoPE and the causal mask.
Shapes: h [m, hidden]; q [1, H, m, D]; k, v [1, Hkv, m, D]; positions [m] (int64).
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


def project_qkv(model: EngineModel, index: int, h: torch.Tensor, positions: torch.Tensor):
    """Norm, q/k/v projections and RoPE at original positions. Returns q, k, v as [1, heads, m, D]."""
    layer = model.layers[index]
    attn = layer.self_attn
    spec = model.spec
    m = h.shape[0]
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(1, m, spec.num_heads, spec.head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(1, m, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(1, m, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    cos, sin = model.cos[positions], model.sin[positions]  # [m, D], broadcast over heads
    return _rotate(q, cos, sin), _rotate(k, cos, sin), v


def attend(
    model: EngineModel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """SDPA with grouped KV heads. mask: bool [m, n], True = attend. Returns [1, H, m, D]."""
    spec = model.spec
    groups = spec.num_heads // spec.num_kv_heads
    if q.shape[2] == 1 and groups > 1 and q.dtype == torch.float32:
        # One query row: fold the query heads of a group into the row axis, so SDPA reads each
        # KV head once instead of repeating it (transformers' pack_gqa does the same). Float32
        # only: in bfloat16 the folded call rounds differently from transformers' (logits a step
        # or two apart, enough to flip a near-tie in greedy decoding), the call below matches it
        # bit for bit.
        qg = q.reshape(1, spec.num_kv_heads, groups, spec.head_dim)
        m = None if mask is None else mask.view(1, 1, 1, -1)
        out = F.scaled_dot_product_attention(qg, k, v, attn_mask=m, scale=model.scaling)
        return out.reshape(1, spec.num_heads, 1, spec.head_dim)  # CUDA's SDPA may return it strided
    if mask is not None:
        mask = mask[None, None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=model.scaling, enable_gqa=groups > 1
    )


def finish(model: EngineModel, index: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Output projection, residual, post-attention norm, MLP, residual. h [m, hidden] -> [m, hidden]."""
    layer = model.layers[index]
    m = h.shape[0]
    h = h + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(m, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


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
    return model.lm_head(model.norm(h)).float()
