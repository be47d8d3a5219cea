"""Gemma 3 270M, the second real model (sliding window 512 on five layers of six), equals
transformers with pruning off, in float32 and bfloat16, on prompts longer than its window; and
its pruned runs keep each token-layer computed at most once.

Real prose from CPython's docs, no template (a base model). Two prompts per dtype in `make test`
(bfloat16's in the slow tier on a CPU without bfloat16 instructions), six more up to 2k tokens in
the slow tier.
"""

from __future__ import annotations

import pytest
import torch

from shared.engine import PruneConfig, decode_step, prefill
from tests.conftest import SLOW_WITHOUT_NATIVE_BFLOAT16
from tests.helpers import compare_with_transformers

MODEL = "gemma-3-270m"
SHORT = [(520, "assignment"), (1000, "typesmapping")]
LONG = [
    (640, "formatstrings"),
    (800, "import"),
    (1200, "debugger"),
    (1500, "specialnames"),
    (1800, "types"),
    (2048, "numbers"),
]


def _prompt(loaded, tokens: int, topic: str) -> torch.Tensor:
    from pydoc_data.topics import topics

    names = list(topics)
    text = "\n\n".join(topics[name] for name in names[names.index(topic) :][:40])  # the topic, then the next ones
    ids = loaded.tokenizer(text).input_ids[:tokens]  # starts with <bos>
    assert len(ids) == tokens > loaded.engine.spec.window_at(0)
    return torch.tensor(ids)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=SLOW_WITHOUT_NATIVE_BFLOAT16)])
@pytest.mark.parametrize("tokens, topic", SHORT, ids=[f"{t}-{n}" for n, t in SHORT])
def test_gemma3_equals_transformers(load, dtype, tokens, topic):
    loaded = load(MODEL, dtype)
    compare_with_transformers(loaded, _prompt(loaded, tokens, topic))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens, topic", LONG, ids=[f"{t}-{n}" for n, t in LONG])
def test_gemma3_equals_transformers_on_long_prompts(load, dtype, tokens, topic):
    loaded = load(MODEL, dtype)
    compare_with_transformers(loaded, _prompt(loaded, tokens, topic))


def test_gemma3_prunes_at_global_layers_and_computes_each_token_layer_once(load):
    loaded = load(MODEL)
    spec = loaded.engine.spec
    assert spec.stage_layers == (5, 11, 17) and spec.window_at(0) == 512
    assert spec.preset("default").stages == ((11, 0.2),)
    config = PruneConfig(stages=((5, 0.5), (11, 0.2)))  # the paper's rule: re-selects and revives every step
    ids = _prompt(loaded, 1100, "typesmapping")
    cache, logits = prefill(loaded.engine, ids, config, reserve=8)
    assert cache.kept_per_layer[5] == 1100 and cache.kept_per_layer[6] == 550 and cache.kept_per_layer[12] == 220
    for _ in range(8):
        logits = decode_step(loaded.engine, cache, int(logits.argmax()), config)
    assert cache.revived_token_layers > 0
    assert cache.computed_token_layers == int(cache.depth[: cache.length].sum())
