"""The `lazyserve` command: one entry point for batch runs, benchmarks and services."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _engine_settings(args):
    from shared.settings import EngineSettings

    overrides = {k: v for k, v in (("model", args.model), ("threads", args.threads)) if v is not None}
    settings = EngineSettings(**overrides)
    settings.apply_threads()
    return settings


def _load_llm(settings):
    from shared.llm import LLM
    from shared.models import load_model

    return LLM(load_model(settings.model, device=settings.device, dtype=settings.dtype, cache_dir=settings.cache_dir))


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


def cmd_bench(args, rest: list[str]) -> int:
    import importlib

    module = importlib.import_module(f"bench.{args.name}")
    return module.main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazyserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    batch = sub.add_parser("run-batch", help="run an OpenAI Batch API JSONL file through the engine")
    batch.add_argument("-i", "--input", required=True)
    batch.add_argument("-o", "--output", required=True)
    batch.add_argument("--pruning", default="default", help="off | default | FILE.json (a body's own wins)")
    batch.add_argument("--model", default=None, help="model name or local checkpoint folder")
    batch.add_argument("--threads", type=int, default=None)
    batch.add_argument("--compare", action="store_true", help="also run unpruned and print both side by side")
    batch.add_argument("--quiet", action="store_true", help="no progress bar")

    bench = sub.add_parser("bench", add_help=False, help="benchmarks: ttft (lazyserve bench ttft --help for flags)")
    bench.add_argument("name", choices=["ttft"])

    sub.add_parser("eval", add_help=False, help="the long-context accuracy suite under many pruning schedules (--help for flags)")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        return cmd_bench(args, rest)
    if args.command == "eval":
        from bench.evalsuite.harness import main as eval_main

        return eval_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return cmd_run_batch(args)


if __name__ == "__main__":
    sys.exit(main())
