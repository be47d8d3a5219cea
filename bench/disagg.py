"""`lazyserve bench disagg`: disaggregated prefill/decode against the engine in one process.

For each prompt length and for full (pruning off) and lazy (the default schedule), in one run:
TTFT and end-to-end time in process vs through a prefill actor on a local Ray, the KV stream over
gRPC and a decode worker process; and the bytes the transfer moved (KV, Aux Cache, the whole
serialized stream) against the full KV cache. Paths alternate round by round after a warm-up;
the tables give medians and ratios. Disaggregated TTFT is the Prefill call's round trip: the
first token is known and the decode worker holds the whole transfer.

`--via up` measures the request's whole path instead: the same prompts as streamed completions
through `lazyserve up` (HTTP, the gateway, Ray's actor, the KV stream, the decode worker; prefix
caching off, so every repeat computes), against the engine in this process, alternating. It
splits what `up` adds into the actor's own prefill (the response's metrics.ttft_s) and the rest
(the path: HTTP, routing, gRPC, the transfer's tail).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

from bench.common import long_text_ids, markdown_table, write_report
from shared.models.precision import DTYPE_CHOICES, resolve_dtype


def _start_decode_worker(model: str, threads: int, dtype: str):
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "decode-worker",
            "--model",
            model,
            "--port",
            "0",
            "--threads",
            str(threads),
            "--dtype",
            dtype,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in process.stdout:
        if line.startswith("READY decode "):
            return process, line.split()[2]
    raise RuntimeError("the decode worker did not start")


def _in_process(model, ids, config, params):
    from shared.engine import Generation, stream

    generation = Generation()
    start = time.perf_counter()
    tokens = stream(model, ids, config, params, generation)
    next(tokens)
    ttft = time.perf_counter() - start
    for _ in tokens:
        pass
    return ttft, time.perf_counter() - start, generation


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve bench disagg", description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every process")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help="every process's model dtype")
    parser.add_argument("--via", choices=["workers", "up"], default="workers", help="what serves the prompts")
    parser.add_argument("--out", default="out/bench_disagg.json")
    args = parser.parse_args(argv)
    if args.via == "up":
        return _via_up(args)

    from services.prefill.actor import actor_addresses, ensure_ray, launch_prefill_actors
    from services.prefill.settings import PrefillSettings
    from services.router.client import DecodeClient, PrefillClient, run_disaggregated
    from shared.contract import default_pruning
    from shared.engine import OFF, SamplingParams
    from shared.models.weights import load_model
    from shared.settings import EngineSettings

    torch.set_num_threads(args.threads)
    args.dtype = resolve_dtype(args.dtype).dtype  # one choice for every process (they share this host)
    loaded = load_model(args.model, dtype=args.dtype)
    model, spec = loaded.engine, loaded.engine.spec
    configs = {"full": OFF, "lazy": default_pruning(spec.num_layers)}
    params = SamplingParams(max_new_tokens=args.new_tokens)

    ensure_ray(num_cpus=os.cpu_count(), log_to_driver=False)
    engine = EngineSettings(model=args.model, threads=args.threads, dtype=args.dtype)
    settings = PrefillSettings(engine=engine, num_cpus=1)
    actor = launch_prefill_actors(settings)[0]
    decode_process, decode_address = _start_decode_worker(args.model, args.threads, args.dtype)
    prefill, decode = PrefillClient(actor_addresses([actor])[0]), DecodeClient(decode_address)
    report = {
        "model": loaded.name,
        "threads": args.threads,
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
        "results": [],
    }
    try:
        warm = long_text_ids(loaded.tokenizer, min(args.lengths)).tolist()
        for config in configs.values():  # warm-up: first calls pay for lazy initialisation
            _in_process(model, torch.tensor(warm), config, params)
            run_disaggregated(prefill, decode, warm, config, params)
        for length in args.lengths:
            ids = long_text_ids(loaded.tokenizer, length)
            for mode, config in configs.items():
                samples = {
                    "local_ttft": [],
                    "local_total": [],
                    "disagg_ttft": [],
                    "disagg_total": [],
                    "prefill_compute": [],
                }
                for _ in range(args.repeats):
                    ttft, total, generation = _in_process(model, ids, config, params)
                    samples["local_ttft"].append(ttft)
                    samples["local_total"].append(total)
                    result = run_disaggregated(prefill, decode, ids.tolist(), config, params)
                    assert result.tokens == generation.tokens, "disaggregated tokens differ from in-process ones"
                    samples["disagg_ttft"].append(result.ttft_s)
                    samples["disagg_total"].append(result.total_s)
                    samples["prefill_compute"].append(result.prefill.stats.ttft_s)
                reply = result.prefill
                full_kv = length * spec.num_layers * spec.kv_bytes_per_token_layer
                record = _record(length, mode, samples, "disagg_ttft")
                medians = record["median_s"]
                report["results"].append(
                    record
                    | {
                        "total_ratio": medians["disagg_total"] / medians["local_total"],
                        "computed_fraction": reply.stats.prefill_token_layers / (length * spec.num_layers),
                        "full_kv_bytes": full_kv,
                        "kv_bytes_sent": reply.kv_bytes_sent,
                        "aux_bytes_sent": reply.aux_bytes_sent,
                        "bytes_sent": reply.bytes_sent,
                        "num_frames": reply.num_frames,
                        "transfer_wait_s": reply.transfer_wait_s,
                        "revived_token_layers": result.stats.revived_token_layers,
                    }
                )
                print(f"{length} tokens, {mode}: done", flush=True)
    finally:
        decode.close()
        decode_process.terminate()
        decode_process.wait(timeout=30)
        import ray

        ray.shutdown()
    _print_tables(report["results"])
    return write_report(args.out, report)


def _record(length: int, mode: str, samples: dict[str, list[float]], ttft: str) -> dict:
    """One (length, mode) result: the samples, their medians, and the `ttft` path against in-process."""
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "tokens": length,
        "mode": mode,
        "median_s": medians,
        "samples_s": samples,
        "ttft_ratio": medians[ttft] / medians["local_ttft"],
    }


def _via_up(args) -> int:
    import asyncio

    from bench.serve import running_up
    from shared.contract import default_pruning
    from shared.engine import OFF, SamplingParams
    from shared.models.weights import load_model

    torch.set_num_threads(args.threads)
    args.dtype = resolve_dtype(args.dtype).dtype
    loaded = load_model(args.model, dtype=args.dtype)
    model = loaded.engine
    configs = {"full": ("off", OFF), "lazy": ("default", default_pruning(model.spec.num_layers))}
    params = SamplingParams(max_new_tokens=args.new_tokens)
    flags = ["--dtype", args.dtype, "--threads", str(args.threads), "--no-enable-prefix-caching"]
    report = {"model": loaded.name, "threads": args.threads, "dtype": args.dtype, "via": "up", "results": []}
    with running_up(args.model, flags, 600.0) as url:
        warm = long_text_ids(loaded.tokenizer, min(args.lengths))
        for preset, config in configs.values():  # warm-up: first calls pay for lazy initialisation
            _in_process(model, warm, config, params)
            asyncio.run(_through_gateway(url, warm.tolist(), preset, args.new_tokens))
        for length in args.lengths:
            ids = long_text_ids(loaded.tokenizer, length)
            for mode, (preset, config) in configs.items():
                samples = {"local_ttft": [], "up_ttft": [], "actor_prefill": []}
                for _ in range(args.repeats):
                    samples["local_ttft"].append(_in_process(model, ids, config, params)[0])
                    ttft, metrics = asyncio.run(_through_gateway(url, ids.tolist(), preset, args.new_tokens))
                    samples["up_ttft"].append(ttft)
                    samples["actor_prefill"].append(metrics["ttft_s"])
                record = _record(length, mode, samples, "up_ttft")
                medians = record["median_s"]
                report["results"].append(record | {"path_s": medians["up_ttft"] - medians["actor_prefill"]})
                print(f"{length} tokens, {mode}: done", flush=True)
    rows = [
        [
            r["tokens"],
            r["mode"],
            f"{r['median_s']['local_ttft']:.3f}",
            f"{r['median_s']['up_ttft']:.3f}",
            f"{r['ttft_ratio']:.3f}",
            f"{r['median_s']['actor_prefill']:.3f}",
            f"{r['path_s']:.3f}",
        ]
        for r in report["results"]
    ]
    header = ["tokens", "mode", "TTFT in-process s", "TTFT through up s", "up / in-process", "actor prefill s"]
    print(markdown_table(header + ["path s (up less actor prefill)"], rows))
    return write_report(args.out, report)


async def _through_gateway(url: str, ids: list[int], preset: str, max_tokens: int) -> tuple[float, dict]:
    """A streamed completion: (seconds to the first token, the response's metrics)."""
    import httpx

    from bench.common import completion_events, has_text

    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True, "pruning": preset}
    ttft, metrics = None, {}
    async with httpx.AsyncClient(timeout=600.0) as client:
        start = time.perf_counter()
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            async for data in completion_events(response):
                if ttft is None and has_text(data):
                    ttft = time.perf_counter() - start
                metrics = data.get("metrics") or metrics
    if ttft is None or not metrics:
        raise RuntimeError("the stream ended without a token or without metrics")
    return ttft, metrics


