"""The decode step's kernels: a native library made for few rows, with torch as reference and fallback.

The engine calls `linear`, `decode_attention`, `rms_norm`, `silu_mul` and `rope` here; this module
checks the shapes and picks the path, and nothing above it knows which one ran. The native library (csrc/, one file per
kernel) is compiled once by `make setup` (build.py) and only loaded here: where it is missing,
stale or the CPU lacks AVX2, the torch path runs and `status()` says why (the services show it in
/status and `lazyserve --version`). `select("torch")` runs the torch path on purpose, so that a
benchmark can put both side by side.

What the native path promises: a row's outputs do not depend on the other rows of its call or on
the thread count (each output is summed in one fixed order), so a decode step is batch-invariant
by construction where it runs them (`invariant_rows`). Where a kernel does not beat torch's on a
shape (bench/kernels.py measures both), `linear` leaves that shape to torch; docs/results.md has
the figures.

The linear reads its weights packed into panels (csrc/linear.inc), made once per weight (or group
of weights that share an input: a layer's q/k/v, its gate and up) at load by `prepack`, or at the
first native call: a second copy beside torch's [N, K] one, which the prompt path's BLAS reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import weakref

import torch
import torch.nn.functional as F

from shared.kernels import build

log = logging.getLogger(__name__)

# Rows a call may have and still go to the native linear (the prompt path keeps the BLAS). The
# packed micro-kernel reads one row's weights near the read bandwidth and, up to 16 rows, runs
# float32 at or above the BLAS's rate on every projection but the smallest (k/v: 0.85-1.07x; the
# LM head 1.1-1.6x); in bfloat16 it wins where the CPU has no bfloat16 products, and from a few
# rows on loses to those that have them (AMX, AVX512-BF16). bench kernels measures both;
# docs/results.md has the figures.
FEW_ROWS = 4
SOME_ROWS = 16


@dataclasses.dataclass(frozen=True)
class KernelStatus:
    """Which path runs, and why: what /status and `lazyserve --version` show."""

    path: str  # "native" or "torch"
    built: bool  # the library is built for these sources and loaded
    isa: str  # "avx512", "avx2", or "" where not loaded
    reason: str  # why the torch path runs, "" where native does

    def describe(self) -> str:
        if self.path == "native":
            return f"native ({self.isa})"
        return f"torch ({self.reason})" if self.reason else "torch"


_lock = threading.Lock()
_loaded: tuple[bool, str] | None = None  # (loaded, why not)
_path: str | None = None  # None until select(): then native where built
_local = threading.local()  # .invariant: the current thread's decode rows must be row-invariant


def _load() -> tuple[bool, str]:
    """Load the built library once: (True, "") or (False, why not)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is None:
            _loaded = _try_load()
            if not _loaded[0]:
                log.warning("native kernels not used: %s; running torch's", _loaded[1])
        return _loaded


def _try_load() -> tuple[bool, str]:
    library = build.library_path()
    if not library.exists():
        return False, "not built (make setup builds it)"
    stamp = build.stamp_path()
    if not stamp.exists() or stamp.read_text().strip() != build.fingerprint():
        return False, "built from other sources or for another torch (make setup rebuilds it)"
    try:
        torch.ops.load_library(str(library))
    except OSError as error:
        return False, f"cannot load {library.name}: {error}"
    if torch.ops.lazyserve.isa() == "none":
        return False, "this CPU lacks AVX2 and FMA"
    return True, ""


@functools.cache
def _bf16_matmul() -> bool:
    """Whether the CPU multiplies bfloat16 in hardware (asked of the library once, not per call)."""
    return torch.ops.lazyserve.bf16_matmul()


def select(name: str) -> KernelStatus:
    """Use the "native" kernels (where built; else torch, and status() says why) or "torch"'s.
    For the whole process: a service calls it once at start, a benchmark around each side."""
    global _path
    if name not in ("native", "torch"):
        raise ValueError(f"kernels must be native or torch, not {name!r}")
    _path = "native" if name == "native" and _load()[0] else "torch"
    return status()


@contextlib.contextmanager
def selected(name: str):
    """select(name) within it, the path before it after."""
    before = status().path
    try:
        yield select(name)
    finally:
        select(before)


