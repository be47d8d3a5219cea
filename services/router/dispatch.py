"""One request through the workers: route, prefill (or not), generate, retry before the first token.

Each attempt is client.generate_on, the one client of the worker services.

Async (grpc.aio) so the gateway's event loop carries many streams. Yields Tokens as they arrive
and one Finished. A failure before any token was yielded is retried once on other workers; after
that it is raised for the gateway to report. Closing the iterator (a client that went away, a
stop string) cancels the downstream calls, and the decode worker frees the sequence.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import grpc
from opentelemetry import context as otel_context

from services.router.admission import in_background, off_loop
from services.router.client import Channels, Finished, Prefilled, Tokens, UpstreamError, WorkerFailed, generate_on
from services.router.metrics import GatewayMetrics
from services.router.policy import Decision, NoWorkerError
from services.router.prefixes import PrefixIndex, prompt_keys
from services.router.tracing import annotate_decision
from services.router.workers import DECODE_TOKENS, PREFILL_COST, Workers
from shared.api.serving import Prepared
from shared.contract.prefix import BLOCK_TOKENS, held_layers
from shared.models.text import TextModel
from shared.net.telemetry import tracer
from shared.net.transport import NO_AUTH, InternalAuth

log = logging.getLogger(__name__)

# Codes that say the request itself is wrong: retrying elsewhere would fail the same way.
NOT_RETRIED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class DeadlineError(Exception):
    """The request deadline passed (504)."""


class Dispatcher:
    def __init__(
        self,
        workers: Workers,
        policy,
        text: TextModel,
        metrics: GatewayMetrics,
        retries: int,
        auth: InternalAuth = NO_AUTH,
        attempt=generate_on,
        prefixes: PrefixIndex | None = None,
    ):
        self.workers, self.policy, self.text, self.metrics, self.retries = workers, policy, text, metrics, retries
        self.channels = Channels(auth)
        self.attempt = attempt  # client.generate_on; the retry tests give a scripted one
        self.prefixes = prefixes  # which worker holds which prompt start; None: no prefix caching

    async def close(self) -> None:
        await self.channels.close()

    def keys(self, prepared: Prepared, ids: list[int] | None = None) -> list[bytes]:
        spec = self.text.spec
        return prompt_keys(ids or prepared.ids, self.text.name, prepared.pruning, spec.num_layers, prepared.cache_salt)

    def choose(
        self,
        prepared: Prepared,
        exclude: set[str],
        parent: otel_context.Context | None = None,
        keys: list[bytes] | None = None,
    ) -> Decision:
        """keys: the prompt's block keys (`keys`), when the gateway routes by cache."""
        fraction = prepared.pruning.computed_fraction(self.text.spec.num_layers, len(prepared.ids))
        with tracer.start_as_current_span("route", context=parent) as span:
            matched = None
            if self.prefixes is not None:
                try:
                    blocks = self.prefixes.matches(keys if keys is not None else self.keys(prepared))
                except Exception as error:  # an index that cannot answer (Redis blip) routes by load
                    log.warning("prefix index lookup failed: %s", error)
                    blocks = {}
                matched = {worker: count * BLOCK_TOKENS for worker, count in blocks.items()}
                span.set_attribute("lazyserve.prefix_matched_tokens", max(matched.values(), default=0))
            spec = self.text.spec
            decision = self.policy.choose(
                self.workers,
                self.text.name,
                len(prepared.ids),
                fraction,
                prepared.sampling.max_new_tokens,
                exclude,
                matched=matched,
                shared=held_layers(prepared.pruning, spec.num_layers) / spec.num_layers,
            )
            annotate_decision(span, decision, self.policy.name)
        self.metrics.routing.labels(decision.kind, self.policy.name).inc()
        log.debug(
            "route %s: %s (prefill=%s decode=%s, predicted cost %.0f)",
            decision.kind,
            decision.reason,
            decision.prefill and decision.prefill.address,
            decision.decode.address,
            decision.prefill_cost,
        )
        return decision

    async def run(
        self, prepared: Prepared, request_id: str, deadline: float, parent: otel_context.Context | None = None
    ) -> AsyncIterator[Tokens | Finished]:
        exclude: set[str] = set()
        attempt = 0
        # Hashed once, off the event loop: every attempt's routing and the index record use them.
        keys = await off_loop(self.keys, prepared) if self.prefixes is not None else []
        while True:
            try:
                # The worker list may come from Redis: a blocking call, kept off the event loop.
                decision = await off_loop(self.choose, prepared, exclude, parent, keys)
            except NoWorkerError:
                if attempt == 0:
                    raise
                raise UpstreamError("the request failed and no other worker is live to retry it") from None
            yield decision  # for the gateway's trace and response headers; not a token
            emitted = False
            await off_loop(self._add_load, decision, +1)  # Redis: in a thread, never on the loop
            try:
                # aclosing: when the consumer leaves early, the attempt's calls are cancelled now,
                # not when the garbage collector finalizes the generator.
                attempt_events = self.attempt(
                    self.channels,
                    decision.decode,
                    decision.prefill,
                    prepared.ids,
                    prepared.pruning,
                    prepared.sampling,
                    request_id,
                    deadline,
                    parent,
                    cache_salt=prepared.cache_salt,
                    token_depths=prepared.token_depths,
                )
                async with aclosing(attempt_events) as events:
                    async for event in events:
                        if isinstance(event, Prefilled):
                            self.metrics.kv_bytes.inc(event.reply.bytes_sent)
                            self._prefill_cache_figures(decision, event.reply)
                            continue
                        if isinstance(event, Tokens) and event.index == 0 and event.stats is not None and not emitted:
                            self._prefilled(decision, keys, event.stats)
                        emitted = emitted or isinstance(event, Tokens)
                        yield event
                return
            except WorkerFailed as failure:
                error = failure.error
                if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= deadline:
                    raise DeadlineError("the request did not finish before its deadline") from None
                message = f"worker {failure.worker.address} failed: {error.code().name}: {error.details()}"
                if emitted or attempt >= self.retries or error.code() in NOT_RETRIED:
                    raise UpstreamError(message) from None
                log.warning("request %s: %s; retrying on another worker", request_id, message)
                self.metrics.retries.inc()
                exclude.add(failure.worker.worker_id)
                attempt += 1
            finally:
                in_background(self._add_load, decision, -1)  # also while this task is being cancelled

    def _prefilled(self, decision: Decision, keys: list[bytes], stats) -> None:
        """The prompt is prefilled: count what the cache gave, and note who holds the prompt now."""
        prefiller = decision.prefill or decision.decode
        self.metrics.prefix_queried.labels(prefiller.address).inc(stats.prompt_tokens)
        self.metrics.prefix_hit.labels(prefiller.address).inc(stats.cached_tokens)
        if self.prefixes is None:
            return
        # The decode worker caches a transferred prompt when it claims it, right after this.
        holders = [decision.decode] if decision.prefill is None else [decision.prefill, decision.decode]
        in_background(self._record, keys, holders)

    def _record(self, keys: list[bytes], holders) -> None:
        try:
            for worker in holders:
                self.prefixes.record(keys, worker.worker_id)
        except Exception as error:  # the index is a hint: a failed record costs a later hit, nothing more
            log.warning("prefix index record failed: %s", error)

    def _prefill_cache_figures(self, decision: Decision, reply) -> None:
        if decision.prefill is not None:
            address = decision.prefill.address
            self.metrics.prefix_bytes.labels(address).set(reply.prefix_bytes_held)
            self.metrics.prefix_evictions.labels(address).set(reply.prefix_evictions)

    def _add_load(self, decision: Decision, sign: int) -> None:
        try:
            self.workers.add_load(DECODE_TOKENS, decision.decode.worker_id, sign * decision.decode_tokens)
            if decision.prefill is not None:
                self.workers.add_load(PREFILL_COST, decision.prefill.worker_id, sign * decision.prefill_cost)
        except Exception as error:  # a load counter must not fail a request (Redis blip): logged
            log.warning("load counter update failed: %s", error)
