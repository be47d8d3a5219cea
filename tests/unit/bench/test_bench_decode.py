"""`lazyserve bench decode` measures what it says: every mode decodes every token of every sequence
(through the Scheduler, or the direct loop beside it), from the same caches, with the same revivals."""

from bench.decode import bench_attention, bench_throughput
from shared.compute import ComputeThread
from shared.engine import OFF, PruneConfig

LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)))


def test_every_mode_decodes_the_same_work(tiny_llama):
    import torch

    model = tiny_llama.engine
    prompts = [torch.randint(3, 1000, (200,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    compute = ComputeThread("bench-test")
    try:
        configs = {"off": OFF, "lazy": LAZY}
        rows = bench_throughput(compute, model, prompts, configs, [1, 3], tokens=4, repeats=1, bandwidth=10e9)
    finally:
        compute.close()
    assert [(r["pruning"], r["sequences"]) for r in rows] == [("off", 1), ("off", 3), ("lazy", 1), ("lazy", 3)]
    for row in rows:
        assert set(row["tokens_per_s"]) == {"batched", "interleaved", "direct", "steady"}
        assert all(rate > 0 for rate in row["tokens_per_s"].values())
        # The steady state is the direct loop without the join it timed apart: never slower.
        assert row["join_ms"] > 0 and row["tokens_per_s"]["steady"] >= row["tokens_per_s"]["direct"]
        revived = row["revived_token_layers"]
        assert revived["batched"] == revived["interleaved"] == revived["direct"]
        # The floor: the weights once and the K/V the sequences hold, at the bandwidth given.
        held = row["bytes_per_step"]
        assert held["total"] == held["weights"] + held["kv"] and held["kv"] > 0
        assert abs(row["floor_ms"] - held["total"] / 10e9 * 1e3) < 1e-9
        if row["pruning"] == "off":
            assert revived["batched"] == 0
        elif row["sequences"] == 3:
            assert revived["batched"] > 0


def test_attention_comparison_covers_every_batch_size(tiny_llama):
    out = bench_attention(tiny_llama.engine, [50, 100], [1, 4], repeats=1)
    assert [a["sequences"] for a in out] == [1, 4] and out[1]["key_lengths"] == [50, 100, 50, 100]
    assert all(a["median_s_per_layer"]["slots"] > 0 for a in out)
