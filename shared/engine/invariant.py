"""Fixed-shape calls: a token's numbers do not depend on what else is computed with it.

What must hold, bit for bit:
- a prompt row computed from a prefix-cache hit (the new rows only, over cached keys that
  another prompt computed) equals the same row of a prefill from scratch, on either worker;
- a sequence's decode step inside a batch equals the same step alone (`--batch-invariant`).

Why it breaks without care: a CPU BLAS picks its kernel, its blocking over rows and columns and
how its threads split the sums by the shape of the call. A row computed in a call of 56 rows can
be summed in another order than the same row in a call of 3,000, and which counts agree differs
from host to host (on an AMX Xeon in bfloat16, SmolLM2's down_proj agrees with a 512-row call for
1-32 rows only, its gate_proj for 1 and 33+ rows only; docs/results.md). So nothing here asks the
BLAS which counts it computes alike. Every call a row takes part in has one shape, fixed in
advance, and the argument rests on two properties that any matrix product has, whatever kernel
the host picks:
1. Determinism: the same call (shapes, strides, dtype, thread count, operand values) gives the
   same bits. Operands are laid out so that their strides do not depend on what else is computed
   (a tile of a [rows, width] buffer; attention's token-major buffers, layer._spread).
2. Row independence: a row's outputs depend on that row's inputs alone, not on the other rows'
   values (a product never mixes rows; the sums that run over K run within a row).

Prompt rows (`tiled` with PROMPT_TILE, `prompt_attention` with QUERY_TILE). Every row-wise step
of a layer (norms, projections, MLP) runs on tiles of exactly PROMPT_TILE rows, and the row at
original position p sits at offset p mod PROMPT_TILE of its tile, whatever else is computed: the
other rows of a hit's first tile are zeros where a prefill from scratch has the cached tokens. By
(2) that changes none of the row's outputs, and by (1) its tile's call computes it as the
scratch prefill's call does. Attention over the prompt is one SDPA call per tile of QUERY_TILE
query rows, again at offset p mod QUERY_TILE, over the keys 0..k-1 with k the tile's last
position rounded up to KEY_BLOCK: the call's shape depends on the tile's position only, never on
the prompt's length or where the computed rows start. Keys a row may not see are masked: they add
exact zeros to its sums (their exp is 0; the running max and the rescaling factor exp(0) = 1 do
not change), so which masked keys a call holds changes nothing either. Deeper layers, past the
first cut, compute the same list of rows in a hit and from scratch: same calls, (1) alone.

Both are on with `--batch-invariant` (`EngineModel.set_batch_invariant`); off, every step is one
plain call of its rows, as transformers computes them.

Decode rows (`decode_tile`). A decode step computes each sequence's new token and revived rows,
packed one sequence after another, so a row's offset in its tile depends on the batch: this needs
a third property, checked rather than assumed.
3. Position uniformity: within a call of DECODE_TILE rows, every row position is computed by the
   same arithmetic. BLAS kernels split K the same way for every row of a call (the blocking over K
   and any split of the sums between threads are per call); rows differ only where a kernel
   handles a last, partial block of rows with other code. (On the host this was built on, float32
   calls of 3, 5, 6, 7 and 16 rows computed every position alike, though 5 rows computed unlike a
   large call.) DECODE_TILE = 16 rows is one AMX
   tile's height and a whole number of the common register blocks (4, 8, 16), though not of every
   kernel's. So `check_decode_tile` verifies it on the model's own weights when the switch is
   turned on, and refuses it where the host disagrees, instead of serving numbers that depend on
   the batch.
The row-wise steps that are not products are elementwise or reduce within a row; in a tile of
fixed shape each runs the same vector loop for every row (16 rows of an even hidden size fill
whole vectors: no scalar tail, whose exp or tanh would be another function).

All of this assumes the same torch build and thread count in every worker of a deployment: that
is what `up` and the compose stack start.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Tile sizes trade a prefill's calls (small tiles: more of them, each less efficient) against what
# a prefix hit computes in vain (up to a tile of zero rows at each shared layer); docs/results.md.
PROMPT_TILE = 128
DECODE_TILE = 16
QUERY_TILE = 256  # cpu_flash_attention splits 192 to 767 query rows into blocks of 64: four whole blocks
KEY_BLOCK = 512  # the CPU flash kernel's block of keys (cpu_flash_attention's kv_split_size)


Rows = torch.Tensor | tuple[torch.Tensor, ...]


def tiled(fn: Callable[..., Rows], tile: int | None, offset: int, *xs: torch.Tensor) -> Rows:
    """fn applied to the rows of xs (each [m, ...], row i at original position offset + i) in
    calls of exactly `tile` rows, row i at offset (offset + i) mod tile, zero rows around them;
    fn must map [tile, ...] inputs to one or more [tile, ...] outputs. tile None: one plain call."""
    if tile is None:
        return fn(*xs)
    m = xs[0].shape[0]
    lead = offset % tile
    total = -(-(lead + m) // tile) * tile
    spread = []
    for x in xs:
        full = x.new_zeros(total, *x.shape[1:])
        full[lead : lead + m] = x
        spread.append(full)
    outs = [fn(*(x[j : j + tile] for x in spread)) for j in range(0, total, tile)]
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs)[lead : lead + m]
    return tuple(torch.cat(parts)[lead : lead + m] for parts in zip(*outs))


@torch.inference_mode()
def check_decode_tile(calls: dict[str, tuple[Callable[..., Rows], tuple[torch.Tensor, ...]]]) -> None:
    """Property 3 for each named call (fn, its input tiles of DECODE_TILE rows): every shift of the
    rows gives the same outputs, shifted. Raises where a position computes otherwise."""
    for name, (fn, xs) in calls.items():
        reference = _as_tuple(fn(*xs))
        for shift in range(1, DECODE_TILE):
            shifted = _as_tuple(fn(*(torch.roll(x, shift, 0) for x in xs)))
            for want, got in zip(reference, shifted):
                if not torch.equal(torch.roll(want, shift, 0), got):
                    raise RuntimeError(
                        f"batch invariance cannot hold on this host: its {name} computes the rows of a "
                        f"{DECODE_TILE}-row call differently by their position (torch {torch.__version__}, "
                        f"{xs[0].dtype}); run without --batch-invariant"
                    )


@torch.inference_mode()
def check_row_counts(calls: dict[str, tuple[Callable[..., Rows], tuple[torch.Tensor, ...]]]) -> None:
    """What decode needs where the native row kernels run every product (kernels.invariant_rows):
    a row's outputs do not depend on how many rows share its call. The products hold it by
    construction; this checks the whole row steps (norms, activations, residuals are torch's)
    on the model's own weights: the first m rows of a call equal a call of those m rows alone."""
    for name, (fn, xs) in calls.items():
        reference = _as_tuple(fn(*xs))
        for m in range(1, DECODE_TILE):
            for want, got in zip(reference, _as_tuple(fn(*(x[:m] for x in xs)))):
                if not torch.equal(want[:m], got):
                    raise RuntimeError(
                        f"batch invariance cannot hold on this host: its {name} computes a row of a "
                        f"{m}-row call otherwise than in a {DECODE_TILE}-row call (torch {torch.__version__}, "
                        f"{xs[0].dtype}); run without --batch-invariant"
                    )


def random_rows(width: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """[DECODE_TILE, width] with magnitudes over 2^-6..2^6: where a float32 product sums in another
    order, its outputs show it."""
    x = torch.randn(DECODE_TILE, width, generator=generator)
    return (x * torch.exp2(torch.randint(-6, 7, x.shape, generator=generator).float())).to(dtype)


def cancelling_rows(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Rows x for a product x @ weight.T [out, in] whose sums show their order after a rounding to
    bfloat16, which hides most: row r holds +-2^22 at two inputs i, j whose weights in one output
    column have equal magnitude, signed so that the two products cancel exactly, and small values
    elsewhere. That column's sum is then the small products alone, and how many of them a kernel adds
    to a partial sum that still holds 2^22 x w (losing their low bits) depends on its order.
    Random rows where no column has such a pair (float32 weights, whose random rows suffice)."""
    out_features, width = weight.shape
    x = random_rows(width, torch.float32, generator) * 2.0**-6
    w = weight.detach().float()
    for r in range(DECODE_TILE):
        column = w[(r * 7919) % out_features]  # a different output column for each row
        magnitudes, order = torch.sort(column.abs())
        same = torch.nonzero((magnitudes[1:] == magnitudes[:-1]) & (magnitudes[1:] > 0)).flatten()
        if same.numel() == 0:
            continue
        k = int(same[r % same.numel()])
        i, j = int(order[k]), int(order[k + 1])
        x[r, i] = 2.0**22
        x[r, j] = -(2.0**22) * float(torch.sign(column[i]) * torch.sign(column[j]))
    return x.to(weight.dtype)


def _as_tuple(rows: Rows) -> tuple[torch.Tensor, ...]:
    return (rows,) if isinstance(rows, torch.Tensor) else rows
