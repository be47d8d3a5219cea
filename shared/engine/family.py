"""What differs between the model families the layer loop computes, one small description each.

The engine calls each model's own modules (norms, projections, MLP with its activation, the
embedding with any scale it applies), so a family only says which of them a layer calls and in
what order; the shapes, windows and RoPE come from the config (ModelSpec, EngineModel). Checked
against transformers' modeling files: `modeling_llama.py`, `modeling_qwen3.py` (q/k norms per
head before RoPE), `modeling_gemma3.py` (q/k norms; a norm after attention and around the MLP;
embeddings scaled by sqrt(hidden) inside the embedding module; one RoPE table per layer type).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    qk_norm: bool = False  # RMSNorm over each head's q and k, before RoPE
    sandwich_norm: bool = False  # post_attention_layernorm on the attention's output, pre/post norms around the MLP
    rope_per_layer_type: bool = False  # the rotary module takes the layer type (local and global bases)


FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(qk_norm=True),
    "gemma3_text": Family(qk_norm=True, sandwich_norm=True, rope_per_layer_type=True),
}