def status() -> KernelStatus:
    native()  # the default where nothing selected
    loaded, why = _load()
    isa = torch.ops.lazyserve.isa() if loaded else ""
    reason = "" if _path == "native" else ("--kernels torch" if loaded else why)
    return KernelStatus(path=_path, built=loaded, isa=isa, reason=reason)


def native() -> bool:
    """Whether the native path runs (until select() is called: where the library is built)."""
    if _path is None:
        select("native")
    return _path == "native"


@contextlib.contextmanager
def invariant_rows(on: bool = True):
    """Within it, on this thread, every `linear` call and every row-wise op goes to the native
    kernels whatever its rows (where the native path runs), so that a row's numbers do not
    depend on its batch (a decode step under --batch-invariant)."""
    before = getattr(_local, "invariant", False)
    _local.invariant = on
    try:
        yield
    finally:
        _local.invariant = before


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]): [..., N], as F.linear computes it."""
    return linear_group(x, (weight,), (bias,))[0]


def linear_group(
    x: torch.Tensor, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]
) -> tuple[torch.Tensor, ...]:
    """linear(x, w, b) for each (w, b) of one input (a layer's q/k/v, its gate and up): one call of
    the native kernel over their panels packed side by side, where it runs. Each output is summed
    alone in the kernel, so it is the same bits as its own call's. The weights share a dtype."""
    if not (native() and _native_rows(x, weights[0])):
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    pack = _pack(weights, biases)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    out = torch.ops.lazyserve.linear(rows.contiguous(), pack.panels, pack.bias, pack.outputs)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], pack.outputs)
    return (out,) if len(weights) == 1 else out.split(pack.sizes, dim=-1)