def _print_tables(results: list[dict]) -> None:
    mib = 2**20
    rows = []
    for r in results:
        m = r["median_s"]
        rows.append(
            [
                r["tokens"],
                r["mode"],
                f"{m['local_ttft']:.2f}",
                f"{m['disagg_ttft']:.2f}",
                f"{r['ttft_ratio']:.3f}",
                f"{m['local_total']:.2f}",
                f"{m['disagg_total']:.2f}",
                f"{r['total_ratio']:.3f}",
            ]
        )
    print(
        markdown_table(
            [
                "tokens",
                "mode",
                "TTFT in-process s",
                "TTFT disagg s",
                "disagg / in-process",
                "e2e in-process s",
                "e2e disagg s",
                "e2e ratio",
            ],
            rows,
        )
    )
    print()
    full = {r["tokens"]: r for r in results if r["mode"] == "full"}
    rows = []
    for r in results:
        bound = r["computed_fraction"] * r["full_kv_bytes"] + r["aux_bytes_sent"]
        sent_vs_full = r["bytes_sent"] / full[r["tokens"]]["bytes_sent"] if r["tokens"] in full else float("nan")
        rows.append(
            [
                r["tokens"],
                r["mode"],
                f"{r['computed_fraction']:.3f}",
                f"{r['full_kv_bytes'] / mib:.1f}",
                f"{r['kv_bytes_sent'] / mib:.1f}",
                f"{r['aux_bytes_sent'] / mib:.1f}",
                f"{r['bytes_sent'] / mib:.1f}",
                f"{r['bytes_sent'] / bound:.4f}",
                f"{sent_vs_full:.3f}",
                r["num_frames"],
            ]
        )
    print(
        markdown_table(
            [
                "tokens",
                "mode",
                "computed fraction",
                "full KV MiB",
                "KV sent MiB",
                "Aux sent MiB",
                "wire MiB",
                "wire / (fraction x full KV + Aux)",
                "wire / full's wire",
                "frames",
            ],
            rows,
        )
    )
