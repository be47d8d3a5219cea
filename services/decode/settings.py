"""Decode worker settings: defaults, then LAZYSERVE_DECODE_* environment, then CLI flags.

The engine's own settings (model, device, dtype, threads) are the shared LAZYSERVE_* ones.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from shared.net.settings import WorkerSettings


class DecodeSettings(WorkerSettings):
    model_config = SettingsConfigDict(env_prefix="LAZYSERVE_DECODE_", extra="ignore")

    port: int = Field(50061, ge=0, le=65535, description="0 picks a free port")
    transfer_timeout_s: float = Field(120.0, gt=0, description="lease: a transfer must complete within this")
    claim_timeout_s: float = Field(
        30.0, gt=0, description="lease: a complete transfer must be claimed by Generate within this"
    )
    max_transfers: int = Field(64, ge=1, description="transfers receiving or waiting at once")
    max_sequences: int = Field(64, ge=1, description="sequences generating at once")
    # Batch defaults for 2 CPU cores: `lazyserve bench decode` shows aggregate tokens/s still
    # rising at 16 sequences there (docs/results.md); 32 keeps a step's latency bounded.
    max_batch_size: int = Field(32, ge=1, description="sequences advanced by one decode step")
    max_batch_tokens: int = Field(
        2048, ge=1, description="rows per step: a local prefill runs whole layers within this less the decode rows"
    )
    prefill_growth: int = Field(
        4,
        ge=1,
        description="a round's local prefill grows with the prompts waiting per sequence decoding, up to this many "
        "times max_batch_tokens (services.decode.budget; 1: never; --itl-slo caps it)",
    )
    grpc_workers: int = Field(160, ge=4, description="server threads: one per open stream")
    drain_seconds: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM: how long running streams may go on before the rest are handed over to the "
        "gateways (which continue them on another worker); nothing new is taken meanwhile",
    )
