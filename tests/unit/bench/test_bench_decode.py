"""`lazyserve bench decode` measures what it says: both modes decode every token of every sequence
through the Scheduler, from the same caches, with the same revivals."""

from bench.decode import bench_attention, bench_throughput
from shared.engine import OFF, PruneConfig

LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)))


def test_both_modes_decode_the_same_work(tiny_llama):
    import torch

    model = tiny_llama.engine
    prompts = [torch.randint(3, 1000, (200,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    rows = bench_throughput(model, prompts, {"off": OFF, "lazy": LAZY}, [1, 3], tokens=4, repeats=1)
    assert [(r["pruning"], r["sequences"]) for r in rows] == [("off", 1), ("off", 3), ("lazy", 1), ("lazy", 3)]
    for row in rows:
        assert all(rate > 0 for rate in row["tokens_per_s"].values())
        revived = row["revived_token_layers"]
        assert revived["batched"] == revived["interleaved"]
        if row["pruning"] == "off":
            assert revived["batched"] == 0


def test_attention_comparison_covers_every_batch_size(tiny_llama):
    out = bench_attention(tiny_llama.engine, [50, 100], [1, 4], repeats=1)
    assert [a["sequences"] for a in out] == [1, 4] and out[1]["key_lengths"] == [50, 100, 50, 100]
    assert all(a["median_s_per_layer"]["padded"] > 0 for a in out)
