"""Per-generation counters: time to first token, work done against the full model's, memory held."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    prefill_token_layers: int = 0
    token_layers_computed: int = 0
    # What the unpruned model computes for the same tokens: every token at every layer.
    token_layers_full: int = 0
    revived_token_layers: int = 0
    kept_per_layer: list[int] = field(default_factory=list)
    kv_cache_bytes: int = 0
    aux_cache_bytes: int = 0
    # Prompt tokens whose shared layers came from a prefix cache (OpenAI's usage.prompt_tokens_details.cached_tokens).
    cached_tokens: int = 0
    # With return_token_depths: per prompt token, the layers it was computed at when the request
    # ended, and the prompt positions decode revived.
    token_depths: list[int] = field(default_factory=list)
    revived_positions: list[int] = field(default_factory=list)

    @property
    def computed_fraction(self) -> float:
        return self.token_layers_computed / self.token_layers_full if self.token_layers_full else 1.0

    def to_dict(self) -> dict:
        return asdict(self) | {"computed_fraction": self.computed_fraction}
