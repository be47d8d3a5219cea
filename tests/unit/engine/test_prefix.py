"""The engine's prefix cache: a prefill that starts from cached blocks gives what a prefill from
scratch gives (logits within float32 rounding, the same greedy tokens), computes only the new
tokens at the shared layers, and never shares what pruning computed for another prompt."""

from __future__ import annotations

import pytest
import torch

from shared.engine import OFF, PrefillRun, PruneConfig, decode_step
from shared.engine.prefix import PrefixCache, block_keys, held_layers, namespace

STEPS = 8
LAZY = PruneConfig(stages=((2, 0.5),), window=4)
MULTI = PruneConfig(stages=((1, 0.5), (3, 0.25)), window=4, pool_kernel=3, granularity="block", block_size=8)
SHORT_UNPRUNED = PruneConfig(stages=((2, 0.5),), window=4, min_prompt_tokens=200)


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model, ids, config, prefix=None):
    run = PrefillRun(model, ids, config, reserve=STEPS, prefix=prefix, keep_boundary=True)
    while not run.done:
        run.step()
    return run


def _greedy(model, run, config) -> tuple[list[torch.Tensor], list[int]]:
    logits, rows, tokens = run.logits, [run.logits], []
    for _ in range(STEPS):
        tokens.append(int(logits.argmax()))
        logits = decode_step(model, run.cache, tokens[-1], config)
        rows.append(logits)
    return rows, tokens


def _cache_with(model, ids, config, budget=1 << 30) -> tuple[PrefixCache, bytes]:
    cache = PrefixCache(budget, block_tokens=16)
    root = namespace("tiny-llama", "float32", held_layers(config, model.spec.num_layers))
    run = _run(model, ids, config)
    cache.insert(block_keys(ids.tolist(), root, 16), *run.shared_rows())
    return cache, root


@pytest.mark.parametrize("config", [OFF, LAZY, MULTI, SHORT_UNPRUNED], ids=["off", "lazy", "multi-stage", "short"])
def test_a_prefill_from_a_hit_equals_one_from_scratch(tiny_llama, config):
    model = tiny_llama.engine
    document = _ids(160, 1)
    cache, root = _cache_with(model, document, config)
    prompt = torch.cat([document, _ids(60, 2)])  # the document, then a question
    keys = block_keys(prompt.tolist(), root, 16)
    hit = cache.lookup(keys, prompt.shape[0] - config.window)
    assert hit is not None and hit.tokens == 160
    warm, cold = _run(model, prompt, config, prefix=hit), _run(model, prompt, config)
    cache.release(hit)
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-4, rtol=0)
    warm_rows, warm_tokens = _greedy(model, warm, config)
    cold_rows, cold_tokens = _greedy(model, cold, config)
    assert warm_tokens == cold_tokens
    for mine, theirs in zip(warm_rows, cold_rows):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=0)
    held = held_layers(config, model.spec.num_layers)
    assert warm.cache.cached_tokens == 160
    assert warm.cache.computed_token_layers == cold.cache.computed_token_layers - 160 * held
    # At most once: every token-layer held was written once, computed here or taken from the cache.
    assert int(warm.cache.depth[: warm.cache.length].sum()) == warm.cache.computed_token_layers + 160 * held
    assert warm.cache.kept_per_layer == cold.cache.kept_per_layer


def test_a_hit_leaves_the_query_window_to_compute(tiny_llama):
    model = tiny_llama.engine
    prompt = _ids(160, 3)
    cache, root = _cache_with(model, prompt, LAZY)
    keys = block_keys(prompt.tolist(), root, 16)
    hit = cache.lookup(keys, prompt.shape[0] - LAZY.window)  # the same prompt again: all but the window
    assert hit.tokens == 144
    warm, cold = _run(model, prompt, LAZY, prefix=hit), _run(model, prompt, LAZY)
    torch.testing.assert_close(warm.logits, cold.logits, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="query window"):
        PrefillRun(model, prompt[:146], LAZY, prefix=hit)
    cache.release(hit)


