"""The decode engine thread on a real (tiny) model: batching, chunked local prefill, slow readers,
failures and cancellation."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.decode.budget import PrefillBudget
from services.decode.scheduler import (
    ChoiceCancelled,
    ChoiceFailed,
    ChoiceFinished,
    ChoiceToken,
    Scheduler,
    Sequence,
)
from shared.engine import OFF, Decoding, Generation, PrefillRun, PruneConfig, SamplingParams, generate, prefill

LAZY = PruneConfig(stages=((1, 0.5), (3, 0.2)))


def _ids(model, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, model.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _local(model, name: str, ids, config, params) -> Sequence:
    return Sequence.local(name, PrefillRun(model, ids, config, reserve=params.max_new_tokens), params)


def _resumed(model, name: str, ids, config, params) -> Sequence:
    """As a transfer arrives: prefilled elsewhere, the first token sampled and sent already."""
    cache, logits = prefill(model, ids, config, reserve=params.max_new_tokens)
    decoding = Decoding(cache, config, params, Generation())
    [sequence] = Sequence.resumed(name, [decoding], [decoding.sampler(logits)])
    return sequence


class Reader:
    """Drains an outbox on its own thread, stamping each item's arrival."""

    def __init__(self, sequence: Sequence):
        self.items: list[tuple[float, object]] = []  # (arrival, outbox message)
        self.thread = threading.Thread(target=self._read, args=(sequence,), daemon=True)
        self.thread.start()

    def _read(self, sequence):
        while True:
            message = sequence.outbox.get(timeout=60)
            self.items.append((time.monotonic(), message))
            if not isinstance(message, ChoiceToken):
                return

    def wait(self):
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "the sequence never finished"
        tokens = [message.sampled.token for _, message in self.items if isinstance(message, ChoiceToken)]
        return tokens, self.items[-1][1]


def _decoding_stream(scheduler: Scheduler, model) -> tuple[Sequence, Reader]:
    """A long answer submitted and decoding (its first token out) before the test goes on."""
    stream = _local(model, "stream", _ids(model, 16, 1), OFF, SamplingParams(max_new_tokens=400))
    reader = Reader(stream)
    scheduler.submit(stream)
    while not reader.items:
        time.sleep(0.001)
    return stream, reader


@pytest.fixture
def scheduler(tiny_llama):
    scheduler = Scheduler(tiny_llama.engine, max_sequences=8, max_batch_size=8, max_batch_tokens=64, max_unsent=8)
    yield scheduler
    scheduler.close()


def test_batched_sequences_give_what_each_gives_alone(tiny_llama, scheduler):
    model = tiny_llama.engine
    cases = [
        ("local-off", 20, OFF, SamplingParams(max_new_tokens=15), _local),
        ("local-lazy-seeded", 300, LAZY, SamplingParams(max_new_tokens=12, temperature=0.8, seed=4), _local),
        ("resumed-lazy", 700, LAZY, SamplingParams(max_new_tokens=18), _resumed),
        (
            "resumed-static-seeded",
            200,
            LAZY.model_copy(update={"mode": "static"}),
            SamplingParams(max_new_tokens=10, temperature=1.0, seed=9),
            _resumed,
        ),
    ]
    sequences, readers = [], []
    for seed, (name, n, config, params, make) in enumerate(cases):
        sequences.append(make(model, name, _ids(model, n, seed), config, params))
        readers.append(Reader(sequences[-1]))
    for sequence in sequences:
        scheduler.submit(sequence)
    for seed, ((name, n, config, params, _), sequence, reader) in enumerate(zip(cases, sequences, readers)):
        tokens, end = reader.wait()
        alone = generate(model, _ids(model, n, seed), config, params)
        # A resumed sequence's first token went out with the transfer's reply, not through here.
        assert tokens == (alone.tokens if name.startswith("local") else alone.tokens[1:]), name
        assert end == ChoiceFinished(0, alone.finish_reason)
        assert sequence.generation.stats.revived_token_layers == alone.stats.revived_token_layers
    total = sum(params.max_new_tokens for _, _, _, params, _ in cases)
    assert scheduler.steps < total - len(cases)  # steps were shared, not one per token
    assert scheduler.num_active == 0 and scheduler.bytes_held() == 0


def test_a_stream_keeps_receiving_tokens_while_a_long_local_prefill_runs(tiny_llama, scheduler):
    model = tiny_llama.engine
    stream, stream_reader = _decoding_stream(scheduler, model)
    submitted = time.monotonic()
    long = _local(model, "long-prompt", _ids(model, 1800, 2), OFF, SamplingParams(max_new_tokens=2))
    long_reader = Reader(long)
    scheduler.submit(long)
    long_tokens, _ = long_reader.wait()
    first_token_at = next(at for at, message in long_reader.items if isinstance(message, ChoiceToken))
    during = [
        at
        for at, message in stream_reader.items
        if isinstance(message, ChoiceToken) and submitted < at < first_token_at
    ]
    # One layer (1800 rows, over the 64-row budget) per round, a decode step between layers.
    assert len(during) >= model.spec.num_layers - 1
    assert long_tokens == generate(model, _ids(model, 1800, 2), OFF, SamplingParams(max_new_tokens=2)).tokens
    stream.cancelled.set()
    assert stream_reader.wait()[1] == ChoiceCancelled(0)


