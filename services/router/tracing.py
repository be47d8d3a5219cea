"""The gateway's spans: one per request (GenAI semantic conventions plus lazyserve's attributes).

The request span's context is handed to the dispatcher, which starts route / prefill / decode
spans under it and carries the context to the workers in gRPC metadata.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.trace import SpanKind, Status, StatusCode

from services.router.policy import Decision
from shared.api.serving import Prepared
from shared.contract import Stats
from shared.net.telemetry import tracer


def start_request_span(headers, operation: str, model: str):
    """operation: "chat" or "text_completion" (gen_ai.operation.name)."""
    span = tracer.start_span(f"{operation} {model}", context=extract(dict(headers)), kind=SpanKind.SERVER)
    span.set_attribute("gen_ai.operation.name", operation)
    span.set_attribute("gen_ai.request.model", model)
    span.set_attribute("gen_ai.provider.name", "lazyserve")
    return span


def annotate_request(span, prepared: Prepared, num_layers: int) -> None:
    sampling, pruning = prepared.sampling, prepared.pruning
    span.set_attribute("gen_ai.request.max_tokens", sampling.max_new_tokens)
    span.set_attribute("gen_ai.request.temperature", sampling.temperature)
    span.set_attribute("gen_ai.request.top_p", sampling.top_p)
    if sampling.seed is not None:
        span.set_attribute("gen_ai.request.seed", sampling.seed)
    span.set_attribute("lazyserve.pruning.mode", pruning.for_prompt(len(prepared.ids)).mode)
    span.set_attribute("lazyserve.pruning.label", prepared.pruning_label)
    span.set_attribute("lazyserve.pruning.stage_layers", [layer for layer, _ in pruning.stages])
    span.set_attribute("lazyserve.pruning.stage_keep", [keep for _, keep in pruning.stages])
    fraction = pruning.computed_fraction(num_layers, len(prepared.ids))
    span.set_attribute("lazyserve.pruning.predicted_computed_fraction", fraction)


def annotate_decision(span, decision: Decision, policy: str) -> None:
    span.set_attribute("lazyserve.route.kind", decision.kind)
    span.set_attribute("lazyserve.route.reason", decision.reason)
    span.set_attribute("lazyserve.route.policy", policy)
    span.set_attribute("lazyserve.route.decode", decision.decode.address)
    if decision.prefill is not None:
        span.set_attribute("lazyserve.route.prefill", decision.prefill.address)
    span.set_attribute("lazyserve.route.predicted_prefill_cost", decision.prefill_cost)
    if decision.predicted_wait_s is not None:
        span.set_attribute("lazyserve.route.predicted_wait_s", decision.predicted_wait_s)


def annotate_stats(span, stats: Stats) -> None:
    span.set_attribute("gen_ai.usage.input_tokens", stats.prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", stats.completion_tokens)
    span.set_attribute("lazyserve.token_layers_computed", stats.token_layers_computed)
    span.set_attribute("lazyserve.computed_fraction", stats.computed_fraction)
    span.set_attribute("lazyserve.revived_token_layers", stats.revived_token_layers)
    span.set_attribute("lazyserve.kv_cache_bytes", stats.kv_cache_bytes)
    span.set_attribute("lazyserve.aux_cache_bytes", stats.aux_cache_bytes)
    span.set_attribute("gen_ai.usage.cache_read.input_tokens", stats.cached_tokens)  # from the prefix cache
    if stats.kept_per_layer and stats.prompt_tokens:
        span.set_attribute("lazyserve.kept_fraction_per_layer", [k / stats.prompt_tokens for k in stats.kept_per_layer])


def finish_request_span(span, job=None, error: Exception | None = None, status_code: int | None = None) -> None:
    if job is not None:
        if job.stats is not None:
            annotate_stats(span, job.stats)
        span.set_attribute("gen_ai.response.finish_reasons", job.finish_reasons)
        if job.ttft_s is not None:
            span.set_attribute("lazyserve.ttft_s", job.ttft_s)
    if status_code is not None:
        span.set_attribute("http.response.status_code", status_code)
    if error is not None:
        span.set_attribute("error.type", type(error).__name__)
        span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    span.end()


def context_of(span):
    return trace.set_span_in_context(span)
