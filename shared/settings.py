"""The engine's settings, shared by every process that runs or routes to it: defaults, then
LAZYSERVE_* environment, then command-line flags (services.options makes them from these fields).

Built once at an entry point and passed down; nothing reads the environment at import time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import ByteSize, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.contract import PRESET_NAMES
from shared.models.catalog import DEFAULT_MODEL, default_cache_dir
from shared.models.precision import DtypeName


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LAZYSERVE_", extra="ignore")

    model: str = Field(
        DEFAULT_MODEL,
        description="SmolLM2-135M-Instruct, gemma-3-270m, a tiny-* test model, or a local checkpoint folder",
    )
    device: str = "cpu"
    dtype: DtypeName = Field(
        "auto",
        description="the model's dtype (vLLM's --dtype): auto is bfloat16 on CUDA and on CPUs with AMX or "
        "AVX512-BF16, float32 elsewhere",
    )
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads (default: every core this process may use)"
    )
    cache_dir: Path = Field(default_factory=default_cache_dir)
    pruning_preset: Literal[PRESET_NAMES] = Field(
        "default", description="the pruning preset of every request that does not name its own"
    )
    chat_template: Path | None = Field(
        None, description="a Jinja chat template file for a model without one, or to replace its own (vLLM's flag)"
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the layers before the first cut of a prompt's cached start (vLLM's flag)"
    )
    batch_invariant: bool = Field(
        False,
        description="calls of fixed shapes (prompt tiles of 128 rows, decode tiles of 16), so that a token's "
        "numbers do not depend on what it is batched with, on a prefix hit or on the route (vLLM's "
        "VLLM_BATCH_INVARIANT, SGLang's deterministic inference); off by default for what the tiles cost, "
        "most of all one sequence's decode (docs/results.md)",
    )
    kernels: Literal["native", "torch"] = Field(
        "native",
        description="the decode step's kernels: native (built by make setup; made for few rows, batch-invariant "
        "by construction) where built, else torch's; torch runs torch's on purpose (shared/kernels)",
    )
    # Service level targets, off by default: every process of a stack reads the same ones (the
    # decode worker sizes its rounds' prefill by them, the gateway reports goodput against them).
    ttft_slo_s: float | None = Field(
        None,
        gt=0,
        description="time-to-first-token target in seconds: a local prompt that has waited half of it "
        "finishes in the next round, and goodput counts requests that meet it",
    )
    itl_slo_s: float | None = Field(
        None,
        gt=0,
        description="inter-token latency target in seconds: caps the local prefill a decode round runs "
        "beside its step (Sarathi-Serve's budget), and goodput counts requests whose mean gap meets it",
    )
    # 2 GiB per worker: `up` runs two (prefill and decode), so 4 GiB of a 24 GiB host, next to
    # two copies of the weights and the running sequences. At SmolLM2's default preset (19 of 30
    # layers held, float32) a token takes 31.5 KiB: about 68k tokens, twenty 3k-token documents.
    prefix_cache_bytes: ByteSize = Field(
        ByteSize(2 << 30), description="memory each worker's prefix cache may hold (bytes, or '2GiB', '512MB')"
    )

    def apply_threads(self) -> None:
        """torch's intra-op threads: the setting, else every core this process may run on; and
        the C allocator tuned for a model server (tune_malloc)."""
        import torch

        torch.set_num_threads(self.threads or available_cores())
        tune_malloc()


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def tune_malloc() -> bool:
    """Keep freed memory for reuse instead of giving it back to the OS at once, so a prefill's
    temporaries (tens of MB per layer) come from pages already mapped rather than fresh,
    zero-filled ones: glibc's default adapts its thresholds as blocks are freed, and with
    long-lived tensors beside them (a prefix cache) every prefill page-faults its temporaries
    again (the figures: docs/results.md). Fixed thresholds: blocks over 32 MiB are mmapped as
    before; up to 1 GiB of free heap is kept. No-op (False) without glibc."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    settings = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20))
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity: a container's cpuset, taskset), not the host's count."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)
