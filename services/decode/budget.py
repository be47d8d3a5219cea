"""How much local prefill a decode round may run besides its decode step.

A round is one decode step for the sequences that can step plus whole layers of the prompts
waiting to be prefilled here, oldest first (services.decode.scheduler). The rows of prefill it
runs are this module's answer, in the spirit of vLLM's chunked prefill and Sarathi-Serve's
stall-free batching: every round keeps its decode step, and the prefill beside it is sized so
that the running streams' inter-token latency (ITL) stays bounded while the queue drains.

- With nothing decoding, the oldest prompt runs to its end at once: nobody waits on the round.
- Otherwise the base is `max_batch_tokens` less one row per decoding sequence (what one step
  holds), and it grows with the queue: by the number of prompts waiting per sequence decoding,
  from 1 up to `growth`. A round's prefill delays each running stream by its length; each
  waiting prompt pays every round's decode step before its first token. Growing the prefill
  share as the waiting outnumber the decoding spends the round where more requests wait, and
  keeps the old schedule (the base) while the streams are as many. `lazyserve bench serve`
  measures the trade (docs/results.md, issue 48).
- An ITL target (`itl_slo_s`) caps the budget at what fits in the target after the decode step,
  with the step's and a row's recent times measured here (Sarathi's token budget from the TBT SLO).
- A TTFT target (`ttft_slo_s`) overrides the cap for the oldest prompt once it has waited half its
  target: it then finishes in this round, whatever the ITL target says (a missed TTFT loses the
  request; a long gap costs one token's latency).
At least one layer of the oldest prompt runs in every round, so each prompt makes progress.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weight of the newest observation in the step's and a row's running averages.
SMOOTHING = 0.2


@dataclass(frozen=True)
class Waiting:
    """A prompt waiting to be prefilled here, as the budget sees it."""

    rows_left: int  # rows still to compute: at most its next layer's rows times the layers left
    waited_s: float  # since it arrived


@dataclass
class PrefillBudget:
    max_batch_tokens: int
    growth: int = 4
    itl_slo_s: float | None = None
    ttft_slo_s: float | None = None
    row_s: float | None = None  # seconds per prefill row over a round's layers, recent
    step_s: float | None = None  # seconds per decode step, recent

    def __post_init__(self):
        if self.max_batch_tokens < 1 or self.growth < 1:
            raise ValueError("max_batch_tokens and growth must be at least 1")

    def observe_rows(self, rows: int, seconds: float) -> None:
        if rows > 0 and seconds > 0:
            self.row_s = _average(self.row_s, seconds / rows)

    def observe_step(self, seconds: float) -> None:
        if seconds > 0:
            self.step_s = _average(self.step_s, seconds)

    def rows(self, decoding: int, waiting: list[Waiting]) -> int | None:
        """Rows of prefill for this round; None: the oldest prompt to its end."""
        if not waiting or decoding == 0:
            return None
        base = max(self.max_batch_tokens - decoding, 1)
        budget = int(base * min(max(len(waiting) / decoding, 1.0), self.growth))
        if self.itl_slo_s is not None and self.row_s and self.step_s is not None:
            budget = min(budget, int(max(self.itl_slo_s - self.step_s, 0.0) / self.row_s))
        oldest = waiting[0]
        if self.ttft_slo_s is not None and oldest.waited_s >= self.ttft_slo_s / 2:
            budget = max(budget, oldest.rows_left)
        return max(budget, 1)


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - SMOOTHING) * mean + SMOOTHING * value
