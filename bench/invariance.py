"""`lazyserve bench invariance`: what `--batch-invariant` costs, off and on side by side in one run.

Per dtype and pruning preset: time to first token (a prefill of each length) and decode tokens/s
of each sequence count (batched steps in a plain loop, `bench decode`'s `direct`). Each round runs
every figure with the switch off, then on; the table gives medians of the rounds after a warm-up
and on / off. On, a prefill computes its rows in tiles of 128 and its attention in tiles of 256
queries, a decode step in tiles of 16 rows (shared/engine/invariant.py). As in a worker, one
ComputeThread loads the model and runs every torch op.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import (
    add_decode_workload_arguments,
    add_dtypes_argument,
    long_text_ids,
    markdown_table,
    pruning_configs,
    runs_per_dtype,
    write_report,
)
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
    prompts = _prompts(loaded.tokenizer, max(args.concurrency), args.prompt)
    for preset, config in configs.items():
        for length in args.lengths:
            ids = long_text_ids(loaded.tokenizer, length, model.spec.vocab_size)
            figures[f"{preset} TTFT {length}"] = (
                lambda ids=ids, c=config: compute.call(_prefill_s, model, ids, c),
                "s",
            )
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
    configs = pruning_configs(args.presets, args.schedule, model.spec)
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
    add_decode_workload_arguments(parser, concurrency=[1, 16], repeats=3, tokens=16)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096], help="prompt tokens for TTFT")
    add_dtypes_argument(parser, "each in its own rounds")
    parser.add_argument("--out", default="out/bench_invariance.json")
    args = parser.parse_args(argv)

    runs = runs_per_dtype(args, bench_dtype)
    for run in runs:
        print(f"\n{run['model']}, {run['label']}")
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
    return write_report(args.out, {"runs": runs})


if __name__ == "__main__":
    raise SystemExit(main())
