"""`lazyserve bench serve`: a loopback load test of the whole service.

One workload (Poisson arrivals, prompt lengths log-uniform between --min-len and --max-len of real
text, streamed completions through the REST API) replayed against:
- `--stack up` (the default): `lazyserve up` as a user starts it, with its defaults (threads,
  dtype, one prefill actor, one decode worker), once per --up-threads value and --pruning preset
  side by side: `auto` is up's own sizing, a number gives every worker that many threads (1 on 2
  cores: prefill and decode on separate cores; 2: both share both);
- `--stack workers`: prefill actors on a local Ray and decode worker processes started here, and
  for each routing policy a gateway over the same workers (length-aware vs round-robin).
`--concurrency N [N ...]` replaces the arrivals with N closed-loop streams (each sends its next
request when its last one ends), as vLLM's and SGLang's serving benchmarks do with max
concurrency; with `--stack up`, one run per value on the same stack, side by side;
`--ignore-eos` makes every answer --max-tokens long.
Reports TTFT, inter-token latency (ITL: every gap between two streamed tokens, pooled), time per
output token (TPOT: each request's mean gap) and end-to-end percentiles, output tokens/s,
throughput, and goodput (DistServe's: the requests meeting both `--ttft-slo` and `--itl-slo`, a
request's ITL being its mean gap, as AIPerf's goodput takes it), as a share and a rate. With
`--pruning off` and another preset, the ratios the service is judged by.

Every run is set against its serial bound: P, the TTFT of the workload's median prompt sent
alone (measured on the same stack right before the runs, fresh text each time, median of 3), and
the TTFT p50 of the same requests served first come, first served, one prompt at a time at that
speed (`serial_bound` at Poisson arrivals; `closed_loop_bound` for --concurrency: each stream
sends its next request once its last one has had its first token and decoded for as long as it
did in the run). For one closed-loop wave (as many requests as streams) that is N/2 x P;
requests sent later queue behind what is left of the wave.
`serial_bound_ttft_p50_s` is that; `half_wave_bound_s`, N/2 x P, is given beside it. Bounded:
--requests requests, each run stops after --max-seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

from bench.common import markdown_table, sse_events, write_report


@dataclass
class Outcome:
    prompt_tokens: int
    ok: bool = False
    error: str = ""
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    tpot_s: float = math.nan  # mean time per output token after the first
    tokens: int = 0
    route: str = ""
    itl_s: list[float] = field(default_factory=list)  # every gap between two streamed tokens


def workload(count: int, rate: float, min_len: int, max_len: int, seed: int) -> list[tuple[float, int]]:
    """(arrival time, prompt length) pairs: Poisson arrivals, log-uniform lengths."""
    rng = random.Random(seed)
    t, items = 0.0, []
    for _ in range(count):
        t += rng.expovariate(rate)
        items.append((t, int(math.exp(rng.uniform(math.log(min_len), math.log(max_len))))))
    return items


async def one_request(
    client, url: str, prompt: list[int], max_tokens: int, timeout: float, ignore_eos: bool = False
) -> Outcome:
    import httpx

    outcome = Outcome(len(prompt))
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body |= {"stream_options": {"include_usage": True}}  # the token count, where a chunk's text is empty
    body |= {"ignore_eos": True} if ignore_eos else {}
    start = time.monotonic()
    stamps = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
            outcome.route = response.headers.get("x-lazyserve-route", "")
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}"
                return outcome
            async for data in sse_events(response):
                if "error" in data:
                    outcome.error = data["error"]["message"][:200]
                    return outcome
                if data["choices"] and data["choices"][0]["text"]:
                    stamps.append(time.monotonic())
                if data["choices"] and data["choices"][0].get("finish_reason"):
                    outcome.tokens = max(outcome.tokens, len(stamps))
                if data.get("usage"):
                    outcome.tokens = data["usage"]["completion_tokens"]
    except (TimeoutError, httpx.HTTPError) as error:
        outcome.error = type(error).__name__
        return outcome
    end = time.monotonic()
    outcome.ok = bool(stamps)
    if stamps:
        outcome.ttft_s, outcome.e2e_s = stamps[0] - start, end - start
        if len(stamps) > 1:
            outcome.tpot_s = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
            outcome.itl_s = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
    return outcome


async def replay(
    url: str, items, prompts, max_tokens: int, max_seconds: float, concurrency: int = 0, ignore_eos: bool = False
) -> list[Outcome]:
    """Every prompt once: at its arrival time, or with `concurrency` streams, each sending its
    next prompt (in order) when its last answer ends."""
    import httpx

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        start = time.monotonic()

        def remaining() -> float:
            return max(1.0, max_seconds - (time.monotonic() - start))

        async def fire(at: float, prompt):
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            return await one_request(client, url, prompt, max_tokens, remaining(), ignore_eos)

        if not concurrency:
            tasks = [asyncio.create_task(fire(at, prompt)) for (at, _), prompt in zip(items, prompts)]
            return list(await asyncio.gather(*tasks))
        outcomes: list[Outcome | None] = [None] * len(prompts)
        pending = iter(range(len(prompts)))

        async def stream():
            for index in pending:  # one shared iterator: each prompt goes to one stream
                outcomes[index] = await one_request(client, url, prompts[index], max_tokens, remaining(), ignore_eos)

        await asyncio.gather(*(stream() for _ in range(concurrency)))
        return outcomes


def sample_prompts(corpus: list[int], items, seed: int) -> list[list[int]]:
    """A prompt of each item's length, cut from the corpus at random offsets."""
    rng = random.Random(seed)
    prompts = []
    for _, length in items:
        offset = rng.randrange(0, len(corpus) - length)
        prompts.append(corpus[offset : offset + length])
    return prompts


