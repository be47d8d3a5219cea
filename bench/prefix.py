"""`lazyserve bench prefix`: what prefix caching gives on the traffic that repeats long prompts.

Two workloads of streamed chat requests (greedy, the default pruning preset), sent one at a time
so each TTFT is the request's own:
- documents: --documents documents of ~--doc-tokens tokens of real text (disjoint slices of the
  Python reference), --questions questions each, interleaved (d0q0, d1q0, ..., d0q1, ...): the
  first question of a document is cold, the others find it cached;
- conversations: --conversations conversations of --turns turns over a long first message; each
  turn re-sends the earlier turns with their answers.
Both run through `lazyserve up` (its own processes, the prefill actor on a local Ray) with the
cache on and with it off (`--no-enable-prefix-caching`), one after the other in one run, with
`--batch-invariant` unless --no-batch-invariant (the engine likewise). Then the
same in-process: the engine's prefill of a document's question from scratch against from the
cached document (medians of --repeats after a warm-up), with no gateway, transfer or decode.

Reports TTFT p50/p99 per kind of request (cold, warm, later turns) on and off, their ratios, hit
rates, throughput, the workers' prefix-cache bytes, and whether every answer is the same with the
cache on and off. Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from bench.common import markdown_table, sse_events, write_report

QUESTIONS = (
    "What is the main topic of this text?",
    "Name one keyword the text explains.",
    "Summarize the first paragraph in one sentence.",
    "Give one example the text mentions.",
    "Which statement is described first?",
    "What does the text say about errors?",
    "List two terms defined in the text.",
    "Is anything deprecated here?",
)
FOLLOW_UPS = ("Say more about that.", "Why?", "Give another example.", "Which part was that in?", "Anything else?")


@dataclass
class Sent:
    workload: str
    kind: str  # cold (first sight of a document), warm (a document seen), turn1, turn2, ...
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    route: str = ""
    answer: str = ""
    error: str = ""


@dataclass
class Plan:
    """The requests in order, each a chat body and its label; conversations fill in their answers."""

    documents: list[tuple[str, str, list[dict]]] = field(default_factory=list)  # (kind, id, messages)
    conversations: list[list[str]] = field(default_factory=list)  # per conversation: the user turns


def _texts(tokenizer, count: int, tokens: int) -> list[str]:
    from bench.common import reference_text

    ids = tokenizer(reference_text()).input_ids
    return [tokenizer.decode(ids[i * tokens : (i + 1) * tokens]) for i in range(count)]


def make_plan(tokenizer, args) -> Plan:
    plan = Plan()
    documents = _texts(tokenizer, args.documents + args.conversations, args.doc_tokens)
    for q in range(args.questions):
        for d in range(args.documents):
            question = QUESTIONS[(q + d) % len(QUESTIONS)]
            messages = [{"role": "user", "content": f"{documents[d]}\n\nQuestion: {question}"}]
            plan.documents.append(("cold" if q == 0 else "warm", f"d{d}", messages))
    for c in range(args.conversations):
        first = f"{documents[args.documents + c]}\n\nQuestion: {QUESTIONS[c % len(QUESTIONS)]}"
        plan.conversations.append([first] + [FOLLOW_UPS[t % len(FOLLOW_UPS)] for t in range(args.turns - 1)])
    return plan


async def _chat(client, url: str, workload: str, kind: str, messages: list[dict], max_tokens: int) -> Sent:
    import httpx

    sent = Sent(workload, kind)
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, parts = time.monotonic(), None, []
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
            sent.route = response.headers.get("x-lazyserve-route", "")
            if response.status_code != 200:
                sent.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return sent
            async for data in sse_events(response):
                if "error" in data:
                    sent.error = data["error"]["message"][:200]
                    return sent
                if data["choices"] and data["choices"][0]["delta"].get("content"):
                    first = first or time.monotonic()
                    parts.append(data["choices"][0]["delta"]["content"])
                if data.get("usage"):
                    sent.prompt_tokens = data["usage"]["prompt_tokens"]
                    sent.cached_tokens = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (TimeoutError, httpx.HTTPError) as error:
        sent.error = type(error).__name__
        return sent
    sent.answer = "".join(parts)
    sent.ttft_s = (first or time.monotonic()) - start
    sent.e2e_s = time.monotonic() - start
    return sent


async def run_plan(url: str, plan: Plan, max_tokens: int) -> tuple[list[Sent], float]:
    import httpx

    results = []
    async with httpx.AsyncClient() as client:
        start = time.monotonic()
        for kind, _, messages in plan.documents:
            results.append(await _chat(client, url, "documents", kind, messages, max_tokens))
        # Conversations interleaved turn by turn: each turn re-sends its own history.
        histories: list[list[dict]] = [[] for _ in plan.conversations]
        for turn in range(max(len(turns) for turns in plan.conversations) if plan.conversations else 0):
            for history, turns in zip(histories, plan.conversations):
                history.append({"role": "user", "content": turns[turn]})
                sent = await _chat(client, url, "conversations", f"turn{turn + 1}", list(history), max_tokens)
                results.append(sent)
                history.append({"role": "assistant", "content": sent.answer})
        return results, time.monotonic() - start


def _up(args, caching: bool, port: int):
    command = ["up", "--model", args.model, "--port", str(port), "--decode-port", str(port + 10)]
    command += ["--prefill-port", str(port + 20)]
    command += ["--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    command += ["--dtype", args.dtype] if args.dtype else []
    command += ["--batch-invariant" if args.batch_invariant else "--no-batch-invariant"]
    process = subprocess.Popen(  # noqa: S603 -- this interpreter running our own CLI
        [sys.executable, "-m", "services.cli", *command], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    for line in process.stdout:
        if line.startswith("READY gateway "):
            return process, line.split()[2]
    raise RuntimeError(f"lazyserve {' '.join(command)} did not start")


def through_up(args, plan: Plan, caching: bool) -> dict:
    import httpx

    from services.up import wait_for_gateway

    process, url = _up(args, caching, 8200 if caching else 8300)
    try:
        wait_for_gateway(url, 120.0)
        warm_up = Plan(documents=[("warm-up", "w", [{"role": "user", "content": "Hello there."}])])
        asyncio.run(run_plan(url, warm_up, 2))
        results, wall = asyncio.run(run_plan(url, plan, args.max_tokens))
        version = httpx.get(f"{url}/version", timeout=10).json()
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        process.send_signal(signal.SIGTERM)  # up stops every child it started
        process.wait(timeout=90)
    # Every worker's cache: the prefill worker's from its last reply, the decode workers' at scrape time.
    cache_bytes = {
        line.split('worker="')[1].split('"')[0]: float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("lazyserve_prefix_cache_bytes{")
    }
    return {
        "results": results,
        "wall_s": wall,
        "decode_workers": version.get("decode_workers", []),
        "prefix_cache_bytes": cache_bytes,
    }


def in_process(args) -> dict:
    """The engine alone: a document's question prefilled from scratch and from the cached document."""
    import torch

    from bench.common import long_text_ids
    from shared.engine import PrefixReuse, prefill, run_prefill
    from shared.models.weights import load_model
    from shared.settings import tune_malloc

    tune_malloc()  # as every worker does
    loaded = load_model(args.model, dtype=args.dtype or "auto")
    model = loaded.engine
    model.set_batch_invariant(args.batch_invariant)
    config = model.spec.preset("default")
    document = long_text_ids(loaded.tokenizer, args.doc_tokens, model.spec.vocab_size)
    question = long_text_ids(loaded.tokenizer, args.doc_tokens + 40, model.spec.vocab_size)[-40:]
    prompt = torch.cat([document, question])
    cold_s, warm_s = [], []
    for repeat in range(args.repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        cold_logits = prefill(model, prompt, config)[1]
        cold = time.perf_counter() - start
        reuse = PrefixReuse(model, loaded.name, 1 << 34)
        run_prefill(model, document, config, prefix=reuse)
        start = time.perf_counter()
        run, _ = run_prefill(model, prompt, config, prefix=reuse)
        warm = time.perf_counter() - start
        same = bool(torch.equal(cold_logits.argmax(), run.logits.argmax()))
        if repeat:
            cold_s.append(cold)
            warm_s.append(warm)
    held_tokens = len(reuse.cache) * reuse.cache.block_tokens
    return {
        "prompt_tokens": int(prompt.shape[0]),
        "cached_tokens": run.cache.cached_tokens,
        "cold_s": statistics.median(cold_s),
        "warm_s": statistics.median(warm_s),
        "speedup": statistics.median(cold_s) / statistics.median(warm_s),
        "same_next_token": same,
        "cache_bytes_per_token": reuse.cache.bytes_held / held_tokens if held_tokens else math.nan,
        "dtype": model.dtype_name,
    }


def _p(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    return values[min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))]


