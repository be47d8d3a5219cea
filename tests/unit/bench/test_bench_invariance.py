"""`lazyserve bench invariance` times every figure with the switch off and on in the same rounds,
on each kernel path, and leaves the model and the kernels as it found them."""

from __future__ import annotations

import json

from bench import invariance
from shared import kernels


def test_every_figure_has_both_settings_and_its_cost(tmp_path):
    out = tmp_path / "invariance.json"
    argv = ["--model", "tiny-llama", "--lengths", "96", "--prompt", "64", "--concurrency", "1", "2"]
    argv += ["--tokens", "2", "--repeats", "2", "--presets", "off", "--dtypes", "float32", "--out", str(out)]
    before = kernels.status()
    assert invariance.main([*argv, "--kernels", "native", "torch"]) == 0
    assert kernels.status() == before
    native, torch_run = json.loads(out.read_text())["runs"]
    assert native["kernels"] == before.describe() and torch_run["kernels"].startswith("torch")
    for run in (native, torch_run):
        assert [row["figure"] for row in run["figures"]] == ["off TTFT 96", "off decode x1", "off decode x2"]
    for row in native["figures"] + torch_run["figures"]:
        assert all(len(row["samples"][setting]) == 2 for setting in ("off", "on"))
        assert all(value > 0 for setting in ("off", "on") for value in row["samples"][setting])
        off, on = row["median"]["off"], row["median"]["on"]
        assert row["cost"] == (on / off if row["unit"] == "s" else off / on)