def percentile(values: list[float], q: float) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return math.nan
    index = min(len(values) - 1, max(0, math.ceil(q / 100 * len(values)) - 1))
    return values[index]


def serial_bound(alone_s: list[float], arrivals: list[float]) -> list[float]:
    """Each request's TTFT had the requests arriving at `arrivals` been served first come, first
    served, one prompt at a time, request i taking alone_s[i] and decode taking nothing."""
    free, ttfts = 0.0, []  # when the one server is next free
    for sent, cost in sorted(zip(arrivals, alone_s)):
        free = max(free, sent) + cost
        ttfts.append(free - sent)
    return ttfts


def closed_loop_bound(alone_s: list[float], decode_s: list[float], concurrency: int) -> list[float]:
    """Each request's TTFT had a closed loop of `concurrency` streams (each taking the next request
    in order when its last one ended) been served one prompt at a time, first come, first served,
    request i's prefill taking alone_s[i] and its decoding what it took in the run, decode_s[i]."""
    ends = [0.0] * concurrency  # when each stream sends its next request
    free, ttfts = 0.0, []
    for cost, decode in zip(alone_s, decode_s):
        stream = min(range(concurrency), key=lambda k: ends[k])
        sent = ends[stream]
        free = max(free, sent) + cost
        ttfts.append(free - sent)
        ends[stream] = free + (0.0 if math.isnan(decode) else decode)
    return ttfts


