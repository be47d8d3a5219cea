"""Prefill worker settings: defaults, then LAZYSERVE_PREFILL_* environment, then CLI flags.

The engine's own settings (model, device, dtype, threads) are the shared LAZYSERVE_* ones.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.net.settings import WorkerSettings
from shared.net.transport import DEFAULT_FRAME_BYTES


class PrefillSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="LAZYSERVE_PREFILL_", extra="ignore")

    frame_bytes: int = Field(
        DEFAULT_FRAME_BYTES, ge=4096, le=4 << 20, description="tensor payload per frame, KV and Aux each"
    )
    send_queue_layers: int = Field(8, ge=1, description="layers computed ahead of the sender before prefill waits")
    transfer_timeout_s: float = Field(120.0, gt=0, description="deadline of a transfer when the caller set none")
    max_concurrent_prefills: int = Field(1, ge=1, description="prefills computing at once; more wait their turn")
    grpc_workers: int = Field(16, ge=2)
    # Ray placement of each actor.
    num_actors: int = Field(1, ge=1, description="prefill actors to start")
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs per actor")
    num_gpus: float = Field(0.0, ge=0, description="Ray GPUs per actor")
    prefill_resource: float = Field(0.0, ge=0, description="units of the custom `prefill` resource each actor needs")
    niceness: int | None = Field(
        0,
        ge=0,
        le=19,
        description="the actor's OS nice value, every thread of it: 0 shares the cores equally with a decode "
        "worker on the same host; higher yields them to the decode loop while it runs (the running streams' "
        "inter-token latency against a long prompt's TTFT); None keeps Ray's 15",
    )
    max_restarts: int = Field(3, ge=-1, description="Ray restarts of a crashed actor; -1: forever")
