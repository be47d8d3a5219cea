"""`lazyserve bench decode`: aggregate decode throughput, batched steps against interleaved ones.

Every run goes through the decode worker's own Scheduler on the same prefilled caches (long
prompts of real text, one per sequence, prefilled once per configuration and copied for each
run): `batched` steps every sequence in one `decode_batch`, `interleaved` has a batch size of one,
so sequences take turns exactly as the decode worker did before batching. `direct` is the batched
steps called in a plain loop on the same thread, without the Scheduler: what a script gets, and
what the served decode should come close to (batched / direct). The modes run side by side in
each round after a warm-up; the table gives medians and the ratios. The direct loop also gives the
join apart: the first step of a sequence copies its whole K/V into the slots, which a short run
would spread over its few tokens, so `steady` is the same loop's rate with the join timed alone.

As in a decode worker, one ComputeThread loads the model and runs every torch op (the prefills,
the copies, the Scheduler's rounds, the direct loop); the main thread only hands it work.

Every row comes with its distance to the memory floor: the bytes a batched step must read (each
weight once, every K/V row the sequences hold) over this host's read bandwidth, measured in the
same run. Also times the attention layout the decode worker uses (shared/engine/slots.py): one
call over a store of every sequence's keys, against one SDPA call per sequence over its own keys.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import torch

from bench.common import (
    add_decode_workload_arguments,
    add_dtypes_argument,
    markdown_table,
    pruning_configs,
    read_bandwidth,
    reference_text,
    runs_per_dtype,
    step_bytes,
    write_report,
)


def _prompts(tokenizer, count: int, length: int) -> list[torch.Tensor]:
    """`count` different prompts of `length` tokens: consecutive windows of the reference text."""
    ids = tokenizer(reference_text()).input_ids
    step = max(1, (len(ids) - length) // max(count, 1))
    assert len(ids) >= length, f"reference text has only {len(ids)} tokens"
    return [torch.tensor(ids[i * step : i * step + length]) for i in range(count)]


def _prefilled(model, prompts, config, tokens):
    from shared.engine import SamplingParams, prefill

    params = SamplingParams(max_new_tokens=tokens + 1)
    out = []
    for ids in prompts:
        cache, logits = prefill(model, ids, config, reserve=params.max_new_tokens)
        out.append((cache, int(logits.argmax()), params))
    return out


def _decodings(prefilled, config) -> list:
    """Fresh copies of the prefilled caches, each with its decode loop (on the compute thread)."""
    from shared.engine import Decoding, Generation

    return [Decoding(copy.deepcopy(cache), config, params, Generation()) for cache, _, params in prefilled]


def _direct(model, prefilled, config) -> tuple[float, float, float, int]:
    """The batched steps in a plain loop, on the calling thread, from a DecodeSlots as the
    Scheduler's: aggregate tokens/s with the join of every sequence's K/V into the slots, the same
    without it (the steady state), the join's seconds, and revived token-layers."""
    from shared.engine import DecodeSlots, decode_batch

    decodings = _decodings(prefilled, config)
    slots = DecodeSlots(model.spec, model.dtype, model.device)
    for decoding, (_, first, _) in zip(decodings, prefilled):
        decoding.accept(first)  # sampled by the prefill, as a transfer's first token: not counted
    start = time.perf_counter()
    for decoding in decodings:  # what the first step would do: once per sequence, not per step
        slots.join(decoding.cache)
    joined = time.perf_counter()
    tokens = 0
    while running := [d for d in decodings if not d.done]:
        logits = decode_batch(model, [(d.cache, d.next_token, d.config) for d in running], slots)
        for decoding, row in zip(running, logits):
            decoding.advance(row)
            tokens += 1
            if decoding.done:
                decoding.close(model.spec.num_layers)
                slots.leave(decoding.cache, keep=False)  # as the Scheduler retires one
    end = time.perf_counter()
    revived = sum(d.generation.stats.revived_token_layers for d in decodings)
    return tokens / (end - start), tokens / (end - joined), joined - start, revived


def _run(compute, model, prefilled, config, batch_size: int) -> tuple[float, int]:
    """Decode every sequence to the end through a Scheduler; aggregate tokens/s and revived token-layers."""
    from services.decode.scheduler import ChoiceFinished, ChoiceToken, Scheduler, Sequence

    scheduler = Scheduler(
        model, max_sequences=len(prefilled), max_batch_size=batch_size, max_unsent=1 << 20, compute=compute
    )
    try:
        sequences = []
        for decoding, (_, first, _) in zip(compute.call(_decodings, prefilled, config), prefilled):
            sequences += Sequence.resumed("bench", [decoding], [first])
        start = time.perf_counter()
        # All in one admission, as the direct loop starts: one by one, each would wait for the
        # round the first ones started, and the first steps would run part of the batch.
        scheduler.submit(*sequences)
        tokens = 0
        for sequence in sequences:
            while isinstance(item := sequence.outbox.get(timeout=600), ChoiceToken):
                tokens += 1
            assert item == ChoiceFinished(item.index, "length"), item
        elapsed = time.perf_counter() - start
    finally:
        scheduler.close()
    return tokens / elapsed, sum(s.generation.stats.revived_token_layers for s in sequences)


