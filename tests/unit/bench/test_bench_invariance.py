"""`lazyserve bench invariance` times every figure with the switch off and on in the same rounds
and leaves the model as it found it."""

from __future__ import annotations

import json

from bench import invariance


def test_every_figure_has_both_settings_and_its_cost(tmp_path):
    out = tmp_path / "invariance.json"
    argv = ["--model", "tiny-llama", "--lengths", "96", "--prompt", "64", "--concurrency", "1", "2"]
    argv += ["--tokens", "2", "--repeats", "2", "--presets", "off", "--dtypes", "float32", "--out", str(out)]
    assert invariance.main(argv) == 0
    [run] = json.loads(out.read_text())["runs"]
    assert [row["figure"] for row in run["figures"]] == ["off TTFT 96", "off decode x1", "off decode x2"]
    for row in run["figures"]:
        assert all(len(row["samples"][setting]) == 2 for setting in ("off", "on"))
        assert all(value > 0 for setting in ("off", "on") for value in row["samples"][setting])
        off, on = row["median"]["off"], row["median"]["on"]
        assert row["cost"] == (on / off if row["unit"] == "s" else off / on)
