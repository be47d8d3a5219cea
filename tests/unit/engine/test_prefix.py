"""The engine's prefix cache: a prefill that starts from cached blocks gives what a prefill from
scratch gives (logits within float32 rounding, the same greedy tokens), computes only the new
tokens at the shared layers, and never shares what pruning computed for another prompt."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine import OFF, PrefillRun, PruneConfig, decode_step, run_prefill
from shared.engine.prefix import PrefixCache, block_keys, held_layers, namespace
from shared.engine.reuse import PrefixReuse

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
    _check_a_hit_equals_scratch(tiny_llama.engine, config)


@pytest.mark.parametrize(
    "config", [OFF, PruneConfig(stages=((3, 0.5),), window=4), MULTI], ids=["off", "lazy", "multi-stage"]
)
def test_a_hit_equals_scratch_on_a_sliding_window_model(load, config):
    # tiny-gemma3: 160 cached tokens are ten windows; the new tokens' sliding layers see only the
    # cached keys within 16 positions, and stages sit at its global layers 1 and 3.
    _check_a_hit_equals_scratch(load("tiny-gemma3").engine, config)


def _check_a_hit_equals_scratch(model, config):
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
    # The survivors were copied down to a chunk of their own: the same rows, and only their bytes held.
    k, v, hidden = run.shared_rows()
    assert torch.equal(again.k, k[:, :, :32]) and torch.equal(again.v, v[:, :, :32])
    assert torch.equal(again.hidden, hidden[:32])
    assert cache.bytes_held == sum(entry.nbytes for entry in cache._entries.values())
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
    messages.append(end_message("t", prompt.tolist(), [first], MULTI, params, len(messages) - 1, Stats()))
    got = assemble(tiny_llama, messages).cache
    for mine, theirs in zip(got.layers, run.cache.layers):
        assert torch.equal(mine.positions, theirs.positions) and torch.equal(mine.k, theirs.k)
    assert torch.equal(got.depth[:200], run.cache.depth[:200])


# ---------------------------------------------------------------- PrefixReuse: what the workers use
def _prefill(reuse: PrefixReuse, ids, config, salt="", **kwargs) -> PrefillRun:
    """A request's prefill through the engine's one door, with this prefix cache."""
    return run_prefill(reuse.model, ids, config, prefix=reuse, salt=salt, **kwargs)[0]


def _reuse(model, budget=1 << 30):
    reuse = PrefixReuse(model, "tiny-llama", budget, block_tokens=16)
    return reuse


def test_tenants_never_share_entries(tiny_llama):
    model = tiny_llama.engine
    reuse = _reuse(model)
    prompt = _ids(100, 13)
    _prefill(reuse, prompt, LAZY, "tenant-a")
    assert _prefill(reuse, prompt, LAZY, "tenant-b").cache.cached_tokens == 0
    assert _prefill(reuse, prompt, LAZY, "tenant-a").cache.cached_tokens == 96


def test_concurrent_prefills_sharing_a_prefix_each_equal_one_from_scratch(tiny_llama):
    import threading

    model = tiny_llama.engine
    reuse = _reuse(model)
    document = _ids(128, 14)
    _prefill(reuse, document, LAZY)
    prompts = [torch.cat([document, _ids(30 + i, 20 + i)]) for i in range(4)]
    results: dict[int, torch.Tensor] = {}

    def ask(i: int) -> None:
        results[i] = _prefill(reuse, prompts[i], LAZY).logits

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(results[i], _run(model, prompt, LAZY).logits, atol=1e-4, rtol=0)
    assert reuse.hit_tokens == 4 * 128
    assert all(entry.pins == 0 for entry in reuse.cache._entries.values())


def test_a_burst_of_distinct_prompts_stays_under_the_budget_and_spares_what_is_in_use(tiny_llama):
    model = tiny_llama.engine
    probe = _reuse(model)
    _prefill(probe, _ids(64, 30), LAZY)
    budget = 3 * probe.cache.bytes_held  # three 64-token prompts' worth
    reuse = _reuse(model, budget)
    document = _ids(64, 31)
    _prefill(reuse, document, LAZY)
    # A prefill from the document is under way (its hit pinned) while the burst comes.
    running = reuse.start(torch.cat([document, _ids(20, 32)]), LAZY)
    assert running.cache.cached_tokens == 64
    for seed in range(40, 52):
        _prefill(reuse, _ids(64, seed), LAZY)
        assert reuse.cache.bytes_held <= budget
    assert all(key in reuse.cache._entries for key in running.prefix_keys[:4])
    while not running.done:
        running.step()
    reuse.finish(running)
    assert reuse.cache.evictions > 0 and reuse.cache.bytes_held <= budget


def _transfer(tiny_llama, run, frames, prompt, config, budget=1 << 20):
    from shared.engine import SamplingParams, Stats
    from shared.transfer import end_message, frame_messages, header_message

    model = tiny_llama.engine
    messages = [header_message("t", tiny_llama.name, model.spec, model.dtype, prompt.shape[0])]
    for frame in frames:
        messages += frame_messages("t", frame, budget)
    first = int(run.logits.argmax())
    params = SamplingParams(max_new_tokens=4)
    messages.append(end_message("t", prompt.tolist(), [first], config, params, len(messages) - 1, Stats()))
    return messages


@pytest.mark.parametrize("config", [LAZY, SHORT_UNPRUNED], ids=["lazy", "short"])
def test_a_transfer_carries_what_lets_the_receiver_cache_the_prompt(tiny_llama, config):
    """The states leaving the first cut of the tokens that went deeper travel with the frames (in
    frames small enough to need several); with the Aux Cache's they give the receiver every token's,
    so its prefix cache gets the entries the sender's got; neither keeps the states after."""
    from helpers import assemble

    model = tiny_llama.engine
    sender, receiver = _reuse(model), _reuse(model)
    prompt = _ids(150, 40)
    frames = []
    run = _prefill(sender, prompt, config, on_layer=frames.append)
    boundary = [frame for frame in frames if frame.boundary_positions is not None]
    assert [frame.layer for frame in boundary] == [held_layers(config, model.spec.num_layers) - 1]
    got = assemble(tiny_llama, _transfer(tiny_llama, run, frames, prompt, config, budget=1024)).cache
    sent = boundary[0]  # the sender's states leaving the last shared layer, as it computed them
    assert torch.equal(got.boundary.rows(150)[sent.boundary_positions], sent.boundary_hidden)
    assert receiver.remember(got, prompt.tolist(), config) == 150 // 16
    for key, entry in sender.cache._entries.items():
        theirs = receiver.cache._entries[key]
        assert torch.equal(entry.k, theirs.k) and torch.equal(entry.hidden, theirs.hidden)
    token = int(run.logits.argmax())
    assert got.boundary is None and run.cache.boundary is None  # cached: neither side keeps them
    decode_step(model, got, token, config)  # decode needs none of them


