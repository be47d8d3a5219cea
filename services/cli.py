"""The `lazyserve` command: one entry point for batch runs, benchmarks and services."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from shared.compute import set_openmp_env
from shared.net.lifecycle import watch_lifeline


def _engine_settings(args):
    from shared.net.settings import EngineSettings

    return EngineSettings(**_engine_overrides(args))


def _load_llm(settings):
    from shared.api.llm import LLM
    from shared.models.weights import load_engine

    loaded = load_engine(settings)  # run-batch computes on this, its main and only thread
    from shared.engine import PrefixReuse

    prefix = PrefixReuse.configured(loaded.engine, loaded.name, settings)
    from shared.models.text import read_chat_template

    template = read_chat_template(settings.chat_template)
    return LLM(loaded, default_preset=settings.pruning_preset, prefix=prefix, chat_template=template)


def cmd_run_batch(args) -> int:
    from services.batch.runner import load_pruning_flag, run_batch

    pruning = load_pruning_flag(args.pruning)
    settings = _engine_settings(args)
    llm = _load_llm(settings)
    summary = run_batch(llm, Path(args.input), Path(args.output), pruning, progress=not args.quiet)
    print(f"{summary.succeeded} succeeded, {summary.failed} failed -> {args.output}", file=sys.stderr)
    if args.compare:
        from services.batch.compare import compare

        compare(llm, Path(args.input), summary)
    return 0


def _engine_overrides(args) -> dict:
    names = (
        "model",
        "threads",
        "dtype",
        "device",
        "enable_prefix_caching",
        "prefix_cache_bytes",
        "chat_template",
        "batch_invariant",
    )
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def _service_overrides(args, names: tuple[str, ...]) -> dict:
    overrides = {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}
    engine = _engine_overrides(args)
    if engine:
        from shared.net.settings import EngineSettings

        overrides["engine"] = EngineSettings(**engine)
    return overrides


def cmd_decode_worker(args) -> int:
    from services.decode.main import serve
    from services.decode.settings import DecodeSettings

    return serve(DecodeSettings(**_service_overrides(args, ("host", "port"))))


def cmd_prefill_worker(args) -> int:
    from services.prefill.main import serve
    from services.prefill.settings import PrefillSettings

    names = ("host", "port", "num_actors", "num_cpus", "num_gpus", "prefill_resource", "niceness")
    return serve(PrefillSettings(**_service_overrides(args, names)), args.ray_address)


def cmd_gateway(args) -> int:
    from services.router.main import serve
    from services.router.settings import GatewaySettings

    names = ("host", "port", "prefill_workers", "decode_workers", "routing", "local_threshold", "redis_url")
    return serve(GatewaySettings(**_service_overrides(args, names)))


def cmd_up(args) -> int:
    from services.up import UpOptions, up

    return up(
        UpOptions(
            model=args.model,
            host=args.host,
            port=args.port,
            decode_workers=args.decode_workers,
            decode_port=args.decode_port,
            prefill_actors=args.prefill_actors,
            prefill_port=args.prefill_port,
            threads=args.threads,
            dtype=args.dtype,
            enable_prefix_caching=args.enable_prefix_caching,
            batch_invariant=args.batch_invariant,
            prefix_cache_bytes=args.prefix_cache_bytes,
            local_threshold=args.local_threshold,
            pruning_preset=args.pruning,
            prefill_niceness=args.prefill_niceness,
            chat_template=args.chat_template,
            api_keys=args.api_key or [],
        )
    )


def cmd_certs(args) -> int:
    import shlex

    from shared.net.certs import DEFAULT_HOSTS, make_dev_certs

    paths = make_dev_certs(Path(args.out), args.host or list(DEFAULT_HOSTS), args.days)
    names = {"ca": "LAZYSERVE_TLS_CA", "cert": "LAZYSERVE_TLS_CERT", "key": "LAZYSERVE_TLS_KEY"}
    print("export " + " ".join(f"{names[role]}={shlex.quote(str(path.resolve()))}" for role, path in paths.items()))
    return 0


def cmd_health(args) -> int:
    from shared.net.rpc import check_health
    from shared.net.settings import InternalAuthSettings

    # The same LAZYSERVE_TLS_* / token environment as the worker: a probe under mutual TLS must
    # present the certificate too.
    healthy = check_health(args.address, args.timeout, args.service, InternalAuthSettings().internal_auth())
    print("SERVING" if healthy else "NOT SERVING", file=sys.stderr)
    return 0 if healthy else 1


def cmd_bench(args, rest: list[str]) -> int:
    import importlib

    module = importlib.import_module(f"bench.{args.name}")
    return module.main(rest)


NICENESS_HELP = (
    "the prefill actors' OS nice value, 0-19 (LAZYSERVE_PREFILL_NICENESS; default 0): higher gives a decode "
    "worker on the same host the cores first, so running streams slow less while a long prompt prefills"
)


def add_dtype_flag(parser: argparse.ArgumentParser) -> None:
    from shared.models.precision import DTYPE_CHOICES

    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=None,  # unset: the settings decide (LAZYSERVE_DTYPE, else auto)
        help="the model's dtype (LAZYSERVE_DTYPE; default auto: bfloat16 on CUDA and on CPUs with AMX or "
        "AVX512-BF16, float32 elsewhere)",
    )


def add_chat_template_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template for /v1/chat/completions, for a base model that has none or to replace "
        "the model's own (vLLM's flag; LAZYSERVE_CHAT_TEMPLATE)",
    )


def add_batch_invariant_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a token's numbers do not depend on what it is batched with, on a prefix hit or on the route "
        "(off by default; LAZYSERVE_BATCH_INVARIANT): prompts and decode steps run in calls of fixed "
        "shapes, which costs most where a call has few rows (docs/results.md)",
    )


def add_prefix_cache_flags(parser: argparse.ArgumentParser, budget: bool = True) -> None:
    """vLLM's flag pair: on unless turned off (LAZYSERVE_ENABLE_PREFIX_CACHING)."""
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse the shared layers of a prompt's cached start (on by default; LAZYSERVE_ENABLE_PREFIX_CACHING)",
    )
    if not budget:  # the gateway holds no cache: it only routes by the workers'
        return
    parser.add_argument(
        "--prefix-cache-bytes",
        default=None,
        help="memory each worker's prefix cache may hold, e.g. 2GiB (LAZYSERVE_PREFIX_CACHE_BYTES; default 2GiB)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazyserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    batch = sub.add_parser("run-batch", help="run an OpenAI Batch API JSONL file through the engine")
    batch.add_argument("-i", "--input", required=True)
    batch.add_argument("-o", "--output", required=True)
    batch.add_argument(
        "--pruning",
        default=None,
        help="a preset (off, default, fast, lazyllm) or FILE.json for every line; a body's own wins; "
        "without it, lines get the default preset (LAZYSERVE_PRUNING_PRESET, else 'default')",
    )
    batch.add_argument("--model", default=None, help="model name or local checkpoint folder")
    batch.add_argument("--threads", type=int, default=None)
    add_dtype_flag(batch)
    add_prefix_cache_flags(batch)
    add_batch_invariant_flag(batch)
    add_chat_template_flag(batch)
    batch.add_argument("--compare", action="store_true", help="also run unpruned and print both side by side")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")

    decode = sub.add_parser("decode-worker", help="serve the gRPC DecodeService (flags override LAZYSERVE_DECODE_*)")
    prefill = sub.add_parser("prefill-worker", help="start prefill actors on Ray (flags override LAZYSERVE_PREFILL_*)")
    for service in (decode, prefill):
        service.add_argument("--model", default=None, help="model name or local checkpoint folder")
        service.add_argument("--threads", type=int, default=None, help="torch threads (default: every core here)")
        add_dtype_flag(service)
        add_prefix_cache_flags(service)
        add_batch_invariant_flag(service)
        service.add_argument("--host", default=None)
        service.add_argument("--port", type=int, default=None, help="0 picks a free port")
    prefill.add_argument("--num-actors", type=int, default=None)
    prefill.add_argument("--num-cpus", type=float, default=None, help="Ray CPUs per actor")
    prefill.add_argument("--num-gpus", type=float, default=None, help="Ray GPUs per actor")
    prefill.add_argument(
        "--prefill-resource", type=float, default=None, help="units of the custom `prefill` resource per actor"
    )
    prefill.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray)")
    prefill.add_argument("--niceness", type=int, default=None, help=NICENESS_HELP)

    stack = sub.add_parser(
        "up", help="the whole system on this host: decode workers, prefill actors on a local Ray, the gateway"
    )
    stack.add_argument(
        "--model", default=None, help="SmolLM2-135M-Instruct (default), gemma-3-270m, a tiny-* model or a folder"
    )
    stack.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of each worker (default: every core of this host, shared by prefill and decode)",
    )
    add_dtype_flag(stack)
    add_prefix_cache_flags(stack)
    add_batch_invariant_flag(stack)
    add_chat_template_flag(stack)
    stack.add_argument("--host", default="127.0.0.1", help="the gateway's address (0.0.0.0: every interface)")
    stack.add_argument("--port", type=int, default=8000, help="the gateway's port")
    stack.add_argument("--api-key", action="append", default=None, help="an API key the gateway accepts (repeatable)")
    stack.add_argument("--decode-workers", type=int, default=1, help="decode worker processes")
    stack.add_argument("--decode-port", type=int, default=50061, help="the first decode worker's port (then +1 each)")
    stack.add_argument("--prefill-actors", type=int, default=1, help="prefill actors on the local Ray")
    stack.add_argument("--prefill-port", type=int, default=50071, help="the first prefill actor's port (then +1 each)")
    stack.add_argument(
        "--local-threshold", type=int, default=None, help="prompts shorter than this are prefilled on a decode worker"
    )
    stack.add_argument("--prefill-niceness", type=int, default=None, help=NICENESS_HELP)
    stack.add_argument(
        "--pruning",
        default=None,
        choices=["off", "default", "fast", "lazyllm"],
        help="the pruning preset of requests that name none (LAZYSERVE_PRUNING_PRESET; else 'default')",
    )

    gateway = sub.add_parser(
        "gateway", help="serve the OpenAI-compatible REST API (flags override LAZYSERVE_GATEWAY_*)"
    )
    gateway.add_argument("--model", default=None)
    gateway.add_argument("--threads", type=int, default=None)
    gateway.add_argument("--host", default=None)
    gateway.add_argument("--port", type=int, default=None)
    gateway.add_argument("--prefill-workers", default=None, help="static mode: comma-separated host:port list")
    gateway.add_argument("--decode-workers", default=None, help="static mode: comma-separated host:port list")
    gateway.add_argument("--routing", choices=["length", "round_robin"], default=None)
    gateway.add_argument(
        "--local-threshold", type=int, default=None, help="prompts shorter than this skip the transfer"
    )
    gateway.add_argument("--redis-url", default=None, help="registered workers and shared load in Redis")
    add_prefix_cache_flags(gateway, budget=False)
    add_chat_template_flag(gateway)

    certs = sub.add_parser("certs", help="write a development CA and certificate for mutual TLS between services")
    certs.add_argument("--out", default="certs", help="folder for ca.pem, cert.pem, key.pem")
    certs.add_argument(
        "--host",
        action="append",
        default=None,
        help="a DNS name or IP the certificate is valid for "
        "(repeatable; default: localhost, 127.0.0.1, lazyserve.internal)",
    )
    certs.add_argument("--days", type=int, default=365)

    probe = sub.add_parser(
        "health", help="grpc.health.v1 check of a worker (exit 0 when SERVING); uses LAZYSERVE_TLS_*"
    )
    probe.add_argument("address", help="host:port")
    probe.add_argument("--service", default="", help="a service name; default: the whole server")
    probe.add_argument("--timeout", type=float, default=2.0)

    bench = sub.add_parser(
        "bench",
        add_help=False,
        help="benchmarks: ttft, decode, step, disagg, serve, interference, prefix, threads, invariance "
        "(bench NAME --help: its flags)",
    )
    bench.add_argument(
        "name", choices=["ttft", "decode", "step", "disagg", "serve", "interference", "prefix", "threads", "invariance"]
    )

    sub.add_parser(
        "eval", add_help=False, help="the long-context accuracy suite under many pruning schedules (--help for flags)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    set_openmp_env()  # before torch loads; the processes `up` and Ray start inherit it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    watch_lifeline()  # started by `lazyserve up`: stop with it
    if args.command == "bench":
        return cmd_bench(args, rest)
    if args.command == "eval":
        from bench.evalsuite.harness import main as eval_main

        return eval_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    commands = {
        "run-batch": cmd_run_batch,
        "decode-worker": cmd_decode_worker,
        "prefill-worker": cmd_prefill_worker,
        "gateway": cmd_gateway,
        "up": cmd_up,
        "certs": cmd_certs,
        "health": cmd_health,
    }
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
