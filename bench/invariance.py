"""`lazyserve bench invariance`: what `--batch-invariant` costs, off and on side by side in one run.

Per dtype and pruning preset: time to first token (a prefill of each length) and decode tokens/s
of each sequence count (batched steps in a plain loop, `bench decode`'s `direct`). Each round runs
every figure with the switch off, then on; the table gives medians of the rounds after a warm-up
and on / off. The switch changes only the decode step's calls (tiles of 16 rows); prompt rows are
computed in fixed tiles either way (shared/engine/invariant.py), so the TTFT ratios show that it
costs prefill nothing. As in a worker, one ComputeThread loads the model and runs every torch op.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.common import add_dtypes_argument, long_text_ids, markdown_table, pruning_configs, write_json
from bench.decode import _direct, _prefilled, _prompts

SETTINGS = {"off": False, "on": True}


def _prefill_s(model, ids, config) -> float:
    from shared.engine import prefill

    start = time.perf_counter()
    prefill(model, ids, config)
    return time.perf_counter() - start


def _figures(compute, model, loaded, configs: dict, args) -> dict:
    """name -> zero-argument callable on the compute thread returning (value, unit)."""
    figures = {}
    for preset, config in configs.items():
        for length in args.lengths:
            ids = long_text_ids(loaded.tokenizer, length, model.spec.vocab_size)
            figures[f"{preset} TTFT {length}"] = (
                lambda ids=ids, c=config: compute.call(_prefill_s, model, ids, c),
                "s",
            )
        prompts = _prompts(loaded.tokenizer, max(args.concurrency), args.prompt)
        prefilled = compute.call(_prefilled, model, prompts, config, args.tokens)
        for count in args.concurrency:
            subset = prefilled[:count]
            figures[f"{preset} decode x{count}"] = (
                lambda s=subset, c=config: compute.call(_direct, model, s, c)[0],
                "tok/s",
            )
    return figures


def bench_dtype(args, dtype: str, compute) -> dict:
    from shared.models.weights import load_model

    loaded = compute.call(load_model, args.model, dtype=dtype)
    model = loaded.engine
    configs = pruning_configs(args.presets, [], model.spec)
    figures = _figures(compute, model, loaded, configs, args)
    samples = {name: {setting: [] for setting in SETTINGS} for name in figures}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for name, (measure, _) in figures.items():
            for setting, on in SETTINGS.items():
                compute.call(model.set_batch_invariant, on)
                value = measure()
                if round_:
                    samples[name][setting].append(value)
        print(f"{dtype}: round {round_} done", flush=True)
    compute.call(model.set_batch_invariant, False)
    rows = []
    for name, (_, unit) in figures.items():
        medians = {setting: statistics.median(values) for setting, values in samples[name].items()}
        # A cost as a factor above 1 either way: time on/off, or throughput off/on.
        cost = medians["on"] / medians["off"] if unit == "s" else medians["off"] / medians["on"]
        rows.append({"figure": name, "unit": unit, "median": medians, "samples": samples[name], "cost": cost})
    return {"model": loaded.name, "dtype": dtype, "figures": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench invariance", description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="prompt tokens for TTFT")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens per decoding sequence")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=16, help="decode tokens per sequence and run")
    parser.add_argument("--presets", nargs="+", default=["off", "default"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    add_dtypes_argument(parser, "each in its own rounds")
    parser.add_argument("--out", default="out/bench_invariance.json")
    args = parser.parse_args(argv)

    from shared.compute import ComputeThread

    compute = ComputeThread("bench-compute")
    compute.call(torch.set_num_threads, args.threads)
    runs = [bench_dtype(args, dtype, compute) for dtype in args.dtypes]
    compute.close()
    for run in runs:
        print(f"\n{run['model']}, {run['dtype']}")
        print(
            markdown_table(
                ["figure", "off", "on", "cost (on vs off)"],
                [
                    [r["figure"], f"{r['median']['off']:.3f} {r['unit']}", f"{r['median']['on']:.3f} {r['unit']}"]
                    + [f"{(r['cost'] - 1) * 100:+.1f}%"]
                    for r in run["figures"]
                ],
            )
        )
    write_json(Path(args.out), {"runs": runs})
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
