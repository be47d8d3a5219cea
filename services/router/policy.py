"""Routing: which workers serve a request.

Length-aware (the default): a prompt under `local_threshold` tokens is prefilled by a decode
worker itself (no transfer is worth it); a longer one goes to the prefill worker with the least
outstanding predicted prefill cost, and to the decode worker with the least outstanding tokens.
Predicted cost is prompt tokens times the schedule's computed fraction: lazy prefill does that
share of the full model's token-layers. Round-robin ignores length and load (the baseline
`lazyserve bench serve` compares against). No silent fallback: every decision carries a reason.

With prefix caching, `matched` says how many leading prompt tokens each worker holds (the
router's index, services.router.prefixes), and the length that counts is the uncached part:
- each worker's price is Dynamo's: the prefill work left (the schedule's cost less the shared
  layers of the tokens it holds, plus TRANSFER_WEIGHT per prompt token on a prefill worker) plus
  its outstanding load per unit of capacity (predicted prefill cost on a prefill worker, tokens
  still to generate on a decode worker), weight 1 each;
- a decode worker whose uncached part is under `local_threshold` prefills the request itself
  (llm-d's rule) when its price is no higher than the cheapest elsewhere (a prefill worker for a
  long prompt, any decode worker for a short one): a conversation's next turn, or another
  question on a document it holds, then never crosses the network;
- otherwise as without the cache, each choice by price: the prefill worker holding most of the
  prompt usually wins a long prompt, the least loaded decode worker receives it.

Under load the route follows the shortest predicted wait (NVIDIA Dynamo's conditional
disaggregation: prefill remotely or locally by the queues, not by length alone). The gateways
count each worker's queued prefill (`queued`: the predicted cost placed there whose first token
has not come, services.router.workers.PREFILL_QUEUED) and each worker reports its recent prefill
rate (shared/load.py: full-model prompt tokens a second of wall time while it had prompts to
prefill, decode steps and shared cores included), bounded by how fast the gateway sees its queue
drain (`rates`, services.router.drains). A prompt's predicted first token there is
(queued + its own work) / rate, its own work being the uncached compute plus, on a prefill worker,
the transfer. While any candidate has a queue, the prompt goes to the side whose prediction is
lowest: the prefill workers when the decode worker's own prompts are backed up, the decode worker
when the prefill workers are busy or the prompt's uncached part is tiny. With every queue empty
(an idle system) the rules above decide, the length threshold first. `by_wait` "other-hosts"
(the default) weighs only prefill workers on another host than the decode worker: one on the same
host takes the cores the decode steps run on (docs/results.md, issue 48); "all" weighs every one.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from services.router.workers import DECODE_TOKENS, PREFILL_COST, PREFILL_QUEUED, Workers
from shared.net.registry import WorkerInfo


class NoWorkerError(Exception):
    """No worker can take the request (HTTP 503)."""


@dataclass(frozen=True)
class Decision:
    decode: WorkerInfo
    prefill: WorkerInfo | None  # None: the decode worker prefills
    reason: str
    prefill_cost: float
    decode_tokens: int
    predicted_wait_s: float | None = None  # to the first token, where the queues decided
    queued_ahead: float = 0.0  # the prefilling worker's queue when it was chosen (PREFILL_QUEUED)

    @property
    def kind(self) -> str:
        return "local" if self.prefill is None else "disaggregated"


def _least(workers: list[WorkerInfo], load: dict[str, float]) -> WorkerInfo:
    # Load per unit of capacity; ties go to the lower id so replicas agree.
    return min(workers, key=lambda w: (load.get(w.worker_id, 0.0) / w.capacity, w.worker_id))


# A transfer's price per prompt token, in full-model prefill tokens: `lazyserve bench disagg` at 3k
# tokens measured the disaggregated TTFT at 1.12x the in-process one (docs/results.md) with the
# transfer overlapped with compute; from a cache hit, with little compute to hide it, it shows whole.
TRANSFER_WEIGHT = 0.1


def _price(worker: WorkerInfo, load: dict[str, float], work: dict[str, float]) -> float:
    """Uncached prefill work (tokens x computed fraction) plus outstanding load per unit of capacity."""
    return work[worker.worker_id] + load.get(worker.worker_id, 0.0) / worker.capacity


def _cheapest(workers: list[WorkerInfo], load: dict[str, float], work: dict[str, float]) -> WorkerInfo:
    """The lowest _price; ties go to the lower id so replicas agree."""
    return min(workers, key=lambda w: (_price(w, load, work), w.worker_id))


class LengthAwarePolicy:
    name = "length"

    def __init__(self, local_threshold: int, by_wait: str = "other-hosts"):
        if by_wait not in ("off", "other-hosts", "all"):
            raise ValueError(f"route_by_wait {by_wait!r}: use off, other-hosts or all")
        self.local_threshold, self.by_wait = local_threshold, by_wait

    def choose(
        self,
        workers: Workers,
        model: str,
        prompt_tokens: int,
        fraction: float,
        max_tokens: int,
        exclude: set[str] = frozenset(),
        matched: dict[str, int] | None = None,
        shared: float = 1.0,
        rates: dict[str, float] | None = None,
    ) -> Decision:
        """matched: per worker, the leading prompt tokens it holds; shared: the share of the
        full model's layers a cached token skips (the layers before the first cut); rates: each
        worker's prefill rate (full-model prompt tokens a second: services.router.drains)."""
        live = [w for w in workers.list() if w.model == model and w.worker_id not in exclude]
        if not any(w.role == "decode" for w in live):
            raise NoWorkerError(f"no decode worker serves {model!r}")
        decision, compute, work = self._by_length(workers, live, prompt_tokens, fraction, max_tokens, matched, shared)
        queued = workers.loads(PREFILL_QUEUED)
        if self.by_wait != "off" and any(queued.get(w.worker_id, 0.0) > 0 for w in live):
            decision = self._by_wait(decision, live, queued, rates or {}, compute, work, max_tokens)
        # else an idle system: the length threshold and the cache decide
        prefilling = decision.prefill or decision.decode
        return dataclasses.replace(decision, queued_ahead=queued.get(prefilling.worker_id, 0.0))

    def _by_wait(self, decision, live, queued, rates, compute, work, max_tokens) -> Decision:
        """The side where the prompt's first token is predicted soonest, from the queues and rates."""
        known = [rate for w in live if (rate := rates.get(w.worker_id, 0.0)) > 0]
        # Not measured yet: as slow as the slowest known, so that an unknown worker earns its
        # share by answering rather than by a guess (services.router.drains bounds it meanwhile).
        fallback = min(known, default=1.0)

        def finish(worker: WorkerInfo) -> float:
            return (queued.get(worker.worker_id, 0.0) + work[worker.worker_id]) / (
                rates.get(worker.worker_id) or fallback
            )

        decoders = [w for w in live if w.role == "decode"]
        local = min(decoders, key=lambda w: (finish(w), w.worker_id))
        # A prefill worker on the decode worker's host takes the cores its decode steps run on: not
        # capacity beside it (unless route_by_wait is "all").
        pairable = [
            w
            for w in live
            if w.role == "prefill"
            and w.can_pair(decision.decode)
            and (self.by_wait == "all" or not shares_host(w, decision.decode))
        ]
        if decision.prefill is not None and decision.prefill not in pairable:
            return decision  # a long prompt for a prefill worker the queues do not weigh
        if not pairable:
            if len(decoders) == 1:
                return decision  # nowhere else to go
            wait = finish(local)
            reason = f"shortest predicted wait among decode workers: {local.address} {wait:.2f} s"
            return Decision(local, None, reason, compute[local.worker_id], max_tokens, wait)
        remote = min(pairable, key=lambda w: (finish(w), w.worker_id))
        here, there = finish(local), finish(remote)
        if here <= there:
            reason = f"shortest predicted wait: decode worker {local.address} {here:.2f} s, prefill {there:.2f} s"
            return Decision(local, None, reason, compute[local.worker_id], max_tokens, here)
        reason = f"shortest predicted wait: prefill worker {remote.address} {there:.2f} s, decode {here:.2f} s"
        return Decision(decision.decode, remote, reason, compute[remote.worker_id], max_tokens, there)

    def _by_length(self, workers, live, prompt_tokens, fraction, max_tokens, matched, shared):
        """The idle system's rules (the module's docstring); also each worker's uncached compute
        and its work (compute plus, on a prefill worker, the transfer)."""
        decoders = [w for w in live if w.role == "decode"]
        prefillers = [w for w in live if w.role == "prefill"]
        matched = matched or {}
        uncached = {w.worker_id: prompt_tokens - min(matched.get(w.worker_id, 0), prompt_tokens) for w in live}
        cost = prompt_tokens * fraction
        # The prefill work left: the whole schedule's, less the shared layers of the cached tokens
        # (the deep layers run for every kept token, cached or not); a transfer adds its own.
        compute = {w.worker_id: max(cost - (prompt_tokens - uncached[w.worker_id]) * shared, 0.0) for w in live}
        work = dict(compute)
        for w in prefillers:
            work[w.worker_id] += TRANSFER_WEIGHT * prompt_tokens
        decode_load, prefill_load = workers.loads(DECODE_TOKENS), workers.loads(PREFILL_COST)
        decode = _least(decoders, decode_load)
        pairable = [w for w in prefillers if w.can_pair(decode)]
        holders = [w for w in decoders if matched.get(w.worker_id) and uncached[w.worker_id] < self.local_threshold]
        if holders:
            holder = _cheapest(holders, decode_load, work)
            # Elsewhere: a prefill worker for a long prompt, any decode worker for a short one.
            long_prompt = prompt_tokens >= self.local_threshold and pairable
            others, others_load = (pairable, prefill_load) if long_prompt else (decoders, decode_load)
            other = _cheapest(others, others_load, work)
            if _price(holder, decode_load, work) <= _price(other, others_load, work):
                held = prompt_tokens - uncached[holder.worker_id]
                reason = f"holds {held} of {prompt_tokens} prompt tokens ({uncached[holder.worker_id]} to compute)"
                return Decision(holder, None, reason, compute[holder.worker_id], max_tokens), compute, work
        if prompt_tokens < self.local_threshold:
            decode = _cheapest(decoders, decode_load, work)
            reason = f"short prompt ({prompt_tokens} < {self.local_threshold} tokens)"
            return Decision(decode, None, reason, compute[decode.worker_id], max_tokens), compute, work
        if not prefillers:
            # Visible in the reason, the metric and the log: a long prompt prefilled on decode.
            reason = "long prompt, but no prefill worker is live"
            return Decision(decode, None, reason, cost, max_tokens), compute, work
        if not pairable:
            reason = f"long prompt, but no live prefill worker runs {decode.dtype}"
            return Decision(decode, None, reason, cost, max_tokens), compute, work
        prefill = _cheapest(pairable, prefill_load, work)
        reason = f"long prompt ({prompt_tokens} >= {self.local_threshold} tokens)"
        if matched.get(prefill.worker_id):
            reason += f"; the prefill worker holds {prompt_tokens - uncached[prefill.worker_id]}"
        return Decision(decode, prefill, reason, compute[prefill.worker_id], max_tokens), compute, work