def summarize(runs: dict) -> dict:
    summary: dict = {}
    for mode, run in runs.items():
        results: list[Sent] = run["results"]
        kinds = {}
        for kind in sorted({r.kind for r in results}):
            chosen = [r for r in results if r.kind == kind and not r.error]
            ttfts = [r.ttft_s for r in chosen]
            prompt = sum(r.prompt_tokens for r in chosen)
            kinds[kind] = {
                "count": len(chosen),
                "ttft_p50": _p(ttfts, 50),
                "ttft_p99": _p(ttfts, 99),
                "hit_rate": sum(r.cached_tokens for r in chosen) / prompt if prompt else math.nan,
                "routes": {route: sum(r.route == route for r in chosen) for route in sorted({r.route for r in chosen})},
            }
        ok = [r for r in results if not r.error]
        summary[mode] = {
            "kinds": kinds,
            "errors": len(results) - len(ok),
            "requests_per_s": len(ok) / run["wall_s"],
            "hit_rate": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
            "prefix_cache_bytes": run["prefix_cache_bytes"],
            "decode_prefix_cache": [w.get("prefix_cache") for w in run["decode_workers"]],
        }
    if {"on", "off"} <= runs.keys():
        on, off = runs["on"]["results"], runs["off"]["results"]
        summary["same_answers"] = sum(a.answer == b.answer for a, b in zip(on, off))
        summary["answers"] = len(on)
        k_on, k_off = summary["on"]["kinds"], summary["off"]["kinds"]

        def ratio(kind_a, mode_a, kind_b, mode_b):
            a = summary[mode_a]["kinds"].get(kind_a, {}).get("ttft_p50", math.nan)
            b = summary[mode_b]["kinds"].get(kind_b, {}).get("ttft_p50", math.nan)
            return b / a if a else math.nan

        summary["ratios"] = {
            "cold_over_warm (on; target >= 8)": ratio("warm", "on", "cold", "on"),
            "warm_off_over_warm_on": ratio("warm", "on", "warm", "off"),
            "turn2_off_over_on (target >= 5)": ratio("turn2", "on", "turn2", "off"),
            "later_turns_off_over_on": _later(k_on, k_off),
            "cold_on_over_cold_off (target <= 1.03)": 1 / ratio("cold", "on", "cold", "off"),
        }
    return summary


