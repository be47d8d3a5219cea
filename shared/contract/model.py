"""What the engine needs to know of a model's shape, read from its Hugging Face config. No torch.

Which layers see every position and which a sliding window of the last W is part of the shape:
pruning scores tokens at a layer, and only a global layer's last query sees every prompt token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.contract.pruning import PruneConfig, preset

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# RoPE variants whose tables depend on position only. "dynamic" rescales with the sequence's
# length, so the same position would rotate differently in a longer prompt: refused.
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint is not of an architecture the engine's layer loop reproduces."""


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    # Per layer, the sliding window W (a query sees the last W positions, itself included), or
    # None where the layer attends to every earlier position. Empty: every layer is global.
    windows: tuple[int | None, ...] = ()

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * 4

    def window_at(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @property
    def stage_layers(self) -> tuple[int, ...] | None:
        """Layers where a pruning stage may score: those whose attention sees the whole prompt.
        None when every layer does (no restriction)."""
        if not any(w is not None for w in self.windows):
            return None
        return tuple(i for i, w in enumerate(self.windows) if w is None)

    def preset(self, name: str) -> PruneConfig:
        """The named pruning preset, fitted to this model's depth and global layers."""
        return preset(name, self.num_layers, self.stage_layers)

    def check(self, config: PruneConfig) -> PruneConfig:
        """Raise ValueError if the schedule does not fit this model; return it."""
        return config.check_for(self.num_layers, self.stage_layers)

    @classmethod
    def from_config_file(cls, path) -> ModelSpec:
        """From a checkpoint's config.json read as JSON, so the gateway needs no transformers config
        class (importing one imports torch). Equal to from_config(AutoConfig...) for the supported
        families (tested); absent fields take those classes' defaults."""
        import json
        from types import SimpleNamespace

        fields = json.loads(Path(path).read_text())
        fields.setdefault("num_key_value_heads", fields.get("num_attention_heads"))
        fields.setdefault("sliding_window", None)
        return cls.from_config(SimpleNamespace(**fields))

    @classmethod
    def from_config(cls, config) -> ModelSpec:
        model_type = getattr(config, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; the engine runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _refuse_unsupported_features(config)
        windows = _layer_windows(config)
        if windows and all(w is not None and w < config.max_position_embeddings for w in windows):
            raise UnsupportedModelError(
                f"sliding-window attention on every layer (window {windows[0]}) is not supported: pruning "
                "scores at a layer that sees the whole prompt; use a checkpoint with global layers"
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
            windows=windows,
        )


def _refuse_unsupported_features(config) -> None:
    """Refuse, by name, what a supported family may switch on and the layer loop does not compute."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedModelError("attention logit soft-capping is not supported (SDPA cannot apply it)")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError("bidirectional attention is not supported: the engine is causal")
    for params in _rope_parameter_sets(config):
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in _ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rope_type!r} is not supported; the engine runs {', '.join(_ROPE_TYPES)}"
            )


def _rope_parameter_sets(config) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        return []
    nested = [value for value in params.values() if isinstance(value, dict)]
    return nested or [params]  # per layer type (Gemma 3) or one set


def _layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window from the config: `layer_types` where the family states them
    (Qwen2/3, Gemma 3), else Mistral's one window on every layer; () when no layer slides."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    elif config.model_type == "mistral" or getattr(config, "use_sliding_window", False):
        windows = (window,) * config.num_hidden_layers
    else:
        return ()
    # A window at least as long as the context never cuts anything.
    limit = config.max_position_embeddings
    windows = tuple(None if w is None or w >= limit else w for w in windows)
    return windows if any(w is not None for w in windows) else ()
