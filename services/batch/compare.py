"""`run-batch --compare`: run each line again unpruned and print full vs pruned side by side."""

from __future__ import annotations

import json
from pathlib import Path

from services.batch.runner import BatchSummary, read_lines
from shared.api.llm import LLM, respond
from shared.api.serving import choice_text


def _answer(body: dict) -> str:
    return " ".join(choice_text(body).split())


def compare(llm: LLM, source: Path, summary: BatchSummary, width: int = 60) -> list[dict]:
    rows = []
    raws = read_lines(source)
    for raw, result in zip(raws, summary.results):
        if result.error is not None:
            continue
        line = json.loads(raw)
        full = respond(llm, line["url"], dict(line["body"], pruning="off")).model_dump()
        lazy = result.response.body
        rows.append(
            {
                "custom_id": result.custom_id,
                "prompt_tokens": lazy["usage"]["prompt_tokens"],
                "ttft_full_s": full["metrics"]["ttft_s"],
                "ttft_pruned_s": lazy["metrics"]["ttft_s"],
                "computed_fraction": lazy["metrics"]["computed_fraction"],
                "full": _answer(full),
                "pruned": _answer(lazy),
            }
        )
    for row in rows:
        speedup = row["ttft_full_s"] / row["ttft_pruned_s"]
        print(
            f"\n{row['custom_id']}: {row['prompt_tokens']} prompt tokens | TTFT full {row['ttft_full_s']:.2f} s, "
            f"pruned {row['ttft_pruned_s']:.2f} s ({speedup:.2f}x) | token-layers computed "
            f"{row['computed_fraction']:.0%} of full"
        )
        print(f"  full  : {row['full'][:width]}")
        print(f"  pruned: {row['pruned'][:width]}")
    return rows
