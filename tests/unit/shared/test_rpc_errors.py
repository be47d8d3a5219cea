"""The gRPC error edge on a real server: a service's typed errors become status codes, and a call
that failed downstream names the failed service in its trailing metadata, not in its words."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from shared.net.rpc import DownstreamError, Unavailable, failed_at, make_server

METHOD = "/test.Echo/Call"


def _serve(error: Exception):
    def call(request: bytes, context) -> bytes:
        raise error

    server, health = make_server(max_workers=2)
    handler = grpc.unary_unary_rpc_method_handler(call)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Call": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize(
    ("error", "code", "at"),
    [
        (
            DownstreamError(grpc.StatusCode.UNAVAILABLE, "its transfer failed", "127.0.0.1:9"),
            "UNAVAILABLE",
            "127.0.0.1:9",
        ),
        (DownstreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "no address known"), "DEADLINE_EXCEEDED", None),
        (Unavailable("this worker is shutting down"), "UNAVAILABLE", None),
    ],
)
def test_a_downstream_failure_names_where_it_failed(error, code, at):
    server, address = _serve(error)
    try:
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as raised:
                channel.unary_unary(METHOD)(b"", timeout=10)
        assert raised.value.code().name == code
        assert raised.value.details() == str(error)
        assert failed_at(raised.value) == at
        assert asyncio.run(_aio_failed_at(address)) == at  # as the gateway's aio client sees it
    finally:
        server.stop(None)


async def _aio_failed_at(address: str) -> str | None:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await channel.unary_unary(METHOD)(b"", timeout=10)
        except grpc.aio.AioRpcError as error:
            return failed_at(error)
    raise AssertionError("the call did not fail")
