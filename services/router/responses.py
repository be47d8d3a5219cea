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
from dataclasses import dataclass, field

from services.router.client import Finished, Tokens
from services.router.merge import merged
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
from shared.api.serving import Output, Prepared, metrics_of, usage_of
from shared.contract import Sampled, Stats
from shared.models.text import Detokenizer


@dataclass
class ChoiceText:
    """One choice's text side: its detokenizer (stop strings), finish, figures and logprobs."""

    detokenizer: Detokenizer
    echo: str = ""  # completions with echo: its prompt's text, sent first
    finish_reason: str = "length"
    stats: Stats | None = None  # its Finished figures
    partial_stats: Stats | None = None  # the prefill's figures, sent with its first tokens
    num_tokens: int = 0
    sampled: list[Sampled] = field(default_factory=list)  # with logprobs asked: each token's

    @property
    def open(self) -> bool:
        return self.stats is None and not self.detokenizer.stopped

    def output(self) -> Output:
        return Output(self.echo + self.detokenizer.text, self.finish_reason, self.sampled, len(self.echo))


class TextJob:
    """Consumes a dispatcher's events, yielding text deltas per choice; afterwards holds the outcome."""

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
        self.choices = [
            ChoiceText(Detokenizer(tokenizer, prepared.stop), prepared.echo) for _ in range(prepared.sampling.n)
        ]
        self.decision: Decision | None = None
        self.stats: Stats | None = None  # the request's: the first choice's figures, every choice's tokens
        self.ttft_s: float | None = None

    async def route(self) -> Decision:
        """Take the routing decision (the first event): errors of routing surface here, before streaming."""
        event = await anext(self.events)
        if not isinstance(event, Decision):
            raise RuntimeError(f"expected the routing decision first, got {event!r}")
        self.decision = event
        return event

    async def deltas(self) -> AsyncIterator[tuple[int, str, list[Sampled]]]:
        """(choice, text delta, the log-probabilities of the tokens it came from) as tokens arrive;
        the text may be held back (a possible stop string) while its tokens' figures are not."""
        last = first = None
        streamed = 0  # tokens received, every choice's
        async with aclosing(self.events) as events:
            async for event in events:
                if isinstance(event, Decision):  # a retry chose again
                    self.decision = event
                elif isinstance(event, Tokens):
                    choice = self.choices[event.index]
                    if event.stats is not None:
                        choice.partial_stats = event.stats
                    now = time.monotonic()
                    streamed += len(event.ids)
                    if last is None:
                        first = now
                        self.ttft_s = now - self.start
                        self.metrics.ttft.observe(self.ttft_s)
                        self.metrics.recent.ttft(self.ttft_s)
                    else:
                        self.metrics.itl.observe((now - last) / len(event.ids))
                    last = now
                    if choice.detokenizer.stopped:  # its stop string came; the others go on
                        continue
                    choice.num_tokens += len(event.ids)
                    sampled = event.logprobs or []
                    choice.sampled.extend(sampled)
                    delta = choice.detokenizer.add(event.ids)
                    if delta or sampled:
                        yield event.index, delta, sampled
                    if choice.detokenizer.stopped:
                        choice.finish_reason = "stop"
                        if not any(c.open for c in self.choices):
                            break  # closing the events cancels generation downstream
                elif isinstance(event, Finished):
                    choice = self.choices[event.index]
                    choice.stats = event.stats
                    if not choice.detokenizer.stopped:
                        choice.finish_reason = event.reason
        for index, choice in enumerate(self.choices):
            if rest := choice.detokenizer.flush():
                yield index, rest, []
        self.stats = self._request_stats()
        self.metrics.e2e.observe(time.monotonic() - self.start)
        self.metrics.prompt_tokens.inc(self.stats.prompt_tokens)
        self.metrics.completion_tokens.inc(self.stats.completion_tokens)
        self.metrics.recent.tokens(self.stats.completion_tokens)
        if first is not None:
            self.metrics.recent.finished(self.ttft_s, (last - first) / (streamed - 1) if streamed > 1 else None)
        if self.stats.token_layers_full:
            self.metrics.computed_fraction.observe(self.stats.computed_fraction)

    def _request_stats(self) -> Stats:
        """The first choice's figures (one prefill serves every choice), with the prompt counted
        once and every choice's tokens; a choice cut short by a stop string counts what it sent."""
        per_choice = []
        for choice in self.choices:
            if choice.stats is None or choice.detokenizer.stopped:
                figures = choice.stats or choice.partial_stats or Stats()
                per_choice.append(dataclasses.replace(figures, completion_tokens=choice.num_tokens))
            else:
                per_choice.append(choice.stats)
        return dataclasses.replace(
            per_choice[0],
            prompt_tokens=len(self.prepared.ids),
            completion_tokens=sum(stats.completion_tokens for stats in per_choice),
        )

    @property
    def finish_reasons(self) -> list[str]:
        return [choice.finish_reason for choice in self.choices]

    def outputs(self) -> list[Output]:
        return [choice.output() for choice in self.choices]

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
            "completion_tokens": stats.completion_tokens if stats else sum(c.num_tokens for c in self.choices),
            "finish_reason": self.finish_reasons[0] if outcome == "ok" else None,
            "ttft_s": self.ttft_s,
            "e2e_s": time.monotonic() - self.start,
            "error": error,
        }


