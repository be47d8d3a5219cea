"""`lazyserve eval`: fidelity to the unpruned model and retained accuracy, per pruning configuration.

Every case runs unpruned once (the reference: first-token distribution, a 32-token greedy
continuation with its distributions); each configuration is then compared with it on the same
case (bench/evalsuite/fidelity.py). Per (length, configuration): first-token top-1 agreement and
KL, teacher-forced agreement and KL, greedy prefix match, the paired accuracy difference on the
answer-bearing tasks, the share of the unpruned model's solved cases still solved, code and
summary fidelity, each with a 95% bootstrap interval over cases; TTFT speedup and the time each
configuration took. Outputs: results JSON with every record, a markdown table, and a PNG of TTFT
speedup against retained accuracy and against teacher-forced agreement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from bench.common import machine, markdown_table, schedule_configs
from bench.evalsuite import fidelity, scorers
from bench.evalsuite.intervals import mean_ci, paired_difference_ci
from bench.evalsuite.tasks import ANSWER_TASKS, DEFAULT_TASKS, TASKS, make_suite
from shared.models.precision import DTYPE_CHOICES, resolve_dtype

# Schedules to compare besides the presets, on a 30-layer model: (layer, keep) after 0-based layer.
SCHEDULES = {
    "late": {"stages": [[12, 0.4], [18, 0.2]]},
    "mid": {"stages": [[5, 0.5], [11, 0.3], [17, 0.15]]},
    "mid-static": {"stages": [[5, 0.5], [11, 0.3], [17, 0.15]], "mode": "static"},
    "mid-random": {"stages": [[5, 0.5], [11, 0.3], [17, 0.15]], "mode": "random"},
    "mid-block": {"stages": [[5, 0.5], [11, 0.3], [17, 0.15]], "granularity": "block", "block_size": 16},
}
QUICK_CONFIGS = ("default", "fast")
QUICK_TASKS = ("passkey", "fewshot")
# Above the presets' min_prompt_tokens (1024), so that they prune.
QUICK_LENGTH = 1536


def resolve_configs(names: list[str], extra: list[str], llm) -> dict:
    """name -> PruneConfig for presets, the named schedules above and NAME=JSON schedules."""
    from shared.engine import PruneConfig

    configs = {}
    for name in names:
        if name in SCHEDULES:
            configs[name] = llm.spec.check(PruneConfig(**SCHEDULES[name]))
        else:
            configs[name] = llm.resolve_pruning(name)
    return configs | schedule_configs(extra, llm.spec)


def case_ids(llm, case) -> list[int]:
    # A base model (no chat template) reads a chat case's message as a plain prompt.
    if case.url == "/v1/completions" or not llm.has_chat_template:
        return llm.prompt_ids(case.content)
    return llm.chat_ids([{"role": "user", "content": case.content}])


def run_case(llm, case, configs: dict, runner=None, label: str = "") -> list[dict]:
    """Records of one case: the unpruned reference as "off", then every configuration against it.

    runner: the LLM the configurations run on when it differs from the reference's (another
    dtype); its records are named NAME + label ("default@bfloat16"), its "off" included."""
    runner = runner or llm
    model, stops = llm.engine, tuple(llm.stop_token_ids)
    ids = case_ids(llm, case)
    ref = fidelity.reference(model, ids, stops)
    ref_tokens = [t for t in ref.tokens[: case.max_tokens] if t not in stops]
    ref_text = llm.tokenizer.decode(ref_tokens, skip_special_tokens=True)
    ref_score = scorers.score(case.scorer, ref_text, case.answer, case.labels, ref_text)
    base = {
        "case": case.id,
        "task": case.task,
        "split": case.split,
        "tokens": len(ids),
        "target_tokens": case.target_tokens,
        "depth": case.depth,
        "ttft_full_s": ref.ttft_s,
        "ref_score": ref_score,
        "ref_output": ref_text,
    }
    records = [
        base
        | {
            "config": "off",
            "ttft_s": ref.ttft_s,
            "seconds": ref.ttft_s,
            "score": ref_score,
            "first_kl": 0.0,
            "first_top1": 1.0,
            "teacher_top1": 1.0,
            "teacher_kl": 0.0,
            "prefix_match": 1.0,
            "computed_fraction": 1.0,
            "revived_token_layers": 0,
            "output": ref_text,
        }
    ]
    for name, config in configs.items():
        if name == "off" and runner is llm:
            continue
        run = fidelity.run(runner.engine, ids, config, ref, case.max_tokens, stops)
        text = llm.tokenizer.decode(run.tokens, skip_special_tokens=True)
        records.append(
            base
            | {
                "config": name + label,
                "ttft_s": run.ttft_s,
                "seconds": run.seconds,
                "score": scorers.score(case.scorer, text, case.answer, case.labels, ref_text),
                "first_kl": run.first_kl,
                "first_top1": run.first_top1,
                "teacher_top1": run.teacher_top1,
                "teacher_kl": run.teacher_kl,
                "prefix_match": run.prefix_match,
                "computed_fraction": run.computed_fraction,
                "revived_token_layers": run.revived_token_layers,
                "output": text,
            }
        )
    return records


def summarize(records: list[dict]) -> list[dict]:
    """Per (length, config): fidelity means, paired accuracy differences and intervals, speed."""
    rows = []
    for length, config in sorted({(r["target_tokens"], r["config"]) for r in records}):
        mine = [r for r in records if r["target_tokens"] == length and r["config"] == config]
        answers = [r for r in mine if r["task"] in ANSWER_TASKS]
        solved = [r for r in answers if r["ref_score"] == 1.0]
        code = [r for r in mine if r["task"] == "code"]
        summary = [r for r in mine if r["task"] == "summary"]
        rows.append(
            {
                "length": length,
                "config": config,
                "cases": len(mine),
                "answer_cases": len(answers),
                "solved_cases": len(solved),
                "first_top1": mean_ci(r["first_top1"] for r in mine),
                "first_kl": statistics.mean(r["first_kl"] for r in mine),
                "teacher_top1": mean_ci(r["teacher_top1"] for r in mine),
                "teacher_kl": statistics.mean(r["teacher_kl"] for r in mine),
                "prefix_match": statistics.mean(r["prefix_match"] for r in mine),
                "accuracy": mean_ci(r["score"] for r in answers),
                "same_answer": mean_ci(scorers.same_answer(r["output"], r["ref_output"]) for r in answers),
                "accuracy_delta": paired_difference_ci(
                    [r["score"] for r in answers], [r["ref_score"] for r in answers]
                ),
                "retained": mean_ci(r["score"] for r in solved),
                "code_delta": paired_difference_ci([r["score"] for r in code], [r["ref_score"] for r in code]),
                "summary_rouge": mean_ci(r["score"] for r in summary),
                "per_task": {
                    t: statistics.mean(r["score"] for r in mine if r["task"] == t)
                    for t in sorted({r["task"] for r in mine})
                },
                "ttft_speedup": statistics.median(r["ttft_full_s"] / r["ttft_s"] for r in mine),
                "ttft_s": statistics.median(r["ttft_s"] for r in mine),
                "computed_fraction": statistics.mean(r["computed_fraction"] for r in mine),
                "revived_token_layers": statistics.mean(r["revived_token_layers"] for r in mine),
                "seconds": sum(r["seconds"] for r in mine),
            }
        )
    return rows


def task_rows(records: list[dict]) -> list[dict]:
    """Per (length, config, task): what the headline row pools. Answer tasks: the cases the
    unpruned model solves and how many of those this configuration still solves; every task: the
    paired score difference and first-token agreement."""
    rows = []
    for length, config, task in sorted({(r["target_tokens"], r["config"], r["task"]) for r in records}):
        mine = [r for r in records if (r["target_tokens"], r["config"], r["task"]) == (length, config, task)]
        solved = [r for r in mine if r["ref_score"] == 1.0] if task in ANSWER_TASKS else []
        rows.append(
            {
                "length": length,
                "config": config,
                "task": task,
                "cases": len(mine),
                "solved_by_off": len(solved),
                "still_solved": sum(r["score"] == 1.0 for r in solved),
                "score_delta": paired_difference_ci([r["score"] for r in mine], [r["ref_score"] for r in mine]),
                "same_answer": mean_ci(
                    scorers.same_answer(r["output"], r["ref_output"]) for r in (mine if task in ANSWER_TASKS else ())
                ),
                "first_top1": mean_ci(r["first_top1"] for r in mine),
                "teacher_top1": mean_ci(r["teacher_top1"] for r in mine),
            }
        )
    return rows


def _pct(triple) -> str:
    mean, low, high = triple
    return "n/a" if mean != mean else f"{100 * mean:.1f} [{100 * low:.1f}, {100 * high:.1f}]"


def _pp(triple) -> str:
    mean, low, high = triple
    return "n/a" if mean != mean else f"{100 * mean:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


def _columns(rows: list[dict], columns: list[tuple[str, Callable[[dict], object]]]) -> str:
    """A markdown table of `rows`, one (header, cell of a row) pair per column."""
    return markdown_table([name for name, _ in columns], [[cell(row) for _, cell in columns] for row in rows])


def _solved(key: str) -> Callable[[dict], object]:
    return lambda row: row[key] if row["task"] in ANSWER_TASKS else "n/a"


SUMMARY_COLUMNS = [
    ("tokens", lambda row: row["length"]),
    ("config", lambda row: row["config"]),
    ("cases", lambda row: row["cases"]),
    ("TTFT speedup", lambda row: f"{row['ttft_speedup']:.2f}x"),
    ("computed", lambda row: f"{row['computed_fraction']:.2f}"),
    ("first-token top-1 %", lambda row: _pct(row["first_top1"])),
    ("first KL", lambda row: f"{row['first_kl']:.3f}"),
    ("teacher-forced top-1 %", lambda row: _pct(row["teacher_top1"])),
    ("teacher KL", lambda row: f"{row['teacher_kl']:.3f}"),
    ("prefix match %", lambda row: f"{100 * row['prefix_match']:.0f}"),
    ("same answer %", lambda row: _pct(row["same_answer"])),
    ("accuracy vs off (pp)", lambda row: _pp(row["accuracy_delta"])),
    ("retained % (solved)", lambda row: f"{_pct(row['retained'])} of {row['solved_cases']}"),
    ("code vs off (pp)", lambda row: _pp(row["code_delta"])),
    ("summary ROUGE-L %", lambda row: _pct(row["summary_rouge"])),
    ("seconds", lambda row: f"{row['seconds']:.0f}"),
]
TASK_COLUMNS = [
    ("tokens", lambda row: row["length"]),
    ("config", lambda row: row["config"]),
    ("task", lambda row: row["task"]),
    ("cases", lambda row: row["cases"]),
    ("solved unpruned", _solved("solved_by_off")),
    ("still solved", _solved("still_solved")),
    ("same answer %", lambda row: _pct(row["same_answer"])),
    ("score vs off (pp)", lambda row: _pp(row["score_delta"])),
    ("first-token top-1 %", lambda row: _pct(row["first_top1"])),
    ("teacher-forced top-1 %", lambda row: _pct(row["teacher_top1"])),
]


def table(rows: list[dict]) -> str:
    return _columns(rows, SUMMARY_COLUMNS)


def task_table(rows: list[dict]) -> str:
    return _columns(rows, TASK_COLUMNS)


def load_runs(directories: list[str]) -> tuple[list[dict], dict]:
    """The records of earlier runs (each DIR/results.json), pooled for one report, and the
    configuration each name stood for. Runs split by task or length pool into the table one run
    of them all would give, since every record is a case paired with its own unpruned reference.
    A (case, config) in two runs, or a name that stood for two configurations, is refused."""
    records, resolved, seen = [], {}, set()
    for directory in directories:
        data = json.loads((Path(directory) / "results.json").read_text())
        for name, config in data["settings"]["resolved"].items():
            if resolved.setdefault(name, config) != config:
                raise ValueError(f"{directory}: configuration {name!r} differs from an earlier run's")
        for record in data["records"]:
            key = (record["case"], record["config"])
            if key in seen:
                raise ValueError(f"{directory}: case {key[0]} under {key[1]!r} is also in an earlier run")
            seen.add(key)
            records.append(record)
    return records, resolved


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({row["length"] for row in rows})
    panels = (
        ("accuracy_delta", "accuracy vs unpruned (pp, answer tasks)"),
        ("teacher_top1", "teacher-forced top-1 agreement (%)"),
    )
    figure, axes = plt.subplots(len(panels), len(lengths), figsize=(5 * len(lengths), 8), squeeze=False)
    for column, length in enumerate(lengths):
        for line, (key, label) in enumerate(panels):
            axis = axes[line][column]
            for row in (r for r in rows if r["length"] == length):
                mean, low, high = (100 * value for value in row[key])
                if mean != mean:
                    continue
                axis.errorbar(
                    mean,
                    row["ttft_speedup"],
                    xerr=[[mean - low], [high - mean]],
                    fmt="o",
                    capsize=3,
                    color="black" if row["config"] == "off" else None,
                )
                axis.annotate(
                    row["config"], (mean, row["ttft_speedup"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
                )
            axis.set_title(f"{length} prompt tokens")
            axis.set_xlabel(label)
            axis.set_ylabel("TTFT speedup over unpruned (x)")
            axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def _names(values: list[str]) -> list[str]:
    return [name for value in values for name in value.split(",") if name]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lazyserve eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help=f"from {', '.join(TASKS)}")
    parser.add_argument(
        "--configs",
        nargs="+",
        default=["off", "default", "fast"],
        help=f"presets or {', '.join(SCHEDULES)}; commas or spaces",
    )
    parser.add_argument(
        "--schedule",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an extra configuration, a PruneConfig as JSON (repeatable)",
    )
    parser.add_argument("--split", choices=["dev", "test"], default="dev")
    parser.add_argument("--limit", type=int, default=30, help="cases per (task, length)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="the configurations' dtype (auto: bfloat16 where the CPU computes it, else float32)",
    )
    parser.add_argument(
        "--reference-dtype",
        choices=DTYPE_CHOICES,
        default="float32",
        help="the unpruned reference's dtype; when --dtype differs, every configuration (off included) "
        "runs at --dtype and is named NAME@DTYPE",
    )
    parser.add_argument("--quick", action="store_true", help="1.5k tokens, 2 tasks, 3 cases each: under 5 minutes")
    parser.add_argument("--out", default="out/eval")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        help="run nothing: pool the records of earlier runs (DIR/results.json) into one report",
    )
    args = parser.parse_args(argv)
    args.configs, args.tasks = _names(args.configs), _names(args.tasks)
    if unknown := set(args.tasks) - set(TASKS):
        parser.error(f"unknown tasks {sorted(unknown)}; choose from {', '.join(TASKS)}")
    if args.quick:
        args.lengths, args.tasks, args.configs, args.limit = (
            [QUICK_LENGTH],
            list(QUICK_TASKS),
            ["off", *QUICK_CONFIGS],
            3,
        )

    if args.merge:
        try:
            records, resolved = load_runs(args.merge)
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"--merge: {error}")
        write_report(Path(args.out), records, vars(args) | {"resolved": resolved, "seconds": 0.0}, host=None)
        return 0

    import torch

    from shared.api.llm import LLM
    from shared.models.weights import load_model

    torch.set_num_threads(args.threads)
    llm = LLM(load_model(args.model, dtype=args.reference_dtype))
    runner, label = llm, ""
    chosen = resolve_dtype(args.dtype).dtype
    if chosen != llm.engine.dtype_name:
        runner, label = LLM(load_model(args.model, dtype=chosen)), f"@{chosen}"
    try:
        configs = resolve_configs(args.configs, args.schedule, llm)
    except ValueError as error:
        parser.error(str(error))
    cases = make_suite(llm.tokenizer, args.tasks, args.lengths, args.split, args.limit)
    records, start = [], time.time()
    for case in tqdm(cases, desc="eval", unit="case"):
        records.extend(run_case(llm, case, configs, runner, label))
    resolved = {name + label: config.model_dump() for name, config in configs.items()}
    settings = vars(args) | {
        # "off" is always the reference; with a label, the configurations carry it.
        "resolved": resolved | ({"off": llm.resolve_pruning("off").model_dump()} if label else {}),
        "reference_dtype": llm.engine.dtype_name,
        "configs_dtype": chosen,
        "seconds": time.time() - start,
    }
    write_report(Path(args.out), records, settings, host=machine())
    print(f"in {time.time() - start:.0f} s")
    return 0


def write_report(out: Path, records: list[dict], settings: dict, host: dict | None) -> None:
    """results.json (every record), table.md (the headline table, then per task) and the plot."""
    rows, per_task = summarize(records), task_rows(records)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps(
            {
                "settings": settings,
                "machine": host,  # None for a merge: each run's own is in its results.json
                "summary": rows,
                "per_task": per_task,
                "records": records,
            },
            indent=2,
        )
    )
    markdown = table(rows) + "\n\nPer task:\n\n" + task_table(per_task)
    (out / "table.md").write_text(markdown + "\n")
    plot(rows, out / "speed_fidelity.png")
    print(markdown)
    print(f"\nwrote {out}/results.json, table.md, speed_fidelity.png")


if __name__ == "__main__":
    raise SystemExit(main())
