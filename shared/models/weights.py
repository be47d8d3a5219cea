"""Loading a model's weights for the engine (prefill and decode workers, run-batch, benchmarks)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from shared import kernels
from shared.compute import ComputeThread
from shared.contract import ModelSpec
from shared.engine.grammar import Grammars
from shared.engine.model import EngineModel
from shared.models.catalog import DEFAULT_MODEL, default_cache_dir, resolve, stop_ids_of, tiny_config
from shared.models.precision import DtypeChoice, resolve_dtype
from shared.models.text import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    engine: EngineModel
    tokenizer: object | None  # a transformers tokenizer; tiny random models borrow SmolLM2's if present
    dtype_choice: DtypeChoice | None = None  # which dtype it runs in and why (--dtype auto)

    @property
    def max_positions(self) -> int:
        return self.engine.spec.max_positions

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return stop_ids_of(self.engine.hf.generation_config.eos_token_id, self.tokenizer)

    @functools.cached_property
    def grammars(self) -> Grammars | None:
        """Structured output's matchers for this model's tokenizer (None without one)."""
        if self.tokenizer is None:
            return None
        return Grammars(self.tokenizer, self.engine.spec.vocab_size, self.stop_token_ids)


def build_tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(kind)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load `name`: the default model, a tiny random config, or a local Hugging Face folder.

    dtype: float32 (the default here, so tests never depend on the host), bfloat16, float16, or
    auto (bfloat16 where the hardware computes it: shared.models.precision)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = resolve(name, cache_dir or default_cache_dir())
    choice = resolve_dtype(dtype, device)
    log.info("%s runs in %s on %s", source.label, choice, device)
    torch_dtype = getattr(torch, choice.dtype)
    if source.tiny is not None:
        # Built in float32 from one seed, then cast: a tiny model's weights are the same values in every dtype.
        hf = build_tiny(source.tiny).to(device=device, dtype=torch_dtype)
        tokenizer = load_tokenizer(source.folder) if source.folder is not None else None
        return LoadedModel(source.label, EngineModel(hf), tokenizer, choice)
    # Refuse an unsupported architecture before loading anything else.
    ModelSpec.from_config(AutoConfig.from_pretrained(source.folder))
    tokenizer = load_tokenizer(source.folder)
    hf = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch_dtype, attn_implementation="sdpa")
    return LoadedModel(source.label, EngineModel(hf.to(device)), tokenizer, choice)


def load_engine(settings, compute: ComputeThread | None = None) -> LoadedModel:
    """The model an EngineSettings names, as a worker runs it: torch's threads and the allocator
    set (apply_threads), the kernels picked (shared.kernels), the weights loaded, batch invariance
    as asked. With `compute`, all of it happens on that thread, the one that will run the engine:
    loading enters torch's OpenMP pool, and only one thread of a process may (shared.compute says
    why)."""

    def load() -> LoadedModel:
        settings.apply_threads()
        kernels.select(settings.kernels)
        loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype, cache_dir=settings.cache_dir)
        loaded.engine.set_batch_invariant(settings.batch_invariant)
        return loaded

    return load() if compute is None else compute.call(load)
