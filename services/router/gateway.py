"""The OpenAI-compatible REST gateway (FastAPI): auth, validation, admission, routing, responses.

Errors leave in OpenAI's format, translated in one place (errors.status_of): 400 bad input,
context overflow or more choices than any worker holds, 401 key, 413 body size, 429 a full
admission queue, 503 no worker or Redis down, 504 deadline (waiting in the queue included).
Anything unexpected is logged and answered 500 without internals. A burst beyond the workers'
room waits in the admission queue (services.router.admission); a client that goes away while its
request waits or runs ends it (499 in the metrics and the log). Every Redis call runs in a thread
(admission.off_loop), never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import re
import time
import uuid
import weakref
from contextlib import asynccontextmanager
from importlib.metadata import version

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.router.admission import Admission, AdmissionQueue, ClientGone, Slot, off_loop
from services.router.auth import KeyStore
from services.router.client import DecodeClient, decode_status
from services.router.dispatch import Dispatcher
from services.router.errors import outcome_of, status_of
from services.router.metrics import GatewayMetrics
from services.router.openapi import build_openapi
from services.router.page import mount_page
from services.router.policy import make_policy
from services.router.prefixes import MemoryPrefixIndex, RedisPrefixIndex
from services.router.records import RequestRecords
from services.router.responses import DONE, JobGroup, TextJob, stream_events
from services.router.settings import GatewaySettings
from services.router.tracing import (
    annotate_decision,
    annotate_request,
    annotate_stats,
    context_of,
    finish_request_span,
    start_request_span,
)
from services.router.workers import DECODE_TOKENS, PREFILL_COST, SEQUENCES, RedisWorkers, StaticWorkers, Workers
from shared.api.logprobs import LogprobFormatter
from shared.api.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from shared.api.serving import (
    CHAT_URL,
    COMPLETIONS_URL,
    MAX_DEPTH_TOKENS,
    RequestError,
    build_response,
    chat_ids,
    parse_request,
    prepare_all,
    validation_message,
    validation_param,
)
from shared.contract import PRESET_NAMES
from shared.models.text import TextModel
from shared.net.registry import WorkerInfo

log = logging.getLogger(__name__)

__version__ = version("lazyserve")

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def static_workers(settings: GatewaySettings, model: str) -> StaticWorkers:
    workers = [
        WorkerInfo(worker_id=f"prefill@{a}", role="prefill", address=a, model=model) for a in settings.prefill_workers
    ]
    workers += [
        WorkerInfo(worker_id=f"decode@{a}", role="decode", address=a, model=model) for a in settings.decode_workers
    ]
    return StaticWorkers(workers)


def status_capacity(auth):
    """StaticWorkers' ask_capacity: a decode worker's max_sequences, from its Status (blocking)."""

    def ask(worker: WorkerInfo) -> int | None:
        client = DecodeClient(worker.address, auth)
        try:
            return client.status(timeout=1.0).max_sequences or None  # 0: a worker too old to say
        finally:
            client.close()

    return ask


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id when it is a plain token (it is echoed and logged), else a new one."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else f"req-{uuid.uuid4().hex[:16]}"


class Gateway:
    """Everything one gateway process holds; `app` serves it."""

    def __init__(self, settings: GatewaySettings, text: TextModel, workers: Workers | None = None):
        self.settings, self.text = settings, text
        self.formatter = LogprobFormatter(text.tokenizer)
        client = None
        if workers is None:
            if settings.redis_url:
                workers = RedisWorkers(settings.redis_url)
                client = workers.client
            else:
                workers = static_workers(settings, text.name)
        if isinstance(workers, StaticWorkers) and workers.ask_capacity is None:
            workers.ask_capacity = status_capacity(settings.internal_auth())
        self.workers = workers
        self.metrics = GatewayMetrics()
        self.records = RequestRecords(client, settings.request_record_ttl_s) if client is not None else None
        required = settings.require_api_key
        if required is None:  # on by default, except for a gateway only reachable from this host
            required = settings.host not in LOOPBACK
        self.keys = KeyStore([k.get_secret_value() for k in settings.api_keys], required, client)
        policy = make_policy(settings.routing, settings.local_threshold)
        prefixes = None  # where prompts are cached; None when the workers cache nothing
        if settings.engine.enable_prefix_caching:
            prefixes = RedisPrefixIndex(client) if client is not None else MemoryPrefixIndex()
        self.queue = AdmissionQueue(self.metrics, settings.max_queued)
        self.dispatcher = Dispatcher(
            workers,
            policy,
            text,
            self.metrics,
            settings.retries,
            settings.internal_auth(),
            prefixes=prefixes,
            queue=self.queue,
        )
        self.admission = Admission(workers, self.metrics, self.queue, settings.max_streams_per_key)
        self.model_names = list(dict.fromkeys([text.name, *settings.served_model_names]))
        self.app = self._build_app()

    # ------------------------------------------------------------------ app and routes
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(app):
            yield
            await self.dispatcher.close()
            if isinstance(self.workers, RedisWorkers):
                self.workers.close()

        app = FastAPI(title="lazyserve", version="0.1.0", lifespan=lifespan)

        def openapi() -> dict:
            if app.openapi_schema is None:
                app.openapi_schema = build_openapi(app)
            return app.openapi_schema

        app.openapi = openapi
        app.state.metrics, app.state.dispatcher, app.state.workers = self.metrics, self.dispatcher, self.workers
        # Every error, raised anywhere, leaves in OpenAI's format.
        app.add_exception_handler(Exception, self._on_error)
        app.add_exception_handler(RequestError, self._on_error)
        app.add_exception_handler(StarletteHTTPException, self._on_error)
        app.add_exception_handler(RequestValidationError, self._on_error)
        app.post(CHAT_URL)(self.chat_completions)
        app.post(COMPLETIONS_URL)(self.completions)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{model_id:path}")(self.model)
        for path, probe in (("/health", self.health), ("/ready", self.ready)):
            app.get(path)(probe)
            app.head(path, include_in_schema=False)(probe)  # HEAD: what load balancers probe
        app.get("/metrics")(self.prometheus)
        app.get("/version")(self.version)
        app.get("/status")(self.status)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        mount_page(app)
        return app

    async def chat_completions(self, request: Request):
        return await self.complete(request, CHAT_URL)

    async def completions(self, request: Request):
        return await self.complete(request, COMPLETIONS_URL)

    async def models(self, request: Request):
        try:
            await self.authorize(request)
        except Exception as error:
            return self.error_response(error)
        return ModelList(data=[ModelCard(id=name) for name in self.model_names]).model_dump()

    async def model(self, request: Request, model_id: str):
        try:
            await self.authorize(request)
            self.check_model(model_id)
        except Exception as error:
            return self.error_response(error)
        return ModelCard(id=model_id).model_dump()

    def check_model(self, name: str | None) -> None:
        """404 for a model this gateway does not serve (an absent name means the one it serves)."""
        if name is not None and name not in self.model_names:
            served = ", ".join(self.model_names)
            raise RequestError(404, f"model {name!r} does not exist here; served: {served}", "model", "model_not_found")

    async def health(self):
        return {"status": "ok"}

    async def ready(self):
        try:
            live = await off_loop(self.workers.list)
        except Exception as error:
            return self.error_response(error)
        name = self.text.name
        decoders = [w for w in live if w.role == "decode" and w.model == name]
        if not decoders:
            return JSONResponse({"status": "no decode worker"}, status_code=503)
        prefillers = [w for w in live if w.role == "prefill" and w.model == name]
        return {"status": "ready", "decode_workers": len(decoders), "prefill_workers": len(prefillers)}

    async def status(self, request: Request):
        """What a person watching the service wants every few seconds (the page's service view):
        requests in flight, the last minute's TTFT p50/p95 and tokens/s, the default pruning
        preset, and every worker with its outstanding load and whether it answers. The same
        figures /metrics exports, as JSON; and what the page's controls need to know (the model's
        layers, the presets, return_token_depths' limit). Behind the API key when keys are on."""
        try:
            await self.authorize(request)
            live = await off_loop(self.workers.list)
            loads = await off_loop(
                lambda: (
                    self.workers.loads(DECODE_TOKENS),
                    self.workers.loads(PREFILL_COST),
                    self.workers.loads(SEQUENCES),
                )
            )
        except Exception as error:
            return self.error_response(error)
        answers = await self._decode_statuses(live, timeout=1.0)
        answered = {entry["address"]: entry for entry in answers}
        workers = [
            {
                "role": w.role,
                "address": w.address,
                "dtype": w.dtype or answered.get(w.address, {}).get("dtype"),
                "load": loads[0 if w.role == "decode" else 1].get(w.worker_id, 0.0),
                "load_unit": "tokens to generate" if w.role == "decode" else "predicted prefill token-layers",
                # Calls of fixed shapes (--batch-invariant); None for prefill workers, not asked.
                "batch_invariant": answered.get(w.address, {}).get("batch_invariant"),
                # prefill workers are not asked (None)
                "healthy": "error" not in answered[w.address] if w.address in answered else None,
                # Decode workers: sequences the gateways placed there, of what it generates at once.
                "sequences": loads[2].get(w.worker_id, 0.0) if w.role == "decode" else None,
                "max_sequences": answered.get(w.address, {}).get("max_sequences") or None,
            }
            for w in live
        ]
        return {
            "model": {
                "name": self.text.name,
                "num_layers": self.text.spec.num_layers,
                "max_model_len": self.text.max_positions,
                # False for a base model: the page sends its text to /v1/completions instead.
                "chat_template": self.text.has_chat_template,
                # Where a pruning stage may sit (None: any layer; else the global layers).
                "stage_layers": self.text.spec.stage_layers,
            },
            "in_flight": self.admission.in_flight,
            # Requests waiting for a worker's room or their key's bound (services.router.admission).
            "queue": {
                "depth": self.queue.depth,
                "max": self.settings.max_queued,
                "oldest_wait_s": round(self.queue.oldest_wait_s(), 3),
            },
            "pruning_preset": self.text.default_preset,
            "pruning_presets": list(PRESET_NAMES),
            "max_depth_tokens": MAX_DEPTH_TOKENS,
            "prefix_caching": self.settings.engine.enable_prefix_caching,
            "recent": self.metrics.recent.snapshot(),
            "workers": workers,
        }

    async def version(self):
        """The release, and what each decode worker runs (dtype, device, threads): `--dtype auto`
        chooses per host, so this is where a deployment shows what it chose."""
        try:
            live = await off_loop(self.workers.list)
        except Exception as error:
            return self.error_response(error)
        return {"version": __version__, "decode_workers": await self._decode_statuses(live)}

    async def _decode_statuses(self, live, timeout: float = 2.0) -> list[dict]:
        """Every live decode worker's Status, asked at once (an error entry for one that does not answer)."""
        decoders = [w for w in live if w.role == "decode"]
        channels = self.dispatcher.channels
        return list(await asyncio.gather(*(decode_status(channels, w, timeout=timeout) for w in decoders)))

    async def tokenize(self, request: Request):
        """vLLM's /tokenize: the ids a prompt (or chat messages, templated) becomes here."""
        try:
            await self.authorize(request)
            body = _validated(TokenizeRequest, await self.read_body(request))
            self.check_model(body.model)
            ids = await off_loop(self._tokenize, body)
            strs = await off_loop(lambda: [self.formatter.text(t) for t in ids]) if body.return_token_strs else None
        except Exception as error:
            return self.error_response(error)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.text.max_positions, tokens=ids, token_strs=strs
        ).model_dump()

    def _tokenize(self, body: TokenizeRequest) -> list[int]:
        text = self.text
        chars = len(body.prompt) if body.prompt is not None else sum(len(m.content) for m in body.messages)
        if chars > text.max_text_chars:
            raise RequestError(
                400, f"{chars} characters cannot fit the context", "prompt" if body.prompt is not None else "messages"
            )
        if body.messages is not None:
            return chat_ids(text, [m.model_dump() for m in body.messages])
        return text.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids

    async def detokenize(self, request: Request):
        try:
            await self.authorize(request)
            body = _validated(DetokenizeRequest, await self.read_body(request))
            self.check_model(body.model)
            if any(not 0 <= token < self.text.vocab_size for token in body.tokens):
                raise RequestError(400, f"token ids must be in [0, {self.text.vocab_size})", "tokens")
            text = await off_loop(self.text.tokenizer.decode, body.tokens)
        except Exception as error:
            return self.error_response(error)
        return DetokenizeResponse(prompt=text).model_dump()

    async def prometheus(self):
        if self.settings.engine.enable_prefix_caching:
            await self._refresh_prefix_gauges()
        return PlainTextResponse(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _refresh_prefix_gauges(self) -> None:
        """The decode workers' prefix caches, asked at scrape time (the prefill workers' come with
        each prefill reply). A worker that does not answer within a second keeps its last figures."""
        try:
            live = await off_loop(self.workers.list)
        except Exception:  # Redis down: /metrics still answers with what it has
            return
        for entry in await self._decode_statuses(live, timeout=1.0):
            if "prefix_cache" in entry:
                self.metrics.prefix_bytes.labels(entry["address"]).set(entry["prefix_cache"]["bytes_held"])
                self.metrics.prefix_evictions.labels(entry["address"]).set(entry["prefix_cache"]["evictions"])

    # ------------------------------------------------------------------ errors
    async def _on_error(self, request: Request, error: Exception):
        return self.error_response(error)

    def error_response(self, error: Exception) -> JSONResponse:
        if isinstance(error, StarletteHTTPException):
            error = RequestError(error.status_code, str(error.detail))
        elif isinstance(error, RequestValidationError):
            error = RequestError(400, str(error))
        status, body = status_of(error)
        headers = {"retry-after": "1"} if status in (429, 503) else None  # when to try again
        return JSONResponse({"error": body.model_dump()}, status_code=status, headers=headers)

    # ------------------------------------------------------------------ a completion
    async def complete(self, request: Request, url: str):
        operation = "chat" if url == CHAT_URL else "text_completion"
        span = start_request_span(request.headers, operation, self.text.name)
        self.metrics.received.inc()
        try:
            response = await self.handle(request, url, span)
        except Exception as error:
            # Answered here rather than by a middleware handler: Starlette re-raises what reaches
            # its catch-all Exception handler, and the client would see a dropped connection.
            status = status_of(error)[0]
            self.metrics.requests.labels(outcome_of(status)).inc()
            if isinstance(error, ClientGone):
                self.metrics.rejections.labels("cancelled").inc()
            finish_request_span(span, error=error, status_code=status)
            return self.error_response(error)
        if not isinstance(response, StreamingResponse):
            span.end()  # streaming responses end their span when the stream ends
        return response

    async def handle(self, request: Request, url: str, span):
        """Check, admit and route a request; the response that runs it to the end."""
        caller, salt = await self.identify(request)
        parsed = parse_request(url, await self.read_body(request))
        self.check_model(parsed.model)
        all_prepared = await off_loop(prepare_all, self.text, parsed)  # tokenizing is CPU work
        all_prepared = [dataclasses.replace(prepared, cache_salt=salt) for prepared in all_prepared]
        annotate_request(span, all_prepared[0], self.text.spec.num_layers)
        try:
            await off_loop(self.dispatcher.check_fits, all_prepared)  # 400 before any waiting
        except RequestError:
            self.metrics.rejections.labels("too_large").inc()
            raise
        self.queue.check_room()  # 429 when the queue is full
        start = time.monotonic()
        deadline = start + self.settings.request_timeout_s
        slot = await until_gone(request, self.admission.admit(caller, deadline))
        streaming = False  # once true, the stream's body gives the slot back
        try:
            request_id = request_id_of(request)
            span.set_attribute("gen_ai.response.id", request_id)
            jobs = []
            for index, prepared in enumerate(all_prepared):  # a completions request's list of prompts
                own_id = request_id if len(all_prepared) == 1 else f"{request_id}-{index}"
                events = self.dispatcher.run(prepared, own_id, deadline, context_of(span), caller)
                jobs.append(TextJob(events, self.text.tokenizer, prepared, self.metrics, start, own_id))
            job = jobs[0] if len(jobs) == 1 else JobGroup(jobs)
            try:
                decision = await until_gone(request, job.route())  # may wait in the queue
            except BaseException as error:
                for each in jobs:
                    await each.events.aclose()
                await self.record(job, "cancelled" if isinstance(error, ClientGone) else "failed", error)
                raise
            annotate_decision(span, decision, self.dispatcher.policy.name)
            if parsed.stream:
                body, streaming = self._stream(job, parsed, slot, span), True
                return StreamingResponse(body, media_type="text/event-stream", headers=job.headers)
            response = await until_gone(request, self._collect(job, parsed, span))
            await slot.give_back()
            return response
        except Exception:
            if not streaming:
                await slot.give_back()  # before the error response goes out
            raise
        finally:
            if not streaming:
                slot.release()

    def _stream(self, job: TextJob | JobGroup, parsed, slot: Slot, span):
        """The SSE body; it holds the request's slot until the stream ends, however it ends."""
        include_usage = bool((parsed.stream_options or {}).get("include_usage"))
        failures = []

        def on_error(error):
            failures.append(error)
            return status_of(error)

        async def body():
            outcome = "cancelled"  # unless it finishes: the client went away
            try:
                model = parsed.model or self.text.name
                async for event in stream_events(job, parsed, model, include_usage, on_error, self.formatter):
                    if event == DONE:
                        await slot.give_back()  # the client may send its next request on [DONE]
                    yield event
                await slot.give_back()  # a stream that ended in an error event
                outcome = "failed" if failures else "ok"
            finally:
                slot.release()
                self.metrics.requests.labels(outcome).inc()
                span.set_attribute("lazyserve.outcome", outcome)
                error = failures[0] if failures else None
                finish_request_span(span, job, error, 200)
                await self.record(job, outcome, error)

        stream = body()
        # A body never started (the client left before the first byte) never runs its finally.
        weakref.finalize(stream, slot.release)
        return stream

    async def _collect(self, job: TextJob | JobGroup, parsed, span) -> JSONResponse:
        try:
            async for _ in job.deltas():
                pass
        except BaseException as error:  # cancelled: the client went away (until_gone)
            outcome = "cancelled" if isinstance(error, asyncio.CancelledError) else "failed"
            await asyncio.shield(self.record(job, outcome, None if outcome == "cancelled" else error))
            raise
        self.metrics.requests.labels("ok").inc()
        await self.record(job, "ok")
        if job.stats is not None:
            annotate_stats(span, job.stats)
        span.set_attribute("gen_ai.response.finish_reasons", job.finish_reasons)
        model = parsed.model or self.text.name
        response = build_response(model, parsed, job.prepared, job.outputs(), job.stats, self.formatter)
        return JSONResponse(response.model_dump(), headers=job.headers)  # after a retry: where it really ran

    # ------------------------------------------------------------------ pieces
    async def authorize(self, request: Request) -> str:
        """Check the key; returns who is asking (a key's hash, or the client's address without keys)."""
        return (await self.identify(request))[0]

    async def identify(self, request: Request) -> tuple[str, str]:
        """Check the key; returns who is asking and the prefix cache's salt for them (auth.KeyStore)."""
        header = request.headers.get("authorization", "")
        presented = header[7:].strip() if header.lower().startswith("bearer ") else None
        address = request.client.host if request.client else "?"
        caller, salt = await off_loop(self.keys.identify, presented, address)  # may ask Redis
        if caller is None:
            raise RequestError(
                401, "missing or invalid API key (send it as `Authorization: Bearer KEY`)", code="invalid_api_key"
            )
        return caller, salt

    async def read_body(self, request: Request) -> dict:
        """The JSON body, read within the size limit and the read timeout: a declared length over
        the limit is refused before reading, a chunked body as soon as it passes the limit."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            raise RequestError(413, f"a request body of {declared} bytes is over the limit of {limit}")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.settings.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise RequestError(413, f"the request body is over the limit of {limit} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestError(
                408, f"the request body did not arrive within {self.settings.body_timeout_s} s"
            ) from None
        except ClientDisconnect:  # gone before its body arrived: a client that left, not our error
            raise ClientGone("the client went away before its request body arrived") from None
        raw = b"".join(chunks)
        depth = self.settings.max_body_depth
        if nested_deeper_than(raw, depth):
            raise RequestError(400, f"the body nests arrays and objects more than {depth} levels deep")
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(400, f"the body is not valid JSON: {error}") from None
        except RecursionError:  # the check above bounds nesting first; kept as a backstop
            raise RequestError(400, "the body nests too deep") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the body must be a JSON object")
        return body

    async def record(self, job: TextJob | JobGroup, outcome: str, error: Exception | None = None) -> None:
        """The request's record in Redis (multi-host mode), written in a thread."""
        if self.records is not None:
            await off_loop(
                self.records.write, job.request_id, job.record(outcome, error and status_of(error)[1].message)
            )


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_INNERMOST = re.compile(rb"\[\]|\{\}")


def nested_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether JSON text nests arrays and objects more than `limit` deep, found without parsing
    it: strings dropped, then every innermost pair removed per pass, all in the regex engine
    (json.loads recurses once per level, and Python's recursion limit made a 100,000-deep body a
    500). At most `limit` passes over the brackets, usually a few hundred bytes of them."""
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets, removed = _INNERMOST.subn(b"", brackets)
        if not removed:
            return False  # unbalanced: json.loads says where
    return bool(brackets)


async def until_gone(request: Request, work):
    """Await `work` (a coroutine) unless the client goes away first: then it is cancelled (what it
    held is given back by its own cleanup) and ClientGone is raised. The request body must have
    been read: the next message the server has for this request is its disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # this task itself cancelled: so is the work
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone("the client went away before its request finished")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _validated(schema, body: dict):
    try:
        return schema.model_validate(body)
    except ValidationError as error:
        raise RequestError(400, validation_message(error), param=validation_param(error)) from None


def create_app(settings: GatewaySettings, text: TextModel, workers: Workers | None = None) -> FastAPI:
    return Gateway(settings, text, workers).app
