"""`lazyserve bench kernels` times each kernel on both paths and says how far each is from the machine."""

from __future__ import annotations

import json
import os

import pytest

from bench import kernels as bench_kernels
from shared import kernels


@pytest.mark.skipif(os.environ.get("LAZYSERVE_KERNELS") == "torch", reason="the suite runs on torch's kernels")
def test_every_kernel_row_has_both_paths_and_leaves_the_kernels_as_found(tmp_path):
    out = tmp_path / "kernels.json"
    before = kernels.status()
    argv = ["--dtypes", "float32", "--rows", "1", "3", "--sequences", "2", "--keys", "300", "--repeats", "1"]
    assert bench_kernels.main([*argv, "--cycle-mb", "1", "--out", str(out)]) == 0
    assert kernels.status() == before
    [run] = json.loads(out.read_text())["runs"]
    linear = [r for r in run["rows"] if r["kernel"] == "linear"]
    attention = [r for r in run["rows"] if r["kernel"] == "decode attention"]
    assert len(linear) == 2 * len(bench_kernels.SHAPES) and len(attention) == 2
    for row in run["rows"]:
        assert row["seconds"]["native"] > 0 and row["seconds"]["torch"] > 0
    # A fifth of the keys live: a fifth of the bytes a full set holds.
    full, pruned = attention
    assert pruned["bytes"] == pytest.approx(0.2 * full["bytes"])
    assert run["blas_peak_gflops"] > 0