def summarize(
    outcomes: list[Outcome],
    wall_s: float,
    slo_ttft: float,
    slo_itl: float,
    alone_s: float | None = None,
    concurrency: int = 0,
    arrivals: list[float] | None = None,
) -> dict:
    """alone_s: P, the median prompt's TTFT alone; with it, the serial bound and the distance to it."""
    ok = [o for o in outcomes if o.ok]
    good = [o for o in ok if o.ttft_s <= slo_ttft and (math.isnan(o.tpot_s) or o.tpot_s <= slo_itl)]
    summary = {"requests": len(outcomes), "ok": len(ok), "errors": len(outcomes) - len(ok), "wall_s": wall_s}
    gaps = [gap for o in ok for gap in o.itl_s]
    for name, values in [(name, [getattr(o, name) for o in ok]) for name in ("ttft_s", "tpot_s", "e2e_s")] + [
        ("itl_s", gaps)
    ]:
        summary[name] = {
            "p50": percentile(values, 50),
            "p90": percentile(values, 90),
            "p99": percentile(values, 99),
            "mean": statistics.fmean(values) if values else math.nan,
        }
    summary["throughput_rps"] = len(ok) / wall_s
    summary["output_tokens_per_s"] = sum(o.tokens for o in ok) / wall_s
    summary["goodput_rps"] = len(good) / wall_s
    summary["goodput_share"] = len(good) / len(outcomes) if outcomes else math.nan
    summary["slo"] = {"ttft_s": slo_ttft, "itl_s": slo_itl}
    if alone_s is not None and outcomes:
        median = statistics.median(o.prompt_tokens for o in outcomes)
        costs = [alone_s * o.prompt_tokens / median for o in outcomes]  # P scaled by length
        if concurrency:
            ttfts = closed_loop_bound(costs, [o.e2e_s - o.ttft_s for o in outcomes], concurrency)
        else:
            ttfts = serial_bound(costs, arrivals or [0.0] * len(costs))
        bound = percentile(ttfts, 50)
        summary["ttft_alone_s"] = alone_s
        summary["serial_bound_ttft_p50_s"] = bound
        summary["ttft_p50_over_serial_bound"] = summary["ttft_s"]["p50"] / bound
        if concurrency:
            summary["half_wave_bound_s"] = concurrency / 2 * alone_s
            summary["ttft_p50_over_half_wave_bound"] = summary["ttft_s"]["p50"] / (concurrency / 2 * alone_s)
    summary["routes"] = {
        route: sum(o.route == route for o in outcomes) for route in sorted({o.route for o in outcomes})
    }
    return summary


