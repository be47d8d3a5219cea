"""The engine's view of a causal LM: its modules, shapes, family and rotary tables.

It wraps an already-built transformers model of a supported family (shared/engine/family.py) and
knows nothing of files, tokenizers or pruning. The layer loop in `layer.py` calls the modules
held here, so the arithmetic is the model's own.
"""

from __future__ import annotations

import torch
from torch import nn

from shared.contract.model import ModelSpec
from shared.engine.family import FAMILIES
from shared.engine.invariant import projections, row_counts


class EngineModel:
    """Holds the causal LM and precomputed RoPE tables indexed by original position."""

    def __init__(self, hf_model: nn.Module):
        self.hf = hf_model.eval()
        config = hf_model.config
        self.spec = ModelSpec.from_config(config)
        self.family = FAMILIES[self.spec.model_type]
        inner = hf_model.model
        self.embed_tokens = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head
        param = next(hf_model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # rope[l] = (cos, sin), each [max_positions, head_dim]: row p is exactly what the model
        # computes for position p at layer l (layers of one type share the tensors).
        layer_types = ["full_attention"] * self.spec.num_layers  # one table, unless the family has one per type
        if self.family.rope_per_layer_type:
            layer_types = config.layer_types
        tables = {kind: self._rope_table(inner.rotary_emb, kind) for kind in set(layer_types)}
        self.rope = [tables[kind] for kind in layer_types]
        self.scaling = self.layers[0].self_attn.scaling
        # Gemma 2's tanh cap on the logits (None for Gemma 3 and the others), as the LM head applies it.
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        # rows[m]: the row count a call of m rows is padded to (layer.padded), so that no row's
        # numbers depend on how many were computed with it.
        self.rows: tuple[int, ...] = ()
        self.set_batch_invariant(True)
        # Whether SDPA's CPU kernel may switch to packed AMX brgemm by the number of queries (in
        # bfloat16 and float16, where the CPU has AMX tiles): layer.prompt_attention pads for it.
        self.sdpa_packs = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16) and _has_amx()

    @torch.inference_mode()
    def _rope_table(self, rotary_emb: nn.Module, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.spec.max_positions, device=self.device)[None]
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        if self.family.rope_per_layer_type:
            cos, sin = rotary_emb(probe, positions, layer_type)
        else:
            cos, sin = rotary_emb(probe, positions)
        return cos[0], sin[0]

    def set_batch_invariant(self, on: bool) -> None:
        """Pad small projection calls (on, the default) or leave them to the BLAS's own small-call
        kernels (off: faster where those are, and a row's numbers depend on the call's size)."""
        self.rows = row_counts(projections(self.layers, self.lm_head)) if on else ()

    @property
    def batch_invariant(self) -> bool:
        return bool(self.rows)

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as a name: "float32", "bfloat16", ..."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def config(self):
        return self.hf.config


def _has_amx() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except AttributeError:  # a torch without the probe: assume the kernel may pack
        return True
