"""`lazyserve bench step` splits a decode step into phases that add up to it, counts what the pruned
step revives, and leaves the engine's functions as it found them."""

import pytest
import torch

from bench.step import PhaseTimer, profile
from shared.engine import OFF, PruneConfig, cache, decode

LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)), window=4)


@pytest.mark.parametrize("layout", ["slots", "per-sequence"])
def test_phases_add_up_and_the_wrappers_are_removed(tiny_llama, layout):
    originals = (
        decode.attend,
        decode.select,
        cache.LazyCache.write,
        decode._SequenceStep.reselect,
        decode._SlotStep.attend,
    )
    prompts = [torch.randint(3, 1000, (200,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    model, bandwidth = tiny_llama.engine, 10e9
    off = profile(model, prompts, "off", OFF, 2, steps=3, repeats=1, layout=layout, bandwidth=bandwidth)
    lazy = profile(model, prompts, "lazy", LAZY, 2, steps=3, repeats=1, layout=layout, bandwidth=bandwidth)
    assert (
        decode.attend,
        decode.select,
        cache.LazyCache.write,
        decode._SequenceStep.reselect,
        decode._SlotStep.attend,
    ) == originals
    for row in (off, lazy):
        assert abs(sum(row["phases_ms"].values()) - row["timed_step_ms"]) < 1e-6 + 0.01 * row["timed_step_ms"]
        # The floor: the weights once and the K/V the two caches held, at the bandwidth given.
        held = row["bytes_per_step"]
        assert held["weights"] > 0 and held["kv"] > 0
        assert row["floor_ms"] == pytest.approx((held["weights"] + held["kv"]) / bandwidth * 1e3)
    layers = model.spec.num_layers
    # Slots: one attention call a layer for both sequences; per sequence: one each.
    assert off["calls_per_step"]["attention"] == (1 if layout == "slots" else 2) * layers
    assert off["revived_token_layers_per_step"] == 0 and "selection: window scores" not in off["phases_ms"]
    assert lazy["calls_per_step"]["selection: window scores"] == 2 * len(LAZY.stages)
    assert lazy["keys_last_layer_per_sequence"] < off["keys_last_layer_per_sequence"]
    assert lazy["bytes_per_step"]["kv"] < off["bytes_per_step"]["kv"]


def test_a_phase_counts_its_own_time_not_what_it_calls():
    timer = PhaseTimer()
    inner = timer.wrap(lambda: sum(range(10_000)), "inner")
    outer = timer.wrap(lambda: [inner() for _ in range(3)], "outer")
    outer()
    assert timer.calls == {"inner": 3, "outer": 1}
    assert timer.seconds["outer"] < timer.seconds["inner"]
