"""Where one attempt of a request goes (services.router.dispatch asks before each): the route,
from the policy over the live decode workers (less those a call found down), the prompt's blocks
in the prefix index and each worker's prefill rate; then room for the request's choices on that
decode worker (`SEQUENCES`), held until the attempt ends. What an attempt reports back (a
worker's prefill rate, who now holds the prompt, a prefill worker's cache figures) is noted here
for the next route.
"""

from __future__ import annotations

import asyncio
import logging

from opentelemetry import context as otel_context

from services.router.admission import AdmissionQueue, Full, in_background
from services.router.down import DownWorkers
from services.router.drains import Drains
from services.router.metrics import GatewayMetrics
from services.router.policy import Decision
from services.router.prefixes import PrefixIndex, prompt_keys
from services.router.tracing import annotate_decision
from services.router.workers import SEQUENCES, Workers
from shared.api.serving import Prepared, RequestError
from shared.contract.prefix import BLOCK_TOKENS, held_layers
from shared.models.text import TextModel
from shared.net.telemetry import tracer

log = logging.getLogger(__name__)

# A worker with unknown capacity (a static address that has not answered Status yet) decides for
# itself: placements there are counted but not bounded, and its refusal requeues the request.
UNBOUNDED = 1 << 30


class Placement:
    def __init__(
        self,
        workers: Workers,
        policy,
        text: TextModel,
        metrics: GatewayMetrics,
        queue: AdmissionQueue,
        down: DownWorkers,
        prefixes: PrefixIndex | None = None,
    ):
        self.workers, self.policy, self.text, self.metrics = workers, policy, text, metrics
        self.queue = queue  # woken when room is given back
        self.down = down  # workers a call found gone, until their health check answers
        self.prefixes = prefixes  # which worker holds which prompt start; None: no prefix caching
        # Each worker's prefill rate as it last reported it (with a prefill's reply or first token),
        # and how fast its queue drains as this gateway sees it: the route takes the lesser.
        self.rates: dict[str, float] = {}
        self.drains = Drains()

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
                exclude=exclude,
                matched=matched,
                shared=held_layers(prepared.pruning, spec.num_layers) / spec.num_layers,
                rates=self.drains.rates(dict(self.rates)),
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

    def check_fits(self, all_prepared: list[Prepared]) -> None:
        """A 400 that names the numbers for a prompt whose choices no live decode worker could ever
        hold at once (each prompt's choices run together on one worker), before any work."""
        capacities = [self.workers.capacity(w) for w in self._decoders(set())]
        if not capacities or None in capacities:  # a worker with unknown capacity decides for itself
            return
        largest = max(capacities)
        for prepared in all_prepared:
            if prepared.sampling.n > largest:
                raise RequestError(
                    400,
                    f"n={prepared.sampling.n} needs {prepared.sampling.n} sequences on one decode worker at once; "
                    f"the largest live decode worker generates at most {largest}",
                    "n",
                    "too_many_choices",
                )

    def _decoders(self, exclude: set[str]) -> list:
        name = self.text.name
        return [w for w in self.workers.list() if w.role == "decode" and w.model == name and w.worker_id not in exclude]

    def place(
        self, prepared: Prepared, exclude: set[str], parent: otel_context.Context | None, keys: list[bytes]
    ) -> Decision:
        """Route to a decode worker with room for the prompt's choices and take that room; Full when
        none has it. Blocking (Redis): run off the event loop."""
        seats = prepared.sampling.n
        exclude = exclude | self.down.excluded()
        decoders = self._decoders(exclude)
        held = self.workers.loads(SEQUENCES)
        capacity = {w.worker_id: self.workers.capacity(w) for w in decoders}
        full = {
            w.worker_id
            for w in decoders
            if capacity[w.worker_id] is not None and held.get(w.worker_id, 0) + seats > capacity[w.worker_id]
        }
        if decoders and len(full) == len(decoders):
            room = ", ".join(
                f"{w.address} holds {held.get(w.worker_id, 0):.0f} of {capacity[w.worker_id]}" for w in decoders
            )
            raise Full("workers", f"it needs {seats} sequences on one decode worker; {room}")
        decision = self.choose(prepared, exclude | full, parent, keys)
        worker = decision.decode
        limit = capacity.get(worker.worker_id) or UNBOUNDED
        if not self.workers.acquire(SEQUENCES, worker.worker_id, limit, seats):
            raise Full("workers", f"another gateway took the room on {worker.address} first")
        return decision

    def unplace(self, decision: Decision, seats: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Give a placement's sequences back (blocking: in a thread), then serve the queue."""
        try:
            self.workers.release(SEQUENCES, decision.decode.worker_id, seats)
        finally:
            if loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self.queue.wake)

    def prefilled(self, decision: Decision, keys: list[bytes], stats) -> None:
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

    def cache_figures(self, decision: Decision, reply) -> None:
        if decision.prefill is not None:
            address = decision.prefill.address
            self.metrics.prefix_bytes.labels(address).set(reply.prefix_bytes_held)
            self.metrics.prefix_evictions.labels(address).set(reply.prefix_evictions)

    def rated(self, worker, rate: float) -> None:
        if worker is not None and rate > 0:
            self.rates[worker.worker_id] = rate
