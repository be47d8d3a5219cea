"""Benchmarks and the eval put dtypes side by side and say what machine the figures came from."""

from __future__ import annotations

import json

import pytest

from bench import decode as bench_decode
from bench import ttft as bench_ttft
from bench.evalsuite.harness import run_case
from bench.evalsuite.tasks import make_suite
from shared.api.llm import LLM
from tests.conftest import SLOW_WITHOUT_NATIVE_BFLOAT16


def test_bench_ttft_times_both_dtypes_in_one_run_against_float32_full(tmp_path):
    out = tmp_path / "ttft.json"
    argv = ["--model", "tiny-llama", "--lengths", "64", "--repeats", "1", "--presets", "default"]
    argv += ["--decode-prompt", "64", "--decode-tokens", "2", "--dtypes", "float32", "bfloat16", "--out", str(out)]
    assert bench_ttft.main(argv) == 0
    report = json.loads(out.read_text())
    assert [run["dtype"] for run in report["runs"]] == ["float32", "bfloat16"]
    for run in report["runs"]:
        assert set(run["prefill"][0]["median_s"]) == {"transformers", "full", "default"}
    [row] = report["across_dtypes"]["prefill"]
    assert row["over"] == "float32 full" and row["ttft_speedup"]["float32 full"] == 1.0
    assert set(row["ttft_speedup"]) >= {"bfloat16 full", "bfloat16 transformers", "bfloat16 default"}
    assert report["across_dtypes"]["decode_over_first_full"]["float32 full"] == 1.0
    machine = report["machine"]
    assert {"cpu", "cpu_flags", "native_bfloat16", "cores", "torch_threads"} <= set(machine)


def test_bench_decode_reports_each_dtype_and_their_ratio(tmp_path):
    out = tmp_path / "decode.json"
    argv = ["--model", "tiny-llama", "--prompt", "64", "--concurrency", "1", "2", "--tokens", "2", "--repeats", "1"]
    argv += ["--presets", "off", "--dtypes", "float32", "bfloat16", "--kernels", "native", "--out", str(out)]
    assert bench_decode.main(argv) == 0
    report = json.loads(out.read_text())
    assert [run["dtype"] for run in report["runs"]] == ["float32", "bfloat16"]
    label = report["runs"][1]["label"]
    assert label.startswith("bfloat16, ")
    assert [(a["dtype"], a["sequences"]) for a in report["across_dtypes"]] == [(label, 1), (label, 2)]
    assert all(a["batched_ratio"] > 0 for a in report["across_dtypes"])


@pytest.fixture(scope="module")
def suite_case(load):
    llm = LLM(load("SmolLM2-135M-Instruct"))
    return llm, make_suite(llm.tokenizer, ["passkey"], [300], "dev", 1)[0]


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=SLOW_WITHOUT_NATIVE_BFLOAT16)])
def test_eval_runs_configurations_at_another_dtype_against_the_float32_reference(load, suite_case, dtype):
    llm, case = suite_case
    configs = {"off": llm.resolve_pruning("off"), "default": llm.resolve_pruning("default")}
    records = run_case(llm, case, configs, LLM(load("SmolLM2-135M-Instruct", dtype)), f"@{dtype}")
    assert [r["config"] for r in records] == ["off", f"off@{dtype}", f"default@{dtype}"]
    reference, unpruned_bf16 = records[0], records[1]
    assert reference["first_top1"] == 1.0 and reference["teacher_kl"] == 0.0
    # The bfloat16 model's own unpruned run, compared with the float32 one: a real difference.
    assert unpruned_bf16["first_kl"] > 0.0 and unpruned_bf16["computed_fraction"] == 1.0


def test_eval_at_one_dtype_keeps_its_names(suite_case):
    llm, case = suite_case
    records = run_case(llm, case, {"off": llm.resolve_pruning("off"), "fast": llm.resolve_pruning("fast")})
    assert [r["config"] for r in records] == ["off", "fast"]
