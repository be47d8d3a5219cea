"""The lazyserve engine: LazyLLM prefill and decode over a Llama-family model. No I/O lives here.

The value types it takes and reports (PruneConfig, SamplingParams, Stats, ModelSpec) are
shared/contract's, re-exported here for the engine's callers."""

from shared.contract import OFF, ModelSpec, PruneConfig, SamplingParams, Stats, UnsupportedModelError
from shared.engine.cache import LazyCache, QueryWindow
from shared.engine.decode import decode_batch, decode_step
from shared.engine.generate import (
    Decoding,
    Generation,
    choice_decodings,
    decode_tokens,
    generate,
    run_decoding,
    stream,
)
from shared.engine.model import EngineModel
from shared.engine.prefill import LayerFrame, PrefillRun, prefill
from shared.engine.prefix import PrefixCache, PrefixHit, block_keys, held_layers, namespace
from shared.engine.pruning import select
from shared.engine.request import abandon_prefill, fill_prefill_stats, finish_prefill, run_prefill, start_prefill
from shared.engine.reuse import PrefixReuse
from shared.engine.sampling import Sampled, Sampler, sample
from shared.engine.slots import DecodeSlots

__all__ = [
    "OFF",
    "DecodeSlots",
    "Decoding",
    "EngineModel",
    "Generation",
    "LayerFrame",
    "LazyCache",
    "ModelSpec",
    "PrefillRun",
    "PrefixCache",
    "PrefixHit",
    "PrefixReuse",
    "PruneConfig",
    "QueryWindow",
    "Sampled",
    "Sampler",
    "SamplingParams",
    "Stats",
    "UnsupportedModelError",
    "decode_batch",
    "decode_step",
    "choice_decodings",
    "decode_tokens",
    "abandon_prefill",
    "finish_prefill",
    "run_prefill",
    "start_prefill",
    "fill_prefill_stats",
    "generate",
    "run_decoding",
    "block_keys",
    "held_layers",
    "namespace",
    "prefill",
    "sample",
    "select",
    "stream",
]