def test_a_reader_that_falls_behind_pauses_only_its_own_sequence(tiny_llama, scheduler):
    model = tiny_llama.engine
    endless = _local(model, "slow-reader", _ids(model, 12, 3), OFF, SamplingParams(max_new_tokens=1000))
    scheduler.submit(endless)
    deadline = time.monotonic() + 10
    while endless.outbox.qsize() < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    quick = _local(model, "quick", _ids(model, 12, 4), OFF, SamplingParams(max_new_tokens=20))
    reader = Reader(quick)
    scheduler.submit(quick)
    tokens, end = reader.wait()
    assert len(tokens) == 20 and end == ChoiceFinished(0, "length")
    assert endless.outbox.qsize() == 8  # bounded: not one token more than the cap
    for _ in range(5):
        endless.outbox.get_nowait()  # the reader catches up a little: its sequence moves again
    deadline = time.monotonic() + 10
    while endless.outbox.qsize() < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert endless.outbox.qsize() == 8
    endless.cancelled.set()
    deadline = time.monotonic() + 10
    while scheduler.num_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.num_active == 0 and scheduler.bytes_held() == 0


def test_a_failed_prefill_stays_with_its_sequence(tiny_llama, scheduler):
    model = tiny_llama.engine
    good = _local(model, "good", _ids(model, 30, 5), OFF, SamplingParams(max_new_tokens=6))
    # A token id past the vocabulary: the embedding lookup fails inside the engine thread.
    bad = _local(model, "bad", torch.tensor([5, model.spec.vocab_size + 10]), OFF, SamplingParams(max_new_tokens=6))
    readers = [Reader(good), Reader(bad)]
    scheduler.submit(good)
    scheduler.submit(bad)
    good_tokens, good_end = readers[0].wait()
    _, bad_end = readers[1].wait()
    assert isinstance(bad_end, ChoiceFailed) and "IndexError" in bad_end.message
    assert good_end == ChoiceFinished(0, "length") and len(good_tokens) == 6
    follow = _local(model, "after", _ids(model, 30, 6), OFF, SamplingParams(max_new_tokens=3))
    reader = Reader(follow)
    scheduler.submit(follow)  # the engine thread lives on
    assert reader.wait()[1] == ChoiceFinished(0, "length")


def test_the_batch_size_caps_a_step_and_everyone_gets_turns(tiny_llama):
    model = tiny_llama.engine
    scheduler = Scheduler(model, max_sequences=6, max_batch_size=2, max_batch_tokens=64)
    try:
        sequences = [
            _local(model, f"s{i}", _ids(model, 10 + i, i), OFF, SamplingParams(max_new_tokens=8)) for i in range(5)
        ]
        readers = [Reader(s) for s in sequences]
        for sequence in sequences:
            scheduler.submit(sequence)
        for i, reader in enumerate(readers):
            tokens, end = reader.wait()
            assert tokens == generate(model, _ids(model, 10 + i, i), OFF, SamplingParams(max_new_tokens=8)).tokens
        # 5 sequences x 7 decode steps each, 2 per step: at least 18 steps.
        assert scheduler.steps >= 18
    finally:
        scheduler.close()


def _first_token_at(reader: Reader) -> float:
    return next(at for at, message in reader.items if isinstance(message, ChoiceToken))


def test_waiting_prompts_advance_together_and_each_equals_its_prefill_alone(tiny_llama):
    model = tiny_llama.engine
    # A round's budget that holds three short prompts whole: they finish in the round they arrive in.
    budget = PrefillBudget(4096, growth=4)
    scheduler = Scheduler(model, max_sequences=8, max_batch_size=8, max_batch_tokens=4096, budget=budget)
    try:
        stream, stream_reader = _decoding_stream(scheduler, model)  # from here each round has a budget
        cases = [(40, OFF), (55, LAZY), (70, OFF)]
        prompts = [
            _local(model, f"p{i}", _ids(model, n, 20 + i), config, SamplingParams(max_new_tokens=4))
            for i, (n, config) in enumerate(cases)
        ]
        readers = [Reader(prompt) for prompt in prompts]
        rounds = scheduler.prefill_rounds
        # All three arrive between two rounds (on the engine thread, submit admits at once).
        scheduler.call(lambda: [scheduler.submit(prompt) for prompt in prompts])
        for i, ((n, config), reader) in enumerate(zip(cases, readers)):
            tokens, end = reader.wait()
            assert tokens == generate(model, _ids(model, n, 20 + i), config, SamplingParams(max_new_tokens=4)).tokens
            assert end == ChoiceFinished(0, "length")
        assert scheduler.prefill_rounds == rounds + 1  # one round prefilled all three
        assert scheduler.prefill_rate.tokens_per_s > 0
        stream.cancelled.set()
        stream_reader.wait()
    finally:
        scheduler.close()


def test_a_budget_too_small_for_two_prompts_serves_them_first_come_first_served(tiny_llama, scheduler):
    model = tiny_llama.engine
    stream, stream_reader = _decoding_stream(scheduler, model)
    # 100 rows a layer against a 64-row budget: one layer of the oldest per round, nothing more.
    prompts = [
        _local(model, f"p{i}", _ids(model, 100, 30 + i), OFF, SamplingParams(max_new_tokens=2)) for i in range(3)
    ]
    readers = [Reader(prompt) for prompt in prompts]
    scheduler.call(lambda: [scheduler.submit(prompt) for prompt in prompts])
    for reader in readers:
        reader.wait()
    firsts = [_first_token_at(reader) for reader in readers]
    assert firsts == sorted(firsts)
    # The stream's own prefill (nothing decoding: one round), then a round per layer of each prompt,
    # never two prompts in one round.
    assert scheduler.prefill_rounds == 1 + 3 * model.spec.num_layers
    stream.cancelled.set()
    stream_reader.wait()
