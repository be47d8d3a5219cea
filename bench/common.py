"""Helpers the benchmarks share: real long text, tables, JSON output."""

from __future__ import annotations

import json
import platform
import time
from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=1)
def reference_text() -> str:
    """The Python language reference that CPython ships: about 465k characters of English prose."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def long_text_ids(tokenizer, length: int, vocab_size: int | None = None) -> torch.Tensor:
    """The first `length` tokens of the reference text (real prose, not random ids).

    A model without a tokenizer (a random-weight model on a machine where the bundled one is not
    installed) gets seeded random ids below `vocab_size` instead: its timings do not depend on the text."""
    if tokenizer is None:
        assert vocab_size is not None, "a model without a tokenizer needs vocab_size"
        return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    ids = tokenizer(reference_text()).input_ids
    assert len(ids) >= length, f"reference text has only {len(ids)} tokens"
    return torch.tensor(ids[:length])


def add_dtypes_argument(parser, help_text: str) -> None:
    """--dtypes: the dtypes a benchmark runs side by side in one run, float32 first (the anchor)."""
    from shared.models.precision import DTYPE_CHOICES

    parser.add_argument("--dtypes", nargs="+", choices=DTYPE_CHOICES, default=["float32", "bfloat16"], help=help_text)


async def sse_events(response):
    """Each `data:` event of a streamed completion (an httpx response), parsed, until [DONE]."""
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


async def completion_events(response):
    """sse_events of a streamed completion that must not fail: an error event raises with its message."""
    response.raise_for_status()
    async for data in sse_events(response):
        if "error" in data:
            raise RuntimeError(data["error"]["message"])
        yield data


def has_text(data: dict) -> bool:
    """Whether a streamed completion's event carries text (a token the client sees)."""
    return bool(data["choices"] and data["choices"][0]["text"])


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict:
    """What a figure was measured on: the CPU with the flags that decide `--dtype auto`, the GPU if any."""
    from shared.models.precision import CpuFeatures
    from shared.settings import available_cores

    cpu = CpuFeatures.detect()
    report = {
        "cpu": cpu.model_name or platform.processor() or platform.machine(),
        "cpu_flags": list(cpu.flags),
        "native_bfloat16": cpu.native_bfloat16,
        "cores": available_cores(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    return report


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report | {"machine": machine()}, indent=2))


def write_report(out: str, report: dict) -> int:
    """A benchmark's last step: its report (with the machine) to `out`; its exit status."""
    write_json(Path(out), report)
    print(f"\nwrote {out}")
    return 0


def runs_per_dtype(args, bench_dtype) -> list[dict]:
    """bench_dtype(args, dtype, compute) for each of args.kernels and each of args.dtypes, all on
    one ComputeThread with args.threads torch threads, as a worker computes (shared.compute says
    why). Each run is labelled with the kernels that ran it (its "kernels" and "label")."""
    from shared.compute import ComputeThread

    compute = ComputeThread("bench-compute")
    paths = each_kernels(args.kernels, compute.call)
    try:
        compute.call(torch.set_num_threads, args.threads)
        runs = []
        for path in paths:
            for dtype in args.dtypes:
                run = bench_dtype(args, dtype, compute)
                runs.append(run | {"kernels": path, "label": f"{run['dtype']}, {path} kernels"})
        return runs
    finally:
        paths.close()  # puts the kernels back, while the compute thread still runs
        compute.close()


def each_kernels(names: list[str], call=lambda fn, *args: fn(*args)):
    """For each kernel path named, select it (through `call`: on the compute thread where there
    is one) and yield what runs ("native (avx512)", "torch (why)"); the path found before is put
    back afterwards, since a test's process goes on."""
    from shared import kernels

    before = kernels.status().path
    try:
        for name in names:
            yield call(kernels.select, name).describe()
    finally:
        call(kernels.select, before)


def add_decode_workload_arguments(parser, concurrency: list[int], repeats: int, tokens: int | None = None) -> None:
    """What the decode benchmarks share: the model, prompts, sequence counts, the configurations
    (presets, and --schedule NAME=JSON as the eval takes it, repeatable), repeats and threads; and
    with `tokens`, how many each sequence decodes."""
    if tokens is not None:
        parser.add_argument("--tokens", type=int, default=tokens, help="decode tokens per sequence and run")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--prompt", type=int, default=2048, help="prompt tokens per sequence")
    parser.add_argument("--concurrency", type=int, nargs="+", default=concurrency)
    parser.add_argument("--presets", nargs="+", default=["off", "default"])
    parser.add_argument("--schedule", action="append", default=[], metavar="NAME=JSON", help="an extra configuration")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--kernels",
        nargs="+",
        choices=["native", "torch"],
        default=["native", "torch"],
        help="the decode step's kernels, each side by side (shared/kernels)",
    )


def schedule_configs(schedules: list[str], spec) -> dict:
    """name -> PruneConfig for each NAME=JSON schedule given on a command line, checked against
    the model (spec: ModelSpec)."""
    from shared.contract import PruneConfig

    configs = {}
    for item in schedules:
        name, _, body = item.partition("=")
        configs[name] = spec.check(PruneConfig.model_validate_json(body))
    return configs


def pruning_configs(presets: list[str], schedules: list[str], spec) -> dict:
    """name -> PruneConfig: the named presets fitted to the model (spec: ModelSpec), then each
    NAME=JSON schedule."""
    return {name: spec.preset(name) for name in presets} | schedule_configs(schedules, spec)


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """This host's read bandwidth in bytes/s at torch's thread count: the median time of a sum over
    a buffer too large for any cache (what a decode step's weights and K/V reads are bounded by)."""
    buffer = torch.ones(megabytes << 18)  # float32: megabytes MiB
    buffer.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - start)
    return buffer.numel() * buffer.element_size() / sorted(times)[len(times) // 2]


def step_bytes(model, caches) -> dict:
    """What one decode step of `caches` must read at the least: every weight once (a tied
    embedding counted once: the LM head reads it) and every K/V row each cache holds."""
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in model.hf.parameters()}
    kv = sum(cache.kv_bytes for cache in caches)
    return {"weights": sum(weights.values()), "kv": kv, "total": sum(weights.values()) + kv}