class JobGroup:
    """The prompts of one completions request, each its own TextJob (routed and run on its own,
    concurrently), seen as one job: its choices numbered prompt by prompt, as OpenAI numbers them."""

    def __init__(self, jobs: list[TextJob]):
        self.jobs = jobs
        self.prepared, self.request_id = jobs[0].prepared, jobs[0].request_id
        self.choices = [choice for job in jobs for choice in job.choices]
        self.stats: Stats | None = None
        self.decision: Decision | None = None

    async def route(self) -> Decision:
        """Route the first prompt: its decision names the response's headers. The others are
        routed as they run (deltas), each when a worker has room for it: routing them all first
        would hold room for prompts that cannot start, and a request with more choices than the
        workers hold at once would wait for itself."""
        self.decision = await self.jobs[0].route()
        return self.decision

    async def deltas(self) -> AsyncIterator[tuple[int, str, list[Sampled]]]:
        """Every job's deltas as they come, choice indices offset by the choices before them."""
        offsets = [0]
        for job in self.jobs[:-1]:
            offsets.append(offsets[-1] + len(job.choices))

        async def offset_deltas(job: TextJob, offset: int):
            async with aclosing(job.deltas()) as deltas:
                async for index, delta, sampled in deltas:
                    yield offset + index, delta, sampled

        # A failure or a client gone: the other prompts' generations stop too.
        async with aclosing(merged([offset_deltas(job, o) for job, o in zip(self.jobs, offsets)])) as items:
            async for item in items:
                yield item
        each = [job.stats for job in self.jobs]
        self.stats = dataclasses.replace(
            each[0],
            prompt_tokens=sum(stats.prompt_tokens for stats in each),
            completion_tokens=sum(stats.completion_tokens for stats in each),
            cached_tokens=sum(stats.cached_tokens for stats in each),
        )

    @property
    def ttft_s(self) -> float | None:
        return min((job.ttft_s for job in self.jobs if job.ttft_s is not None), default=None)

    @property
    def finish_reasons(self) -> list[str]:
        return [reason for job in self.jobs for reason in job.finish_reasons]

    def outputs(self) -> list[Output]:
        return [output for job in self.jobs for output in job.outputs()]

    @property
    def headers(self) -> dict[str, str]:
        return self.jobs[0].headers

    def record(self, outcome: str, error: str | None = None) -> dict:
        record = self.jobs[0].record(outcome, error)
        record["prompt_tokens"] = sum(len(job.prepared.ids) for job in self.jobs)
        if self.stats is not None:
            record["completion_tokens"] = self.stats.completion_tokens
        return record


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


DONE = sse("[DONE]")  # a stream's last event


async def stream_events(
    job: TextJob, request, model: str, include_usage: bool, on_error, formatter: LogprobFormatter
) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending in `data: [DONE]`; an error event on failure.
    With n > 1 each chunk carries one choice, by its index, as OpenAI and vLLM send them."""
    chat = isinstance(request, ChatCompletionRequest)
    base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
    # Completions' text_offset: where each choice's next token's text starts.
    offsets = [len(choice.echo) for choice in job.choices]

    def chunk(index: int, delta: str | None, finish=None, role=False, sampled=None, metrics=None) -> str:
        if chat:
            choice = ChatChunkChoice(
                index=index,
                delta=ChatDelta(role="assistant" if role else None, content=delta),
                finish_reason=finish,
                logprobs=formatter.chat(sampled) if sampled else None,
            )
            body = ChatCompletionChunk(**base, choices=[choice], metrics=metrics)
        else:
            logprobs = None
            if sampled:
                logprobs = formatter.completion(sampled, offsets[index])
                offsets[index] += sum(map(len, logprobs["tokens"]))
            choice = CompletionChunkChoice(index=index, text=delta or "", finish_reason=finish, logprobs=logprobs)
            body = CompletionChunk(**base, choices=[choice], metrics=metrics)
        return sse(_chunk_dump(body))

    try:
        for index in range(len(job.choices)):
            if chat:
                yield chunk(index, "", role=True)
            elif job.choices[index].echo:
                yield chunk(index, job.choices[index].echo)
        async with aclosing(job.deltas()) as deltas:  # leaving early cancels downstream at once
            async for index, delta, sampled in deltas:
                yield chunk(index, delta, sampled=sampled)
    except Exception as error:  # after the stream began, a failure is an event, never a dropped stream
        status, body = on_error(error)
        yield sse({"error": body.model_dump()})
        return
    metrics = metrics_of(job.stats, job.prepared.pruning_label)
    last = len(job.choices) - 1
    for index, reason in enumerate(job.finish_reasons):
        yield chunk(index, None if chat else "", finish=reason, metrics=metrics if index == last else None)
    if include_usage:
        kind = ChatCompletionChunk if chat else CompletionChunk
        yield sse(kind(**base, choices=[], usage=usage_of(job.stats)).model_dump(exclude_none=True))
    yield DONE


def _chunk_dump(body: ChatCompletionChunk | CompletionChunk) -> dict:
    # Optional top-level fields (usage, metrics) appear only when set; each choice keeps OpenAI's
    # exact keys: `finish_reason` and `logprobs` stay, null until the end; a chat delta keeps
    # `content` only when set.
    data = body.model_dump(exclude_none=True)
    for choice, model in zip(data["choices"], body.choices):
        choice["finish_reason"], choice["logprobs"] = model.finish_reason, model.logprobs
    return data
