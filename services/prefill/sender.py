"""KVSender: streams one transfer to a decode worker while prefill is still computing.

Prefill hands each finished layer to put(); gRPC's own request thread pulls them from a bounded
queue, encodes them into frames and sends them, so compute and network overlap and at most
`queue_layers` layers wait in memory. If the decode worker refuses the stream, goes away, or the
deadline passes, the next put() raises at once and prefill stops there.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Protocol

import grpc
from opentelemetry.trace import SpanKind, Status, StatusCode

from proto.lazyserve.v1 import lazyserve_pb2 as pb
from proto.lazyserve.v1 import lazyserve_pb2_grpc as pb_grpc
from shared.engine import LayerFrame
from shared.net import rpc
from shared.net.telemetry import trace_metadata, tracer
from shared.net.transport import NO_AUTH, InternalAuth
from shared.transfer import frame_messages, payload_bytes

_CLOSE = object()

EndMaker = Callable[[int], pb.TransferMessage]  # number of frames sent -> the TransferEnd message


class Sender(Protocol):
    """What the prefill servicer needs of a transfer's sending side (SGLang's disaggregation has the
    same seam): KVSender streams to a decode worker over gRPC; tests put a fake in its place."""

    num_frames: int
    kv_bytes: int
    aux_bytes: int
    bytes_sent: int

    def put(self, frame: LayerFrame) -> None:
        """Queue a finished layer; raises if the transfer already failed."""

    def finish(self, make_end: EndMaker) -> pb.PushKVReply:
        """Send the end; returns once the receiver holds the whole transfer."""

    def abort(self) -> None:
        """Stop sending; safe to call more than once."""


# address, header, frame_bytes, queue_layers, timeout_s, auth -> a Sender
SenderFactory = Callable[[str, pb.TransferMessage, int, int, float, InternalAuth], Sender]


class KVSender:
    def __init__(
        self,
        address: str,
        header: pb.TransferMessage,
        frame_bytes: int,
        queue_layers: int,
        timeout_s: float,
        auth: InternalAuth = NO_AUTH,
    ):
        self.address, self.transfer_id = address, header.header.transfer_id
        self.frame_bytes = frame_bytes
        self.num_frames = self.kv_bytes = self.aux_bytes = self.bytes_sent = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_layers)
        self._channel = auth.channel(address)
        stub = pb_grpc.DecodeServiceStub(self._channel)
        # A child of the current (prefill) span; its context rides the stream's metadata.
        self.span = tracer.start_span("kv_transfer", kind=SpanKind.CLIENT)
        self.span.set_attribute("lazyserve.transfer_id", self.transfer_id)
        self.span.set_attribute("server.address", address)
        metadata = trace_metadata(self.span) + auth.metadata()
        self._future = stub.PushKV.future(self._messages(header), timeout=timeout_s, metadata=metadata)

    def _count(self, message: pb.TransferMessage) -> pb.TransferMessage:
        kv, aux = payload_bytes(message)
        self.kv_bytes += kv
        self.aux_bytes += aux
        self.bytes_sent += message.ByteSize()
        return message

    def _messages(self, header: pb.TransferMessage):
        # Runs on gRPC's request thread: encoding happens here, off the compute thread.
        yield self._count(header)
        while True:
            item = self._queue.get()
            if item is _CLOSE:
                return
            if isinstance(item, LayerFrame):
                for message in frame_messages(self.transfer_id, item, self.frame_bytes):
                    self.num_frames += 1
                    yield self._count(message)
            else:
                yield self._count(item(self.num_frames))
                return

    def put(self, frame: LayerFrame) -> None:
        """Queue a finished layer; waits while the queue is full, raises if the stream failed."""
        while True:
            self._raise_if_failed()
            try:
                self._queue.put(frame, timeout=0.05)
                return
            except queue.Full:
                continue

    def finish(self, make_end: EndMaker) -> pb.PushKVReply:
        """Send the end message and wait until the decode worker holds the whole transfer."""
        self.put(make_end)  # type: ignore[arg-type]  (a callable, made into the end message in order)
        try:
            return self._future.result()
        except grpc.RpcError as error:
            raise self._failure(error) from None
        finally:
            self._channel.close()
            self._end_span()

    def _end_span(self, error: str | None = None) -> None:
        if not self.span.is_recording():
            return
        self.span.set_attribute("lazyserve.frames", self.num_frames)
        self.span.set_attribute("lazyserve.kv_bytes_sent", self.kv_bytes)
        self.span.set_attribute("lazyserve.aux_bytes_sent", self.aux_bytes)
        self.span.set_attribute("lazyserve.stream_bytes", self.bytes_sent)
        if error:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()

    def abort(self) -> None:
        """Stop sending and drop what is queued; safe to call more than once."""
        self._future.cancel()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._queue.put_nowait(_CLOSE)
        self._channel.close()
        self._end_span("aborted")

    def _raise_if_failed(self) -> None:
        if not self._future.done():
            return
        error = self._future.exception() if not self._future.cancelled() else None
        if error is None:
            raise rpc.Cancelled(f"transfer {self.transfer_id!r} to {self.address} was cancelled")
        raise self._failure(error)

    def _failure(self, error: grpc.RpcError) -> rpc.DownstreamError:
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNAVAILABLE
        details = error.details() if hasattr(error, "details") else str(error)
        return rpc.DownstreamError(code, f"KV transfer to decode worker {self.address} failed: {details}", self.address)
