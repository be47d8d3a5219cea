"""Shared fixtures: one load of each model per test session."""

from __future__ import annotations

import os

import pytest
import torch

from shared import kernels
from shared.models.catalog import TINY_MODELS
from shared.models.precision import CpuFeatures
from shared.models.weights import load_model
from shared.settings import available_cores

# `make test` runs the suite on two pytest-xdist workers (the Makefile's TEST_WORKERS): each takes
# its share of the cores for torch, so that two workers' OpenMP teams do not fight over the same
# cores (a team whose thread is descheduled waits at every barrier: several times slower, not two).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, available_cores() // WORKERS)
torch.set_num_threads(THREADS)

# Every worker a test starts (in process, as a subprocess, as a Ray actor) runs float32, whatever
# `--dtype auto` would pick on this host: CI runs on hosts with and without bfloat16 instructions,
# and the tests compare workers with the float32 engine. Tests of bfloat16 ask for it by name;
# tests of auto inject the CPU's flags (tests/unit/shared/test_precision.py).
os.environ["LAZYSERVE_DTYPE"] = "float32"

ALL_MODELS = (*TINY_MODELS, "SmolLM2-135M-Instruct")

# The decode step's kernels (shared/kernels): native where `make setup` built them, as a worker
# runs by default; LAZYSERVE_KERNELS=torch runs the suite on torch's, the reference and the
# fallback (the workers tests start read the same variable as their --kernels setting).
kernels.select(os.environ.get("LAZYSERVE_KERNELS", "native"))

# A CPU without AMX or AVX512-BF16 converts every bfloat16 operand to float32 and back, about 4x
# slower than float32: there the real models' bfloat16 equalities run in the slow tier (this
# mark), and `make test` keeps bfloat16 on the tiny models. LAZYSERVE_TEST_NATIVE_BF16=0 (or 1)
# shows one kind of host's split on the other.
_native = os.environ.get("LAZYSERVE_TEST_NATIVE_BF16")
NATIVE_BFLOAT16 = CpuFeatures.detect().native_bfloat16 if _native is None else _native == "1"
SLOW_WITHOUT_NATIVE_BFLOAT16 = () if NATIVE_BFLOAT16 else (pytest.mark.slow,)


def pytest_addoption(parser):
    # The exactness tests on another device: `pytest --device cuda tests/unit/engine/test_baseline.py`.
    # Everything else runs on the CPU, which is all CI has.
    parser.addoption("--device", default="cpu", help="device of the models the `load` fixture gives (default cpu)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` a group runs on one worker. A module is a group, so its
    module-scoped servers start once; every test that uses the local Ray or starts a Ray head of
    its own (`starts_ray`) is one group, so that no two Ray heads start at once: two starting
    together on two loaded cores made a GCS miss Ray's 30 s start window. A test that asserts on
    latencies (`latency`) joins that group, so that no Ray head starts beside it."""
    for item in items:
        marked = item.get_closest_marker("starts_ray") or item.get_closest_marker("latency")
        ray = "local_ray" in item.fixturenames or marked
        item.add_marker(pytest.mark.xdist_group("ray" if ray else item.module.__name__))


@pytest.fixture(autouse=True)
def _torch_threads():
    """A benchmark's main() run in process sets torch's threads on its compute thread, and with
    them the count every thread started later takes: put it back. Otherwise a later test's
    server thread and the test's own thread would compute with different counts, and where the
    BLAS sums a row otherwise at another count (an AVX2 host's MKL), a bit-for-bit test fails."""
    yield
    torch.set_num_threads(THREADS)


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
