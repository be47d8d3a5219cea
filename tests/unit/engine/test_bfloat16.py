"""The engine in bfloat16 equals transformers in bfloat16: with pruning off, greedy tokens that
transformers ranks first and first-token logits within bfloat16's rounding; caches and transfers
take half the bytes of float32.

Both sides load the same weights in bfloat16 here, whatever `--dtype auto` would pick on this host.
Tolerance of the logits: bfloat16 keeps 8 significant bits, so a logit near 20 is a multiple of
0.125. The two paths run the same modules but do not group every sum alike: the engine pads its
prefill attention's keys to whole blocks of the kernel and its small projections to row counts
that compute as large calls (so that no token's numbers depend on the prompt's length, a
prefix-cache hit or the batch: test_invariance.py), where transformers makes one call of the
prompt's length and multiplies a single row with the matrix-vector kernel. A rounding step
anywhere in the layers can move a logit by a step of the largest one. Over the 26 bfloat16 comparisons
here and in test_gemma3 (both tiers) the largest difference was four steps (SmolLM2, 7,000
tokens), the median two; six is the bound. Greedy tokens are checked teacher-forced
(tests/helpers.py).
"""

from __future__ import annotations

import pytest
import torch

from shared.engine import OFF, PruneConfig, SamplingParams, generate, prefill
from shared.models.catalog import TINY_MODELS
from shared.transfer import payload_bytes
from tests.conftest import SLOW_WITHOUT_NATIVE_BFLOAT16
from tests.helpers import compare_with_transformers, encode_transfer, random_ids

STEPS = 16


@pytest.mark.parametrize("name", TINY_MODELS)
@pytest.mark.parametrize("length", [12, 300])
def test_tiny_models_in_bfloat16_equal_transformers(load, name, length):
    loaded = load(name, "bfloat16")
    ids = torch.randint(3, loaded.engine.spec.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    compare_with_transformers(loaded, ids)


def _smollm2_prompt(loaded, chars: int, topic: str) -> torch.Tensor:
    """A chat-templated question over real prose from CPython's docs (at most about 2k tokens)."""
    from pydoc_data.topics import topics

    text = topics[topic][:chars]
    messages = [{"role": "user", "content": f"{text}\n\nSummarize the text above in one sentence."}]
    template = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return torch.tensor(loaded.tokenizer(template, add_special_tokens=False).input_ids)


# Eight prompts from a few dozen tokens to about 2k: the short half in `make test` where the CPU
# computes bfloat16 natively, the long half (each about 10 s per side on a CPU without bfloat16
# instructions) in the slow tier.
SHORT = [(200, "assert"), (600, "pass"), (1200, "while"), (2000, "import")]
LONG = [(3500, "typesmapping"), (5000, "assignment"), (7000, "debugger"), (8200, "formatstrings")]


@pytest.mark.parametrize(
    "chars, topic", [pytest.param(c, t, id=f"{t}-{c}", marks=SLOW_WITHOUT_NATIVE_BFLOAT16) for c, t in SHORT]
)
def test_smollm2_in_bfloat16_equals_transformers(load, chars, topic):
    loaded = load("SmolLM2-135M-Instruct", "bfloat16")
    compare_with_transformers(loaded, _smollm2_prompt(loaded, chars, topic))


@pytest.mark.slow
@pytest.mark.parametrize("chars, topic", LONG, ids=[f"{t}-{c}" for c, t in LONG])
def test_smollm2_in_bfloat16_equals_transformers_on_long_prompts(load, chars, topic):
    loaded = load("SmolLM2-135M-Instruct", "bfloat16")
    ids = _smollm2_prompt(loaded, chars, topic)
    assert 500 < ids.shape[0] <= 2100
    compare_with_transformers(loaded, ids)


def test_bfloat16_holds_and_sends_half_the_bytes(load):
    float32, bfloat16 = load("tiny-llama"), load("tiny-llama", "bfloat16")
    ids = random_ids(float32, 200)
    full, _ = prefill(float32.engine, torch.tensor(ids), OFF)
    half, _ = prefill(bfloat16.engine, torch.tensor(ids), OFF)
    assert half.layers[0].k.dtype == torch.bfloat16 and half.bytes_held * 2 == full.bytes_held
    _, wide = encode_transfer(float32, ids, OFF, SamplingParams(max_new_tokens=2))
    _, narrow = encode_transfer(bfloat16, ids, OFF, SamplingParams(max_new_tokens=2))
    sent = [sum(sum(payload_bytes(m)) for m in messages) for messages in (wide, narrow)]
    assert sent[1] * 2 == sent[0] > 0
    # What a response's `metrics` reports (kv_cache_bytes, aux_cache_bytes) halves with them. Under
    # pruning the prefill keeps the same counts at both dtypes; decode's revivals follow each
    # dtype's own scores (a token or two apart), so one token is generated, by the prefill alone.
    lazy = PruneConfig(stages=((1, 0.5), (3, 0.25)), min_prompt_tokens=0)
    for config, params in ((OFF, SamplingParams(max_new_tokens=4)), (lazy, SamplingParams(max_new_tokens=1))):
        wide_stats = generate(float32.engine, torch.tensor(ids), config, params).stats
        narrow_stats = generate(bfloat16.engine, torch.tensor(ids), config, params).stats
        assert narrow_stats.kv_cache_bytes * 2 == wide_stats.kv_cache_bytes > 0
        assert narrow_stats.aux_cache_bytes * 2 == wide_stats.aux_cache_bytes
