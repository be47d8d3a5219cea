"""The engine's view of a Llama-family causal LM: its modules, shapes and rotary tables.

It wraps an already-built transformers model (Llama, Mistral, Qwen2 share one layer shape) and
knows nothing of files, tokenizers or pruning. The layer loop in `layer.py` calls the modules
held here, so the arithmetic is the model's own.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.contract.model import ModelSpec


class EngineModel:
    """Holds the causal LM and precomputed RoPE tables indexed by original position."""

    def __init__(self, hf_model: nn.Module):
        self.hf = hf_model.eval()
        self.spec = ModelSpec.from_config(hf_model.config)
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        param = next(hf_model.parameters())
        self.device, self.dtype = param.device, param.dtype
        with torch.inference_mode():
            positions = torch.arange(self.spec.max_positions, device=self.device)[None]
            cos, sin = inner.rotary_emb(torch.empty(0, dtype=self.dtype, device=self.device), positions)
        # cos, sin: [max_positions, head_dim]; row p is exactly what the model computes for position p.
        self.cos, self.sin = cos[0], sin[0]
        self.scaling = self.layers[0].self_attn.scaling

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as a name: "float32", "bfloat16", ..."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def config(self):
        return self.hf.config
