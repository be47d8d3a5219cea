"""`lazyserve bench step`: where one batched decode step's time goes, unpruned against pruned.

The same prefilled caches (2048-token prompts of real text by default) are decoded by
`decode_batch` for a few steps after a warm-up, once per (dtype, preset, sequence count). While
they run, the engine's own functions are wrapped with timers (shared/engine/decode.py's imports:
projections, attention, the rest of the layer, cache writes, scoring, selection, and the revival
bookkeeping around them); the wrappers are removed in `finally`. Each phase is reported in ms per
step (its own time, without the phases it calls), with what the step computed: revived
token-layers and the keys held at the last layer.

Timers read the wall clock around synchronous CPU work, so on the CPU a phase's time is what it
cost. They add a few microseconds a call, the same for every preset; the step time without them
comes from an untimed run of the same steps beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections import defaultdict

import torch

from bench.common import (
    add_decode_workload_arguments,
    add_dtypes_argument,
    each_kernels,
    markdown_table,
    pruning_configs,
    read_bandwidth,
    step_bytes,
    write_report,
)

# (module attribute, phase): what shared/engine/decode.py calls, by the name it calls it.
PHASES = [
    ("project_qkv", "norm + q/k/v + RoPE"),
    ("attend", "attention"),
    ("attend_slots", "attention"),
    ("attend_live", "attention"),
    ("finish", "o_proj + MLP"),
    ("logits_of", "final norm + lm_head"),
    ("window_scores", "selection: window scores"),
    ("window_probs", "selection: window scores"),
    ("select", "selection: pool + top-k"),
]


class PhaseTimer:
    """Seconds per phase, accumulated by wrappers around the decode module's functions, the
    cache's write and two of `_SequenceStep`' methods; a phase that calls others (`reselect` calls the
    scoring and selection) keeps only its own time."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []

    def wrap(self, fn, phase: str):
        def timed(*args, **kwargs):
            self._stack.append([0.0])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                inner = self._stack.pop()[0]
                self.seconds[phase] += elapsed - inner  # self time: nested phases count once
                self.calls[phase] += 1
                if self._stack:
                    self._stack[-1][0] += elapsed

        return timed

    @contextlib.contextmanager
    def installed(self):
        """Wrap the engine's functions for the duration; always restored."""
        from shared.engine import cache as cache_module
        from shared.engine import decode as decode_module
        from shared.engine import slots as slots_module

        saved = []
        targets = [(decode_module, name, phase) for name, phase in PHASES]
        targets += [
            (cache_module.LazyCache, "write", "cache writes"),
            (slots_module.DecodeSlots, "write", "cache writes"),
            (decode_module._SequenceStep, "reselect", "selection: live set, stash, revive"),
            (decode_module._SequenceStep, "attend", "attention: masks"),
            (decode_module._SlotStep, "_attend_new", "attention: masks"),
            (decode_module._SlotStep, "attend", "slots: rows in and out"),
        ]
        try:
            for owner, name, phase in targets:
                original = owner.__dict__[name]
                saved.append((owner, name, original))
                setattr(owner, name, self.wrap(original, phase))
            yield self
        finally:
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)


def _prefilled(model, prompts, config, steps: int):
    from shared.engine import prefill

    out = []
    for ids in prompts:
        cache, logits = prefill(model, ids, config, reserve=2 * steps + 2)
        out.append((cache, int(logits.argmax())))
    return out


def _decode(model, prefilled, config, steps: int, layout: str) -> tuple[float, dict]:
    """Greedy steps from copies of the caches; seconds and what the steps computed. layout:
    "slots" (a DecodeSlots, as the decode worker runs them) or "per-sequence" (a call each)."""
    from shared.engine import DecodeSlots
    from shared.engine.decode import decode_batch

    batch = [(copy.deepcopy(cache), token, config) for cache, token in prefilled]
    slots = DecodeSlots(model.spec, model.dtype, model.device) if layout == "slots" else None
    for cache, _, _ in batch:
        if slots is not None:
            slots.join(cache)  # once per sequence, when it starts decoding: not a step's work
    revived = sum(cache.revived_token_layers for cache, _, _ in batch)
    computed = sum(cache.computed_token_layers for cache, _, _ in batch)
    read = []
    start = time.perf_counter()
    for _ in range(steps):
        read.append(sum(cache.kv_bytes for cache, _, _ in batch))
        tokens = decode_batch(model, batch, slots).argmax(dim=-1).tolist()
        batch = [(cache, token, config) for (cache, _, _), token in zip(batch, tokens)]
    elapsed = time.perf_counter() - start
    last = model.spec.num_layers - 1
    rows = {
        "revived_token_layers_per_step": (sum(c.revived_token_layers for c, _, _ in batch) - revived) / steps,
        "computed_token_layers_per_step": (sum(c.computed_token_layers for c, _, _ in batch) - computed) / steps,
        "keys_last_layer_per_sequence": statistics.mean(c.layers[last].size for c, _, _ in batch),
        "kv_bytes_per_step": statistics.mean(read),
    }
    return elapsed, rows


