"""Settings common to every process that runs the engine: defaults, then LAZYSERVE_* env, then CLI flags.

Built once at an entry point and passed down; nothing reads the environment at import time.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.models import DEFAULT_MODEL, default_cache_dir


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LAZYSERVE_", extra="ignore")

    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str = "float32"
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; None keeps torch's default")
    cache_dir: Path = Field(default_factory=default_cache_dir)

    def apply_threads(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)


class WorkerSettings(BaseSettings):
    """What every worker process has: its engine, where it listens, how others reach it, the
    internal token and its registration. Each worker's settings add their own env prefix."""

    engine: EngineSettings = Field(default_factory=EngineSettings)
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    advertise_host: str | None = Field(None, description="host others reach this worker at; default: host")
    # A plain str (not SecretStr): it must survive model_dump_json into a Ray actor; repr=False
    # keeps it out of logs and reprs.
    internal_token: str | None = Field(
        None,
        repr=False,
        validation_alias=AliasChoices("internal_token", "LAZYSERVE_INTERNAL_TOKEN"),
        description="shared token every internal gRPC call must carry",
    )
    redis_url: str | None = Field(
        None, validation_alias=AliasChoices("redis_url", "LAZYSERVE_REDIS_URL"), description="register here (multi-host mode)"
    )
    heartbeat_ttl_s: float = Field(3.0, gt=0, description="registration TTL; refreshed every third of it")
