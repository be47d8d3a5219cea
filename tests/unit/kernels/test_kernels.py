"""The native kernels against the torch computation each replaces, and what the engine gets from them.

Each kernel on odd shapes against its torch reference (float32 within 1e-5 relative, bfloat16
within its rounding); a row's outputs the same bits alone and inside calls of 7 and 32 rows; the
attention reading only live keys equal to the masked torch path; a decode step on either path
alike; and the torch path taking over, and saying why, where the library is not built. These
tests need the build (`make setup`): where a C++ compiler is found and the CPU has AVX2, a missing
or stale build fails them; they skip only on a host that cannot build or run the kernels (the
torch path then serves, and says why) or when the suite runs on torch's kernels on purpose
(LAZYSERVE_KERNELS=torch). test_fallback.py runs everywhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from shared import kernels
from shared.engine import DecodeSlots, PruneConfig, decode_batch, prefill

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: within 1e-5 of the largest magnitude; bfloat16: within two of its rounding steps
    there (the two sides round sums taken in another order)."""
    scale = float(want.float().abs().max())
    bound = 1e-5 * scale if dtype == torch.float32 else 2 * 2.0**-8 * scale
    assert float((got.float() - want.float()).abs().max()) <= bound


@pytest.fixture(autouse=True, scope="module")
def native():
    if os.environ.get("LAZYSERVE_KERNELS") == "torch":
        pytest.skip("the suite runs on torch's kernels (LAZYSERVE_KERNELS=torch)")
    with kernels.selected("native") as status:
        if status.path != "native":
            if "AVX2" in status.reason or not (shutil.which("c++") or shutil.which("g++")):
                pytest.skip(f"this host cannot build or run the native kernels: {status.reason}")
            pytest.fail(f"the native kernels are not running, though this host can build them: {status.reason}")
        yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features"), [(1, 37, 45), (3, 64, 576), (7, 129, 33), (32, 5, 1000)]
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_torchs_on_odd_shapes(dtype, rows, out_features, in_features, bias):
    generator = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    b = torch.randn(out_features, generator=generator).to(dtype) if bias else None
    with kernels.invariant_rows():
        _close(kernels.linear(x, weight, b), F.linear(x, weight, b), dtype)


def _native_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    pack = kernels._pack((weight,), (None,))
    return torch.ops.lazyserve.linear(x.contiguous(), pack.panels, None, weight.shape[0])


