"""How lazyserve's services reach each other: message limits, the shared token and mutual TLS.

Every server port, every client channel (sync and asyncio) and every token header is made from
one InternalAuth, built from a process's settings at its entry point, so a process cannot check
one thing and send another. What a call means and how its errors read is shared.net.rpc's business.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

import grpc

# Frames stay under 4 MiB; the limits leave room for a long prompt's TransferEnd and stats.
MAX_MESSAGE_BYTES = 16 << 20
# Tensor payload per KV frame, KV and Aux each: frames stay well under gRPC's 4 MiB message default.
DEFAULT_FRAME_BYTES = 1 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
TOKEN_HEADER = "x-lazyserve-token"  # noqa: S105 -- a header's name, not a secret


@dataclass(frozen=True, repr=False)
class TlsFiles:
    """PEM bytes for mutual TLS: the CA that signs every lazyserve service, and this process's own
    certificate and key (presented as a server and, on outgoing calls, as a client)."""

    ca: bytes
    cert: bytes
    key: bytes
    # The name clients check in a server's certificate; None: the host they dialled. A fixed name
    # lets a certificate made in advance cover workers at addresses known only at run time.
    server_name: str | None = None


@dataclass(frozen=True, repr=False)
class InternalAuth:
    """How lazyserve's services trust each other: a shared token in every call's metadata and/or
    mutual TLS. Servers, clients and the gateway's channels are all made from one of these, so a
    process cannot end up checking one thing and sending another."""

    token: str | None = None
    tls: TlsFiles | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What a client adds to every internal call."""
        return ((TOKEN_HEADER, self.token),) if self.token else ()

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        if self.tls is None:
            raise RuntimeError("TLS is not configured")
        return grpc.ssl_channel_credentials(self.tls.ca, self.tls.key, self.tls.cert)

    def _secure_options(self) -> list[tuple[str, object]]:
        if self.tls is None:
            raise RuntimeError("TLS is not configured")
        if self.tls.server_name is None:
            return CHANNEL_OPTIONS
        return CHANNEL_OPTIONS + [("grpc.ssl_target_name_override", self.tls.server_name)]

    def channel(self, address: str) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(address, self._channel_credentials(), options=self._secure_options())

    def aio_channel(self, address: str) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(address, self._channel_credentials(), options=self._secure_options())

    def add_port(self, server: grpc.Server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        # require_client_auth: a peer without a certificate from our CA never completes the handshake.
        credentials = grpc.ssl_server_credentials(
            [(self.tls.key, self.tls.cert)], root_certificates=self.tls.ca, require_client_auth=True
        )
        return server.add_secure_port(address, credentials)


NO_AUTH = InternalAuth()


class TokenInterceptor(grpc.ServerInterceptor):
    """Internal services require the shared token (constant-time comparison); health checks
    stay open for probes. A refused call never reaches a handler."""

    def __init__(self, token: str):
        self.token = token.encode()

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {TOKEN_HEADER} metadata")

        self._refusal = grpc.unary_unary_rpc_method_handler(refuse)

    def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        presented = dict(details.invocation_metadata or ()).get(TOKEN_HEADER, "")
        if hmac.compare_digest(presented.encode(), self.token):
            return continuation(details)
        return self._refusal
