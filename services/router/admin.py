"""The gateway's routes beside the completion path: the models it serves, health and readiness,
what the service is doing (/status, /metrics, /version) and vLLM's /tokenize and /detokenize.

Each route reads the Gateway from the app's state; routes behind the API key depend on
auth.caller_of; errors are raised and answered by the handlers (errors.install_handlers).
"""

from __future__ import annotations

import asyncio
from importlib.metadata import version

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.router.admission import off_loop
from services.router.auth import Caller, caller_of
from services.router.client import decode_status
from services.router.gateway import Gateway
from services.router.http import read_body, validated
from services.router.workers import DECODE_TOKENS, PREFILL_COST, PREFILL_QUEUED, SEQUENCES
from shared.api.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from shared.api.serving import MAX_DEPTH_TOKENS, RequestError, chat_ids
from shared.contract import PRESET_NAMES

__version__ = version("lazyserve")

router = APIRouter()
Authorized = Depends(caller_of)


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


Held = Depends(gateway_of)


@router.get("/v1/models")
async def models(caller: Caller = Authorized, gateway: Gateway = Held):
    return ModelList(data=[ModelCard(id=name) for name in gateway.model_names]).model_dump()


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, caller: Caller = Authorized, gateway: Gateway = Held):
    gateway.check_model(model_id)
    return ModelCard(id=model_id).model_dump()


async def health():
    return {"status": "ok"}


async def ready(gateway: Gateway = Held):
    live = await off_loop(gateway.workers.list)
    name = gateway.text.name
    decoders = [w for w in live if w.role == "decode" and w.model == name]
    if not decoders:
        return JSONResponse({"status": "no decode worker"}, status_code=503)
    prefillers = [w for w in live if w.role == "prefill" and w.model == name]
    return {"status": "ready", "decode_workers": len(decoders), "prefill_workers": len(prefillers)}


for _path, _probe in (("/health", health), ("/ready", ready)):
    router.get(_path)(_probe)
    router.head(_path, include_in_schema=False)(_probe)  # HEAD: what load balancers probe


@router.get("/status")
async def status(caller: Caller = Authorized, gateway: Gateway = Held):
    """What a person watching the service wants every few seconds (the page's service view):
    requests in flight and queued, the last minute's TTFT p50/p95 and tokens/s, the default
    pruning preset, and every worker with its outstanding load and whether it answers. The same
    figures /metrics exports, as JSON; and what the page's controls need to know (the model's
    layers, the presets, return_token_depths' limit)."""
    text, settings = gateway.text, gateway.settings
    return {
        "model": {
            "name": text.name,
            "num_layers": text.spec.num_layers,
            "max_model_len": text.max_positions,
            # False for a base model: the page sends its text to /v1/completions instead.
            "chat_template": text.has_chat_template,
            # Where a pruning stage may sit (None: any layer; else the global layers).
            "stage_layers": text.spec.stage_layers,
        },
        # Serving without Redis: the workers last seen and this gateway's own counts (fallback.py).
        "degraded": gateway.degraded,
        # Where workers, shared counts and keys live: "redis" (--redis-url) or "memory" (this gateway's own).
        "shared_state": "redis" if settings.redis_url else "memory",
        "in_flight": gateway.admission.in_flight,
        # Requests waiting for a worker's room or their key's bound (services.router.admission).
        "queue": {
            "depth": gateway.queue.depth,
            "max": settings.max_queued,
            "oldest_wait_s": round(gateway.queue.oldest_wait_s(), 3),
        },
        "pruning_preset": text.default_preset,
        "pruning_presets": list(PRESET_NAMES),
        "max_depth_tokens": MAX_DEPTH_TOKENS,
        "prefix_caching": settings.engine.enable_prefix_caching,
        "recent": gateway.metrics.recent.snapshot(settings.engine.ttft_slo_s, settings.engine.itl_slo_s),
        "workers": await _workers_view(gateway),
    }


