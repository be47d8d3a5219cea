"""The engine's view of a causal LM: its modules, shapes, family and rotary tables.

It wraps an already-built transformers model of a supported family (shared/engine/family.py) and
knows nothing of files, tokenizers or pruning. The layer loop in `layer.py` calls the modules
held here, so the arithmetic is the model's own.
"""

from __future__ import annotations

import torch
from torch import nn

from shared import kernels
from shared.contract.model import ModelSpec
from shared.engine.family import FAMILIES
from shared.engine.invariant import DECODE_TILE, PROMPT_TILE, check_decode_tile, check_row_counts
from shared.engine.rows import packing_groups, row_steps


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
        # The rows of each call of a prefill and of a decode step: PROMPT_TILE and DECODE_TILE with
        # batch invariance on (invariant.py), else None: one call of the rows.
        self.prompt_tile: int | None = None
        self.decode_tile: int | None = None
        # The decode kernels' packed weights, made now so that no request pays it (0 on torch's path).
        self.packed_bytes = kernels.prepack(packing_groups(self))

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
        """On: calls of fixed shapes (invariant.py), so that a token's numbers do not depend on
        what else is computed with it (the batch, a prefix hit, the prompt's length), at the cost
        of the tiles' zero rows. Off (the default): one call of each step's rows. Turning it on
        checks that this host computes every row of a decode tile alike
        (invariant.check_decode_tile), or, where the native kernels run decode's products, every
        row alike whatever the rows of its call (check_row_counts), once per process and shape."""
        if on:
            native = kernels.native()
            key = (native, self.dtype, torch.get_num_threads(), *(tuple(p.shape) for p in self.hf.parameters()))
            if key not in _checked:
                if native:  # decode runs its rows in one call, through the row kernels (decode.py)
                    with kernels.invariant_rows():
                        check_row_counts(row_steps(self))
                else:
                    check_decode_tile(row_steps(self))
                _checked.add(key)
        self.prompt_tile, self.decode_tile = (PROMPT_TILE, DECODE_TILE) if on else (None, None)

    @property
    def batch_invariant(self) -> bool:
        return self.decode_tile is not None

    @property
    def kernels(self) -> str:
        """Which kernels its decode step runs, and why: "native (avx512)", "torch (not built ...)"."""
        return kernels.status().describe()

    @property
    def dtype_name(self) -> str:
        """The weights' dtype as a name: "float32", "bfloat16", ..."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def config(self):
        return self.hf.config


_checked: set[tuple] = set()  # (dtype, threads, parameter shapes) whose decode tile was checked
