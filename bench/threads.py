"""`lazyserve bench threads`: what a thread other than the one that computes costs torch's CPU work.

The mechanism behind shared/compute.py, measured on this host. Each scenario runs in a fresh
process (an OpenMP pool, once made, lives as long as its thread) and times the same work, two
projections of SmolLM2's MLP shapes on a few rows ([rows x 576] by W[1536 x 576], then by
W[576 x 1536]), as a decode step makes them:
- `main`: in the main thread, the only one that ever computes (a script);
- `second thread`: in a second thread after the main thread has run one parallel op (what served
  decode and the prefill actor did before: the main thread loaded the model);
- `compute thread`: in a ComputeThread of a process whose main thread never computes (what every
  worker does now);
- `second thread, main paused`: as `second thread`, but the main thread first gave its OpenMP pool
  back (libgomp's omp_pause_resource_all): the check that the count of pools is the cause.
Medians of several runs, after a warm-up; ratios over `main`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import markdown_table, write_report

SCENARIOS = ["main", "second thread", "compute thread", "second thread, main paused"]


def _work(dtype_name: str, rows: int, calls: int) -> float:
    """Microseconds per pair of projections, on the calling thread."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=generator).to(dtype)
    up = torch.randn(1536, 576, generator=generator).to(dtype)
    down = torch.randn(576, 1536, generator=generator).to(dtype)
    for _ in range(calls // 10):  # warm-up
        F.linear(F.linear(x, up), down)
    start = time.perf_counter()
    for _ in range(calls):
        F.linear(F.linear(x, up), down)
    return (time.perf_counter() - start) / calls * 1e6


def _in_thread(fn, *args) -> float:
    out = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    return out[0]


def _pause_openmp() -> None:
    """Give the calling thread's OpenMP pool back (GNU libgomp, as torch's CPU wheel ships)."""
    import torch

    library = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    ctypes.CDLL(str(library)).omp_pause_resource_all(1)  # omp_pause_soft


def scenario(name: str, dtype: str, rows: int, calls: int, threads: int) -> float:
    """One scenario in this process (run it in a fresh one)."""
    import torch

    from shared.compute import ComputeThread

    if name == "compute thread":
        compute = ComputeThread("bench-compute")
        try:
            compute.call(torch.set_num_threads, threads)
            return compute.call(_work, dtype, rows, calls)
        finally:
            compute.close()
    torch.set_num_threads(threads)
    if name == "main":
        return _work(dtype, rows, calls)
    _work(dtype, rows, 10)  # the main thread enters the pool, as loading a model does
    if name == "second thread, main paused":
        _pause_openmp()
    return _in_thread(_work, dtype, rows, calls)


def _fresh(name: str, dtype: str, rows: int, calls: int, threads: int) -> float:
    code = (
        "import json, sys\nfrom bench.threads import scenario\n"
        f"print(json.dumps(scenario({name!r}, {dtype!r}, {rows}, {calls}, {threads})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench threads", description=__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, default=4, help="rows per projection (sequences in a decode step)")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per scenario")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="out/bench_threads.json")
    args = parser.parse_args(argv)

    results = []
    for dtype in args.dtypes:
        samples: dict[str, list[float]] = {name: [] for name in SCENARIOS}
        for _ in range(args.repeats):  # scenarios alternate, so drift on a noisy host hits each alike
            for name in SCENARIOS:
                samples[name].append(_fresh(name, dtype, args.rows, args.calls, args.threads))
        medians = {name: statistics.median(values) for name, values in samples.items()}
        results.append(
            {
                "dtype": dtype,
                "median_us": medians,
                "over_main": {name: medians[name] / medians["main"] for name in SCENARIOS},
                "samples_us": samples,
            }
        )
    rows = [
        [r["dtype"], name, f"{r['median_us'][name]:.1f}", f"{r['over_main'][name]:.2f}x"]
        for r in results
        for name in SCENARIOS
    ]
    print(markdown_table(["dtype", "where", "µs per 2 projections", "over main"], rows))
    return write_report(args.out, {"rows": args.rows, "threads": args.threads, "results": results})


if __name__ == "__main__":
    raise SystemExit(main())
