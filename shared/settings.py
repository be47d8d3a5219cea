"""Settings common to every process that runs the engine: defaults, then LAZYSERVE_* env, then CLI flags.

Built once at an entry point and passed down; nothing reads the environment at import time.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
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