@dataclasses.dataclass(frozen=True)
class Pack:
    """Weights [N_i, K] (and biases) repacked for the native linear: panels [P, K, PANEL] of PANEL
    outputs each (the group's outputs one after another, zeros past the last), as they were at
    `versions`."""

    panels: torch.Tensor
    bias: torch.Tensor | None  # [sum N_i], zeros for a weight without one; None where none has one
    sizes: tuple[int, ...]  # N_i of each weight
    versions: tuple[int, ...]  # the tensors' _version when packed: an in-place change repacks
    sources: tuple[weakref.ref, ...]  # the tensors packed: a key whose id another tensor took misses

    def packs(self, tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> bool:
        """Whether this is the pack of these very tensors as they are now."""
        return self.versions == versions and all(ref() is t for ref, t in zip(self.sources, tensors))

    @property
    def outputs(self) -> int:
        return sum(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.panels.numel() * self.panels.element_size()


# A weight carries the packs of the groups it leads as an attribute (a dict by the ids of the
# group's tensors): found in a getattr at every call, and dropped with the weight. A hit is checked
# against weak references to the tensors packed, so an id that a later tensor took (a copy of the
# model carrying the attribute along) packs anew.
PACKS = "_lazyserve_packs"


def _pack(weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...]) -> Pack:
    tensors = (*weights, *(b for b in biases if b is not None))
    packs = getattr(weights[0], PACKS, None)
    if packs is None:
        packs = {}
        setattr(weights[0], PACKS, packs)
    key = tuple(map(id, tensors))
    versions = tuple(0 if t.is_inference() else t._version for t in tensors)  # inference tensors keep none
    pack = packs.get(key)
    if pack is None or not pack.packs(tensors, versions):
        pack = packs[key] = _packed(weights, biases, tensors, versions)
    return pack


@torch.inference_mode(False)
def _packed(weights, biases, tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> Pack:
    width = int(torch.ops.lazyserve.panel_width())
    stacked = torch.cat([w.detach() for w in weights])
    n, k = stacked.shape
    panels = -(-n // width)
    padded = F.pad(stacked, (0, 0, 0, panels * width - n))  # [P * PANEL, K]
    packed = padded.view(panels, width, k).transpose(1, 2).contiguous()  # [P, K, PANEL]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(weights, biases)])
    sources = tuple(weakref.ref(t) for t in tensors)
    return Pack(packed, bias, tuple(w.shape[0] for w in weights), versions, sources)


def prepack(groups: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]]) -> int:
    """Pack each group of (weights, biases) now (a model's projections at load, so that no request
    pays it), where the native path runs. Returns the bytes the packs hold."""
    if not native():
        return 0
    on_cpu = [(w, b) for w, b in groups if w[0].device.type == "cpu" and w[0].dtype in (torch.float32, torch.bfloat16)]
    return sum(_pack(weights, biases).nbytes for weights, biases in on_cpu)


def _native_rows(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.dtype != weight.dtype:
        return False
    if weight.dim() != 2 or x.requires_grad:
        return False
    rows = x.numel() // x.shape[-1]
    if getattr(_local, "invariant", False) or rows <= FEW_ROWS:
        return True
    if rows > SOME_ROWS:
        return False
    return x.dtype == torch.float32 or not _bf16_matmul()


def _row_work(x: torch.Tensor) -> bool:
    """Whether a row-wise op on x [rows, ...] goes native: a decode step's few rows (or any, within
    invariant_rows), float32 or bfloat16, on the CPU. A prompt's rows stay on torch's ops."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16) or x.requires_grad:
        return False
    return x.shape[0] <= SOME_ROWS or getattr(_local, "invariant", False)


def rms_norm(x, weight, eps: float, unit_offset: bool, reference, residual=None):
    """The norm of x (+ residual) [rows, H] and that sum: (normed, x + residual or x).
    unit_offset: Gemma's form, h / rms x (1 + weight) rounded once; else Llama's, (h / rms)
    rounded, times the weight. reference: the model's own norm module, the torch path."""
    if native() and _row_work(x):
        x = x.contiguous()
        residual = None if residual is None else residual.contiguous()
        normed, summed = torch.ops.lazyserve.rms_norm(x, residual, weight, eps, unit_offset)
        return normed, (x if residual is None else summed)
    h = x if residual is None else x + residual
    return reference(h), h


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, as transformers' gated MLP computes it."""
    if native() and _row_work(gate):
        return torch.ops.lazyserve.silu_mul(gate.contiguous(), up.contiguous())
    return F.silu(gate) * up


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [rows, heads, D] at positions [rows] from the tables cos, sin [P, D]: x * cos +
    rotate_half(x) * sin, as transformers' apply_rotary_pos_emb computes it (native: the same
    roundings, so the same bits)."""
    if native() and _row_work(x) and x.shape[-1] % 32 == 0:
        return torch.ops.lazyserve.rope(x.contiguous(), positions, cos, sin)
    c, s = cos[positions][:, None], sin[positions][:, None]  # [rows, 1, D]: broadcast over heads
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * c) + (rotated * s)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    sizes: torch.Tensor,
    row_slot: torch.Tensor,
    limits: torch.Tensor,
    live: torch.Tensor | None,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Each query row over the keys of its slot that it may see: q [R, H, D]; k, v [S, Hkv, C, D]
    (rows contiguous); positions [S, C] int64; sizes [S] (rows held per slot); row_slot [R];
    limits [R] (a row sees the keys at positions <= its limit, and above limit - window where a
    window is given); live [S, W] bool or None (position p of slot s is read only where p >= W or
    live[s, p]: the selection's live set). Returns [R, H, D] in q's dtype. Native: only the
    visible keys' rows are read; torch: masked SDPA per row, the reference."""
    if native() and q.device.type == "cpu":
        return torch.ops.lazyserve.decode_attention(
            q.contiguous(), k, v, positions, sizes, row_slot, limits, live, window, scale
        )
    return decode_attention_reference(q, k, v, positions, sizes, row_slot, limits, live, scale, window)


def decode_attention_reference(q, k, v, positions, sizes, row_slot, limits, live, scale, window=0) -> torch.Tensor:
    """decode_attention with torch's SDPA, one row at a time over its slot's visible keys."""
    rows, heads, dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty_like(q)
    for r in range(rows):
        slot = int(row_slot[r])
        held = int(sizes[slot])
        at = positions[slot, :held]
        visible = at <= limits[r]
        if window:
            visible &= at > limits[r] - window
        if live is not None:
            width = live.shape[1]
            visible &= torch.where(at < width, live[slot, at.clamp(max=width - 1)], True)
        qg = q[r].view(kv_heads, heads // kv_heads, dim)
        o = F.scaled_dot_product_attention(
            qg, k[slot, :, :held], v[slot, :, :held], attn_mask=visible[None, None], scale=scale
        )
        out[r] = o.reshape(heads, dim)
    return out
