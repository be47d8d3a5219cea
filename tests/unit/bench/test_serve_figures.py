"""`lazyserve bench serve`'s figures without a server: the serial bound a run is set against, and
goodput at the targets as a share and a rate."""

from __future__ import annotations

import math

import pytest

from bench.serve import Outcome, closed_loop_bound, serial_bound, summarize


def test_one_wave_sent_at_once_has_its_median_at_half_the_wave_times_p():
    ttfts = serial_bound([2.0] * 64, [0.0] * 64)
    assert ttfts == [2.0 * (k + 1) for k in range(64)]  # the k-th waits for the k before it
    assert sorted(ttfts)[31] == 64.0  # N/2 x P: the serial bound


def test_a_closed_loops_later_requests_queue_behind_what_is_left_of_the_wave():
    # Two streams, prefill 1 s each, one at a time: requests 0 and 1 at once (first tokens at 1
    # and 2 s). Stream 1 decodes for 0.5 s and sends request 2 at 2.5 (served 2.5-3.5); stream 0
    # decodes for 3 s and sends request 3 at 4 (4-5); stream 1 sends request 4 at 3.5 + 1 = 4.5,
    # which waits for request 3: its first token at 6, 1.5 s after it was sent.
    ttfts = closed_loop_bound([1.0] * 5, [3.0, 0.5, 1.0, 0.0, 1.0], concurrency=2)
    assert ttfts == [1.0, 2.0, 1.0, 1.0, 1.5]
    # Decoding free, more requests than streams: each waits for the whole wave ahead of it.
    assert closed_loop_bound([1.0] * 8, [0.0] * 8, 4) == [1.0, 2.0, 3.0, 4.0, 4.0, 4.0, 4.0, 4.0]


def test_arrivals_queue_only_when_the_server_is_busy():
    assert serial_bound([1.0, 1.0, 1.0], [0.0, 0.5, 5.0]) == [1.0, 1.5, 1.0]
    assert serial_bound([1.0, 1.0], [2.0, 0.0]) == [1.0, 1.0]  # served in the order they were sent


def _outcome(ttft: float, gaps: list[float], tokens: int = 5) -> Outcome:
    outcome = Outcome(400, ok=True, ttft_s=ttft, e2e_s=ttft + sum(gaps), tokens=tokens, itl_s=gaps)
    outcome.tpot_s = sum(gaps) / len(gaps)
    return outcome


def test_goodput_counts_requests_meeting_both_targets_and_the_run_is_set_against_its_bound():
    outcomes = [
        _outcome(1.0, [0.1, 0.1]),  # meets both
        _outcome(1.0, [0.1, 0.5]),  # mean gap 0.3: misses the ITL target
        _outcome(3.0, [0.1, 0.1]),  # misses the TTFT target
        _outcome(2.0, [0.2, 0.2]),  # meets both
        Outcome(400, error="HTTP 503"),
    ]
    summary = summarize(outcomes, 10.0, slo_ttft=2.0, slo_itl=0.25, alone_s=1.0, concurrency=5)
    assert summary["goodput_rps"] == pytest.approx(0.2) and summary["goodput_share"] == pytest.approx(0.4)
    # Five streams, all sent at once: served one at a time, 1, 2, 3, 4, 5 s.
    assert summary["ttft_alone_s"] == 1.0 and summary["serial_bound_ttft_p50_s"] == 3.0
    assert summary["ttft_p50_over_serial_bound"] == pytest.approx(1.0 / 3.0)
    assert summary["half_wave_bound_s"] == 2.5
    assert summary["itl_s"]["p90"] == 0.5 and summary["errors"] == 1
    assert math.isnan(summarize([], 1.0, 1.0, 1.0)["goodput_share"])
