"""Settings of every worker process: how services authenticate to each other, where a worker
listens and registers. Defaults, then environment, then CLI flags; the engine's own settings are
shared.settings.EngineSettings.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings

from shared.net.transport import InternalAuth, TlsFiles
from shared.settings import EngineSettings


def shared_env(name: str, description: str, **options):
    """A field read from LAZYSERVE_<NAME> in every role, whatever the role's own env prefix."""
    return Field(
        None, validation_alias=AliasChoices(name, f"LAZYSERVE_{name.upper()}"), description=description, **options
    )


class InternalAuthSettings(BaseSettings):
    """How this process authenticates to the other lazyserve services and they to it: a shared
    token (LAZYSERVE_INTERNAL_TOKEN) and/or mutual TLS (LAZYSERVE_TLS_CA, _CERT, _KEY: PEM files;
    all three or none). The same names in every role, whatever the role's own env prefix."""

    # A plain str (not SecretStr): it must survive model_dump_json into a Ray actor; repr=False
    # keeps it out of logs and reprs.
    internal_token: str | None = shared_env(
        "internal_token",
        "shared token every internal gRPC call must carry",
        repr=False,
    )
    tls_ca: Path | None = shared_env("tls_ca", "CA certificate (PEM) for mutual TLS")
    tls_cert: Path | None = shared_env("tls_cert", "this service's certificate (PEM)")
    tls_key: Path | None = shared_env("tls_key", "this service's private key (PEM)")
    tls_server_name: str | None = shared_env(
        "tls_server_name",
        "name to check in servers' certificates instead of the dialled host (lazyserve certs adds "
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
    host: str = Field("127.0.0.1", description="the address to listen on (0.0.0.0: every interface)")
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    advertise_host: str | None = Field(None, description="host others reach this worker at; default: host")
    redis_url: str | None = shared_env("redis_url", "register here (multi-host mode)")
    heartbeat_ttl_s: float = Field(3.0, gt=0, description="registration TTL; refreshed every third of it")
