"""`lazyserve bench ttft`: time to first token and decode speed, unpruned vs every pruning preset vs transformers.

All paths run in one process on the same text, interleaved round by round after a warm-up, so
machine noise hits them alike; the table reports medians and ratios. Peak memory is the largest
rise of the process's resident set during a call, sampled every few milliseconds.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import threading
import time

import torch

from bench.common import add_dtypes_argument, long_text_ids, markdown_table, write_report


class PeakRSS:
    """Largest rise in resident memory while the block runs (sampled from /proc every 2 ms)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def rise_mib(self) -> float:
        return (self.peak - self.base) / 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _sync() -> None:
    """Wait for queued GPU work, so a timer around a call sees all of it (nothing to wait for on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn):
    with PeakRSS() as memory:
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        elapsed = time.perf_counter() - start
    return elapsed, memory.rise_mib


def bench_prefill(model, ids, configs: dict, repeats):
    """Median prefill seconds per path: transformers, full (pruning off) and each config."""
    from shared.engine import OFF, prefill

    hf = model.hf
    ids = ids.to(model.device)
    paths = {"transformers": lambda: hf(ids[None], logits_to_keep=1), "full": lambda: prefill(model, ids, OFF)}
    paths |= {name: (lambda config=config: prefill(model, ids, config)) for name, config in configs.items()}
    times = {name: [] for name in paths}
    peaks = {name: 0.0 for name in paths}
    with torch.inference_mode():
        for fn in paths.values():  # warm-up
            fn()
        for _ in range(repeats):
            for name, fn in paths.items():
                elapsed, peak = _timed(fn)
                times[name].append(elapsed)
                peaks[name] = max(peaks[name], peak)
    return {name: statistics.median(t) for name, t in times.items()}, peaks, times


def _hf_decode(hf, ids, tokens):
    ids = ids.to(hf.device)
    # transformers 5.2x names the KV cache `cache`; earlier releases (5.17 on the GPU machine) `past_key_values`.
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = hf(ids[None], use_cache=True, logits_to_keep=1)
        cache, token = getattr(out, name), out.logits[:, -1:].argmax(-1)
        _sync()
        start = time.perf_counter()
        for _ in range(tokens):
            out = hf(token, use_cache=True, **{name: cache})
            token = out.logits[:, -1:].argmax(-1)
        _sync()
        return tokens / (time.perf_counter() - start)


def _our_decode(model, ids, config, tokens):
    from shared.engine import decode_step, prefill

    with torch.inference_mode():
        cache, logits = prefill(model, ids, config, reserve=tokens)
        _sync()
        start = time.perf_counter()
        for _ in range(tokens):
            logits = decode_step(model, cache, int(logits.argmax()), config)
        _sync()
        return tokens / (time.perf_counter() - start), cache.revived_token_layers


def bench_decode(model, ids, configs: dict, tokens, repeats):
    """Median decode tokens/s per path and each config's revived token-layers."""
    from shared.engine import OFF

    paths = {"full": OFF} | configs
    rates = {"transformers": []} | {name: [] for name in paths}
    revived = {}
    _our_decode(model, ids, OFF, 2)  # warm-up
    for _ in range(repeats):
        rates["transformers"].append(_hf_decode(model.hf, ids, tokens))
        for name, config in paths.items():
            rate, revived[name] = _our_decode(model, ids, config, tokens)
            rates[name].append(rate)
    return {name: statistics.median(r) for name, r in rates.items()}, revived


def bench_dtype(args, dtype: str) -> dict:
    """Every path at one dtype: prefill per length, then decode."""
    from shared.engine import PruneConfig
    from shared.models.weights import load_model

    loaded = load_model(args.model, dtype=dtype, device=args.device)
    model = loaded.engine
    configs = {name: model.spec.preset(name) for name in args.presets}
    if args.pruning:
        configs["custom"] = PruneConfig.model_validate_json(args.pruning)
    report = {
        "model": loaded.name,
        "dtype": loaded.dtype_choice.dtype,
        "dtype_reason": loaded.dtype_choice.reason,
        "pruning": {name: config.model_dump() for name, config in configs.items()},
        "prefill": [],
    }
    vocab = model.spec.vocab_size
    for length in args.lengths:
        ids = long_text_ids(loaded.tokenizer, length, vocab)
        medians, peaks, samples = bench_prefill(model, ids, configs, args.repeats)
        report["prefill"].append(
            {
                "tokens": length,
                "median_s": medians,
                "samples_s": samples,
                "peak_rss_rise_mib": peaks,
                "full_over_transformers": medians["full"] / medians["transformers"],
                "speedup_over_full": {name: medians["full"] / medians[name] for name in configs},
            }
        )
        print(f"{report['dtype']}: {length} tokens done", flush=True)
    ids = long_text_ids(loaded.tokenizer, args.decode_prompt, vocab)
    rates, revived = bench_decode(model, ids, configs, args.decode_tokens, args.repeats)
    report["decode"] = {
        "prompt_tokens": args.decode_prompt,
        "tokens": args.decode_tokens,
        "tokens_per_s": rates,
        "full_over_transformers": rates["full"] / rates["transformers"],
        "over_full": {name: rates[name] / rates["full"] for name in configs},
        "revived_token_layers": revived,
    }
    return report


