"""`lazyserve eval`: the suite through run-batch's code path, for many pruning configurations.

Every case runs unpruned first (its output is the reference for fidelity and summaries), then under
each configuration. Outputs: results JSON with every record, a markdown table, and a PNG of TTFT
speedup against accuracy, one panel per prompt length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from bench.common import machine, markdown_table
from bench.evalsuite import scorers
from bench.evalsuite.tasks import TASKS, make_suite

# Candidate schedules on a 30-layer model: (layer, keep) after 0-based layer.
SCHEDULES = {
    "default": "default",
    "gentle": {"stages": [[8, 0.6], [16, 0.4], [22, 0.25]]},
    "late": {"stages": [[12, 0.4], [18, 0.2]]},
    "mid": {"stages": [[5, 0.5], [11, 0.3], [17, 0.15]]},
    "aggressive": {"stages": [[2, 0.3], [6, 0.15], [10, 0.08]]},
    "mid-sinks": {"stages": [[5, 0.5], [11, 0.3], [17, 0.15]], "sink_tokens": 4},
    "mid-block": {"stages": [[5, 0.5], [11, 0.3], [17, 0.15]], "granularity": "block", "block_size": 16},
    "mid-static": {"stages": [[5, 0.5], [11, 0.3], [17, 0.15]], "mode": "static"},
    "mid-random": {"stages": [[5, 0.5], [11, 0.3], [17, 0.15]], "mode": "random"},
}
QUICK_CONFIGS = ("default", "mid-static", "mid-random")
QUICK_TASKS = ("passkey", "multikey", "fewshot")


def run_case(llm, case, configs: dict) -> list[dict]:
    from shared.serving import choice_text, respond

    records = []
    full = respond(llm, case.url, case.body() | {"pruning": "off"}).model_dump()
    full_text = choice_text(full)
    full_tokens = llm.tokenizer(full_text, add_special_tokens=False).input_ids
    for name, pruning in {"off": "off", **configs}.items():
        body = full if name == "off" else respond(llm, case.url, case.body() | {"pruning": pruning}).model_dump()
        text = choice_text(body)
        tokens = llm.tokenizer(text, add_special_tokens=False).input_ids
        records.append(
            {
                "case": case.id,
                "task": case.task,
                "split": case.split,
                "tokens": body["usage"]["prompt_tokens"],
                "target_tokens": case.target_tokens,
                "depth": case.depth,
                "config": name,
                "ttft_s": body["metrics"]["ttft_s"],
                "ttft_full_s": full["metrics"]["ttft_s"],
                "computed_fraction": body["metrics"]["computed_fraction"],
                "score": scorers.score(case.scorer, text, case.answer, case.labels, full_text),
                "fidelity": scorers.prefix_agreement(tokens, full_tokens),
                "output": text,
            }
        )
    return records


def summarize(records: list[dict]) -> list[dict]:
    """Per (length, config): accuracy = mean over tasks of each task's mean score; speedup = median TTFT ratio."""
    rows = []
    keys = sorted({(r["target_tokens"], r["config"]) for r in records})
    for length, config in keys:
        mine = [r for r in records if r["target_tokens"] == length and r["config"] == config]
        tasks = sorted({r["task"] for r in mine})
        per_task = {t: statistics.mean(r["score"] for r in mine if r["task"] == t) for t in tasks}
        rows.append(
            {
                "length": length,
                "config": config,
                "cases": len(mine),
                "accuracy": statistics.mean(per_task.values()),
                "per_task": per_task,
                "fidelity": statistics.mean(r["fidelity"] for r in mine),
                "ttft_speedup": statistics.median(r["ttft_full_s"] / r["ttft_s"] for r in mine),
                "ttft_s": statistics.median(r["ttft_s"] for r in mine),
                "computed_fraction": statistics.mean(r["computed_fraction"] for r in mine),
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    tasks = sorted({t for row in rows for t in row["per_task"]})
    body = []
    for row in rows:
        off = next(r for r in rows if r["length"] == row["length"] and r["config"] == "off")
        body.append(
            [row["length"], row["config"], f"{row['ttft_speedup']:.2f}x", f"{row['computed_fraction']:.2f}",
             f"{100 * row['accuracy']:.1f}", f"{100 * (row['accuracy'] - off['accuracy']):+.1f}",
             f"{100 * row['fidelity']:.0f}"]
            + [f"{100 * row['per_task'].get(t, float('nan')):.0f}" for t in tasks]
        )
    header = ["tokens", "config", "TTFT speedup", "computed", "accuracy %", "vs off (pp)", "fidelity %"] + tasks
    return markdown_table(header, body)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({row["length"] for row in rows})
    figure, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4.2), squeeze=False)
    for axis, length in zip(axes[0], lengths):
        for row in (r for r in rows if r["length"] == length):
            axis.scatter(100 * row["accuracy"], row["ttft_speedup"], color="black" if row["config"] == "off" else None)
            axis.annotate(row["config"], (100 * row["accuracy"], row["ttft_speedup"]), fontsize=7,
                          xytext=(3, 3), textcoords="offset points")
        axis.set_title(f"{length} prompt tokens")
        axis.set_xlabel("accuracy (%)")
        axis.set_ylabel("TTFT speedup over unpruned (x)")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lazyserve eval", description=__doc__)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 6144])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    parser.add_argument("--configs", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--split", choices=["dev", "test"], default="dev")
    parser.add_argument("--limit", type=int, default=1, help="cases per (task, length)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1k tokens, 3 tasks, 4 configs: a few minutes")
    parser.add_argument("--out", default="out/eval")
    args = parser.parse_args(argv)
    if args.quick:
        args.lengths, args.tasks, args.configs, args.limit = [1024], list(QUICK_TASKS), list(QUICK_CONFIGS), 1

    import torch

    from shared.llm import LLM
    from shared.models import load_model

    torch.set_num_threads(args.threads)
    llm = LLM(load_model(args.model))
    configs = {name: SCHEDULES[name] for name in args.configs}
    cases = make_suite(llm.tokenizer, args.tasks, args.lengths, args.split, args.limit)
    records, start = [], time.time()
    for case in tqdm(cases, desc="eval", unit="case"):
        records.extend(run_case(llm, case, configs))
    rows = summarize(records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = vars(args) | {"default_schedule": llm.default_pruning.model_dump(), "seconds": time.time() - start}
    (out / "results.json").write_text(json.dumps({"settings": settings, "machine": machine(), "summary": rows,
                                                   "records": records}, indent=2))
    markdown = table(rows)
    (out / "table.md").write_text(markdown + "\n")
    plot(rows, out / "speed_accuracy.png")
    print(markdown)
    print(f"\nwrote {out}/results.json, table.md, speed_accuracy.png in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
