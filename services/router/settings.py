"""Gateway and router settings: defaults, then LAZYSERVE_GATEWAY_* environment, then CLI flags.

Worker lists accept JSON or comma-separated addresses. LAZYSERVE_REDIS_URL switches from the
static single-host worker list to Redis (registered workers, shared load, hashed API keys).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from shared.net.settings import InternalAuthSettings, shared_env
from shared.settings import EngineSettings

AddressList = Annotated[list[str], NoDecode]


def _split(value):
    if isinstance(value, str):
        value = value.strip()
        if value.startswith("["):
            import json

            return json.loads(value)
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class GatewaySettings(InternalAuthSettings):
    model_config = SettingsConfigDict(env_prefix="LAZYSERVE_GATEWAY_", extra="ignore")

    engine: EngineSettings = Field(default_factory=EngineSettings)
    host: str = Field("127.0.0.1", description="the gateway's address (0.0.0.0: every interface)")
    port: int = Field(8000, ge=0, le=65535, description="the gateway's port")
    redis_url: str | None = shared_env(
        "redis_url", "registered workers, shared load and hashed API keys in Redis (multi-host mode)"
    )
    prefill_workers: AddressList = Field(
        default_factory=list, description="static mode: prefill worker addresses (host:port, comma-separated)"
    )
    decode_workers: AddressList = Field(
        default_factory=list, description="static mode: decode worker addresses (host:port, comma-separated)"
    )
    routing: Literal["length", "round_robin"] = Field("length", description="how a request picks its workers")
    local_threshold: int = Field(1024, ge=0, description="prompts shorter than this are prefilled on a decode worker")
    route_by_wait: Literal["off", "other-hosts", "all"] = Field(
        "other-hosts",
        description="under load, send a prompt where its first token is predicted soonest (the workers' prefill "
        "queues and rates): other-hosts counts only prefill workers on another host than the decode worker (one "
        "on the same host takes its cores: docs/results.md, issue 48); all counts every one; off routes by "
        "length and cache only",
    )
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list, description="an API key the gateway accepts (hashed at start)"
    )
    require_api_key: bool | None = Field(
        None, description="None: required unless the gateway listens on loopback only (local development)"
    )
    max_streams_per_key: int = Field(
        1024,
        ge=1,
        description="requests in progress per API key (or per client without keys) on all gateways; "
        "more wait in the queue, in turn with other keys' requests",
    )
    max_queued: int = Field(
        1024, ge=1, description="requests waiting for a worker's room or their key's bound; more get 429"
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="past this a request ends with 504, waiting in the queue included"
    )
    max_body_bytes: int = Field(4 << 20, ge=1024)
    max_body_depth: int = Field(
        64, ge=4, description="nesting of arrays and objects a body may have, checked before it is parsed"
    )
    body_timeout_s: float = Field(30.0, gt=0, description="a request body must arrive within this")
    retries: int = Field(1, ge=0, description="retries on another worker before the first token")
    migration_limit: int = Field(
        3,
        ge=0,
        description="times a streamed choice whose decode worker fails or drains after its first token is "
        "continued on a live worker (its tokens so far replayed there); 0: it ends with an error event",
    )
    migration_max_tokens: int = Field(
        4096, ge=1, description="a choice with more generated tokens than this is not kept for migration"
    )
    migration_wait_s: float = Field(
        60.0,
        gt=0,
        description="how long a migrating choice waits for a live decode worker (the only one restarting) "
        "before its stream ends with the error",
    )
    request_record_ttl_s: int = Field(86400, ge=1, description="Redis mode: how long request records are kept")
    served_model_names: AddressList = Field(
        default_factory=list, description="names (aliases) the model answers to besides its own; others get 404"
    )

    @field_validator("prefill_workers", "decode_workers", "api_keys", "served_model_names", mode="before")
    @classmethod
    def _lists(cls, value):
        return _split(value)