def _print_dtype(run: dict) -> None:
    configs = list(run["pruning"])
    rows = []
    for entry in run["prefill"]:
        medians, speedups, peaks = entry["median_s"], entry["speedup_over_full"], entry["peak_rss_rise_mib"]
        rows.append(
            [entry["tokens"], f"{medians['transformers']:.2f}", f"{medians['full']:.2f}"]
            + [f"{entry['full_over_transformers']:.3f}"]
            + [f"{medians[name]:.2f} ({speedups[name]:.2f}x)" for name in configs]
            + [" / ".join(f"{peaks[name]:.0f}" for name in peaks)]
        )
    print(f"\n{run['dtype']} ({run['dtype_reason']}): prefill")
    print(
        markdown_table(
            ["tokens", "transformers s", "full s", "full / transformers"]
            + [f"{name} s (speedup)" for name in configs]
            + [f"peak MiB ({' / '.join(['tf', 'full', *configs])})"],
            rows,
        )
    )
    decode = run["decode"]
    rates, revived = decode["tokens_per_s"], decode["revived_token_layers"]
    print()
    print(
        markdown_table(
            ["decode after", "transformers tok/s", "full tok/s"]
            + [f"{name} tok/s (/ full, revived)" for name in configs],
            [
                [
                    f"{decode['prompt_tokens']} tokens, {decode['tokens']} steps",
                    f"{rates['transformers']:.1f}",
                    f"{rates['full']:.1f}",
                ]
                + [f"{rates[name]:.1f} ({rates[name] / rates['full']:.2f}x, {revived[name]})" for name in configs]
            ],
        )
    )


def across_dtypes(runs: list[dict]) -> dict:
    """Every path of every dtype against the first dtype's full path (float32 when it is listed first):
    TTFT as full_first / path, decode as path / full_first."""
    base = runs[0]
    prefill = []
    for i, entry in enumerate(base["prefill"]):
        anchor = entry["median_s"]["full"]
        speedups = {
            f"{run['dtype']} {name}": anchor / seconds
            for run in runs
            for name, seconds in run["prefill"][i]["median_s"].items()
        }
        prefill.append({"tokens": entry["tokens"], "over": f"{base['dtype']} full", "ttft_speedup": speedups})
    anchor = base["decode"]["tokens_per_s"]["full"]
    decode = {
        f"{run['dtype']} {name}": rate / anchor for run in runs for name, rate in run["decode"]["tokens_per_s"].items()
    }
    return {"prefill": prefill, "decode_over_first_full": decode}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench ttft", description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    add_dtypes_argument(
        parser, "side by side in one run, each with transformers at its dtype; ratios are over the first"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--decode-prompt", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--presets", nargs="+", default=["default", "fast", "lazyllm"], help="pruning presets to time")
    parser.add_argument("--pruning", default=None, help="also time this JSON schedule, as 'custom'")
    parser.add_argument("--out", default="out/bench_ttft.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    runs = [bench_dtype(args, dtype) for dtype in args.dtypes]
    for run in runs:
        _print_dtype(run)
    across = across_dtypes(runs)
    if len(runs) > 1:
        names = list(across["prefill"][0]["ttft_speedup"])
        print(f"\nTTFT speedup over {across['prefill'][0]['over']} (decode: tok/s over it)")
        rows = [[entry["tokens"]] + [f"{entry['ttft_speedup'][n]:.2f}x" for n in names] for entry in across["prefill"]]
        rows.append(["decode"] + [f"{across['decode_over_first_full'][n]:.2f}x" for n in names])
        print(markdown_table(["tokens", *names], rows))
    report = {"model": runs[0]["model"], "device": args.device, "threads": args.threads}
    return write_report(args.out, report | {"runs": runs, "across_dtypes": across})


if __name__ == "__main__":
    raise SystemExit(main())