def bench_throughput(
    compute, model, prompts, configs: dict, concurrency: list[int], tokens: int, repeats: int, bandwidth: float
):
    rows = []
    for name, config in configs.items():
        prefilled = compute.call(_prefilled, model, prompts[: max(concurrency)], config, tokens)
        for count in concurrency:
            subset = prefilled[:count]
            modes = {"batched": count, "interleaved": 1}
            rates = {mode: [] for mode in [*modes, "direct", "steady"]}
            revived, joins = {}, []
            for batch_size in modes.values():  # warm-up
                _run(compute, model, subset[:1], config, batch_size)
            compute.call(_direct, model, subset[:1], config)
            for _ in range(repeats):
                for mode, batch_size in modes.items():
                    rate, revived[mode] = _run(compute, model, subset, config, batch_size)
                    rates[mode].append(rate)
                rate, steady, join_s, revived["direct"] = compute.call(_direct, model, subset, config)
                rates["direct"].append(rate)
                rates["steady"].append(steady)
                joins.append(join_s)
            medians = {mode: statistics.median(r) for mode, r in rates.items()}
            join_ms = statistics.median(joins) * 1e3
            # A batched step reads every weight once and every K/V row the sequences hold (as
            # prefilled; the few decoded rows are left out): its time can be no less.
            held = step_bytes(model, [cache for cache, _, _ in subset])
            floor_s = held["total"] / bandwidth
            step_s = {mode: count / rate if mode != "interleaved" else 1 / rate for mode, rate in medians.items()}
            rows.append(
                {
                    "pruning": name,
                    "sequences": count,
                    "tokens_per_sequence": tokens,
                    "tokens_per_s": medians,
                    "samples_tokens_per_s": rates,
                    "batched_over_interleaved": medians["batched"] / medians["interleaved"],
                    "batched_over_direct": medians["batched"] / medians["direct"],
                    "join_ms": join_ms,
                    "revived_token_layers": revived,
                    "bytes_per_step": held,
                    "floor_ms": floor_s * 1e3,
                    "step_over_floor": {mode: step / floor_s for mode, step in step_s.items() if mode != "interleaved"},
                }
            )
            print(
                f"{name} x{count}: batched {medians['batched']:.1f} tok/s, interleaved {medians['interleaved']:.1f}, "
                f"direct {medians['direct']:.1f}, steady {medians['steady']:.1f} (join {join_ms:.0f} ms "
                f"apart); a batched step {step_s['batched'] / floor_s:.1f}x its floor, a steady one "
                f"{step_s['steady'] / floor_s:.1f}x",
                flush=True,
            )
    return rows


def _per_sequence(model, queries, keys, values):
    from shared.engine.layer import attend

    return [attend(model, q, k, v) for q, k, v in zip(queries, keys, values)]


def _slots(model, queries, store, sizes):
    """One call for every sequence's query over its slot of a store (DecodeSlots' layout): the
    keys past a slot's size masked, nothing gathered."""
    from shared.engine.layer import attend_slots

    k, v = store
    width = max(sizes)
    mask = None  # as _SlotStep: a mask only where a slot holds fewer keys than the widest
    if min(sizes) < width:
        mask = torch.arange(width)[None, :] < torch.tensor(sizes)[:, None]
    return attend_slots(model, torch.cat(queries), k[:, :, :width], v[:, :, :width], mask)


def bench_attention(model, lengths: list[int], batch_sizes: list[int], repeats: int) -> list[dict]:
    """One decode query per sequence over ragged key lengths: an SDPA call per sequence against one
    call over a slot store."""
    spec = model.spec
    out = []
    gen = torch.Generator().manual_seed(0)
    for count in batch_sizes:
        sizes = [lengths[i % len(lengths)] for i in range(count)]
        keys = [torch.randn(1, spec.num_kv_heads, n, spec.head_dim, generator=gen).to(model.dtype) for n in sizes]
        values = [torch.randn_like(k) for k in keys]
        queries = [torch.randn(1, spec.num_heads, 1, spec.head_dim, generator=gen).to(model.dtype) for _ in sizes]

        store = [torch.zeros(count, spec.num_kv_heads, max(sizes), spec.head_dim, dtype=model.dtype) for _ in "kv"]
        for i, n in enumerate(sizes):
            store[0][i, :, :n], store[1][i, :, :n] = keys[i][0], values[i][0]
        per_sequence = functools.partial(_per_sequence, model, queries, keys, values)
        slots = functools.partial(_slots, model, queries, store, sizes)
        times = {"per_sequence": [], "slots": []}
        with torch.inference_mode():
            for fn in (per_sequence, slots):
                fn()
            for _ in range(repeats):
                for name, fn in (("per_sequence", per_sequence), ("slots", slots)):
                    start = time.perf_counter()
                    for _ in range(spec.num_layers):
                        fn()
                    times[name].append((time.perf_counter() - start) / spec.num_layers)
        medians = {name: statistics.median(t) for name, t in times.items()}
        out.append(
            {
                "sequences": count,
                "key_lengths": sizes,
                "median_s_per_layer": medians,
                "slots_over_per_sequence": medians["slots"] / medians["per_sequence"],
            }
        )
    return out


