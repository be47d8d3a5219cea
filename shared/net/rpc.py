"""gRPC plumbing shared by every server and client: errors translated once, health, channel options.

Services raise the exceptions below (or a FrameError); one server interceptor turns them into
status codes with the message, so handlers never call context.abort themselves. Anything else is
logged with its traceback here and reaches the client only as INTERNAL with no detail.
"""

from __future__ import annotations

import logging
from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shared.compute import mark_io_thread
from shared.contract.wire import FrameError
from shared.net.transport import CHANNEL_OPTIONS, NO_AUTH, InternalAuth

log = logging.getLogger(__name__)


class ServiceError(Exception):
    code = grpc.StatusCode.INTERNAL


# Trailing metadata of a call that failed because a call it made failed: the address of the
# service that failed (a prefill worker's transfer to a decode worker), so that its caller knows
# which one to avoid without reading the message.
FAILED_AT = "lazyserve-failed-at"


class DownstreamError(ServiceError):
    """A call to another service (at `address`) failed; its status code is passed on with this
    message, and the address in the FAILED_AT trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, address: str | None = None):
        super().__init__(message)
        self.code, self.address = code, address


def failed_at(error: grpc.RpcError) -> str | None:
    """The address a failed call names in its FAILED_AT trailing metadata, if any."""
    metadata = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
    return dict(metadata or ()).get(FAILED_AT)


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(ServiceError):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


# How a draining decode worker's UNAVAILABLE details begin (refusing a request, or handing a stream
# over when its grace period ends): the gateway counts the migration as "drained", not "failed".
DRAINING = "the decode worker is draining"


def status_of(error: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(error, FrameError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    if isinstance(error, ServiceError):
        return error.code, str(error)
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        # A downstream call failed: pass its status on, saying where it came from.
        return error.code(), f"downstream: {error.details()}"
    if isinstance(error, grpc.RpcError):
        # A bare RpcError out of a request iterator: the client cancelled or went away.
        return grpc.StatusCode.CANCELLED, "the client cancelled the stream"
    log.exception("unexpected error in a gRPC handler", exc_info=error)
    return grpc.StatusCode.INTERNAL, "internal error (see the worker's log)"


class ErrorInterceptor(grpc.ServerInterceptor):
    """Errors to status codes, and bytes that do not parse as the request type to
    INVALID_ARGUMENT (gRPC's own deserializer failure would be an opaque INTERNAL)."""

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None:
            return None
        handler = handler._replace(request_deserializer=_lenient(handler.request_deserializer))
        streaming = handler.request_streaming
        if handler.unary_unary:
            return handler._replace(unary_unary=_wrap_unary(handler.unary_unary, streaming))
        if handler.stream_unary:
            return handler._replace(stream_unary=_wrap_unary(handler.stream_unary, streaming))
        if handler.unary_stream:
            return handler._replace(unary_stream=_wrap_stream(handler.unary_stream, streaming))
        return handler._replace(stream_stream=_wrap_stream(handler.stream_stream, streaming))


class _Malformed:
    """Stands for a request message that did not parse."""


MALFORMED = _Malformed()


def _lenient(deserialize):
    if deserialize is None:
        return None

    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError:
            return MALFORMED

    return parse


def _checked(requests):
    for request in requests:
        if request is MALFORMED:
            raise InvalidArgument("a message that does not parse as this method's request type")
        yield request


def _check(request, streaming: bool):
    if streaming:
        return _checked(request)
    if request is MALFORMED:
        raise InvalidArgument("the request does not parse as this method's request type")
    return request


def _wrap_unary(behavior, streaming: bool):
    def wrapped(request, context):
        try:
            return behavior(_check(request, streaming), context)
        except Exception as error:  # translated at the edge, by design
            _abort(context, error)

    return wrapped


def _wrap_stream(behavior, streaming: bool):
    def wrapped(request, context):
        try:
            yield from behavior(_check(request, streaming), context)
        except Exception as error:  # translated at the edge, by design
            _abort(context, error)

    return wrapped


def _abort(context, error: Exception) -> None:
    if isinstance(error, DownstreamError) and error.address is not None:
        context.set_trailing_metadata(((FAILED_AT, error.address),))
    context.abort(*status_of(error))


@dataclass
class RunningServer:
    """A started worker server: `address` is what others dial; stop ends the server, then its servicer."""

    server: grpc.Server
    servicer: object  # with a close()
    address: str
    health: health.HealthServicer | None = None

    def not_ready(self) -> None:
        """Every service NOT_SERVING from now on (a draining worker): probes stop sending it work."""
        if self.health is not None:
            self.health.enter_graceful_shutdown()

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace).wait()
        self.servicer.close()


def make_server(
    max_workers: int, max_concurrent_rpcs: int | None = None, auth: InternalAuth = NO_AUTH
) -> tuple[grpc.Server, health.HealthServicer]:
    """A server with the token check (if a token is set), the error interceptor, raised message
    limits and grpc.health.v1 (NOT_SERVING until the caller marks it ready). TLS, if any, is
    the port's: see start_serving."""
    interceptors = auth.interceptors() + [ErrorInterceptor()]
    server = grpc.server(
        # Its threads move bytes: engine work is handed to the process's compute thread.
        futures.ThreadPoolExecutor(max_workers=max_workers, initializer=mark_io_thread),
        interceptors=interceptors,
        options=CHANNEL_OPTIONS,
        maximum_concurrent_rpcs=max_concurrent_rpcs,
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, health_servicer


def start_serving(
    server: grpc.Server,
    health_servicer,
    host: str,
    port: int,
    advertise_host: str | None,
    services: list[str],
    auth: InternalAuth = NO_AUTH,
) -> str:
    """Bind (with mutual TLS when `auth` has it), start, mark SERVING; returns the address others
    dial (the OS picks the port for 0)."""
    bound = auth.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    set_serving(health_servicer, services)
    return f"{advertise_host or host}:{bound}"


def set_serving(health_servicer: health.HealthServicer, services: list[str]) -> None:
    for name in ["", *services]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)


def check_health(address: str, timeout: float = 2.0, service: str = "", auth: InternalAuth = NO_AUTH) -> bool:
    """True when the server at `address` answers SERVING."""
    with auth.channel(address) as chan:
        try:
            reply = health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