class RoundRobinPolicy:
    """Every request disaggregated, workers taken in turn whatever their load or the prompt."""

    name = "round_robin"

    def __init__(self):
        self._turn = itertools.count()

    def choose(self, workers: Workers, model: str, *load: float, exclude=frozenset(), **_cache) -> Decision:
        """load: (prompt_tokens, fraction, max_tokens) as LengthAwarePolicy takes them; the prefix
        cache's arguments are ignored: the baseline routes blind."""
        prompt_tokens, fraction, max_tokens = load
        live = sorted(
            (w for w in workers.list() if w.model == model and w.worker_id not in exclude), key=lambda w: w.worker_id
        )
        decoders = [w for w in live if w.role == "decode"]
        prefillers = [w for w in live if w.role == "prefill"]
        if not decoders:
            raise NoWorkerError(f"no decode worker serves {model!r}")
        turn = next(self._turn)
        decode = decoders[turn % len(decoders)]
        prefillers = [w for w in prefillers if w.can_pair(decode)]
        prefill = prefillers[turn % len(prefillers)] if prefillers else None
        return Decision(decode, prefill, "round robin", prompt_tokens * fraction, max_tokens)


LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0].strip("[]")
    return "loopback" if host in LOOPBACK else host


def shares_host(a: WorkerInfo, b: WorkerInfo) -> bool:
    """Whether two workers' addresses name one host (so they share its cores). Containers of one
    machine with addresses of their own look like separate hosts: route_by_wait "off" is for them."""
    return _host(a.address) == _host(b.address)


def make_policy(name: str, local_threshold: int, by_wait: str = "other-hosts"):
    if name == "length":
        return LengthAwarePolicy(local_threshold, by_wait)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; use length or round_robin")
