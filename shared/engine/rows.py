"""The row-wise steps of a layer and of the LM head: what each token computes from its own numbers.

Each maps [rows, ...] to [rows, ...] and never mixes rows, so that layer.py can call it on any
set of tokens, in one call or in the fixed tiles of batch invariance (invariant.py); `row_steps`
gives invariant.check_decode_tile what to check. It knows the model only as its modules: no
attention, positions or cache.
"""

from __future__ import annotations

import functools

import torch

from shared.engine.invariant import cancelling_rows, random_rows
from shared.kernels import linear, linear_group, rms_norm, silu_mul


def project(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A projection of the model's through the kernels' face (native for a decode step's few
    rows, torch's BLAS for a prompt's): module(x), computed where it is fastest."""
    return linear(x, module.weight, module.bias)


def project_group(modules: tuple[torch.nn.Linear, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Projections of one input (q/k/v, gate and up) in one call where the native kernel runs them:
    each output the same bits as `project`'s."""
    return linear_group(x, tuple(m.weight for m in modules), tuple(m.bias for m in modules))


def packing_groups(model) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]]:
    """The (weights, biases) of every call the row steps make, grouped as they call them: what
    kernels.prepack packs at load (model: EngineModel)."""
    groups = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for modules in ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), _gate_up(mlp), (mlp.down_proj,)):
            groups.append((tuple(m.weight for m in modules), tuple(m.bias for m in modules)))
    groups.append(((model.lm_head.weight,), (model.lm_head.bias,)))
    return groups


def _gate_up(mlp) -> tuple[torch.nn.Linear, ...]:
    return (mlp.gate_proj, mlp.up_proj)


def norm(module, h: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An RMSNorm module of the model's on h (+ residual) through the kernels' face: (normed, the
    sum). Gemma's norms scale by (1 + weight) in float32 (and name their epsilon `eps`)."""
    unit_offset = hasattr(module, "eps")  # Gemma3RMSNorm; Llama's, Qwen's, Mistral's: variance_epsilon
    eps = module.eps if unit_offset else module.variance_epsilon
    return rms_norm(h, module.weight, eps, unit_offset, module, residual)


def mlp_rows(mlp, x: torch.Tensor) -> torch.Tensor:
    """The gated MLP of every family here, down(act(gate(x)) * up(x)), as transformers' MLP
    modules compute it, with the projections through `project` (and SiLU x up fused where the
    activation is SiLU)."""
    gate, up = project_group(_gate_up(mlp), x)
    hidden = silu_mul(gate, up) if type(mlp.act_fn).__name__ in SILU else mlp.act_fn(gate) * up
    return project(mlp.down_proj, hidden)


SILU = ("SiLUActivation", "SiLU")  # transformers' ACT2FN["silu"] (a SiLU of its own), torch's


def qkv_rows(layer, qk_norm: bool, spec, h: torch.Tensor):
    """Norm and q/k/v projections of one decoder layer: h [rows, hidden] -> q [rows, H * D], k and v
    [rows, Hkv * D], q and k normed per head where the family norms them (spec: ModelSpec)."""
    attn = layer.self_attn
    x, _ = norm(layer.input_layernorm, h)
    q, k, v = project_group((attn.q_proj, attn.k_proj, attn.v_proj), x)
    if qk_norm:  # over each head's D
        rows = h.shape[0]
        q = attn.q_norm(q.view(rows, spec.num_heads, spec.head_dim)).view(rows, -1)
        k = attn.k_norm(k.view(rows, spec.num_kv_heads, spec.head_dim)).view(rows, -1)
    return q, k, v


def finish_rows(layer, sandwich_norm: bool, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Output projection, residual, the norms around the MLP, MLP, residual of one decoder layer:
    h [rows, hidden], attn_out [rows, H * D] -> [rows, hidden]."""
    out = project(layer.self_attn.o_proj, attn_out)
    if sandwich_norm:
        h = h + norm(layer.post_attention_layernorm, out)[0]
        return (
            h
            + norm(layer.post_feedforward_layernorm, mlp_rows(layer.mlp, norm(layer.pre_feedforward_layernorm, h)[0]))[
                0
            ]
        )
    x, h = norm(layer.post_attention_layernorm, h, out)  # h + out, and its norm, in one pass
    return h + mlp_rows(layer.mlp, x)


def logit_rows(model, h: torch.Tensor) -> torch.Tensor:
    """Final norm, LM head and the family's cap on the logits (model: EngineModel): [rows, hidden]
    -> [rows, vocab] in the model's dtype."""
    logits = project(model.lm_head, norm(model.norm, h)[0])
    if model.final_softcap is not None:  # as the LM's forward applies it, in the model's dtype
        logits = torch.tanh(logits / model.final_softcap) * model.final_softcap
    return logits


def row_steps(model) -> dict:
    """What invariant.check_decode_tile checks, with its input tiles: the row-wise steps of the
    first layer (every layer has the same shapes) and of the LM head on random rows, and each of
    their products on rows whose sums show their order."""
    spec, first, dtype = model.spec, model.layers[0], model.dtype
    generator = torch.Generator().manual_seed(0)
    steps = {
        "q/k/v projections": (
            functools.partial(qkv_rows, first, model.family.qk_norm, spec),
            (random_rows(spec.hidden_size, dtype, generator),),
        ),
        "output projection and MLP": (
            functools.partial(finish_rows, first, model.family.sandwich_norm),
            (
                random_rows(spec.hidden_size, dtype, generator),
                random_rows(spec.num_heads * spec.head_dim, dtype, generator),
            ),
        ),
        "LM head": (functools.partial(logit_rows, model), (random_rows(spec.hidden_size, dtype, generator),)),
    }
    linears = {name: module for name, module in first.named_modules() if isinstance(module, torch.nn.Linear)}
    for name, module in {**linears, "lm_head": model.lm_head}.items():
        steps[name] = (
            functools.partial(project, module),
            (cancelling_rows(module.weight, generator).to(model.device),),
        )
    return steps