def test_entries_hold_only_the_layers_every_question_shares(tiny_llama):
    model = tiny_llama.engine
    cache, _ = _cache_with(model, _ids(64, 4), MULTI)
    entry = next(iter(cache._entries.values()))
    assert entry.k.shape[0] == 2 and entry.hidden.shape == (16, model.spec.hidden_size)  # first cut after layer 1
    off_cache, _ = _cache_with(model, _ids(64, 4), OFF)
    entry = next(iter(off_cache._entries.values()))
    assert entry.k.shape[0] == model.spec.num_layers and entry.hidden is None
    # Different layers held, different keys: one schedule's entries never serve another's.
    assert namespace("m", "float32", 2) != namespace("m", "float32", 6) != namespace("m", "bfloat16", 6)
    assert namespace("m", "float32", 6, "tenant-a") != namespace("m", "float32", 6, "tenant-b")


def test_keys_chain_over_the_blocks_before():
    root = namespace("m", "float32", 6)
    a = block_keys(list(range(64)), root, 16)
    b = block_keys([99, *range(1, 64)], root, 16)
    assert len(a) == 4 and len(block_keys(list(range(70)), root, 16)) == 4  # full blocks only
    assert all(x != y for x, y in zip(a, b))  # one token differs in block 0: every later key differs
    assert a == block_keys(list(range(64)), root, 16)


def test_eviction_keeps_the_budget_spares_pinned_entries_and_drops_a_chain_tail_first(tiny_llama):
    model = tiny_llama.engine
    ids = _ids(64, 5)
    probe, root = _cache_with(model, ids, LAZY)
    per_block = probe.bytes_held // 4
    cache = PrefixCache(budget_bytes=6 * per_block, block_tokens=16)
    run = _run(model, ids, LAZY)
    keys = block_keys(ids.tolist(), root, 16)
    assert cache.insert(keys, *run.shared_rows()) == 4 and cache.bytes_held == 4 * per_block
    hit = cache.lookup(keys, 64)
    other = _ids(64, 6)
    other_keys = block_keys(other.tolist(), root, 16)
    cache.insert(other_keys, *_run(model, other, LAZY).shared_rows())
    # Pinned by the hit: nothing of the first chain goes; the new one cannot stay beyond the budget.
    assert all(key in cache._entries for key in keys)
    cache.release(hit)
    assert cache.bytes_held <= cache.budget_bytes
    cache.insert(other_keys, *_run(model, other, LAZY).shared_rows())
    assert cache.bytes_held <= cache.budget_bytes
    # The first chain, now least recently used, lost its tail (two blocks) before its head.
    assert [key in cache._entries for key in keys] == [True, True, False, False]
    assert all(key in cache._entries for key in other_keys)
    again = cache.lookup(keys, 64)
    assert again.tokens == 32
    cache.release(again)
    assert (cache.hits, cache.misses) == (2, 0) and cache.evictions == 4


def test_a_prefill_from_a_hit_streams_a_whole_transfer(tiny_llama):
    """The frames of the shared layers carry the cached rows too: the decode side needs them all."""
    from helpers import assemble

    from shared.engine import SamplingParams, Stats
    from shared.transfer import end_message, frame_messages, header_message

    model = tiny_llama.engine
    document = _ids(160, 7)
    cache, root = _cache_with(model, document, MULTI)
    prompt = torch.cat([document, _ids(40, 8)])
    hit = cache.lookup(block_keys(prompt.tolist(), root, 16), prompt.shape[0] - MULTI.window)
    frames = []
    run = PrefillRun(model, prompt, MULTI, prefix=hit, on_layer=frames.append)
    while not run.done:
        run.step()
    cache.release(hit)
    messages = [header_message("t", tiny_llama.name, model.spec, model.dtype, prompt.shape[0])]
    for frame in frames:
        messages += frame_messages("t", frame, 1 << 20)
    params = SamplingParams(max_new_tokens=2)
    first = int(run.logits.argmax())
    messages.append(end_message("t", prompt.tolist(), [first], MULTI, params, [b""], len(messages) - 1, Stats()))
    got = assemble(tiny_llama, messages).cache
    for mine, theirs in zip(got.layers, run.cache.layers):
        assert torch.equal(mine.positions, theirs.positions) and torch.equal(mine.k, theirs.k)
    assert torch.equal(got.depth[:200], run.cache.depth[:200])
