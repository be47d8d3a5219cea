"""Decode worker settings: defaults, then LAZYSERVE_DECODE_* environment, then CLI flags.

The engine's own settings (model, device, dtype, threads) are the shared LAZYSERVE_* ones.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.settings import EngineSettings


class DecodeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LAZYSERVE_DECODE_", extra="ignore")

    engine: EngineSettings = Field(default_factory=EngineSettings)
    host: str = "127.0.0.1"
    port: int = Field(50061, ge=0, le=65535, description="0 picks a free port")
    advertise_host: str | None = Field(None, description="host others reach this worker at; default: host")
    # A plain str (not SecretStr): it must survive model_dump_json into the Ray actor; repr=False
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
    transfer_timeout_s: float = Field(120.0, gt=0, description="lease: a transfer must complete within this")
    claim_timeout_s: float = Field(30.0, gt=0, description="lease: a complete transfer must be claimed by Generate within this")
    max_transfers: int = Field(64, ge=1, description="transfers receiving or waiting at once")
    max_sequences: int = Field(64, ge=1, description="sequences generating at once")
    grpc_workers: int = Field(160, ge=4, description="server threads: one per open stream")
