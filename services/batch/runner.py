"""`lazyserve run-batch`: OpenAI Batch API files through the engine, one output line per input line.

A bad line gets an output line with an `error` object and the others still run: nothing is
dropped. Output order follows input order.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError
from tqdm import tqdm

from shared.api.llm import LLM, respond
from shared.api.schemas import BatchInputLine, BatchOutputLine, BatchResponse, ErrorBody
from shared.api.serving import RequestError, validation_message
from shared.contract import PRESET_NAMES

log = logging.getLogger(__name__)


@dataclass
class BatchSummary:
    succeeded: int = 0
    failed: int = 0
    results: list[BatchOutputLine] = field(default_factory=list)


def _error_line(custom_id, status: int | None, message: str, code: str, param=None) -> BatchOutputLine:
    error = ErrorBody(message=message, code=code, param=param)
    response = None
    if status is not None:
        response = BatchResponse(
            status_code=status, request_id=f"req-{uuid.uuid4().hex}", body={"error": error.model_dump()}
        )
    return BatchOutputLine(custom_id=custom_id, response=response, error=error)


def run_line(llm: LLM, raw: str, pruning_flag: str | dict | None) -> BatchOutputLine:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as error:
        return _error_line(None, None, f"invalid JSON: {error}", "invalid_json")
    custom_id = data.get("custom_id") if isinstance(data, dict) else None
    try:
        line = BatchInputLine.model_validate(data)
    except ValidationError as error:
        return _error_line(custom_id, None, f"invalid batch line: {validation_message(error)}", "invalid_line")
    body = dict(line.body)
    if pruning_flag is not None:
        body.setdefault("pruning", pruning_flag)  # the body's own pruning wins over the flag
    try:
        result = respond(llm, line.url, body)
    except RequestError as error:
        return _error_line(custom_id, error.status_code, error.message, error.code or "invalid_request", error.param)
    except Exception as error:  # noqa: BLE001 - one failed line must not stop the batch
        log.exception("line %s failed", custom_id)
        return _error_line(custom_id, 500, f"internal error: {type(error).__name__}", "internal_error")
    response = BatchResponse(status_code=200, request_id=f"req-{uuid.uuid4().hex}", body=result.model_dump())
    return BatchOutputLine(custom_id=line.custom_id, response=response)


def load_pruning_flag(value: str | None) -> str | dict | None:
    """A preset name, a JSON schedule file, or None (each line gets the default preset)."""
    if value is None or value in PRESET_NAMES:
        return value
    path = Path(value)
    if not path.exists():
        raise SystemExit(f"--pruning takes a preset ({', '.join(PRESET_NAMES)}) or a JSON file; {value!r} is neither")
    return json.loads(path.read_text())


# JSON leaves U+2028, U+2029 and U+0085 raw inside strings, and str.splitlines() breaks lines at each
# of them: written escaped, an output record stays one line for any reader (as Go's encoding/json does).
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def read_lines(source: Path) -> list[str]:
    """A JSONL file's lines, split at newlines only (a line's strings may hold U+2028 and kin).

    Only lines of JSON whitespace are skipped: any other line is a request, or an error line.
    """
    return [raw for raw in source.read_text().split("\n") if raw.strip(" \t\r")]


def jsonl_record(line: BatchOutputLine) -> str:
    """One output line's JSON, with no character any line splitter takes for a line break."""
    return line.model_dump_json().translate(_LINE_BREAKS)


def run_batch(
    llm: LLM, source: Path, target: Path, pruning_flag: str | dict | None, progress: bool = True
) -> BatchSummary:
    lines = read_lines(source)
    summary = BatchSummary()
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("w") as out:
        for raw in tqdm(lines, desc="run-batch", unit="req", disable=not progress):
            result = run_line(llm, raw, pruning_flag)
            out.write(jsonl_record(result) + "\n")
            out.flush()
            summary.results.append(result)
            if result.error is None:
                summary.succeeded += 1
            else:
                summary.failed += 1
    return summary
