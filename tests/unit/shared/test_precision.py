"""`--dtype auto` picks per the CPU's flags: the choice is a function of injected inputs, so every
case runs on every host (CI's CPU has no say in what these tests see)."""

from __future__ import annotations

import pytest

from services.cli import build_parser
from shared.models.precision import CpuFeatures, choose_dtype
from shared.settings import EngineSettings

AMX = CpuFeatures(amx_bf16=True, avx512_bf16=True)
AVX512_BF16 = CpuFeatures(avx512_bf16=True)
PLAIN = CpuFeatures()


@pytest.mark.parametrize(
    "requested, device, cpu, expected",
    [
        ("auto", "cpu", AMX, "bfloat16"),
        ("auto", "cpu", CpuFeatures(amx_bf16=True), "bfloat16"),
        ("auto", "cpu", AVX512_BF16, "bfloat16"),
        ("auto", "cpu", PLAIN, "float32"),
        ("auto", "cuda", PLAIN, "bfloat16"),
        ("auto", "cuda:1", PLAIN, "bfloat16"),
        ("auto", "mps", AMX, "float32"),
        ("float32", "cpu", AMX, "float32"),
        ("bfloat16", "cpu", PLAIN, "bfloat16"),  # asked for: taken as it is, slow or not
        ("float16", "cuda", PLAIN, "float16"),
    ],
)
def test_auto_picks_per_device_and_cpu_flags(requested, device, cpu, expected):
    choice = choose_dtype(requested, device, cpu)
    assert choice.dtype == expected
    assert choice.reason.startswith("auto" if requested == "auto" else "asked")


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="float64"):
        choose_dtype("float64", "cpu", PLAIN)
    with pytest.raises(ValueError, match="dtype"):
        EngineSettings(dtype="float64")


CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu avx2 fma avx512f avx512_bf16 avx512_vnni amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu avx2
"""


def test_cpuinfo_flags_are_read_from_the_first_processor():
    cpu = CpuFeatures.from_cpuinfo(CPUINFO)
    assert cpu.amx_bf16 and cpu.avx512_bf16 and cpu.native_bfloat16
    assert cpu.model_name == "Intel(R) Xeon(R) Platinum 8488C"
    assert cpu.flags == ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx512_vnni", "avx2", "fma")
    plain = CpuFeatures.from_cpuinfo("model name : AMD EPYC\nflags : fpu avx2 fma avx512f\n")
    assert not plain.native_bfloat16 and choose_dtype("auto", "cpu", plain).dtype == "float32"


def test_the_settings_default_is_auto_and_the_environment_sets_it(monkeypatch):
    monkeypatch.delenv("LAZYSERVE_DTYPE")  # tests/conftest.py pins float32 for every worker tests start
    assert EngineSettings().dtype == "auto"
    monkeypatch.setenv("LAZYSERVE_DTYPE", "bfloat16")
    assert EngineSettings().dtype == "bfloat16"


@pytest.mark.parametrize(
    "argv",
    [
        ["up"],
        ["decode-worker"],
        ["prefill-worker"],
        ["run-batch", "-i", "in.jsonl", "-o", "out.jsonl"],
    ],
)
def test_every_command_that_loads_a_model_takes_dtype(argv):
    parser = build_parser()
    assert parser.parse_args([*argv, "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert parser.parse_args(argv).dtype is None  # unset: the settings (env, else auto) decide
    with pytest.raises(SystemExit):
        parser.parse_args([*argv, "--dtype", "float64"])
