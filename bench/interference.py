"""`lazyserve bench interference`: what a long prompt's prefill costs the streams already running.

Under `lazyserve up` on one host, the prefill actor and the decode worker's loop share the cores.
For each --prefill-niceness value, side by side, this starts `up` with it and:
1. opens --streams streams (short prompts, answers without end: `ignore_eos`) and waits until
   every one is decoding;
2. measures their inter-token gaps for --quiet-seconds (the quiet window);
3. sends --long-count prompts of --long-len tokens one after another (each asks for one token)
   and measures the streams' gaps while any of them is prefilling (the busy window), and each
   long prompt's TTFT;
4. closes the streams.
Reports ITL p50 / p99 in both windows, busy / quiet, and the long prompts' TTFT: what a priority
between prefill and decode trades. Bounded: each run stops after --max-seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from bench.common import completion_events, has_text, markdown_table, write_report
from bench.serve import percentile, running_up


async def _stream(client, url: str, prompt: list[int], max_tokens: int, stamps: list[float], started) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for data in completion_events(response):
            if has_text(data):
                stamps.append(time.monotonic())
                started.set()


async def _long(client, url: str, prompt: list[int]) -> tuple[float, float]:
    """(sent, first token) of a one-token request."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    sent = time.monotonic()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        async for data in completion_events(response):
            if has_text(data):
                return sent, time.monotonic()
    return sent, time.monotonic()


async def measure(
    url: str, streams: list[list[int]], longs: list[list[int]], quiet_s: float, max_s: float, stream_tokens: int
) -> dict:
    """Run the four steps against a running gateway; the gaps of each window and the long TTFTs."""
    import httpx

    async with httpx.AsyncClient(timeout=max_s, limits=httpx.Limits(max_connections=64)) as client:
        stamps = [[] for _ in streams]
        started = [asyncio.Event() for _ in streams]
        tasks = [
            asyncio.create_task(_stream(client, url, prompt, stream_tokens, mine, event))
            for prompt, mine, event in zip(streams, stamps, started)
        ]

        def check_streams() -> None:
            """A stream that ended early fails the run with its error, not a short silent window."""
            if ended := [task for task in tasks if task.done()]:
                if error := ended[0].exception():
                    raise error
                raise RuntimeError("a stream ended before the long prompts were done: raise --stream-tokens")

        try:
            waiting = asyncio.ensure_future(asyncio.gather(*(event.wait() for event in started)))
            await asyncio.wait([waiting, *tasks], timeout=max_s, return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            check_streams()
            if not all(event.is_set() for event in started):
                raise TimeoutError(f"the streams did not all start within {max_s} s")
            quiet = (time.monotonic(), time.monotonic() + quiet_s)
            await asyncio.sleep(quiet_s)
            busy = [await _long(client, url, prompt) for prompt in longs]
            check_streams()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return windows(stamps, quiet, busy)


def windows(stamps: list[list[float]], quiet: tuple[float, float], busy: list[tuple[float, float]]) -> dict:
    """Each stream's gaps, split: inside the quiet window, or overlapping a long prompt's prefill."""
    quiet_gaps, busy_gaps = [], []
    for times in stamps:
        for earlier, later in zip(times, times[1:]):
            if quiet[0] <= earlier and later <= quiet[1]:
                quiet_gaps.append(later - earlier)
            elif any(earlier < end and later > sent for sent, end in busy):
                busy_gaps.append(later - earlier)
    ttfts = [end - sent for sent, end in busy]
    return {
        "quiet_itl_s": {"p50": percentile(quiet_gaps, 50), "p99": percentile(quiet_gaps, 99), "n": len(quiet_gaps)},
        "busy_itl_s": {"p50": percentile(busy_gaps, 50), "p99": percentile(busy_gaps, 99), "n": len(busy_gaps)},
        "long_ttft_s": {"p50": percentile(ttfts, 50), "mean": statistics.fmean(ttfts), "all": ttfts},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench interference", description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prefill-niceness", nargs="+", default=["auto"], help="one run each; auto: up's default")
    parser.add_argument("--pruning", default=None, choices=["off", "default", "fast", "lazyllm"])
    parser.add_argument("--dtype", default=None, help="the workers' dtype (default: up's, auto)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: up's)")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--stream-len", type=int, default=256, help="the streams' prompt tokens")
    parser.add_argument("--stream-tokens", type=int, default=2048, help="the streams' max_tokens (closed early)")
    parser.add_argument("--long-len", type=int, default=3000)
    parser.add_argument("--long-count", type=int, default=4)
    parser.add_argument("--quiet-seconds", type=float, default=6.0)
    parser.add_argument("--max-seconds", type=float, default=600.0, help="bound of each run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/bench_interference.json")
    args = parser.parse_args(argv)

    from bench.common import reference_text
    from shared.models.text import load_text_model

    corpus = load_text_model(args.model).tokenizer(reference_text()).input_ids
    rng = random.Random(args.seed)

    def pick(length: int) -> list[int]:
        offset = rng.randrange(0, len(corpus) - length)
        return corpus[offset : offset + length]

    streams = [pick(args.stream_len) for _ in range(args.streams)]
    longs = [pick(args.long_len) for _ in range(args.long_count)]
    warm = pick(args.long_len)  # not one of the measured prompts: no prefix-cache hit on them
    report = {"args": vars(args), "runs": {}}
    for niceness in args.prefill_niceness:
        flags = [] if niceness == "auto" else ["--prefill-niceness", str(int(niceness))]
        flags += ["--pruning", args.pruning] if args.pruning else []
        flags += ["--dtype", args.dtype] if args.dtype else []
        flags += ["--threads", str(args.threads)] if args.threads else []
        with running_up(args.model, flags, args.max_seconds) as url:
            warm_up = measure(url, streams[:1], [warm], 0.5, args.max_seconds, args.stream_tokens)  # both paths
            asyncio.run(warm_up)
            result = asyncio.run(measure(url, streams, longs, args.quiet_seconds, args.max_seconds, args.stream_tokens))
        report["runs"][f"prefill niceness={niceness}"] = result
        print(f"prefill niceness={niceness}: done", flush=True)
    rows = []
    for name, r in report["runs"].items():
        quiet, busy = r["quiet_itl_s"], r["busy_itl_s"]
        rows.append(
            [
                name,
                f"{quiet['p50'] * 1000:.0f} / {quiet['p99'] * 1000:.0f}",
                f"{busy['p50'] * 1000:.0f} / {busy['p99'] * 1000:.0f}",
                f"{busy['p50'] / quiet['p50']:.2f}x / {busy['p99'] / quiet['p99']:.2f}x",
                f"{quiet['n']}, {busy['n']}",
                f"{r['long_ttft_s']['p50']:.2f}",
            ]
        )
    header = ["run", "quiet ITL p50 / p99 ms", "busy ITL p50 / p99 ms", "busy / quiet", "gaps", "long TTFT p50 s"]
    print(markdown_table(header, rows))
    return write_report(args.out, report)