def _start(args: list[str], ready: str, env=None):
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if ready:
        for line in process.stdout:
            if line.startswith(f"READY {ready} "):
                return process, line.split()[2]
        raise RuntimeError(f"{args} did not start")
    return process, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench serve", description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--rate", type=float, default=0.4, help="mean arrivals per second")
    parser.add_argument("--min-len", type=int, default=200)
    parser.add_argument("--max-len", type=int, default=6000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stack", choices=["up", "workers"], default="up", help="what serves the workload")
    parser.add_argument(
        "--up-threads",
        nargs="+",
        default=["auto"],
        help="--stack up: one run per value, side by side: auto (up's default) or threads per worker",
    )
    parser.add_argument(
        "--pruning",
        nargs="+",
        default=[None],
        choices=["off", "default", "fast", "lazyllm"],
        help="--stack up: one run per preset (up's --pruning), side by side; default: up's own",
    )
    parser.add_argument(
        "--kernels",
        nargs="+",
        default=[None],
        choices=["native", "torch"],
        help="--stack up: one run per value (up's --kernels), side by side; default: up's own",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[0],
        help="closed-loop streams instead of Poisson arrivals (0: arrivals); --stack up: one run per value "
        "(--stack workers: the first)",
    )
    parser.add_argument("--ignore-eos", action="store_true", help="every answer --max-tokens long")
    parser.add_argument("--dtype", default=None, help="the workers' dtype (default: theirs, auto)")
    parser.add_argument("--prefill-workers", type=int, default=None, help="default: up's 1; --stack workers: 2")
    parser.add_argument("--decode-workers", type=int, default=None, help="default: up's 1; --stack workers: 2")
    parser.add_argument("--threads", type=int, default=1, help="--stack workers: torch threads per worker")
    parser.add_argument("--local-threshold", type=int, default=None, help="default: the gateway's")
    parser.add_argument("--policies", nargs="+", default=["length", "round_robin"], help="--stack workers only")
    parser.add_argument("--ttft-slo", "--slo-ttft", dest="slo_ttft", type=float, default=10.0, help="seconds")
    parser.add_argument(
        "--itl-slo",
        "--slo-tpot",
        dest="slo_tpot",
        type=float,
        default=0.5,
        help="seconds: a request meets it when its mean gap between tokens does",
    )
    parser.add_argument(
        "--serve-slo",
        action="store_true",
        help="--stack up: start up with these targets too (--ttft-slo, --itl-slo: they steer its schedule)",
    )
    parser.add_argument("--max-seconds", type=float, default=900.0, help="bound of each policy's run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="out/bench_serve.json")
    args = parser.parse_args(argv)

    from bench.common import reference_text
    from shared.models.text import load_text_model

    text = load_text_model(args.model)
    corpus = text.tokenizer(reference_text()).input_ids
    items = workload(args.requests, args.rate, args.min_len, args.max_len, args.seed)
    # One prompt set per --concurrency value: the same lengths, other text, so that a run on the
    # same stack finds nothing of the previous one's in the prefix cache.
    prompt_sets = [sample_prompts(corpus, items, args.seed + 1 + run) for run in range(len(args.concurrency))]
    prompts = prompt_sets[0]
    report = {"args": vars(args), "workload": [length for _, length in items], "policies": {}}
    if args.stack == "up":
        runs = [(t, p, k) for t in args.up_threads for p in args.pruning for k in args.kernels]
        arrivals = [at for at, _ in items]
        for threads, pruning, kernels in runs:
            served, alone = _through_up(args, threads, pruning, kernels, items, prompt_sets, corpus)
            for concurrency, (outcomes, wall) in served.items():
                summary = summarize(outcomes, wall, args.slo_ttft, args.slo_tpot, alone, concurrency, arrivals)
                name = f"up threads={threads}" + (f" pruning={pruning}" if pruning else "")
                name += f" kernels={kernels}" if kernels else ""
                name += f" concurrency={concurrency}" if len(args.concurrency) > 1 else ""
                report["policies"][name] = {"summary": summary, "requests": [asdict(o) for o in outcomes]}
                print(f"{name}: {summary['ok']}/{summary['requests']} ok in {wall:.0f} s", flush=True)
    else:
        _through_workers(args, items, prompts, report, corpus)
    _print(report)
    return write_report(args.out, report)


def ttft_alone(url: str, corpus: list[int], length: int, seed: int, repeats: int = 3) -> float:
    """P: the median TTFT of a `length`-token prompt sent alone, fresh text each time (no prefix
    cache hit), one token asked."""
    prompts = sample_prompts(corpus, [(0.0, length)] * repeats, seed)
    ttfts = [asyncio.run(replay(url, [(0.0, length)], [prompt], 1, 120))[0].ttft_s for prompt in prompts]
    return statistics.median(ttfts)


def _through_up(
    args, threads: str, pruning: str | None, kernels: str | None, items, prompt_sets, corpus
) -> tuple[dict[int, tuple[list[Outcome], float]], float]:
    """Start `lazyserve up` with its defaults (and the flags given), measure P (ttft_alone), replay
    the workload once per --concurrency value (each with its prompt set), stop it:
    ({concurrency: (outcomes, wall seconds)}, P)."""
    flags = ["--prefill-actors", str(args.prefill_workers)] if args.prefill_workers else []
    flags += ["--decode-workers", str(args.decode_workers)] if args.decode_workers else []
    flags += ["--local-threshold", str(args.local_threshold)] if args.local_threshold is not None else []
    flags += ["--dtype", args.dtype] if args.dtype else []
    flags += [] if threads == "auto" else ["--threads", str(int(threads))]
    flags += ["--pruning", pruning] if pruning else []
    flags += ["--kernels", kernels] if kernels else []
    flags += ["--ttft-slo", str(args.slo_ttft), "--itl-slo", str(args.slo_tpot)] if args.serve_slo else []
    with running_up(args.model, flags, args.max_seconds) as url:
        asyncio.run(replay(url, [(0.0, 300)], [prompt_sets[0][0][:300]], 2, 120))  # warm-up
        alone = ttft_alone(url, corpus, int(statistics.median(length for _, length in items)), args.seed + 1000)
        runs = {}
        for concurrency, prompts in zip(args.concurrency, prompt_sets):
            start = time.monotonic()
            outcomes = asyncio.run(
                replay(url, items, prompts, args.max_tokens, args.max_seconds, concurrency, args.ignore_eos)
            )
            runs[concurrency] = outcomes, time.monotonic() - start
        return runs, alone


@contextlib.contextmanager
def running_up(model: str, flags: list[str], request_timeout_s: float, port: int = 8100):
    """`lazyserve up --model MODEL FLAGS` on 127.0.0.1:port: its URL once the gateway is ready;
    stopped (every child with it) afterwards."""
    import signal

    from services.up import wait_for_gateway

    with socket.socket() as probe:  # else the READY line could come from whatever already answers there
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: only a listener blocks
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise RuntimeError(f"port {port} is in use (another lazyserve up?): stop what holds it") from None
    command = ["up", "--model", model, "--port", str(port), *flags]
    env = {"LAZYSERVE_GATEWAY_REQUEST_TIMEOUT_S": str(request_timeout_s)}
    process = subprocess.Popen(  # noqa: S603 -- this interpreter running our own CLI
        [sys.executable, "-m", "services.cli", *command], stdout=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    try:
        for line in process.stdout:
            if line.startswith("READY gateway "):
                break
        else:
            raise RuntimeError(f"lazyserve {' '.join(command)} did not start")
        url = f"http://127.0.0.1:{port}"
        wait_for_gateway(url, 60.0)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)  # up stops every child it started
        process.wait(timeout=60)


def _through_workers(args, items, prompts, report: dict, corpus: list[int]) -> None:
    from services.prefill.actor import actor_addresses, ensure_ray, launch_prefill_actors
    from services.prefill.settings import PrefillSettings
    from services.up import wait_for_gateway
    from shared.settings import EngineSettings

    args.prefill_workers = args.prefill_workers or 2
    args.decode_workers = args.decode_workers or 2
    local_threshold = 1024 if args.local_threshold is None else args.local_threshold
    engine = {"model": args.model, "threads": args.threads} | ({"dtype": args.dtype} if args.dtype else {})
    ensure_ray(num_cpus=max(os.cpu_count(), args.prefill_workers), log_to_driver=False)
    settings = PrefillSettings(engine=EngineSettings(**engine), num_cpus=1, num_actors=args.prefill_workers)
    processes = []
    try:
        actors = launch_prefill_actors(settings)
        prefill_addresses = actor_addresses(actors)
        decode_addresses = []
        for _ in range(args.decode_workers):
            worker = ["decode-worker", "--model", args.model, "--port", "0", "--threads", str(args.threads)]
            process, address = _start(worker + (["--dtype", args.dtype] if args.dtype else []), "decode")
            processes.append(process)
            decode_addresses.append(address)
        for policy in args.policies:
            port = 8100 + len(report["policies"])
            gateway, _ = _start(
                [
                    "gateway",
                    "--model",
                    args.model,
                    "--port",
                    str(port),
                    "--routing",
                    policy,
                    "--local-threshold",
                    str(local_threshold),
                    "--prefill-workers",
                    ",".join(prefill_addresses),
                    "--decode-workers",
                    ",".join(decode_addresses),
                ],
                "",
                env={"LAZYSERVE_GATEWAY_REQUEST_TIMEOUT_S": str(args.max_seconds)},
            )
            url = f"http://127.0.0.1:{port}"
            try:
                wait_for_gateway(url, 120.0)
                asyncio.run(replay(url, [(0.0, 300)], [prompts[0][:300]], 2, 120))  # warm-up
                median = int(statistics.median(length for _, length in items))
                alone = ttft_alone(url, corpus, median, args.seed + 1000 + len(report["policies"]))
                start = time.monotonic()
                outcomes = asyncio.run(
                    replay(url, items, prompts, args.max_tokens, args.max_seconds, args.concurrency[0], args.ignore_eos)
                )
                wall = time.monotonic() - start
            finally:
                gateway.terminate()
                gateway.wait(timeout=30)
            arrivals = [at for at, _ in items]
            summary = summarize(outcomes, wall, args.slo_ttft, args.slo_tpot, alone, args.concurrency[0], arrivals)
            report["policies"][policy] = {"summary": summary, "requests": [asdict(o) for o in outcomes]}
            print(f"{policy}: {summary['ok']}/{summary['requests']} ok in {wall:.0f} s", flush=True)
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)
        import ray

        ray.shutdown()


def _print(report: dict) -> None:
    rows = []
    for policy, entry in report["policies"].items():
        s = entry["summary"]
        rows.append(
            [
                policy,
                f"{s['ok']}/{s['requests']}",
                f"{s['ttft_s']['p50']:.2f}",
                f"{s['ttft_s']['p99']:.2f}",
                f"{s['tpot_s']['p50'] * 1000:.0f}",
                f"{s['tpot_s']['p99'] * 1000:.0f}",
                f"{s['itl_s']['p50'] * 1000:.0f}",
                f"{s['itl_s']['p90'] * 1000:.0f}",
                f"{s['e2e_s']['p50']:.2f}",
                f"{s['e2e_s']['p99']:.2f}",
                f"{s['output_tokens_per_s']:.1f}",
                f"{s['throughput_rps']:.3f}",
                f"{s['goodput_rps']:.3f} ({s['goodput_share']:.0%})",
                _bound(s),
                json.dumps(s["routes"]),
            ]
        )
    print(
        markdown_table(
            [
                "policy",
                "ok",
                "TTFT p50 s",
                "TTFT p99 s",
                "TPOT p50 ms",
                "TPOT p99 ms",
                "ITL p50 ms",
                "ITL p90 ms",
                "e2e p50 s",
                "e2e p99 s",
                "output tok/s",
                "req/s",
                "goodput req/s (share)",
                "TTFT p50 / serial bound (P)",
                "routes",
            ],
            rows,
        )
    )
    policies = report["policies"]
    if "length" in policies and "round_robin" in policies:
        ratio = policies["length"]["summary"]["ttft_s"]["p99"] / policies["round_robin"]["summary"]["ttft_s"]["p99"]
        report["p99_ttft_length_over_round_robin"] = ratio
        print(f"\np99 TTFT, length-aware / round-robin: {ratio:.3f} (target <= 0.8)")
    report["against_off"] = against_off(policies)
    report["against_lowest_concurrency"] = against_lowest_concurrency(policies)
    for name, ratio in report["against_lowest_concurrency"].items():
        tokens, errors = ratio["output_tokens_per_s"], ratio["errors"]
        print(f"{name}: output tok/s x{tokens:.2f} of the lowest concurrency's, {errors} errors")
    for name, ratios in report["against_off"].items():
        print(
            f"{name} against pruning=off: output tok/s {ratios['output_tokens_per_s']:.2f}x, "
            f"ITL p50 {ratios['itl_p50']:.2f}x, TTFT p50 {ratios['ttft_p50_speedup']:.2f}x faster"
        )


def _bound(summary: dict) -> str:
    if "serial_bound_ttft_p50_s" not in summary:
        return "–"
    text = f"{summary['ttft_p50_over_serial_bound']:.2f}x of {summary['serial_bound_ttft_p50_s']:.1f} s"
    text += f" (P {summary['ttft_alone_s']:.2f} s"
    if "half_wave_bound_s" in summary:
        text += f"; {summary['ttft_p50_over_half_wave_bound']:.2f}x of N/2 x P"
    return text + ")"


def against_lowest_concurrency(policies: dict) -> dict:
    """Each `concurrency=N` run against the lowest N with the rest of its name the same: output
    tokens/s as a ratio, and its errors (a burst above the workers' room must queue, not fail)."""
    groups: dict[str, dict[int, dict]] = {}
    for name, entry in policies.items():
        base, _, concurrency = name.partition(" concurrency=")
        if concurrency:
            groups.setdefault(base, {})[int(concurrency)] = entry["summary"]
    ratios = {}
    for base, runs in groups.items():
        lowest = runs[min(runs)]
        for concurrency, summary in sorted(runs.items()):
            ratios[f"{base} concurrency={concurrency}"] = {
                "output_tokens_per_s": summary["output_tokens_per_s"] / lowest["output_tokens_per_s"],
                "errors": summary["errors"],
            }
    return ratios


def against_off(policies: dict) -> dict:
    """Each pruned run against the `pruning=off` run with the same threads: output tokens/s and
    ITL p50 as ratios (pruned / off), TTFT p50 as a speedup (off / pruned)."""
    ratios = {}
    for name, entry in policies.items():
        base, _, pruning = name.partition(" pruning=")
        off = policies.get(f"{base} pruning=off")
        if not pruning or pruning == "off" or off is None:
            continue
        mine, theirs = entry["summary"], off["summary"]
        ratios[name] = {
            "output_tokens_per_s": mine["output_tokens_per_s"] / theirs["output_tokens_per_s"],
            "itl_p50": mine["itl_s"]["p50"] / theirs["itl_s"]["p50"],
            "ttft_p50_speedup": theirs["ttft_s"]["p50"] / mine["ttft_s"]["p50"],
        }
    return ratios