def test_a_transfer_with_wrong_boundary_rows_is_refused(tiny_llama):
    from helpers import assemble

    from shared.transfer import FrameError

    model = tiny_llama.engine
    prompt = _ids(150, 41)
    frames = []
    run = _prefill(_reuse(model), prompt, LAZY, on_layer=frames.append)
    index = next(i for i, frame in enumerate(frames) if frame.boundary_positions is not None)
    frame = frames[index]
    short = dataclasses.replace(
        frame, boundary_positions=frame.boundary_positions[1:], boundary_hidden=frame.boundary_hidden[1:]
    )
    with pytest.raises(FrameError, match="boundary states must be those of the"):
        assemble(tiny_llama, _transfer(tiny_llama, run, [*frames[:index], short, *frames[index + 1 :]], prompt, LAZY))


def test_a_prefill_from_what_is_left_after_eviction_equals_one_from_scratch(tiny_llama):
    """The chain lost its tail to the budget: the head that is left is a shorter hit, and a
    prefill from it still gives what one from scratch gives."""
    model = tiny_llama.engine
    probe = _reuse(model)
    document = _ids(128, 50)
    _prefill(probe, document, LAZY)
    per_block = probe.cache.bytes_held // 8
    reuse = _reuse(model, budget=10 * per_block)
    _prefill(reuse, document, LAZY)
    _prefill(reuse, _ids(64, 51), LAZY)  # 4 more blocks: the document's tail goes first
    assert reuse.cache.evictions == 2
    prompt = torch.cat([document, _ids(30, 52)])
    warm = _prefill(reuse, prompt, LAZY)
    assert warm.cache.cached_tokens == 96
    torch.testing.assert_close(warm.logits, _run(model, prompt, LAZY).logits, atol=1e-4, rtol=0)


def test_a_fork_leaves_the_boundary_states_with_the_original(tiny_llama):
    """Another choice's copy of a prefilled cache needs no boundary states: only the original's
    prompt is cached from them, and `remember` drops them once it has (cached or not)."""
    model = tiny_llama.engine
    run = _run(model, _ids(40, 43), LAZY)
    fork = run.cache.fork()
    assert fork.boundary is None and run.cache.boundary is not None
    assert fork.bytes_held == run.cache.bytes_held - run.cache.boundary.nbytes
    _reuse(model).remember(run.cache, _ids(40, 43).tolist(), LAZY)
    assert run.cache.boundary is None