async def _workers_view(gateway: Gateway) -> list[dict]:
    """Every live worker: its load in its unit and, for decode workers, what its Status says."""
    workers = gateway.workers
    live = await off_loop(workers.list)
    tokens, cost, sequences, queued = await off_loop(
        lambda: tuple(workers.loads(kind) for kind in (DECODE_TOKENS, PREFILL_COST, SEQUENCES, PREFILL_QUEUED))
    )
    rates = gateway.dispatcher.placement.rates
    answered = {entry["address"]: entry for entry in await decode_statuses(gateway, live, timeout=1.0)}
    view = []
    for w in live:
        decode = w.role == "decode"
        said = answered.get(w.address, {})
        view.append(
            {
                "role": w.role,
                "address": w.address,
                "dtype": w.dtype or said.get("dtype"),
                "load": (tokens if decode else cost).get(w.worker_id, 0.0),
                "load_unit": "tokens to generate" if decode else "predicted prefill token-layers",
                # Calls of fixed shapes (--batch-invariant); None for prefill workers, not asked.
                "batch_invariant": said.get("batch_invariant"),
                # The decode step's kernels ("native (avx512)", "torch (why)"); None for prefill workers.
                "kernels": said.get("kernels"),
                "healthy": "error" not in said if w.address in answered else None,
                # Decode workers: sequences the gateways placed there, of what it generates at once.
                "sequences": sequences.get(w.worker_id, 0.0) if decode else None,
                "max_sequences": said.get("max_sequences") or None,
                # Predicted prefill cost placed there and not yet prefilled (full-model prompt tokens),
                # for a decode worker the prompts waiting in its rounds, and its last reported rate.
                "prefill_queued": queued.get(w.worker_id, 0.0),
                "prefills_waiting": said.get("prefills_waiting"),
                "prefill_rate": said.get("prefill_rate") or rates.get(w.worker_id),
            }
        )
    return view


@router.get("/version")
async def version_of(gateway: Gateway = Held):
    """The release, and what each decode worker runs (dtype, device, threads): `--dtype auto`
    chooses per host, so this is where a deployment shows what it chose."""
    live = await off_loop(gateway.workers.list)
    return {"version": __version__, "decode_workers": await decode_statuses(gateway, live)}


async def decode_statuses(gateway: Gateway, live, timeout: float = 2.0) -> list[dict]:
    """Every live decode worker's Status, asked at once (an error entry for one that does not answer)."""
    channels = gateway.dispatcher.channels
    decoders = [w for w in live if w.role == "decode"]
    return list(await asyncio.gather(*(decode_status(channels, w, timeout=timeout) for w in decoders)))


@router.get("/metrics")
async def prometheus(gateway: Gateway = Held):
    if gateway.settings.engine.enable_prefix_caching:
        await _refresh_prefix_gauges(gateway)
    return PlainTextResponse(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _refresh_prefix_gauges(gateway: Gateway) -> None:
    """The decode workers' prefix caches, asked at scrape time (the prefill workers' come with
    each prefill reply). A worker that does not answer within a second keeps its last figures."""
    try:
        live = await off_loop(gateway.workers.list)
    except Exception:  # Redis down: /metrics still answers with what it has
        return
    for entry in await decode_statuses(gateway, live, timeout=1.0):
        if "prefix_cache" in entry:
            gateway.metrics.prefix_bytes.labels(entry["address"]).set(entry["prefix_cache"]["bytes_held"])
            gateway.metrics.prefix_evictions.labels(entry["address"]).set(entry["prefix_cache"]["evictions"])


@router.post("/tokenize")
async def tokenize(request: Request, caller: Caller = Authorized, gateway: Gateway = Held):
    """vLLM's /tokenize: the ids a prompt (or chat messages, templated) becomes here."""
    body = validated(TokenizeRequest, await read_body(request, gateway.settings))
    gateway.check_model(body.model)
    ids = await off_loop(_tokenize, gateway, body)
    strs = None
    if body.return_token_strs:
        strs = await off_loop(lambda: [gateway.formatter.text(t) for t in ids])
    return TokenizeResponse(
        count=len(ids), max_model_len=gateway.text.max_positions, tokens=ids, token_strs=strs
    ).model_dump()


def _tokenize(gateway: Gateway, body: TokenizeRequest) -> list[int]:
    text = gateway.text
    chars = len(body.prompt) if body.prompt is not None else sum(len(m.content) for m in body.messages)
    if chars > text.max_text_chars:
        raise RequestError(
            400, f"{chars} characters cannot fit the context", "prompt" if body.prompt is not None else "messages"
        )
    if body.messages is not None:
        return chat_ids(text, [m.model_dump() for m in body.messages])
    return text.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids


@router.post("/detokenize")
async def detokenize(request: Request, caller: Caller = Authorized, gateway: Gateway = Held):
    body = validated(DetokenizeRequest, await read_body(request, gateway.settings))
    gateway.check_model(body.model)
    vocab = gateway.text.vocab_size
    if any(not 0 <= token < vocab for token in body.tokens):
        raise RequestError(400, f"token ids must be in [0, {vocab})", "tokens")
    return DetokenizeResponse(prompt=await off_loop(gateway.text.tokenizer.decode, body.tokens)).model_dump()
