"""Shared fixtures: one load of each model per test session."""

from __future__ import annotations

import os

import pytest
import torch

from shared.models.catalog import TINY_MODELS
from shared.models.weights import load_model

torch.set_num_threads(2)

# Every worker a test starts (in process, as a subprocess, as a Ray actor) runs float32, whatever
# `--dtype auto` would pick on this host: CI runs on hosts with and without bfloat16 instructions,
# and the tests compare workers with the float32 engine. Tests of bfloat16 ask for it by name;
# tests of auto inject the CPU's flags (tests/unit/shared/test_precision.py).
os.environ["LAZYSERVE_DTYPE"] = "float32"

ALL_MODELS = (*TINY_MODELS, "SmolLM2-135M-Instruct")


def pytest_addoption(parser):
    # The exactness tests on another device: `pytest --device cuda tests/unit/engine/test_baseline.py`.
    # Everything else runs on the CPU, which is all CI has.
    parser.addoption("--device", default="cpu", help="device of the models the `load` fixture gives (default cpu)")


@pytest.fixture(scope="session")
def device(request) -> str:
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def smollm2():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def tiny_llama():
    return load_model("tiny-llama")


_cache: dict[tuple, object] = {}


@pytest.fixture(scope="session")
def load(device):
    """Load a model by name (and dtype: float32 unless asked, never what `auto` picks on this host)
    once per session, on the --device given."""

    def get(name: str, dtype: str = "float32"):
        key = (name, dtype)
        if key not in _cache:
            _cache[key] = load_model(name, dtype=dtype, device=device)
        return _cache[key]

    return get
