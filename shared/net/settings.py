"""Settings common to every process that runs the engine: defaults, then LAZYSERVE_* env, then CLI flags.

Built once at an entry point and passed down; nothing reads the environment at import time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, ByteSize, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.contract import PRESET_NAMES
from shared.models.catalog import DEFAULT_MODEL, default_cache_dir
from shared.models.precision import DtypeName
from shared.net.transport import InternalAuth, TlsFiles


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LAZYSERVE_", extra="ignore")

    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: DtypeName = Field(
        "auto",
        description="the model's dtype (vLLM's --dtype): auto is bfloat16 on CUDA and on CPUs with AMX or "
        "AVX512-BF16, float32 elsewhere",
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; None: every core this process may use")
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
    zero-filled ones. glibc's default adapts its thresholds as blocks are freed, and with
    long-lived tensors beside them (a prefix cache) each 3k-token prefill page-faulted about 1 GB
    more. Measured on seven 3k-token SmolLM2 prefills (float32, 2 cores): 2.2-2.9M minor faults
    with a prefix cache and 1.1M without, 0.2-0.4M with these settings, and each prefill 5-10%
    faster. Fixed thresholds: blocks over 32 MiB are mmapped as before; up to 1 GiB of free heap
    is kept. No-op (False) without glibc."""
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


class InternalAuthSettings(BaseSettings):
    """How this process authenticates to the other lazyserve services and they to it: a shared
    token (LAZYSERVE_INTERNAL_TOKEN) and/or mutual TLS (LAZYSERVE_TLS_CA, _CERT, _KEY: PEM files;
    all three or none). The same names in every role, whatever the role's own env prefix."""

    # A plain str (not SecretStr): it must survive model_dump_json into a Ray actor; repr=False
    # keeps it out of logs and reprs.
    internal_token: str | None = Field(
        None,
        repr=False,
        validation_alias=AliasChoices("internal_token", "LAZYSERVE_INTERNAL_TOKEN"),
        description="shared token every internal gRPC call must carry",
    )
    tls_ca: Path | None = Field(
        None,
        validation_alias=AliasChoices("tls_ca", "LAZYSERVE_TLS_CA"),
        description="CA certificate (PEM) for mutual TLS",
    )
    tls_cert: Path | None = Field(
        None,
        validation_alias=AliasChoices("tls_cert", "LAZYSERVE_TLS_CERT"),
        description="this service's certificate (PEM)",
    )
    tls_key: Path | None = Field(
        None,
        validation_alias=AliasChoices("tls_key", "LAZYSERVE_TLS_KEY"),
        description="this service's private key (PEM)",
    )
    tls_server_name: str | None = Field(
        None,
        validation_alias=AliasChoices("tls_server_name", "LAZYSERVE_TLS_SERVER_NAME"),
        description="name to check in servers' certificates instead of the dialled host (lazyserve certs adds "
        "lazyserve.internal): for workers at addresses known only at run time, such as Ray-placed prefill actors",
    )

    @model_validator(mode="after")
    def _tls_all_or_none(self):
        given = [name for name in ("tls_ca", "tls_cert", "tls_key") if getattr(self, name) is not None]
        if given and len(given) != 3:
            missing = sorted({"tls_ca", "tls_cert", "tls_key"} - set(given))
            raise ValueError(f"mutual TLS needs tls_ca, tls_cert and tls_key; missing {', '.join(missing)}")
        return self

    def internal_auth(self) -> InternalAuth:
        """Reads the PEM files (on the node where it is called: a Ray actor reads its own node's)."""
        tls = None
        if self.tls_ca is not None:
            tls = TlsFiles(
                self.tls_ca.read_bytes(), self.tls_cert.read_bytes(), self.tls_key.read_bytes(), self.tls_server_name
            )
        return InternalAuth(self.internal_token, tls)


class WorkerSettings(InternalAuthSettings):
    """What every worker process has: its engine, where it listens, how others reach it, the
    internal authentication and its registration. Each worker's settings add their own env prefix."""

    engine: EngineSettings = Field(default_factory=EngineSettings)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    advertise_host: str | None = Field(None, description="host others reach this worker at; default: host")
    redis_url: str | None = Field(
        None,
        validation_alias=AliasChoices("redis_url", "LAZYSERVE_REDIS_URL"),
        description="register here (multi-host mode)",
    )
    heartbeat_ttl_s: float = Field(3.0, gt=0, description="registration TTL; refreshed every third of it")
