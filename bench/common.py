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


def long_text_ids(tokenizer, length: int) -> torch.Tensor:
    """The first `length` tokens of the reference text (real prose, not random ids)."""
    ids = tokenizer(reference_text()).input_ids
    assert len(ids) >= length, f"reference text has only {len(ids)} tokens"
    return torch.tensor(ids[:length])


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def write_json(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report | {"machine": machine()}, indent=2))