def profile(model, prompts, name: str, config, count: int, steps: int, repeats: int, layout: str, bandwidth) -> dict:
    prefilled = _prefilled(model, prompts[:count], config, steps * 2)
    _decode(model, prefilled[:1], config, 2, layout)  # warm-up
    plain, timed_runs, timer = [], [], PhaseTimer()
    rows = {}
    for _ in range(repeats):
        elapsed, rows = _decode(model, prefilled, config, steps, layout)
        plain.append(elapsed / steps)
        with timer.installed():
            elapsed, _ = _decode(model, prefilled, config, steps, layout)
        timed_runs.append(elapsed / steps)
    per_step = {phase: seconds / (steps * repeats) for phase, seconds in timer.seconds.items()}
    timed = statistics.mean(timed_runs)
    per_step["other (Python, embedding, batching)"] = max(timed - sum(per_step.values()), 0.0)
    weights = step_bytes(model, [])["weights"]
    floor = (weights + rows["kv_bytes_per_step"]) / bandwidth
    return {
        "pruning": name,
        "sequences": count,
        "layout": layout,
        "steps": steps,
        "step_ms": statistics.median(plain) * 1e3,
        "samples_step_ms": [s * 1e3 for s in plain],
        "timed_step_ms": timed * 1e3,
        "tokens_per_s": count / statistics.median(plain),
        "phases_ms": {phase: s * 1e3 for phase, s in per_step.items()},
        "calls_per_step": {phase: n / (steps * repeats) for phase, n in timer.calls.items()},
        "bytes_per_step": {"weights": weights, "kv": rows["kv_bytes_per_step"]},
        "floor_ms": floor * 1e3,
        "over_floor": statistics.median(plain) / floor,
        **rows,
    }


def bench_dtype(args, dtype: str) -> dict:
    from bench.decode import _prompts
    from shared.models.weights import load_model

    loaded = load_model(args.model, dtype=dtype)
    model = loaded.engine
    prompts = _prompts(loaded.tokenizer, max(args.concurrency), args.prompt)
    results = []
    bandwidth = read_bandwidth()
    for name, config in pruning_configs(args.presets, args.schedule, model.spec).items():
        for count in args.concurrency:
            for layout in args.layouts:
                result = profile(model, prompts, name, config, count, args.steps, args.repeats, layout, bandwidth)
                print(
                    f"{dtype} {name} x{count} {layout}: {result['step_ms']:.1f} ms a step, "
                    f"{result['over_floor']:.1f}x its floor",
                    flush=True,
                )
                results.append(result)
    return {
        "model": loaded.name,
        "dtype": loaded.dtype_choice.dtype,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "profiles": results,
    }


def report(run: dict) -> str:
    """One table per dtype: phases as rows, (preset, sequences) as columns."""
    profiles = run["profiles"]
    phases = list(dict.fromkeys(p for r in profiles for p in r["phases_ms"]))
    header = ["ms per step"] + [f"{r['pruning']} x{r['sequences']} {r['layout']}" for r in profiles]
    rows = [["step (untimed)"] + [f"{r['step_ms']:.1f}" for r in profiles]]
    rows.append(["memory floor"] + [f"{r['floor_ms']:.1f}" for r in profiles])
    rows.append(["step / floor"] + [f"{r['over_floor']:.2f}x" for r in profiles])
    rows += [["step (timed)"] + [f"{r['timed_step_ms']:.1f}" for r in profiles]]
    for phase in phases:
        rows.append([phase] + [f"{r['phases_ms'].get(phase, 0.0):.1f}" for r in profiles])
    rows.append(["revived token-layers"] + [f"{r['revived_token_layers_per_step']:.0f}" for r in profiles])
    rows.append(["keys at the last layer"] + [f"{r['keys_last_layer_per_sequence']:.0f}" for r in profiles])
    bandwidth = f"read bandwidth {run['read_bandwidth_gb_s']:.1f} GB/s"
    return f"{run['dtype']}, {run['model']}, {run['kernels']} kernels, {bandwidth}\n" + markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench step", description=__doc__)
    add_decode_workload_arguments(parser, concurrency=[1, 16], repeats=2)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per run")
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=["slots", "per-sequence"],
        default=["slots", "per-sequence"],
        help="K/V in a DecodeSlots (as the decode worker) or an attention call per sequence",
    )
    add_dtypes_argument(parser, "one table each")
    parser.add_argument("--out", default="out/bench_step.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    runs = []
    for path in each_kernels(args.kernels):
        runs += [bench_dtype(args, dtype) | {"kernels": path} for dtype in args.dtypes]
    for run in runs:
        print("\n" + report(run))
    return write_report(args.out, {"prompt_tokens": args.prompt, "threads": args.threads, "runs": runs})


if __name__ == "__main__":
    raise SystemExit(main())
