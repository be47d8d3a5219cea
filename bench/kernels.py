"""`lazyserve bench kernels`: each decode kernel at the default model's shapes, native beside torch.

For the few-row linear, every projection of SmolLM2 (q/o, k/v, gate/up, down, the tied LM head)
at 1, 4, 16 and 32 rows: GB/s of weights read and GFLOP/s, with the weights cycled through
copies that no cache holds. For decode attention, 1 and 16 sequences over 2k and 8k keys, every
key live or a fifth of them (a pruned deep layer's live set): ms a layer and GB/s of K/V held.
Both against this host's read bandwidth and its BLAS's peak (a 2048-cubed product), measured in
the same run, so each row says how far it is from the machine. Medians of --repeats after a
warm-up; ratios are native over torch (above 1: native is faster).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import add_dtypes_argument, markdown_table, read_bandwidth, write_report
from shared import kernels

# SmolLM2-135M's projections [out, in] and attention shape (3 KV heads, 3 query heads each, D 64).
SHAPES = {
    "q_proj, o_proj": (576, 576),
    "k_proj, v_proj": (192, 576),
    "gate_proj, up_proj": (1536, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}
KV_HEADS, GROUPS, HEAD_DIM = 3, 3, 64


def _each(fn, calls: list[tuple]):
    """A callable that runs fn(*args) for each args of `calls` (a step's layers, weight copies)."""
    return lambda: [fn(*args) for args in calls]


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def blas_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of torch's matrix product at size^3, this dtype."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    return 2 * size**3 / _median_seconds(lambda: a @ b, repeats)


def bench_linear(dtype: torch.dtype, rows_list: list[int], repeats: int, cycle_bytes: int) -> list[dict]:
    out = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k).to(dtype)
        nbytes = weight.numel() * weight.element_size()
        copies = [weight.clone() for _ in range(max(2, min(64, cycle_bytes // nbytes)))]
        for rows in rows_list:
            x = torch.randn(rows, k).to(dtype)
            seconds = {}
            for path in ("native", "torch"):
                with kernels.selected(path), kernels.invariant_rows(path == "native"):
                    call = kernels.linear if path == "native" else F.linear
                    total = _median_seconds(_each(call, [(x, w) for w in copies]), repeats)
                seconds[path] = total / len(copies)
            out.append(
                {
                    "kernel": "linear",
                    "shape": f"{name} {n}x{k}",
                    "rows": rows,
                    "bytes": nbytes,
                    "flops": 2 * rows * n * k,
                    "seconds": seconds,
                }
            )
    return out


def bench_attention(dtype: torch.dtype, sequences: list[int], keys: list[int], repeats: int) -> list[dict]:
    out = []
    layers = 4  # stores cycled through, as a step's layers are
    for count in sequences:
        for length in keys:
            shape = (count, KV_HEADS, length, HEAD_DIM)
            ks = [torch.randn(shape).to(dtype) for _ in range(layers)]
            vs = [torch.randn(shape).to(dtype) for _ in range(layers)]
            positions = torch.arange(length).expand(count, length).contiguous()
            sizes, row_slot = torch.full((count,), length), torch.arange(count)
            limits = torch.full((count,), length)
            q = torch.randn(count, KV_HEADS * GROUPS, HEAD_DIM).to(dtype)
            held = 2 * count * KV_HEADS * length * HEAD_DIM * ks[0].element_size()
            for live_share in (1.0, 0.2):
                generator = torch.Generator().manual_seed(length)
                live = None if live_share == 1.0 else torch.rand(count, length, generator=generator) < live_share
                scale = HEAD_DIM**-0.5
                native = [(q, k, v, positions, sizes, row_slot, limits, live, scale) for k, v in zip(ks, vs)]
                seconds = {
                    "native": _median_seconds(_each(kernels.decode_attention, native), repeats) / layers,
                    "torch": _median_seconds(
                        _each(_torch_attention, [(q, k, v, live) for k, v in zip(ks, vs)]), repeats
                    )
                    / layers,
                }
                out.append(
                    {
                        "kernel": "decode attention",
                        "shape": f"x{count}, {length} keys, {live_share:.0%} live",
                        "rows": count,
                        "bytes": held * live_share,
                        "flops": 4 * count * KV_HEADS * GROUPS * length * HEAD_DIM * live_share,
                        "seconds": seconds,
                    }
                )
    return out


def _torch_attention(q, k, v, live):
    """What the torch path runs for the same rows: one SDPA call over the store, pruned keys masked
    (shared/engine/layer.py's attend_slots)."""
    count = q.shape[0]
    mask = None if live is None else live[:, None, None, :]
    if q.dtype == torch.float32:
        qg = q.view(count, KV_HEADS, GROUPS, HEAD_DIM)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=HEAD_DIM**-0.5)
    return F.scaled_dot_product_attention(
        q.view(count, KV_HEADS * GROUPS, 1, HEAD_DIM), k, v, attn_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True
    )


def _table(rows: list[dict], bandwidth: float, peak: float) -> str:
    header = ["kernel", "shape", "rows", "native ms", "torch ms", "native / torch", "native GB/s", "torch GB/s"]
    header += ["native GFLOP/s", "torch GFLOP/s", "native of floor"]
    lines = []
    for r in rows:
        native, torch_s = r["seconds"]["native"], r["seconds"]["torch"]
        floor = max(r["bytes"] / bandwidth, r["flops"] / peak)
        lines.append(
            [
                r["kernel"],
                r["shape"],
                r["rows"],
                f"{native * 1e3:.3f}",
                f"{torch_s * 1e3:.3f}",
                f"{torch_s / native:.2f}x",
            ]
            + [f"{r['bytes'] / native / 1e9:.1f}", f"{r['bytes'] / torch_s / 1e9:.1f}"]
            + [f"{r['flops'] / native / 1e9:.0f}", f"{r['flops'] / torch_s / 1e9:.0f}", f"{floor / native:.0%}"]
        )
    return markdown_table(header, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench kernels", description=__doc__)
    add_dtypes_argument(parser, "each in its own tables")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32], help="rows of the linear calls")
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--keys", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--cycle-mb",
        type=int,
        default=768,
        help="MiB of weight copies each linear cycles through (more than any cache)",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="out/bench_kernels.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    status = kernels.select("native")
    if status.path != "native":
        print(f"the native kernels do not run here: {status.reason}")
        return 1
    bandwidth = read_bandwidth()
    runs = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        peak = blas_peak(dtype)
        rows = bench_linear(dtype, args.rows, args.repeats, args.cycle_mb << 20)
        rows += bench_attention(dtype, args.sequences, args.keys, args.repeats)
        machine = f"read bandwidth {bandwidth / 1e9:.1f} GB/s, BLAS peak {peak / 1e9:.0f} GFLOP/s"
        print(f"\n{name}, {status.describe()}: {machine}")
        print(_table(rows, bandwidth, peak))
        runs.append({"dtype": name, "blas_peak_gflops": peak / 1e9, "rows": rows})
    report = {
        "threads": args.threads,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "kernels": status.describe(),
        "runs": runs,
    }
    return write_report(args.out, report)


if __name__ == "__main__":
    raise SystemExit(main())
