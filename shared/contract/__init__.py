"""The engine's contract with everything around it, importable without torch or transformers.

What a request asks (PruneConfig and its presets, SamplingParams), what a model is (ModelSpec),
what a generation reports (Stats), and how each travels as protobuf (wire). The gateway and
router import only this side; the engine (shared/engine) and the KV codec (shared/transfer)
build on it.
"""

from shared.contract.model import SUPPORTED_MODEL_TYPES, ModelSpec, UnsupportedModelError
from shared.contract.pruning import OFF, PRESET_NAMES, PRESETS, PruneConfig, default_pruning, preset
from shared.contract.sampling import MAX_LOGPROBS, MAX_N, Sampled, SamplingParams
from shared.contract.stats import Stats

__all__ = [
    "OFF",
    "PRESETS",
    "PRESET_NAMES",
    "SUPPORTED_MODEL_TYPES",
    "ModelSpec",
    "PruneConfig",
    "MAX_LOGPROBS",
    "MAX_N",
    "Sampled",
    "SamplingParams",
    "Stats",
    "UnsupportedModelError",
    "default_pruning",
    "preset",
]