def _later(k_on: dict, k_off: dict) -> float:
    turns = [k for k in k_on if k.startswith("turn") and k != "turn1"]
    on = [k_on[k]["ttft_p50"] for k in turns]
    off = [k_off[k]["ttft_p50"] for k in turns]
    return statistics.median(off) / statistics.median(on) if on else math.nan


def _print(summary: dict, engine: dict | None) -> None:
    rows = []
    for mode in ("off", "on"):
        if mode not in summary:
            continue
        for kind, k in summary[mode]["kinds"].items():
            rows.append(
                [
                    mode,
                    kind,
                    k["count"],
                    f"{k['ttft_p50']:.3f}",
                    f"{k['ttft_p99']:.3f}",
                    f"{k['hit_rate']:.1%}",
                    json.dumps(k["routes"]),
                ]
            )
    print(markdown_table(["cache", "requests", "n", "TTFT p50 s", "TTFT p99 s", "hit rate", "routes"], rows))
    for mode in ("off", "on"):
        if mode in summary:
            s = summary[mode]
            print(
                f"{mode}: {s['requests_per_s']:.3f} req/s, hit rate {s['hit_rate']:.1%}, errors {s['errors']}, "
                f"prefix cache bytes per worker {s['prefix_cache_bytes']}"
            )
    if "ratios" in summary:
        for name, value in summary["ratios"].items():
            print(f"{name}: {value:.2f}")
        print(f"same answers with the cache on and off: {summary['same_answers']}/{summary['answers']}")
    if engine:
        print(
            f"in-process ({engine['dtype']}): {engine['prompt_tokens']} tokens, {engine['cached_tokens']} cached: "
            f"{engine['cold_s']:.3f} s from scratch, {engine['warm_s']:.3f} s from the cache "
            f"({engine['speedup']:.2f}x); "
            f"{engine['cache_bytes_per_token']:.0f} cache bytes per token"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench prefix", description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default=None, help="the workers' dtype (default: theirs, auto)")
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--questions", type=int, default=4, help="questions per document")
    parser.add_argument("--conversations", type=int, default=2)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--doc-tokens", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="in-process: medians of this many after a warm-up")
    parser.add_argument("--modes", nargs="+", choices=["on", "off"], default=["off", "on"])
    parser.add_argument("--no-engine", action="store_true", help="skip the in-process figure")
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the workers' switch, on by default here: the question is whether the cache changes an answer, "
        "and without it a prefix hit's few rows may be summed otherwise than a prefill's",
    )
    parser.add_argument("--out", default="out/bench_prefix.json")
    args = parser.parse_args(argv)

    from shared.models.text import load_text_model

    text = load_text_model(args.model)
    plan = make_plan(text.tokenizer, args)
    runs = {}
    for mode in args.modes:
        runs[mode] = through_up(args, plan, caching=mode == "on")
        print(f"cache {mode}: {len(runs[mode]['results'])} requests in {runs[mode]['wall_s']:.0f} s", flush=True)
    engine = None if args.no_engine else in_process(args)
    summary = summarize(runs)
    _print(summary, engine)
    report = {
        "args": vars(args),
        "summary": summary,
        "engine": engine,
        "requests": {mode: [asdict(r) for r in run["results"]] for mode, run in runs.items()},
    }
    return write_report(args.out, report)
