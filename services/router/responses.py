"""From dispatcher events to OpenAI responses: one JSON body, or server-sent event chunks.

The text side (detokenizing, stop strings) lives here, in the gateway: workers deal in token ids.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing

from services.router.client import Finished, Tokens
from services.router.metrics import GatewayMetrics
from services.router.policy import Decision
from shared.api.logprobs import LogprobFormatter
from shared.api.schemas import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    CompletionChunk,
    CompletionChunkChoice,
)
from shared.api.serving import Prepared, metrics_of, usage_of
from shared.contract import Sampled, Stats
from shared.models.text import Detokenizer


class TextJob:
    """Consumes a dispatcher's events, yielding text deltas; afterwards holds the outcome."""

    def __init__(
        self,
        events: AsyncIterator,
        tokenizer,
        prepared: Prepared,
        metrics: GatewayMetrics,
        start: float,
        request_id: str,
    ):
        self.events, self.prepared, self.metrics, self.start = events, prepared, metrics, start
        self.request_id = request_id
        self.detokenizer = Detokenizer(tokenizer, prepared.stop)
        self.decision: Decision | None = None
        self.finish_reason = "length"
        self.stats: Stats | None = None
        self.partial_stats: Stats | None = None  # the prefill's figures, sent with the first tokens
        self.num_tokens = 0
        self.sampled: list[Sampled] = []  # with logprobs asked: each token's, as they came
        self.ttft_s: float | None = None

    async def route(self) -> Decision:
        """Take the routing decision (the first event): errors of routing surface here, before streaming."""
        event = await anext(self.events)
        if not isinstance(event, Decision):
            raise RuntimeError(f"expected the routing decision first, got {event!r}")
        self.decision = event
        return event

    async def deltas(self) -> AsyncIterator[tuple[str, list[Sampled]]]:
        """(text delta, the log-probabilities of the tokens it came from) as tokens arrive; the
        text may be held back (a possible stop string) while its tokens' figures are not."""
        last = None
        async with aclosing(self.events) as events:
            async for event in events:
                if isinstance(event, Decision):  # a retry chose again
                    self.decision = event
                elif isinstance(event, Tokens):
                    if event.stats is not None:
                        self.partial_stats = event.stats
                    now = time.monotonic()
                    if last is None:
                        self.ttft_s = now - self.start
                        self.metrics.ttft.observe(self.ttft_s)
                    else:
                        self.metrics.itl.observe((now - last) / len(event.ids))
                    last = now
                    self.num_tokens += len(event.ids)
                    sampled = event.logprobs or []
                    self.sampled.extend(sampled)
                    delta = self.detokenizer.add(event.ids)
                    if delta or sampled:
                        yield delta, sampled
                    if self.detokenizer.stopped:
                        self.finish_reason = "stop"
                        break  # closing the events cancels generation downstream
                elif isinstance(event, Finished):
                    self.finish_reason, self.stats = event.reason, event.stats
        if rest := self.detokenizer.flush():
            yield rest, []
        if self.stats is None:  # cut short by a stop string: the prefill's figures, the counts seen here
            self.stats = dataclasses.replace(
                self.partial_stats or Stats(), prompt_tokens=len(self.prepared.ids), completion_tokens=self.num_tokens
            )
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.prompt_tokens.inc(self.stats.prompt_tokens)
        self.metrics.completion_tokens.inc(self.stats.completion_tokens)
        if self.stats.token_layers_full:
            self.metrics.computed_fraction.observe(self.stats.computed_fraction)

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def headers(self) -> dict[str, str]:
        """Response headers: the request id and where it ran (the last attempt's workers)."""
        decision = self.decision
        return {
            "x-request-id": self.request_id,
            "x-lazyserve-route": decision.kind,
            "x-lazyserve-decode": decision.decode.address,
        }

    def record(self, outcome: str, error: str | None = None) -> dict:
        """The request's record fields (status, route, timings) for the Redis request log."""
        decision, stats = self.decision, self.stats
        return {
            "outcome": outcome,
            "route": decision and decision.kind,
            "decode": decision and decision.decode.address,
            "prefill": decision and decision.prefill and decision.prefill.address,
            "prompt_tokens": len(self.prepared.ids),
            "completion_tokens": stats.completion_tokens if stats else self.num_tokens,
            "finish_reason": self.finish_reason if outcome == "ok" else None,
            "ttft_s": self.ttft_s,
            "e2e_s": time.monotonic() - self.start,
            "error": error,
        }


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def stream_events(
    job: TextJob, request, model: str, include_usage: bool, on_error, formatter: LogprobFormatter
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending in `data: [DONE]`; an error event on failure."""
    chat = isinstance(request, ChatCompletionRequest)
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    offset = len(job.prepared.echo)  # completions' text_offset: where the next token's text starts

    def chunk(delta: str | None, finish=None, role=False, usage=None, metrics=None, sampled=None) -> str:
        nonlocal offset
        if chat:
            logprobs = formatter.chat(sampled) if sampled else None
            choices = (
                []
                if delta is None and finish is None and not role
                else [
                    ChatChunkChoice(
                        delta=ChatDelta(role="assistant" if role else None, content=delta),
                        finish_reason=finish,
                        logprobs=logprobs,
                    )
                ]
            )
            body = ChatCompletionChunk(**base, choices=choices, usage=usage, metrics=metrics)
        else:
            logprobs = None
            if sampled:
                logprobs = formatter.completion(sampled, offset)
                offset += sum(map(len, logprobs["tokens"]))
            choices = (
                []
                if delta is None and finish is None
                else [CompletionChunkChoice(text=delta or "", finish_reason=finish, logprobs=logprobs)]
            )
            body = CompletionChunk(**base, choices=choices, usage=usage, metrics=metrics)
        return sse(_chunk_dump(body))

    try:
        if chat:
            yield chunk("", role=True)
        elif job.prepared.echo:
            yield chunk(job.prepared.echo)
        async with aclosing(job.deltas()) as deltas:  # leaving early cancels downstream at once
            async for delta, sampled in deltas:
                yield chunk(delta, sampled=sampled)
    except Exception as error:  # after the stream began, a failure is an event, never a dropped stream
        status, body = on_error(error)
        yield sse({"error": body.model_dump()})
        return
    metrics = metrics_of(job.stats, job.prepared.pruning_label)
    yield chunk(None if chat else "", finish=job.finish_reason, metrics=metrics)
    if include_usage:
        yield chunk(None, usage=usage_of(job.stats))
    yield sse("[DONE]")


def _chunk_dump(body: ChatCompletionChunk | CompletionChunk) -> dict:
    # Optional top-level fields (usage, metrics) appear only when set; each choice keeps OpenAI's
    # exact keys: `finish_reason` and `logprobs` stay, null until the end; a chat delta keeps
    # `content` only when set.
    data = body.model_dump(exclude_none=True)
    for choice, model in zip(data["choices"], body.choices):
        choice["finish_reason"], choice["logprobs"] = model.finish_reason, model.logprobs
    return data
