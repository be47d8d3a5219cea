"""Without the native library, the torch path runs, and the engine says why."""

from __future__ import annotations

import copy

import torch

from shared import kernels
from shared.engine import PruneConfig, decode_batch, prefill
from shared.kernels import build

OFF = PruneConfig(mode="off")


def test_without_the_build_the_torch_path_runs_and_says_why(tiny_llama, monkeypatch, tmp_path):
    monkeypatch.setattr(build, "LIBRARY_DIR", tmp_path)  # nothing built there
    monkeypatch.setattr(kernels, "_loaded", None)
    monkeypatch.setattr(kernels, "_path", None)
    status = kernels.select("native")
    assert (status.path, status.built) == ("torch", False) and "not built" in status.reason
    assert "make setup" in status.describe()
    model = tiny_llama.engine
    ids = torch.arange(3, 60)
    cache, logits = prefill(model, ids, OFF, reserve=2)
    alone = copy.deepcopy(cache)
    assert torch.equal(
        decode_batch(model, [(cache, 5, OFF)])[0],
        decode_batch(model, [(alone, 5, OFF)])[0],
    )
    assert model.kernels == status.describe()
    monkeypatch.undo()
    kernels.select("native")
