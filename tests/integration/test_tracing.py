"""One trace per request across gateway -> router -> prefill -> KV transfer -> decode.

In one process with the SDK's in-memory exporter, and across real processes (`lazyserve up`:
gateway, prefill actor on a local Ray, decode worker) through a real OTLP/gRPC receiver.
"""

from __future__ import annotations

import signal
import threading
from concurrent import futures

import grpc
import httpx
import pytest
from conftest import Up, session_members, wait_for
from helpers import random_ids
from opentelemetry import trace
from opentelemetry.propagate import inject
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_exporter = InMemorySpanExporter()


@pytest.fixture(scope="module")
def spans():
    """The process-wide SDK provider, set once (the API allows one), exporting to memory."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(_exporter))
        trace.set_tracer_provider(provider)
    _exporter.clear()
    return _exporter


def _traceparent(root) -> dict:
    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(root))
    return carrier


def test_one_trace_links_every_hop(spans, tiny_llama, decode_worker, prefill_worker, gateway):
    decode, _ = decode_worker(tiny_llama)
    prefill = prefill_worker(tiny_llama)
    running = gateway(prefill_workers=[prefill.address], decode_workers=[decode.address], local_threshold=100)
    root = trace.get_tracer("test").start_span("client")
    reply = httpx.post(
        f"{running.url}/v1/completions",
        # lazyllm prunes a 300-token prompt (the default preset leaves prompts under 1024 tokens whole).
        json={"prompt": random_ids(tiny_llama, 300), "max_tokens": 4, "pruning": "lazyllm"},
        headers=_traceparent(root),
        timeout=60,
    )
    root.end()
    assert reply.status_code == 200
    wanted = {"text_completion tiny-llama", "route", "prefill", "kv_transfer", "kv_receive", "decode"}
    # The decode worker ends its span just after the last message went out: wait for it.
    assert wait_for(
        lambda: any(s.name == "decode" and s.kind == trace.SpanKind.SERVER for s in spans.get_finished_spans())
    )
    trace_id = root.get_span_context().trace_id
    mine = [s for s in spans.get_finished_spans() if s.context.trace_id == trace_id]
    by_id = {s.context.span_id: s for s in mine}
    assert {s.name for s in mine} >= wanted

    def parent(span):
        return by_id.get(span.parent.span_id) if span.parent else None

    def one(name, kind):
        [span] = [s for s in mine if s.name == name and s.kind == kind]
        return span

    K = trace.SpanKind
    request = one("text_completion tiny-llama", K.SERVER)
    assert parent(request).name == "client"
    assert parent(one("route", K.INTERNAL)) is request
    prefill_client, decode_client = one("prefill", K.CLIENT), one("decode", K.CLIENT)
    assert parent(prefill_client) is request and parent(decode_client) is request
    prefill_server = one("prefill", K.SERVER)
    assert parent(prefill_server) is prefill_client
    transfer = one("kv_transfer", K.CLIENT)
    assert parent(transfer) is prefill_server
    assert parent(one("kv_receive", K.SERVER)) is transfer
    decode_server = one("decode", K.SERVER)
    assert parent(decode_server) is decode_client
    # GenAI semantic conventions plus pruning's own attributes.
    attributes = request.attributes
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == "tiny-llama"
    assert attributes["gen_ai.usage.input_tokens"] == 300
    assert attributes["gen_ai.usage.output_tokens"] == 4
    assert attributes["lazyserve.route.kind"] == "disaggregated"
    assert 0 < attributes["lazyserve.computed_fraction"] < 1
    assert len(prefill_server.attributes["lazyserve.kept_fraction_per_layer"]) == tiny_llama.engine.spec.num_layers
    assert transfer.attributes["lazyserve.kv_bytes_sent"] > 0
    assert "lazyserve.revived_token_layers" in decode_server.attributes


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace endpoint: keeps (service name, span) pairs."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = next(
                    (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), "?"
                )
                for scope in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver():
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.starts_ray
@pytest.mark.slow  # the whole stack under `lazyserve up`: `make test-slow` and CI run it
def test_lazyserve_up_serves_traces_every_process_and_leaves_nothing(spans, receiver, tiny_llama):
    # spans: the SDK provider, so that the client root span below is real and has a trace id.
    servicer, endpoint = receiver
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    up = Up("--model", "tiny-llama", "--threads", "1", "--local-threshold", "100", env=env)
    process = up.process
    try:
        up.wait_ready(timeout=180)
        sessions = up.sessions
        assert len(sessions) == 3  # decode worker, prefill-worker (with its Ray), gateway

        import openai

        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="none", max_retries=0)
        root = trace.get_tracer("test").start_span("client")
        long_prompt = " ".join(["tell me about the rainbow"] * 40)
        reply = client.chat.completions.with_raw_response.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": long_prompt}],
            max_tokens=4,
            extra_headers=_traceparent(root),
        )
        root.end()
        assert reply.headers["x-lazyserve-route"] == "disaggregated"
        assert reply.parse().usage.completion_tokens == 4
        trace_id = root.get_span_context().trace_id.to_bytes(16, "big")
        services = {"lazyserve-gateway", "lazyserve-prefill", "lazyserve-decode"}

        expected = {
            ("lazyserve-gateway", "chat tiny-llama"),
            ("lazyserve-gateway", "route"),
            ("lazyserve-gateway", "prefill"),
            ("lazyserve-gateway", "decode"),
            ("lazyserve-prefill", "prefill"),
            ("lazyserve-prefill", "kv_transfer"),
            ("lazyserve-decode", "kv_receive"),
            ("lazyserve-decode", "decode"),
        }

        def mine():
            with servicer.lock:
                return [(service, span) for service, span in servicer.spans if span.trace_id == trace_id]

        assert wait_for(lambda: {(service, span.name) for service, span in mine()} >= expected, timeout=20), (
            f"spans arrived: {sorted({(service, span.name) for service, span in mine()})}"
        )
        assert {service for service, _ in mine()} == services

        def orphans():
            spans_here = mine()
            ids = {span.span_id for _, span in spans_here} | {root.get_span_context().span_id.to_bytes(8, "big")}
            return [(service, span.name) for service, span in spans_here if span.parent_span_id not in ids]

        # Each process exports in batches: a parent that ends last (the HTTP request's span, after
        # the response) may come in a batch after its children's. Every parent must come.
        wait_for(lambda: not orphans(), timeout=10)
        assert not orphans(), f"spans whose parent is not in the trace: {orphans()}"
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    assert process.returncode == 0
    assert wait_for(lambda: not session_members(sessions), timeout=10), "lazyserve up left processes behind"
