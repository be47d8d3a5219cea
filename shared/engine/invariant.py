"""Row counts at which this host's matrix products compute a row as a large call does.

A token's numbers must not depend on what else is computed with it: a decode step of one
sequence and the same step inside a batch of 16, a prefix-cache hit that computes 5 new tokens
and the prefill that computed them among 3,000. The projections are where that breaks on the CPU:
BLAS libraries pick their kernel by the shape, and a small call takes a different one (a
matrix-vector product for one row, small-matrix kernels for a few) that adds its products in
another order. Measured on an AMD EPYC with AVX512-BF16 (torch 2.13, 2 threads): in float32 a
call of 1, 2, 3, 5, 6, 7, 9, 10 or 11 rows differs from the same rows inside a large call, while
4, 8 and 12 or more agree. In bfloat16 calls of 1 and 2 rows differ on a few rows only (86 of
1,024 single rows of SmolLM2's down_proj; 2 to 4 of 1,024 pairs of rows of tiny-gemma3's k_proj),
because most differences of the float32 sums vanish in the rounding to bfloat16: a probe on a few
random rows can miss them.

So the engine pads a call's rows with zero rows (`padded` in layer.py) to at least MIN_ROWS, below
which every kind of call tried had a kernel of its own, and then up to the smallest count that
agrees. This module finds those counts once per process, on the model's own projection weights: for
each count from MIN_ROWS to PROBE_ROWS, the rows of a PROBE_CALL-row call computed in calls of that
count (0.07 s for a tiny model, 0.3-0.5 s for SmolLM2, 1.8-3.1 s for Gemma 3, whose LM head has
262k rows). Counts of
PROBE_ROWS and more are taken as large calls (every count up to 3,100 agreed on the host above).
The cost is what the padded rows compute, and only small calls pay it: `lazyserve bench decode`
measures it (docs/results.md).
"""

from __future__ import annotations

import torch
from torch import nn

MIN_ROWS = 4
PROBE_ROWS = 16
PROBE_CALL = 64  # a float32 kernel switch shows on nearly every row: 64 rows find it
LARGE = 1 << 24  # weights of more elements (the LM head) are probed on fewer row blocks: they are slow to call
OFFSETS_LARGE = 4

_probed: dict[tuple, tuple[int, ...]] = {}


def projections(hf_layers: list[nn.Module], lm_head: nn.Module) -> list[nn.Linear]:
    """One layer's projections and the LM head: every matrix shape the engine multiplies rows by."""
    return [module for module in hf_layers[0].modules() if isinstance(module, nn.Linear)] + [lm_head]


@torch.inference_mode()
def row_counts(linears: list[nn.Linear]) -> tuple[int, ...]:
    """counts[m] for m < PROBE_ROWS: the row count a call of m rows is padded to (m itself where m
    rows already agree with a large call). Probed once per process for each set of shapes."""
    weight = linears[0].weight
    key = (weight.dtype, weight.device.type, tuple(tuple(linear.weight.shape) for linear in linears))
    if key not in _probed:
        generator = torch.Generator().manual_seed(0)
        inputs = [
            torch.randn(PROBE_CALL, linear.in_features, generator=generator).to(weight.device, weight.dtype)
            for linear in linears
        ]
        references = [linear(x) for linear, x in zip(linears, inputs)]
        agreeing = [
            m
            for m in range(MIN_ROWS, PROBE_ROWS)  # all() stops at the first disagreement: the LM head comes last
            if all(_agrees(linear, x, full, m) for linear, x, full in zip(linears, inputs, references))
        ]
        counts = [next((a for a in agreeing if a >= max(m, MIN_ROWS)), PROBE_ROWS) for m in range(1, PROBE_ROWS)]
        _probed[key] = (0, *counts)
    return _probed[key]


def _agrees(linear: nn.Linear, x: torch.Tensor, full: torch.Tensor, m: int) -> bool:
    starts = range(0, PROBE_CALL - m + 1, m)
    if linear.weight.numel() > LARGE:
        starts = starts[:OFFSETS_LARGE]
    return all(torch.equal(linear(x[j : j + m].clone()), full[j : j + m]) for j in starts)
