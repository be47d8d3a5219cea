"""The `lazyserve` command: one entry point for batch runs, benchmarks and services."""

from __future__ import annotations

import argparse
import logging
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from services.decode.settings import DecodeSettings
from services.options import Option, add_flags, build, engine_options, given
from services.prefill.settings import PrefillSettings
from services.router.settings import GatewaySettings
from services.up import UP_OPTIONS
from shared.compute import set_openmp_env
from shared.contract import PRESET_NAMES
from shared.net.lifecycle import watch_lifeline
from shared.settings import EngineSettings

# Which settings fields each command takes as flags (services.options makes the flags).
WORKER_ENGINE = engine_options(
    "model", "threads", "dtype", "enable_prefix_caching", "prefix_cache_bytes", "batch_invariant", "kernels"
)
SLO_OPTIONS = [Option(EngineSettings, "ttft_slo_s", "--ttft-slo"), Option(EngineSettings, "itl_slo_s", "--itl-slo")]
BATCH_OPTIONS = [*WORKER_ENGINE, *engine_options("chat_template")]
DECODE_OPTIONS = [
    *WORKER_ENGINE,
    *SLO_OPTIONS,
    *(Option(DecodeSettings, field) for field in ("host", "port", "prefill_growth", "drain_seconds")),
]
PREFILL_OPTIONS = [
    *WORKER_ENGINE,
    *(Option(PrefillSettings, field) for field in ("host", "port", "num_actors", "num_cpus", "num_gpus")),
    Option(PrefillSettings, "prefill_resource"),
    Option(PrefillSettings, "niceness"),
]
GATEWAY_OPTIONS = [
    *engine_options("model", "threads", "enable_prefix_caching", "chat_template"),
    *SLO_OPTIONS,
    *(Option(GatewaySettings, field) for field in ("host", "port", "prefill_workers", "decode_workers")),
    *(Option(GatewaySettings, field) for field in ("routing", "local_threshold", "route_by_wait", "redis_url")),
    *(Option(GatewaySettings, field) for field in ("migration_limit", "migration_max_tokens", "migration_wait_s")),
]


def _load_llm(settings):
    from shared.api.llm import LLM
    from shared.engine import PrefixReuse
    from shared.models.text import read_chat_template
    from shared.models.weights import load_engine

    loaded = load_engine(settings)  # run-batch computes on this, its main and only thread
    prefix = PrefixReuse.configured(loaded.engine, loaded.name, settings)
    template = read_chat_template(settings.chat_template)
    return LLM(loaded, default_preset=settings.pruning_preset, prefix=prefix, chat_template=template)


def cmd_run_batch(args) -> int:
    from services.batch.runner import load_pruning_flag, run_batch

    pruning = load_pruning_flag(args.pruning)
    llm = _load_llm(build(EngineSettings, args, BATCH_OPTIONS))
    summary = run_batch(llm, Path(args.input), Path(args.output), pruning, progress=not args.quiet)
    print(f"{summary.succeeded} succeeded, {summary.failed} failed -> {args.output}", file=sys.stderr)
    if args.compare:
        from services.batch.compare import compare

        compare(llm, Path(args.input), summary)
    return 0


def cmd_decode_worker(args) -> int:
    from services.decode.main import serve

    return serve(build(DecodeSettings, args, DECODE_OPTIONS))


def cmd_prefill_worker(args) -> int:
    from services.prefill.main import serve

    return serve(build(PrefillSettings, args, PREFILL_OPTIONS), args.ray_address)


def cmd_gateway(args) -> int:
    from services.router.main import serve

    return serve(build(GatewaySettings, args, GATEWAY_OPTIONS))


def cmd_up(args) -> int:
    from services.up import up

    return up(given(args, UP_OPTIONS))


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


def cmd_models(args) -> int:
    """Convert the installed bundled models once (make setup runs it); list where each lives."""
    from shared.models.catalog import prepare_bundled_models

    for name, where in prepare_bundled_models().items():
        print(f"{name}: {where}")
    return 0


def plugins(group: str) -> dict[str, EntryPoint]:
    """Commands another package adds (pyproject's entry points): `lazyserve bench NAME` runs the
    `lazyserve.bench` table's NAME, `lazyserve eval` the `lazyserve.commands` table's; the CLI
    never imports them itself."""
    return {entry.name: entry for entry in entry_points(group=group)}


class _Version(argparse.Action):
    """--version: the package, torch, and which kernels a decode step runs here (and why)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="show the versions and the decode kernels, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        import torch

        from shared import kernels

        print(f"lazyserve {version('lazyserve')}, torch {torch.__version__}, kernels {kernels.status().describe()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazyserve", description=__doc__)
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)

    batch = sub.add_parser("run-batch", help="run an OpenAI Batch API JSONL file through the engine")
    batch.add_argument("-i", "--input", required=True)
    batch.add_argument("-o", "--output", required=True)
    batch.add_argument(
        "--pruning",
        default=None,
        help=f"a preset ({', '.join(PRESET_NAMES)}) or FILE.json for every line; a body's own wins; "
        "without it, lines get the default preset (LAZYSERVE_PRUNING_PRESET, else 'default')",
    )
    add_flags(batch, BATCH_OPTIONS)
    batch.add_argument("--compare", action="store_true", help="also run unpruned and print both side by side")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")

    decode = sub.add_parser("decode-worker", help="serve the gRPC DecodeService (flags override LAZYSERVE_DECODE_*)")
    add_flags(decode, DECODE_OPTIONS)
    prefill = sub.add_parser("prefill-worker", help="start prefill actors on Ray (flags override LAZYSERVE_PREFILL_*)")
    add_flags(prefill, PREFILL_OPTIONS)
    prefill.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray)")

    stack = sub.add_parser(
        "up", help="the whole system on this host: decode workers, prefill actors on a local Ray, the gateway"
    )
    add_flags(stack, UP_OPTIONS)

    gateway = sub.add_parser(
        "gateway", help="serve the OpenAI-compatible REST API (flags override LAZYSERVE_GATEWAY_*)"
    )
    add_flags(gateway, GATEWAY_OPTIONS)

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

    sub.add_parser("models", help="convert the installed bundled models once into the cache and list them")

    benches = sorted(plugins("lazyserve.bench"))
    bench = sub.add_parser(
        "bench", add_help=False, help=f"benchmarks: {', '.join(benches)} (bench NAME --help: its flags)"
    )
    bench.add_argument("name", choices=benches)
    for name, entry in sorted(plugins("lazyserve.commands").items()):
        sub.add_parser(name, add_help=False, help=f"{entry.value} (--help for its flags)")
    return parser


def main(argv: list[str] | None = None) -> int:
    set_openmp_env()  # before torch loads; the processes `up` and Ray start inherit it
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    watch_lifeline()  # started by `lazyserve up`: stop with it
    if args.command == "bench":
        return plugins("lazyserve.bench")[args.name].load()(rest)
    commands = plugins("lazyserve.commands")
    if args.command in commands:
        return commands[args.command].load()(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    handlers = {
        "run-batch": cmd_run_batch,
        "decode-worker": cmd_decode_worker,
        "prefill-worker": cmd_prefill_worker,
        "gateway": cmd_gateway,
        "up": cmd_up,
        "certs": cmd_certs,
        "health": cmd_health,
        "models": cmd_models,
    }
    return handlers[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
