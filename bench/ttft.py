"""`lazyserve bench ttft`: time to first token, full vs lazy vs transformers, and decode speed.

All paths run in one process on the same text, interleaved round by round after a warm-up, so
machine noise hits them alike; the table reports medians and ratios. Peak memory is the largest
rise of the process's resident set during a call, sampled every few milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import torch

from bench.common import long_text_ids, markdown_table, write_json


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


def _timed(fn):
    with PeakRSS() as memory:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
    return elapsed, memory.rise_mib


def bench_prefill(model, ids, lazy, repeats):
    from shared.engine import OFF, prefill

    hf = model.hf
    paths = {
        "transformers": lambda: hf(ids[None], logits_to_keep=1),
        "full": lambda: prefill(model, ids, OFF),
        "lazy": lambda: prefill(model, ids, lazy),
    }
    times = {name: [] for name in paths}
    peaks = {name: 0.0 for name in paths}
    with torch.inference_mode():
        for name, fn in paths.items():  # warm-up
            fn()
        for _ in range(repeats):
            for name, fn in paths.items():
                elapsed, peak = _timed(fn)
                times[name].append(elapsed)
                peaks[name] = max(peaks[name], peak)
    return {name: statistics.median(t) for name, t in times.items()}, peaks, times


def _hf_decode(hf, ids, tokens):
    with torch.inference_mode():
        out = hf(ids[None], use_cache=True, logits_to_keep=1)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(tokens):
            out = hf(token, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return tokens / (time.perf_counter() - start)


def _our_decode(model, ids, config, tokens):
    from shared.engine import decode_step, prefill

    with torch.inference_mode():
        cache, logits = prefill(model, ids, config, reserve=tokens)
        start = time.perf_counter()
        for _ in range(tokens):
            logits = decode_step(model, cache, int(logits.argmax()), config)
        return tokens / (time.perf_counter() - start), cache.revived_token_layers


def bench_decode(model, ids, lazy, tokens, repeats):
    from shared.engine import OFF

    rates = {"transformers": [], "full": [], "lazy": []}
    revived = 0
    _our_decode(model, ids, OFF, 2)  # warm-up
    for _ in range(repeats):
        rates["transformers"].append(_hf_decode(model.hf, ids, tokens))
        rates["full"].append(_our_decode(model, ids, OFF, tokens)[0])
        rate, revived = _our_decode(model, ids, lazy, tokens)
        rates["lazy"].append(rate)
    return {name: statistics.median(r) for name, r in rates.items()}, revived


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench ttft", description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--decode-prompt", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--pruning", default="default", help="default or a JSON schedule")
    parser.add_argument("--out", default="out/bench_ttft.json")
    args = parser.parse_args(argv)

    from shared.engine import PruneConfig
    from shared.engine.pruning import default_pruning
    from shared.models import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    model = loaded.engine
    lazy = default_pruning(model.spec.num_layers)
    if args.pruning != "default":
        lazy = PruneConfig.model_validate_json(args.pruning)
    rows, report = [], {"model": loaded.name, "threads": args.threads, "pruning": lazy.model_dump(), "prefill": []}
    for length in args.lengths:
        ids = long_text_ids(loaded.tokenizer, length)
        medians, peaks, samples = bench_prefill(model, ids, lazy, args.repeats)
        entry = {
            "tokens": length,
            "median_s": medians,
            "samples_s": samples,
            "peak_rss_rise_mib": peaks,
            "full_over_transformers": medians["full"] / medians["transformers"],
            "lazy_speedup_over_full": medians["full"] / medians["lazy"],
        }
        report["prefill"].append(entry)
        rows.append(
            [
                length,
                f"{medians['transformers']:.2f}",
                f"{medians['full']:.2f}",
                f"{medians['lazy']:.2f}",
                f"{entry['full_over_transformers']:.3f}",
                f"{entry['lazy_speedup_over_full']:.2f}x",
                f"{peaks['transformers']:.0f} / {peaks['full']:.0f} / {peaks['lazy']:.0f}",
            ]
        )
        print(f"{length} tokens done", flush=True)
    print(
        markdown_table(
            ["tokens", "transformers s", "full s", "lazy s", "full / transformers", "lazy speedup", "peak MiB (tf/full/lazy)"],
            rows,
        )
    )
    ids = long_text_ids(loaded.tokenizer, args.decode_prompt)
    rates, revived = bench_decode(model, ids, lazy, args.decode_tokens, args.repeats)
    report["decode"] = {
        "prompt_tokens": args.decode_prompt,
        "tokens": args.decode_tokens,
        "tokens_per_s": rates,
        "full_over_transformers": rates["full"] / rates["transformers"],
        "lazy_over_full": rates["lazy"] / rates["full"],
        "lazy_revived_token_layers": revived,
    }
    print()
    print(
        markdown_table(
            ["decode after", "transformers tok/s", "full tok/s", "lazy tok/s", "full / transformers", "lazy / full"],
            [
                [
                    f"{args.decode_prompt} tokens, {args.decode_tokens} steps",
                    f"{rates['transformers']:.1f}",
                    f"{rates['full']:.1f}",
                    f"{rates['lazy']:.1f}",
                    f"{report['decode']['full_over_transformers']:.2f}x",
                    f"{report['decode']['lazy_over_full']:.2f}x",
                ]
            ],
        )
    )
    write_json(Path(args.out), report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
