"""The completion path: /v1/chat/completions and /v1/completions, from the request to its last byte.

A request is checked (key, body, model, whether any worker could ever hold it), waits in the
admission queue for its key's bound and a worker's room, is routed and run; its answer is one JSON
body or a server-sent event stream. A client that goes away while its request waits or runs ends
it (499 in the metrics and the log). Each request is counted once in `lazyserve_requests_received`
and once in `lazyserve_requests{outcome}`; errors leave through the registered handlers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import weakref

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.router.admission import ClientGone, Slot, off_loop
from services.router.auth import caller_of
from services.router.errors import outcome_of, status_code_of, status_of
from services.router.gateway import Gateway
from services.router.http import read_body, request_id_of, until_gone
from services.router.responses import DONE, JobGroup, TextJob, stream_events
from services.router.tracing import (
    annotate_decision,
    annotate_request,
    annotate_stats,
    context_of,
    finish_request_span,
    start_request_span,
)
from shared.api.serving import CHAT_URL, COMPLETIONS_URL, RequestError, build_response, parse_request, prepare_all

router = APIRouter()


@router.post(CHAT_URL)
async def chat_completions(request: Request):
    return await complete(request.app.state.gateway, request, CHAT_URL)


@router.post(COMPLETIONS_URL)
async def completions(request: Request):
    return await complete(request.app.state.gateway, request, COMPLETIONS_URL)


async def complete(gateway: Gateway, request: Request, url: str):
    """One completion request, counted and traced from here; an error is counted, then raised."""
    operation = "chat" if url == CHAT_URL else "text_completion"
    span = start_request_span(request.headers, operation, gateway.text.name)
    gateway.metrics.received.inc()
    try:
        response = await _handle(gateway, request, url, span)
    except Exception as error:
        status = status_code_of(error)
        gateway.metrics.requests.labels(outcome_of(status)).inc()
        if isinstance(error, ClientGone):
            gateway.metrics.rejections.labels("cancelled").inc()
        finish_request_span(span, error=error, status_code=status)
        raise
    if not isinstance(response, StreamingResponse):
        span.end()  # streaming responses end their span when the stream ends
    return response


async def _handle(gateway: Gateway, request: Request, url: str, span):
    """Check, admit and route a request; the response that runs it to the end."""
    caller = await caller_of(request)
    parsed = parse_request(url, await read_body(request, gateway.settings))
    gateway.check_model(parsed.model)
    all_prepared = await off_loop(prepare_all, gateway.text, parsed)  # tokenizing is CPU work
    all_prepared = [dataclasses.replace(prepared, cache_salt=caller.salt) for prepared in all_prepared]
    annotate_request(span, all_prepared[0], gateway.text.spec.num_layers)
    try:
        await off_loop(gateway.dispatcher.placement.check_fits, all_prepared)  # 400 before any waiting
    except RequestError:
        gateway.metrics.rejections.labels("too_large").inc()
        raise
    gateway.queue.check_room()  # 429 when the queue is full
    start = time.monotonic()
    deadline = start + gateway.settings.request_timeout_s
    slot = await until_gone(request, gateway.admission.admit(caller.id, deadline))
    streaming = False  # once true, the stream's body gives the slot back
    try:
        request_id = request_id_of(request)
        span.set_attribute("gen_ai.response.id", request_id)
        jobs = []
        for index, prepared in enumerate(all_prepared):  # a completions request's list of prompts
            own_id = request_id if len(all_prepared) == 1 else f"{request_id}-{index}"
            events = gateway.dispatcher.run(prepared, own_id, deadline, context_of(span), caller.id)
            jobs.append(TextJob(events, gateway.text.tokenizer, prepared, gateway.metrics, start, own_id))
        job = jobs[0] if len(jobs) == 1 else JobGroup(jobs)
        try:
            decision = await until_gone(request, job.route())  # may wait in the queue
        except BaseException as error:
            for each in jobs:
                await each.events.aclose()
            await gateway.record(job, "cancelled" if isinstance(error, ClientGone) else "failed", error)
            raise
        annotate_decision(span, decision, gateway.dispatcher.policy.name)
        if parsed.stream:
            body, streaming = _stream(gateway, job, parsed, slot, span), True
            return StreamingResponse(body, media_type="text/event-stream", headers=job.headers)
        response = await until_gone(request, _collect(gateway, job, parsed, span))
        await slot.give_back()
        return response
    except Exception:
        if not streaming:
            await slot.give_back()  # before the error response goes out
        raise
    finally:
        if not streaming:
            slot.release()


def _stream(gateway: Gateway, job: TextJob | JobGroup, parsed, slot: Slot, span):
    """The SSE body; it holds the request's slot until the stream ends, however it ends."""
    include_usage = bool((parsed.stream_options or {}).get("include_usage"))
    failures = []

    def on_error(error):
        failures.append(error)
        return status_of(error)

    async def body():
        outcome = "cancelled"  # unless it finishes: the client went away
        try:
            model = parsed.model or gateway.text.name
            async for event in stream_events(job, parsed, model, include_usage, on_error, gateway.formatter):
                if event == DONE:
                    await slot.give_back()  # the client may send its next request on [DONE]
                yield event
            await slot.give_back()  # a stream that ended in an error event
            outcome = "failed" if failures else "ok"
        finally:
            slot.release()
            gateway.metrics.requests.labels(outcome).inc()
            span.set_attribute("lazyserve.outcome", outcome)
            error = failures[0] if failures else None
            finish_request_span(span, job, error, 200)
            await gateway.record(job, outcome, error)

    stream = body()
    # A body never started (the client left before the first byte) never runs its finally.
    weakref.finalize(stream, slot.release)
    return stream


async def _collect(gateway: Gateway, job: TextJob | JobGroup, parsed, span) -> JSONResponse:
    try:
        async for _ in job.deltas():
            pass
    except BaseException as error:  # cancelled: the client went away (until_gone)
        outcome = "cancelled" if isinstance(error, asyncio.CancelledError) else "failed"
        await asyncio.shield(gateway.record(job, outcome, None if outcome == "cancelled" else error))
        raise
    gateway.metrics.requests.labels("ok").inc()
    await gateway.record(job, "ok")
    if job.stats is not None:
        annotate_stats(span, job.stats)
    span.set_attribute("gen_ai.response.finish_reasons", job.finish_reasons)
    model = parsed.model or gateway.text.name
    response = build_response(model, parsed, job.prepared, job.outputs(), job.stats, gateway.formatter)
    return JSONResponse(response.model_dump(), headers=job.headers)  # after a retry: where it really ran
