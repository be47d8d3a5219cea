"""What the engine needs to know of a model's shape, read from its Hugging Face config. No torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


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

    @property
    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * 4

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
        window = getattr(config, "sliding_window", None)
        uses_window = window is not None and (model_type == "mistral" or getattr(config, "use_sliding_window", False))
        if uses_window and window < config.max_position_embeddings:
            raise UnsupportedModelError(
                f"sliding-window attention (window {window}) is not supported; use a checkpoint without it"
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
        )
