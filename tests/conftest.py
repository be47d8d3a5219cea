"""Shared fixtures: one load of each model per test session."""

from __future__ import annotations

import pytest
import torch

from shared.models.catalog import TINY_MODELS
from shared.models.weights import load_model

torch.set_num_threads(2)

ALL_MODELS = (*TINY_MODELS, "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def smollm2():
    return load_model("SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def tiny_llama():
    return load_model("tiny-llama")


_cache: dict[str, object] = {}


@pytest.fixture(scope="session")
def load():
    """Load a model by name once per session."""

    def get(name: str):
        if name not in _cache:
            _cache[name] = load_model(name)
        return _cache[name]

    return get
