"""Routing: which workers serve a request.

Length-aware (the default): a prompt under `local_threshold` tokens is prefilled by a decode
worker itself (no transfer is worth it); a longer one goes to the prefill worker with the least
outstanding predicted prefill cost, and to the decode worker with the least outstanding tokens.
Predicted cost is prompt tokens times the schedule's computed fraction: lazy prefill does that
share of the full model's token-layers. Round-robin ignores length and load (the baseline
`lazyserve bench serve` compares against). No silent fallback: every decision carries a reason.
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
    ) -> Decision:
        live = [w for w in workers.list() if w.model == model and w.worker_id not in exclude]
        decoders = [w for w in live if w.role == "decode"]
        prefillers = [w for w in live if w.role == "prefill"]
        if not decoders:
            raise NoWorkerError(f"no decode worker serves {model!r}")
        cost = prompt_tokens * fraction
        decode = _least(decoders, workers.loads(DECODE_TOKENS))
        if prompt_tokens < self.local_threshold:
            return Decision(
                decode, None, f"short prompt ({prompt_tokens} < {self.local_threshold} tokens)", cost, max_tokens
            )
        if not prefillers:
            # Visible in the reason, the metric and the log: a long prompt prefilled on decode.
            return Decision(decode, None, "long prompt, but no prefill worker is live", cost, max_tokens)
        prefillers = [w for w in prefillers if w.can_pair(decode)]
        if not prefillers:
            reason = f"long prompt, but no live prefill worker runs {decode.dtype}"
            return Decision(decode, None, reason, cost, max_tokens)
        prefill = _least(prefillers, workers.loads(PREFILL_COST))
        return Decision(
            decode, prefill, f"long prompt ({prompt_tokens} >= {self.local_threshold} tokens)", cost, max_tokens
        )


class RoundRobinPolicy:
    """Every request disaggregated, workers taken in turn whatever their load or the prompt."""

    name = "round_robin"

    def __init__(self):
        self._turn = itertools.count()

    def choose(
        self,
        workers: Workers,
        model: str,
        prompt_tokens: int,
        fraction: float,
        max_tokens: int,
        exclude: set[str] = frozenset(),
    ) -> Decision:
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
