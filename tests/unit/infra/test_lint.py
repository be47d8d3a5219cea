"""The linter that `make test` runs sees what the old grep test did, and what it missed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

UNSAFE = """\
import marshal
from pickle import loads

import torch


def receive(data: bytes):
    loads(data)
    marshal.loads(data)
    torch.load(data)
    eval(data)
    exec(data)
"""


def _ruff(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    ruff = Path(sys.executable).parent / "ruff"
    return subprocess.run([str(ruff), *args], cwd=ROOT, input=stdin, capture_output=True, text=True, timeout=60)


def test_unpickling_and_evaluation_are_refused_however_spelled():
    result = _ruff("check", "--output-format", "concise", "--stdin-filename", "shared/receiver.py", "-", stdin=UNSAFE)
    assert result.returncode == 1
    for needle in ("`pickle` is banned", "`marshal` is banned", "`torch.load` is banned", "S307", "S102"):
        assert needle in result.stdout, (needle, result.stdout)
