"""The decode round's prefill budget (services.decode.budget): its base, its growth with the
queue, the ITL target's cap and the TTFT target's override, from measured times."""

from __future__ import annotations

import pytest

from services.decode.budget import PrefillBudget, Waiting


def _queue(count: int, rows_left: int = 1000, waited_s: float = 0.0) -> list[Waiting]:
    return [Waiting(rows_left, waited_s) for _ in range(count)]


def test_with_nothing_decoding_the_oldest_runs_to_its_end():
    assert PrefillBudget(2048).rows(0, _queue(3)) is None


def test_the_base_is_the_step_less_its_decode_rows_and_it_grows_with_waiting_per_decoding_up_to_its_bound():
    budget = PrefillBudget(2048, growth=3)
    assert budget.rows(48, _queue(1)) == 2000
    assert budget.rows(48, _queue(48)) == 2000  # as many waiting as decoding: the base
    assert budget.rows(48, _queue(72)) == 3000  # 1.5 waiting per decoding
    assert budget.rows(8, _queue(60)) == 3 * 2040  # bounded: the running streams wait at most this
    # More decode rows than a step holds: a token budget of almost nothing (the scheduler still
    # runs one layer of the oldest prompt: services.decode.scheduler).
    assert budget.rows(4096, _queue(5)) == 1
    assert PrefillBudget(2048, growth=1).rows(8, _queue(60)) == 2040  # the schedule before the budget grew


def test_an_itl_target_caps_the_budget_at_what_fits_after_the_decode_step():
    budget = PrefillBudget(2048, growth=4, itl_slo_s=0.2)
    assert budget.rows(10, _queue(40)) == 4 * 2038  # nothing measured yet: no cap
    budget.observe_step(0.05)
    budget.observe_rows(1000, 0.1)  # 100 us a row
    assert budget.rows(10, _queue(40)) == pytest.approx(1500, abs=1)  # (0.2 - 0.05) / 1e-4
    for _ in range(30):  # the step alone now takes over the target: one layer still runs
        budget.observe_step(0.5)
    assert budget.rows(10, _queue(40)) == 1


def test_a_ttft_target_finishes_the_oldest_prompt_once_it_has_waited_half_of_it():
    budget = PrefillBudget(2048, growth=1, itl_slo_s=0.1, ttft_slo_s=4.0)
    budget.observe_step(0.05)
    budget.observe_rows(1000, 0.1)
    assert budget.rows(10, [Waiting(9000, 1.9), Waiting(500, 0.0)]) == 500  # the ITL cap
    assert budget.rows(10, [Waiting(9000, 2.0), Waiting(500, 0.0)]) == 9000  # its TTFT first


def test_times_are_running_averages_and_bad_settings_are_refused():
    budget = PrefillBudget(64)
    budget.observe_rows(0, 1.0)  # nothing measured from nothing
    assert budget.row_s is None
    budget.observe_step(1.0)
    budget.observe_step(2.0)
    assert budget.step_s == pytest.approx(1.2)
    with pytest.raises(ValueError):
        PrefillBudget(0)
    with pytest.raises(ValueError):
        PrefillBudget(64, growth=0)
