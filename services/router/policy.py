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
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from services.router.workers import DECODE_TOKENS, PREFILL_COST, Workers
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

    def __init__(self, local_threshold: int):
        self.local_threshold = local_threshold

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
    ) -> Decision:
        """matched: per worker, the leading prompt tokens it holds; shared: the share of the
        full model's layers a cached token skips (the layers before the first cut)."""
        live = [w for w in workers.list() if w.model == model and w.worker_id not in exclude]
        decoders = [w for w in live if w.role == "decode"]
        prefillers = [w for w in live if w.role == "prefill"]
        if not decoders:
            raise NoWorkerError(f"no decode worker serves {model!r}")
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
                return Decision(holder, None, reason, compute[holder.worker_id], max_tokens)
        if prompt_tokens < self.local_threshold:
            decode = _cheapest(decoders, decode_load, work)
            reason = f"short prompt ({prompt_tokens} < {self.local_threshold} tokens)"
            return Decision(decode, None, reason, compute[decode.worker_id], max_tokens)
        if not prefillers:
            # Visible in the reason, the metric and the log: a long prompt prefilled on decode.
            return Decision(decode, None, "long prompt, but no prefill worker is live", cost, max_tokens)
        if not pairable:
            reason = f"long prompt, but no live prefill worker runs {decode.dtype}"
            return Decision(decode, None, reason, cost, max_tokens)
        prefill = _cheapest(pairable, prefill_load, work)
        reason = f"long prompt ({prompt_tokens} >= {self.local_threshold} tokens)"
        if matched.get(prefill.worker_id):
            reason += f"; the prefill worker holds {prompt_tokens - uncached[prefill.worker_id]}"
        return Decision(decode, prefill, reason, compute[prefill.worker_id], max_tokens)


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


def make_policy(name: str, local_threshold: int):
    if name == "length":
        return LengthAwarePolicy(local_threshold)
    if name == "round_robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; use length or round_robin")
