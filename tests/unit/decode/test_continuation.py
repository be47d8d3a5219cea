"""A migrated choice's continuation on the decode engine: its tokens so far are replayed as decode
steps (not sampled, not sent again), and what follows is what the first run gave after them."""

from __future__ import annotations

import pytest
import torch

from services.decode.scheduler import ChoiceFinished, Scheduler, Sequence
from shared.engine import Decoding, Generation, PrefillRun, SamplingParams, prefill
from shared.engine.sampling import Sampler, position_seed
from tests.unit.decode.test_scheduler import LAZY, Reader, _ids

GREEDY = SamplingParams(max_new_tokens=24)
# Sampling with everything that depends on the tokens so far: the seeded draw at each position,
# the penalties' counts and min_tokens.
SAMPLED = SamplingParams(
    max_new_tokens=24, temperature=1.0, top_p=0.9, seed=7, repetition_penalty=1.2, frequency_penalty=0.5, min_tokens=4
)


@pytest.fixture
def scheduler(tiny_llama):
    scheduler = Scheduler(tiny_llama.engine, max_sequences=8, max_batch_size=8, max_batch_tokens=64)
    yield scheduler
    scheduler.close()


def _run(scheduler, sequence: Sequence) -> tuple[list[int], object]:
    reader = Reader(sequence)
    scheduler.submit(sequence)
    return reader.wait()


def _local(model, ids, params, replayed=()) -> Sequence:
    sequence = Sequence.local("c", PrefillRun(model, ids, LAZY, reserve=params.max_new_tokens), params)
    sequence.replayed = list(replayed)
    return sequence


def _transferred(model, ids, params, replayed) -> Sequence:
    """As a continuation arrives with a transfer: the prefill worker's first token is replaced by
    the choice's own first token, the rest replayed."""
    cache, _ = prefill(model, ids, LAZY, reserve=params.max_new_tokens)
    decoding = Decoding(cache, LAZY, params, Generation(), prompt_ids=ids.tolist())
    decoding.replay(list(replayed[1:]))
    [sequence] = Sequence.resumed("c", [decoding], [replayed[0]], ids.tolist())
    return sequence


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("source", ["local", "transfer"])
def test_a_continuation_gives_what_the_first_run_gave_after_its_tokens(tiny_llama, scheduler, params, source):
    model, ids = tiny_llama.engine, _ids(tiny_llama.engine, 40, 3)
    tokens, end = _run(scheduler, _local(model, ids, params))
    assert len(tokens) == params.max_new_tokens and isinstance(end, ChoiceFinished)
    for cut in (1, 5, params.max_new_tokens - 1):
        make = _local if source == "local" else _transferred
        rest, end = _run(scheduler, make(model, ids, params, tokens[:cut]))
        assert rest == tokens[cut:], f"after {cut} replayed tokens"
        assert end == ChoiceFinished(0, "length")


def test_a_seeded_draw_depends_on_its_position_not_on_the_draws_before():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=11)
    fresh, used = Sampler(params), Sampler(params)
    for _ in range(5):  # draws that a continuation's worker never made
        used.choose(logits)
    fresh.generated = used.generated = 5
    assert [fresh.choose(logits).token for _ in range(20)] == [used.choose(logits).token for _ in range(20)]
    assert len({position_seed(11, k) for k in range(1000)} | {position_seed(12, k) for k in range(1000)}) == 2000


def test_replay_refuses_what_cannot_be_a_choice_so_far(tiny_llama):
    model, ids = tiny_llama.engine, _ids(tiny_llama.engine, 10, 1)
    cache, _ = prefill(model, ids, LAZY, reserve=8)
    decoding = Decoding(cache, LAZY, SamplingParams(max_new_tokens=4, stop_token_ids=(2,)), Generation())
    with pytest.raises(ValueError, match="leave nothing"):
        decoding.replay([5, 6, 7, 8])
    with pytest.raises(ValueError, match="stop token 2"):
        decoding.replay([5, 2])


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_a_continuation_prefilled_with_its_answer_counts_it_as_generated(tiny_llama, scheduler, params):
    """Off --batch-invariant the decode worker prefills the answer so far with the prompt (one
    pruned prefill instead of a decode step per token); the tokens after it are the model's
    continuation of that text, and the limits count the answer as generated."""
    model, ids = tiny_llama.engine, _ids(tiny_llama.engine, 40, 3)
    tokens, _ = _run(scheduler, _local(model, ids, params))
    cut = 9
    both = torch.cat([ids, torch.tensor(tokens[:cut])])
    sequence = Sequence.local("c", PrefillRun(model, both, LAZY, reserve=params.max_new_tokens), params)
    sequence.answered = tokens[:cut]
    rest, end = _run(scheduler, sequence)
    assert len(rest) == params.max_new_tokens - cut and end == ChoiceFinished(0, "length")
    # The same prefill's logits give the first token after the answer, at position `cut`'s seed.
    cache, logits = prefill(model, both, LAZY, reserve=params.max_new_tokens)
    decoding = Decoding(cache, LAZY, params, Generation(), prompt_ids=both.tolist())
    decoding.resume(tokens[:cut])
    assert decoding.advance(logits).token == rest[0]
    assert decoding.generation.stats.completion_tokens == cut + 1
