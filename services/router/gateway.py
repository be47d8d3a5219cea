"""The OpenAI-compatible REST gateway (FastAPI): auth, validation, admission, routing, responses.

Errors leave in OpenAI's format, translated in one place (errors.status_of): 400 bad input or
context overflow, 401 key, 413 body size, 429 queue or per-key bound, 503 no worker or Redis down,
504 deadline. Anything unexpected is logged and answered 500 without internals.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.router.auth import KeyStore, hash_key
from services.router.dispatch import Dispatcher
from services.router.errors import status_of
from services.router.metrics import GatewayMetrics
from services.router.openapi import build_openapi
from services.router.policy import make_policy
from services.router.records import RequestRecords
from services.router.responses import TextJob, stream_events
from services.router.settings import GatewaySettings
from services.router.tracing import (
    annotate_decision,
    annotate_request,
    annotate_stats,
    context_of,
    finish_request_span,
    start_request_span,
)
from services.router.workers import STREAMS, RedisWorkers, StaticWorkers, Workers
from shared.api.schemas import ModelCard, ModelList
from shared.api.serving import CHAT_URL, COMPLETIONS_URL, RequestError, build_response, parse_request, prepare
from shared.models.text import TextModel
from shared.net.registry import WorkerInfo

log = logging.getLogger(__name__)

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def static_workers(settings: GatewaySettings, model: str) -> StaticWorkers:
    workers = [
        WorkerInfo(worker_id=f"prefill@{a}", role="prefill", address=a, model=model) for a in settings.prefill_workers
    ]
    workers += [
        WorkerInfo(worker_id=f"decode@{a}", role="decode", address=a, model=model) for a in settings.decode_workers
    ]
    return StaticWorkers(workers)


def create_app(settings: GatewaySettings, text: TextModel, workers: Workers | None = None) -> FastAPI:
    client = None
    if workers is None:
        if settings.redis_url:
            workers = RedisWorkers(settings.redis_url)
            client = workers.client
        else:
            workers = static_workers(settings, text.name)
    metrics = GatewayMetrics()
    records = RequestRecords(client, settings.request_record_ttl_s) if client is not None else None
    required = settings.require_api_key
    if required is None:  # on by default, except for a gateway only reachable from this host
        required = settings.host not in LOOPBACK
    keys = KeyStore([k.get_secret_value() for k in settings.api_keys], required, client)
    policy = make_policy(settings.routing, settings.local_threshold)
    dispatcher = Dispatcher(workers, policy, text, metrics, settings.retries, settings.internal_auth())
    in_flight = 0

    @asynccontextmanager
    async def lifespan(app):
        yield
        await dispatcher.close()
        if isinstance(workers, RedisWorkers):
            workers.close()

    app = FastAPI(title="lazyserve", version="0.1.0", lifespan=lifespan)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi
    app.state.metrics, app.state.dispatcher, app.state.workers = metrics, dispatcher, workers

    def error_response(error: Exception) -> JSONResponse:
        status, body = status_of(error)
        outcome = "client_error" if status < 500 else "server_error"
        metrics.requests.labels(outcome).inc()
        return JSONResponse({"error": body.model_dump()}, status_code=status)

    @app.exception_handler(Exception)
    async def _any(request: Request, error: Exception):
        return error_response(error)

    @app.exception_handler(RequestError)
    async def _request(request: Request, error: RequestError):
        return error_response(error)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        return error_response(RequestError(error.status_code, str(error.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError):
        return error_response(RequestError(400, str(error)))

    async def authorize(request: Request) -> str:
        """Check the key; returns who is asking (a key's hash, or the client's address without keys)."""
        header = request.headers.get("authorization", "")
        presented = header[7:].strip() if header.lower().startswith("bearer ") else None
        if not await run_in_threadpool(keys.accepts, presented):  # may ask Redis: off the loop
            raise RequestError(
                401, "missing or invalid API key (send it as `Authorization: Bearer KEY`)", code="invalid_api_key"
            )
        return hash_key(presented) if presented else (request.client.host if request.client else "?")

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        if len(raw) > settings.max_body_bytes:
            raise RequestError(413, f"request body of {len(raw)} bytes is over the limit of {settings.max_body_bytes}")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(400, f"the body is not valid JSON: {error}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        return body

    async def record(request_id: str, job: TextJob, outcome: str, error: Exception | None = None) -> None:
        if records is None:
            return
        decision, stats = job.decision, job.stats
        fields = {
            "outcome": outcome,
            "route": decision and decision.kind,
            "decode": decision and decision.decode.address,
            "prefill": decision and decision.prefill and decision.prefill.address,
            "prompt_tokens": len(job.prepared.ids),
            "completion_tokens": stats.completion_tokens if stats else job.num_tokens,
            "finish_reason": job.finish_reason if outcome == "ok" else None,
            "ttft_s": job.ttft_s,
            "e2e_s": time.monotonic() - job.start,
            "error": error and status_of(error)[1].message,
        }
        await run_in_threadpool(records.write, request_id, fields)

    async def complete(request: Request, url: str):
        operation = "chat" if url == CHAT_URL else "text_completion"
        span = start_request_span(request.headers, operation, text.name)
        try:
            response = await handle(request, url, span)
        except Exception as error:
            # Answered here rather than by a middleware handler: Starlette re-raises what reaches
            # its catch-all Exception handler, and the client would see a dropped connection.
            finish_request_span(span, error=error, status_code=status_of(error)[0])
            return error_response(error)
        if not isinstance(response, StreamingResponse):
            span.end()  # streaming responses end their span when the stream ends
        return response

    async def handle(request: Request, url: str, span):
        nonlocal in_flight
        caller = await authorize(request)
        parsed = parse_request(url, await read_body(request))
        prepared = await run_in_threadpool(prepare, text, parsed)  # tokenizing is CPU work: off the loop
        annotate_request(span, prepared, text.spec.num_layers)
        if in_flight >= settings.max_in_flight:
            raise RequestError(429, f"the gateway has {settings.max_in_flight} requests in progress; retry later")
        in_flight += 1  # taken before the next await, so concurrent requests cannot overshoot the bound
        metrics.in_flight.set(in_flight)
        acquired = False
        try:
            # Counted in Redis across every gateway replica when there is one (atomic check-and-take).
            acquired = await run_in_threadpool(workers.acquire, STREAMS, caller, settings.max_streams_per_key)
        finally:
            if not acquired:
                in_flight -= 1
                metrics.in_flight.set(in_flight)
        if not acquired:
            raise RequestError(
                429, f"this key has {settings.max_streams_per_key} requests in progress on all gateways; retry later"
            )
        start = time.monotonic()
        request_id = f"req-{uuid.uuid4().hex[:16]}"
        span.set_attribute("gen_ai.response.id", request_id)
        events = dispatcher.run(prepared, request_id, start + settings.request_timeout_s, context_of(span))
        job = TextJob(events, text.tokenizer, prepared, metrics, start)
        released = False

        def release():
            nonlocal in_flight, released
            if not released:
                released = True
                in_flight -= 1
                metrics.in_flight.set(in_flight)
                try:
                    workers.release(STREAMS, caller)
                except redis.RedisError as error:
                    # This replica's share (and the count in it) expires with the replica only;
                    # until then the key has one slot fewer. Logged, never raised at a client.
                    log.warning("could not release a stream slot in Redis: %s", error)

        try:
            decision = await job.route()
        except BaseException as error:
            release()
            await events.aclose()
            await record(request_id, job, "failed", error)
            raise
        annotate_decision(span, decision, dispatcher.policy.name)
        headers = {
            "x-request-id": request_id,
            "x-lazyserve-route": decision.kind,
            "x-lazyserve-decode": decision.decode.address,
        }
        if parsed.stream:
            include_usage = bool((parsed.stream_options or {}).get("include_usage"))

            async def body():
                failures = []

                def on_error(error):
                    failures.append(error)
                    metrics.requests.labels("server_error").inc()
                    return status_of(error)

                outcome = "cancelled"  # unless it finishes: the client went away
                try:
                    async for event in stream_events(job, parsed, parsed.model or text.name, include_usage, on_error):
                        yield event
                    outcome = "failed" if failures else "ok"
                    if not failures:
                        metrics.requests.labels("ok").inc()
                finally:
                    release()
                    if outcome == "cancelled":
                        metrics.requests.labels("cancelled").inc()
                    span.set_attribute("lazyserve.outcome", outcome)
                    finish_request_span(span, job, failures[0] if failures else None, 200)
                    await record(request_id, job, outcome, failures[0] if failures else None)

            return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
        try:
            async for _ in job.deltas():
                pass
        except BaseException as error:
            await record(request_id, job, "failed", error)
            raise
        finally:
            release()
        metrics.requests.labels("ok").inc()
        await record(request_id, job, "ok")
        if job.stats is not None:
            annotate_stats(span, job.stats)
        span.set_attribute("gen_ai.response.finish_reasons", [job.finish_reason])
        response = build_response(text.name, parsed, prepared, job.text, job.finish_reason, job.stats)
        final = job.decision  # after a retry, where the answer really came from
        headers |= {"x-lazyserve-route": final.kind, "x-lazyserve-decode": final.decode.address}
        return JSONResponse(response.model_dump(), headers=headers)

    @app.post(CHAT_URL)
    async def chat_completions(request: Request):
        return await complete(request, CHAT_URL)

    @app.post(COMPLETIONS_URL)
    async def completions(request: Request):
        return await complete(request, COMPLETIONS_URL)

    @app.get("/v1/models")
    async def models(request: Request):
        try:
            await authorize(request)
        except Exception as error:
            return error_response(error)
        return ModelList(data=[ModelCard(id=text.name)]).model_dump()

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        try:
            live = await run_in_threadpool(workers.list)
        except Exception as error:
            return error_response(error)
        decoders = [w for w in live if w.role == "decode" and w.model == text.name]
        if not decoders:
            return JSONResponse({"status": "no decode worker"}, status_code=503)
        prefillers = [w for w in live if w.role == "prefill" and w.model == text.name]
        return {"status": "ready", "decode_workers": len(decoders), "prefill_workers": len(prefillers)}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