@pytest.mark.parametrize("isa", ["host", "avx2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_a_row_is_the_same_bits_alone_and_in_calls_of_every_count_to_32(dtype, isa, tmp_path):
    """Every row count from 1 to 32 (each remainder of the register tiles) and the threads; on this
    host's region and, in a child process, on the AVX2 region (LAZYSERVE_KERNEL_ISA=avx2)."""
    if isa == "avx2":
        _in_avx2_child(
            f"test_a_row_is_the_same_bits_alone_and_in_calls_of_every_count_to_32[{str(dtype).removeprefix('torch.')}-host]"
        )
        return
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(200, 576, generator=generator).to(dtype)  # 200: a last panel part full
    batch = torch.randn(32, 576, generator=generator).to(dtype)
    full = _native_linear(batch, weight)
    for rows in range(1, 33):
        assert torch.equal(_native_linear(batch[:rows], weight), full[:rows]), rows
    alone = _native_linear(batch[5:6], weight)
    assert torch.equal(full[5:6], alone)
    # And whatever the threads: outputs are split between threads, never a sum.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_native_linear(batch, weight), full)
    finally:
        torch.set_num_threads(threads)


def _in_avx2_child(test_id: str) -> None:
    """Runs one test of this file in a child process held to the AVX2 region (a host without
    AVX-512 runs that region anyway)."""
    if torch.ops.lazyserve.isa() == "avx2":
        pytest.skip("this host runs the AVX2 region already (the host case covers it)")
    env = {**os.environ, "LAZYSERVE_KERNEL_ISA": "avx2"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run([*command, f"{__file__}::{test_id}"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_group_of_projections_is_the_same_bits_as_each_alone(dtype):
    """q/k/v (or gate and up) packed side by side and called once: each output as its own call's,
    biases where some have one."""
    generator = torch.Generator().manual_seed(3)
    weights = tuple(torch.randn(n, 96, generator=generator).to(dtype) for n in (72, 24, 30))
    biases = (None, torch.randn(24, generator=generator).to(dtype), None)
    x = torch.randn(5, 96, generator=generator).to(dtype)
    with kernels.invariant_rows():
        together = kernels.linear_group(x, weights, biases)
        for w, b, got in zip(weights, biases, together):
            assert torch.equal(got, kernels.linear(x, w, b))
            _close(got, F.linear(x, w, b), dtype)


def test_a_weight_changed_in_place_is_packed_again():
    weight = torch.randn(48, 64)
    x = torch.randn(2, 64)
    with kernels.invariant_rows():
        before = kernels.linear(x, weight)
        weight.mul_(2)
        _close(kernels.linear(x, weight), F.linear(x, weight), torch.float32)
    assert not torch.allclose(before, kernels.linear(x, weight))


def test_a_pack_is_used_only_for_the_tensors_it_packed():
    """Packs are found by the ids of their tensors; an id that another tensor took later (a copy of
    the model carrying the attribute along) must not find the old pack: here one weight's pack is
    filed under another's id, as such a reuse would leave it."""
    first, second = torch.randn(48, 64), torch.randn(48, 64)
    x = torch.randn(2, 64)
    with kernels.invariant_rows():
        kernels.linear(x, first)
        stale = next(iter(getattr(first, kernels.PACKS).values()))
        setattr(second, kernels.PACKS, {(id(second),): stale})
        _close(kernels.linear(x, second), F.linear(x, second), torch.float32)


def test_the_face_sends_few_rows_to_the_kernel_and_a_prompt_to_torch(monkeypatch):
    calls = []
    native_linear = torch.ops.lazyserve.linear
    panel_width = torch.ops.lazyserve.panel_width

    class Ops:
        @staticmethod
        def linear(*args):
            calls.append(args[0].shape[0])
            return native_linear(*args)

        @staticmethod
        def panel_width():
            return panel_width()

    monkeypatch.setattr(torch.ops, "lazyserve", Ops)
    weight = torch.randn(64, 576)
    kernels.linear(torch.randn(1, 576), weight)
    kernels.linear(torch.randn(300, 576), weight)
    with kernels.invariant_rows():  # a decode step under --batch-invariant: every count
        kernels.linear(torch.randn(300, 576), weight)
    assert calls == [1, 300]


def _attention_case(dtype, slots, kv_heads, groups, capacity, dim, seed):
    generator = torch.Generator().manual_seed(seed)
    k = torch.randn(slots, kv_heads, capacity, dim, generator=generator).to(dtype)
    v = torch.randn(slots, kv_heads, capacity, dim, generator=generator).to(dtype)
    sizes = torch.randint(1, capacity + 1, (slots,), generator=generator)
    positions = torch.stack([torch.randperm(capacity, generator=generator) for _ in range(slots)])
    row_slot = torch.cat([torch.arange(slots), torch.randint(0, slots, (3,), generator=generator)])
    limits = torch.cat([torch.full((slots,), capacity), torch.randint(0, capacity, (3,), generator=generator)])
    q = torch.randn(row_slot.shape[0], kv_heads * groups, dim, generator=generator).to(dtype)
    live = torch.rand(slots, capacity - 3, generator=generator) < 0.3
    return q, k, v, positions, sizes, row_slot, limits, live


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("slots", "kv_heads", "groups", "capacity", "dim"),
    [(3, 3, 3, 700, 64), (2, 1, 4, 300, 256), (2, 2, 8, 130, 128), (4, 2, 5, 33, 16)],
)
@pytest.mark.parametrize("selection", ["all", "live", "live in a window"])
def test_decode_attention_reads_the_live_keys_as_torchs_masked_attention(
    dtype, slots, kv_heads, groups, capacity, dim, selection
):
    q, k, v, positions, sizes, row_slot, limits, live = _attention_case(
        dtype, slots, kv_heads, groups, capacity, dim, capacity
    )
    live = None if selection == "all" else live
    window = 40 if selection == "live in a window" else 0
    args = (q, k, v, positions, sizes, row_slot, limits, live, dim**-0.5, window)
    want = kernels.decode_attention_reference(*args)
    _close(kernels.decode_attention(*args), want, dtype)


def test_a_rows_attention_does_not_depend_on_the_other_rows():
    q, k, v, positions, sizes, row_slot, limits, live = _attention_case(torch.float32, 4, 3, 3, 600, 64, 1)
    full = torch.ops.lazyserve.decode_attention(q, k, v, positions, sizes, row_slot, limits, live, 0, 0.125)
    for r in range(q.shape[0]):
        one = torch.ops.lazyserve.decode_attention(
            q[r : r + 1].contiguous(),
            k,
            v,
            positions,
            sizes,
            row_slot[r : r + 1].contiguous(),
            limits[r : r + 1].contiguous(),
            live,
            0,
            0.125,
        )
        assert torch.equal(one[0], full[r])


def test_bad_shapes_are_refused_with_a_reason():
    width = torch.ops.lazyserve.panel_width()
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and packed panels \[P, K, "):
        torch.ops.lazyserve.linear(torch.randn(2, 5), torch.randn(1, 6, width), None, 3)
    with pytest.raises(RuntimeError, match="do not fill"):
        torch.ops.lazyserve.linear(torch.randn(2, 6), torch.randn(2, 6, width), None, 3)
    q, k, v, positions, sizes, row_slot, limits, _ = _attention_case(torch.float32, 2, 1, 2, 50, 64, 2)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.lazyserve.decode_attention(q, k, v, positions, sizes, row_slot + 5, limits, None, 0, 0.125)


@pytest.mark.parametrize(
    "config", [PruneConfig(mode="off"), PruneConfig(stages=((1, 0.5), (3, 0.2)))], ids=["off", "pruned"]
)
def test_a_decode_step_on_the_native_kernels_equals_the_torch_path(tiny_llama, config):
    """Three sequences from one DecodeSlots, pruned keys skipped by the native kernel and masked
    by torch's, rows through the row kernels: the same logits within float32's rounding."""
    model = tiny_llama.engine
    results = {}
    for path in ("native", "torch"):
        with kernels.selected(path):
            slots = DecodeSlots(model.spec, model.dtype, model.device)
            batch = []
            for i, length in enumerate((90, 200, 130)):
                ids = torch.randint(3, model.spec.vocab_size, (length,), generator=torch.Generator().manual_seed(i))
                cache, logits = prefill(model, ids, config, reserve=4)
                batch.append((cache, int(logits.argmax()), config))
            steps = []
            for _ in range(4):
                logits = decode_batch(model, batch, slots)
                steps.append(logits)
                batch = [(cache, int(row.argmax()), config) for (cache, _, _), row in zip(batch, logits)]
            results[path] = steps
    for native_logits, torch_logits in zip(results["native"], results["torch"]):
        assert float((native_logits - torch_logits).abs().max()) <= 1e-4 * float(torch_logits.abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [576, 37])
def test_rms_norm_with_its_residual_equals_the_models_norms(dtype, width):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    generator = torch.Generator().manual_seed(width)
    x, residual = (torch.randn(5, width, generator=generator).to(dtype) for _ in range(2))
    for module, eps, unit_offset in ((LlamaRMSNorm(width, eps=1e-5), 1e-5, False), (Gemma3RMSNorm(width), 1e-6, True)):
        with torch.no_grad():
            module.weight.copy_(torch.randn(width, generator=generator))
        module = module.to(dtype)
        with torch.inference_mode():
            normed, summed = kernels.rms_norm(x, module.weight, eps, unit_offset, module, residual)
            assert torch.equal(summed, x + residual)  # one rounding, as torch's add
            _close(normed, module(x + residual), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_and_rope_are_torchs_to_the_bit_where_they_round_alike(dtype):
    generator = torch.Generator().manual_seed(11)
    gate, up = (torch.randn(7, 1537, generator=generator).to(dtype) for _ in range(2))
    # SiLU's exp is our own polynomial (within 2 ulp of torch's): equal after bfloat16's rounding.
    got = kernels.silu_mul(gate, up)
    assert (
        torch.equal(got, F.silu(gate) * up)
        if dtype == torch.bfloat16
        else _close(got, F.silu(gate) * up, dtype) is None
    )
    x = torch.randn(3, 9, 64, generator=generator).to(dtype)
    positions = torch.tensor([5, 0, 199])
    cos, sin = (torch.randn(200, 64, generator=generator).to(dtype) for _ in range(2))
    with kernels.selected("torch"):
        reference = kernels.rope(x, positions, cos, sin)
    assert torch.equal(kernels.rope(x, positions, cos, sin), reference)