def bench_dtype(args, dtype: str, compute) -> dict:
    from shared.models.weights import load_model

    loaded = compute.call(load_model, args.model, dtype=dtype)
    model = loaded.engine
    configs = pruning_configs(args.presets, args.schedule, model.spec)
    prompts = _prompts(loaded.tokenizer, max(args.concurrency), args.prompt)
    bandwidth = compute.call(read_bandwidth)
    throughput = bench_throughput(
        compute, model, prompts, configs, args.concurrency, args.tokens, args.repeats, bandwidth
    )
    lengths = [args.prompt // 2, args.prompt, args.prompt * 3 // 2]
    attention = compute.call(bench_attention, model, lengths, args.concurrency, args.repeats * 5)
    return {
        "model": loaded.name,
        "dtype": loaded.dtype_choice.dtype,
        "dtype_reason": loaded.dtype_choice.reason,
        "pruning": {name: config.model_dump() for name, config in configs.items()},
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "throughput": throughput,
        "attention": attention,
    }


def _print_dtype(run: dict) -> None:
    print(f"\n{run['label']} ({run['dtype_reason']}), read bandwidth {run['read_bandwidth_gb_s']:.1f} GB/s")
    print(
        markdown_table(
            [
                "pruning",
                "sequences",
                "batched tok/s",
                "interleaved tok/s",
                "batched / interleaved",
                "direct tok/s",
                "batched / direct",
                "steady tok/s",
                "join ms",
                "revived (batched)",
                "floor ms",
                "batched step / floor",
                "steady step / floor",
            ],
            [
                [
                    r["pruning"],
                    r["sequences"],
                    f"{r['tokens_per_s']['batched']:.1f}",
                    f"{r['tokens_per_s']['interleaved']:.1f}",
                    f"{r['batched_over_interleaved']:.2f}x",
                    f"{r['tokens_per_s']['direct']:.1f}",
                    f"{r['batched_over_direct']:.2f}x",
                    f"{r['tokens_per_s']['steady']:.1f}",
                    f"{r['join_ms']:.0f}",
                    r["revived_token_layers"]["batched"],
                    f"{r['floor_ms']:.1f}",
                    f"{r['step_over_floor']['batched']:.2f}x",
                    f"{r['step_over_floor']['steady']:.2f}x",
                ]
                for r in run["throughput"]
            ],
        )
    )
    print()
    print(
        markdown_table(
            ["sequences", "per-sequence SDPA ms/layer", "slots SDPA ms/layer", "slots / per-sequence"],
            [
                [
                    a["sequences"],
                    f"{a['median_s_per_layer']['per_sequence'] * 1e3:.2f}",
                    f"{a['median_s_per_layer']['slots'] * 1e3:.2f}",
                    f"{a['slots_over_per_sequence']:.2f}",
                ]
                for a in run["attention"]
            ],
        )
    )


def across_dtypes(runs: list[dict]) -> list[dict]:
    """Batched tokens/s of every run (dtype and kernels) over the first run's, per (pruning, sequences)."""
    base = {(r["pruning"], r["sequences"]): r["tokens_per_s"]["batched"] for r in runs[0]["throughput"]}
    return [
        {
            "dtype": run["label"],
            "over": runs[0]["label"],
            "pruning": r["pruning"],
            "sequences": r["sequences"],
            "batched_ratio": r["tokens_per_s"]["batched"] / base[(r["pruning"], r["sequences"])],
        }
        for run in runs[1:]
        for r in run["throughput"]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench decode", description=__doc__)
    add_decode_workload_arguments(parser, concurrency=[1, 4, 8, 16], repeats=3, tokens=16)
    add_dtypes_argument(parser, "side by side in one run; ratios are over the first")
    parser.add_argument("--out", default="out/bench_decode.json")
    args = parser.parse_args(argv)

    runs = runs_per_dtype(args, bench_dtype)
    for run in runs:
        _print_dtype(run)
    across = across_dtypes(runs)
    if across:
        print(f"\nbatched tok/s over {runs[0]['label']}")
        rows = [[a["dtype"], a["pruning"], a["sequences"], f"{a['batched_ratio']:.2f}x"] for a in across]
        print(markdown_table(["run", "pruning", "sequences", "batched tok/s ratio"], rows))
    report = {"model": runs[0]["model"], "threads": args.threads, "prompt_tokens": args.prompt}
    return write_report(args.out, report | {"runs": runs, "across_dtypes": across})


if __name__ == "__main__":
    raise SystemExit(main())
