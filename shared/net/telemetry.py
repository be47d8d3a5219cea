"""Tracing and structured logs, set up once at a process's start.

Traces follow OpenTelemetry's standard environment: OTEL_TRACES_EXPORTER (otlp | console | none),
OTEL_EXPORTER_OTLP_ENDPOINT / _PROTOCOL, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER... With no
exporter configured, no SDK provider is installed and the API's no-op tracer costs nothing.
W3C trace context rides HTTP headers (the gateway) and gRPC metadata (every internal call):
`trace_metadata()` on the client side, `extract_context()` in servers.

Logs: one JSON object per line with the trace and span ids of the current span, so a log line
can be found from a trace and back.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.trace import set_span_in_context

tracer = trace.get_tracer("lazyserve")
_configured = False


def setup_tracing(service_name: str) -> bool:
    """Install an SDK tracer provider if the environment asks for an exporter; True if it did."""
    global _configured
    exporter_name = os.environ.get(
        "OTEL_TRACES_EXPORTER", "otlp" if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") else "none"
    )
    if _configured or exporter_name == "none":
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            raise ValueError("only OTEL_EXPORTER_OTLP_PROTOCOL=grpc is installed; use grpc")
        exporter = OTLPSpanExporter()  # endpoint, headers, TLS from OTEL_EXPORTER_OTLP_*
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: use otlp, console or none")
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _configured = True
    return True


def shutdown_tracing() -> None:
    """Flush spans still buffered (call before a process exits)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


def trace_metadata(span=None) -> tuple[tuple[str, str], ...]:
    """W3C trace context as gRPC metadata (traceparent, tracestate): of `span` when given, else
    the current context. The one place a client call carries its trace to a worker."""
    carrier: dict[str, str] = {}
    inject(carrier, context=None if span is None else set_span_in_context(span))
    return tuple(carrier.items())


def extract_context(grpc_context) -> otel_context.Context:
    """The caller's context from a gRPC server context's metadata."""
    return extract({key: value for key, value in grpc_context.invocation_metadata()})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        span = trace.get_current_span().get_span_context()
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if span.is_valid:
            entry["trace_id"] = f"{span.trace_id:032x}"
            entry["span_id"] = f"{span.span_id:016x}"
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: int = logging.INFO) -> None:
    """Structured (JSON lines) logs on stderr for a service process."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
