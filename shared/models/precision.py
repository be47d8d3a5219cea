"""Which dtype the model runs in: `--dtype auto|float32|bfloat16|float16`, as vLLM's flag.

`auto` is bfloat16 where the hardware computes it natively and float32 elsewhere: on CUDA, and on
CPUs with AMX (`amx_bf16`) or AVX512-BF16 (`avx512_bf16`). A CPU without them converts every
bfloat16 operand to float32 and back, so bfloat16 there is slower than float32 (a 2048x576 by
576x1536 product: 244 GFLOP/s in float32, 56 in bfloat16 on a 2-core Xeon without the flags; 108
and 540 on one with AMX). The choice is a pure function of its inputs (`choose_dtype`), so each
case is testable on any host; `CpuFeatures.detect()` reads the host. No torch on import.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger(__name__)

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
DTYPE_CHOICES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
# What a report shows of the CPU: the flags that decide `auto` and the vector units under them.
REPORTED_FLAGS = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx512_vnni", "avx2", "fma")


@dataclass(frozen=True)
class CpuFeatures:
    amx_bf16: bool = False
    avx512_bf16: bool = False
    flags: tuple[str, ...] = ()  # of REPORTED_FLAGS, those this CPU has (for reports)
    model_name: str = ""

    @property
    def native_bfloat16(self) -> bool:
        return self.amx_bf16 or self.avx512_bf16

    @classmethod
    def from_cpuinfo(cls, text: str) -> CpuFeatures:
        """From /proc/cpuinfo's text (its first processor's `flags` and `model name` lines)."""
        flags: set[str] = set()
        model_name = ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "flags" and not flags:
                flags = set(value.split())
            elif key == "model name" and not model_name:
                model_name = value.strip()
        return cls(
            amx_bf16="amx_bf16" in flags,
            avx512_bf16="avx512_bf16" in flags,
            flags=tuple(name for name in REPORTED_FLAGS if name in flags),
            model_name=model_name,
        )

    @classmethod
    def detect(cls) -> CpuFeatures:
        """This host's CPU. /proc/cpuinfo where there is one; torch's own probe otherwise (and as
        a second opinion: what matters is what torch's kernels will use)."""
        path = Path("/proc/cpuinfo")
        found = cls.from_cpuinfo(path.read_text()) if path.exists() else cls(model_name=platform.processor())
        try:
            import torch

            amx = bool(torch.cpu._is_amx_tile_supported())
            avx512_bf16 = bool(torch.cpu._is_avx512_bf16_supported())
        except (ImportError, AttributeError):  # an older torch: the flags alone decide
            return found
        return cls(found.amx_bf16 and amx, found.avx512_bf16 and avx512_bf16, found.flags, found.model_name)

    def report(self) -> dict:
        return {"model_name": self.model_name, "flags": list(self.flags), "native_bfloat16": self.native_bfloat16}


@dataclass(frozen=True)
class DtypeChoice:
    dtype: str  # float32 | bfloat16 | float16
    reason: str

    def __str__(self) -> str:
        return f"{self.dtype} ({self.reason})"


def choose_dtype(requested: str, device: str, cpu: CpuFeatures) -> DtypeChoice:
    """The dtype to load the model in. `requested` other than auto is taken as it is."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}; got {requested!r}")
    if requested != "auto":
        return DtypeChoice(requested, "asked for")
    kind = device.split(":")[0]
    if kind == "cuda":
        return DtypeChoice("bfloat16", "auto: CUDA")
    if kind != "cpu":
        return DtypeChoice("float32", f"auto: device {device}")
    if cpu.amx_bf16:
        return DtypeChoice("bfloat16", "auto: the CPU has AMX (amx_bf16)")
    if cpu.avx512_bf16:
        return DtypeChoice("bfloat16", "auto: the CPU has AVX512-BF16")
    return DtypeChoice("float32", "auto: the CPU has neither AMX nor AVX512-BF16, where bfloat16 is slower")


def resolve_dtype(requested: str, device: str = "cpu") -> DtypeChoice:
    """choose_dtype for this host (the CPU is probed only when it matters)."""
    cpu = CpuFeatures.detect() if requested == "auto" and device.split(":")[0] == "cpu" else CpuFeatures()
    return choose_dtype(requested, device, cpu)
