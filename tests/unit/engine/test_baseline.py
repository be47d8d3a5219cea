"""With pruning off the engine equals transformers: logits after prefill and each decode step, greedy tokens."""

import pytest
import torch

from shared.engine import OFF, PruneConfig, SamplingParams, decode_step, generate, prefill
from tests.conftest import ALL_MODELS

STEPS = 64


def _prompt(loaded, n: int = 48) -> torch.Tensor:
    if loaded.tokenizer is not None:
        text = "Explain in detail how a Python dictionary stores its keys, and why lookups are fast."
        ids = loaded.tokenizer(
            loaded.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        ).input_ids
        return torch.tensor(ids)
    return torch.randint(3, loaded.engine.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(0))


KEEP_ALL = PruneConfig(mode="lazy", stages=((1, 1.0), (3, 1.0)))
CASES = [
    pytest.param(name, config, id=f"{label}-{name}")
    for label, config in (("off", OFF), ("keep-all", KEEP_ALL))
    for name in ALL_MODELS
]


@pytest.mark.parametrize(("name", "config"), CASES)
def test_logits_match_transformers_at_every_step(load, name, config):
    loaded = load(name)
    model, hf = loaded.engine, loaded.engine.hf
    ids = _prompt(loaded)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        cache, logits = prefill(model, ids, config, reserve=STEPS)
        # transformers' reference steps through its own KV cache, as its generate() does: one row
        # a step, where a forward over the whole sequence at each of 64 steps took SmolLM2 25 s.
        out = hf(ids[None].to(model.device), use_cache=True)
        torch.testing.assert_close(logits, out.logits[0, -1], atol=1e-4, rtol=0)
        for step in range(STEPS):
            # Teacher-forced mix of greedy and random tokens, so every step is compared whatever comes out.
            token = int(logits.argmax()) if step % 2 else int(torch.randint(3, 1000, (1,), generator=gen))
            logits = decode_step(model, cache, token, config)
            out = hf(torch.tensor([[token]], device=model.device), cache=out.cache, use_cache=True)
            torch.testing.assert_close(logits, out.logits[0, -1], atol=1e-4, rtol=0, msg=f"step {step}")
    assert cache.computed_token_layers == model.spec.num_layers * (ids.shape[0] + STEPS)


@pytest.mark.parametrize("name", ALL_MODELS)
def test_greedy_tokens_equal_generate(load, name):
    loaded = load(name)
    model = loaded.engine
    ids = _prompt(loaded)
    eos = loaded.stop_token_ids
    with torch.inference_mode():
        expected = model.hf.generate(ids[None].to(model.device), max_new_tokens=STEPS, do_sample=False)
    expected = expected[0, ids.shape[0] :].tolist()
    expected = [t for t in expected if t not in eos]  # ours leaves the stop token out
    ours = generate(model, ids, OFF, SamplingParams(max_new_tokens=STEPS, stop_token_ids=eos))
    assert ours.tokens == expected[: len(ours.tokens)]
    assert len(ours.tokens) == len(expected)
