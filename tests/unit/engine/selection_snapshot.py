"""A fingerprint of what the selection does on tiny-llama: kept positions, revivals, greedy tokens, top logits.

`golden_selection.json` holds the fingerprints taken from the engine before the window, pooling,
protection and mass-budget options existed (commit 07219bc). Window 1, no pooling, no protection
must reproduce them: that is today's LazyLLM. Regenerate only for a deliberate change of the
selection: `python -m tests.unit.engine.selection_snapshot`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("golden_selection.json")
PROMPT_TOKENS = 160
DECODE_STEPS = 6
# Configurations whose behaviour predates the new options: every mode and granularity.
CONFIGS = {
    "lazy": {"mode": "lazy", "stages": [[1, 0.5], [3, 0.25]]},
    "lazy-sinks": {"mode": "lazy", "stages": [[0, 0.4], [2, 0.2]], "sink_tokens": 4},
    "lazy-block": {"mode": "lazy", "stages": [[1, 0.5], [3, 0.25]], "granularity": "block", "block_size": 8},
    "static": {"mode": "static", "stages": [[1, 0.5], [3, 0.25]]},
    "random": {"mode": "random", "stages": [[1, 0.5], [3, 0.25]], "seed": 3},
}


def fingerprint(model, config) -> dict:
    from shared.engine import decode_step, prefill

    ids = torch.randint(3, model.spec.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(7))
    cache, logits = prefill(model, ids, config)
    steps = []
    for _ in range(DECODE_STEPS):
        top = torch.topk(logits, 8)
        steps.append({"token": int(top.indices[0]), "top_ids": top.indices.tolist(), "top_logits": top.values.tolist()})
        logits = decode_step(model, cache, int(top.indices[0]), config)
    return {
        "kept": [sorted(p for p in layer.positions.tolist() if p < PROMPT_TOKENS) for layer in cache.layers],
        "aux": [sorted(entries.positions.tolist()) for entries in cache.aux],
        "revived_token_layers": cache.revived_token_layers,
        "computed_token_layers": cache.computed_token_layers,
        "steps": steps,
    }


def main() -> None:
    from shared.engine import PruneConfig
    from shared.models.weights import load_model

    torch.set_num_threads(2)
    model = load_model("tiny-llama").engine
    snapshot = {name: fingerprint(model, PruneConfig(**config)) for name, config in CONFIGS.items()}
    GOLDEN.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in snapshot.items()) + "\n}\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
