"""The decode worker's engine loop: continuous batching of every running sequence.

Its rounds run on the worker's ComputeThread (shared.compute), the only thread of the
process that touches the model; other threads hand it work with `call`. Each round has
nano-vllm's three parts:
- schedule: the sequences that can step (prompt in the cache, not finished, not cancelled, their
  reader not `max_unsent` tokens behind), at most `max_batch_size`, those that waited longest
  first; a new sequence joins at the next round, a finished or cancelled one leaves at once; and
  the prompts waiting to be prefilled here (short prompts the router sends), oldest first;
- run: whole layers of the waiting prompts, oldest first, within the round's row budget
  (services.decode.budget: it grows with the queue, shrinks with an ITL target; with nothing
  decoding the oldest runs to its end at once), so that several prompts advance in one round
  and a short one finishes in one; then one `decode_batch` over the batch (the weights are read
  once per round, not once per sequence; their K/V sit in one DecodeSlots, so each layer attends
  in one call). The decode step keeps its place in every round;
- postprocess: each sequence samples its own row with its own generator (a seeded request gives
  the same tokens batched or alone), its tokens go to its outbox, the finished retire.

A local prefill is chunked at layer granularity (engine.PrefillRun): a stage layer's selection
needs the last queries' attention over the whole prompt, which a token-chunked layer would only
have after its last chunk, and whole layers keep the cache bit-identical to an unchunked prefill.
Prompts of one round run one after another, each its own calls: rows of two prompts in one call
would give each row numbers that depend on the other prompt's length (the BLAS blocks by rows).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from services.decode.budget import PrefillBudget, Waiting
from shared.compute import ComputeThread
from shared.contract import Sampled
from shared.engine import (
    DecodeSlots,
    Decoding,
    EngineModel,
    Generation,
    PrefillRun,
    PrefixReuse,
    SamplingParams,
    abandon_prefill,
    choice_decodings,
    decode_batch,
    finish_prefill,
)
from shared.engine.grammar import Grammars
from shared.load import PrefillRate
from shared.net.rpc import InvalidArgument, ResourceExhausted

log = logging.getLogger(__name__)


# What a sequence's outbox carries to the thread that answers its request: tokens of a choice,
# then that choice's one end (finished, cancelled or failed).
@dataclass(frozen=True)
class ChoiceToken:
    index: int  # which choice of the request
    sampled: Sampled


@dataclass(frozen=True)
class ChoiceFinished:
    index: int
    reason: str  # OpenAI's finish_reason: "stop" or "length"


@dataclass(frozen=True)
class ChoiceCancelled:
    index: int


@dataclass(frozen=True)
class ChoiceFailed:
    index: int
    message: str  # for the client: what failed, without internals


ChoiceEnd = ChoiceFinished | ChoiceCancelled | ChoiceFailed


@dataclass(eq=False)  # identity: a sequence is found in the active list by `is`
class Sequence:
    """One request on the engine thread: a local prefill still running, or a decode loop."""

    request_id: str
    generation: Generation
    decoding: Decoding | None = None  # once the prompt is in the cache
    prefill: PrefillRun | None = None  # a local prefill not finished yet
    params: SamplingParams | None = None  # with `prefill`: how to decode after it (all its choices)
    # ChoiceToken ... then a ChoiceEnd per choice; the choices of one request (index 0..n-1)
    # share one outbox and one cancelled event.
    outbox: queue.Queue[ChoiceToken | ChoiceEnd] = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    index: int = 0  # which choice of its request
    num_choices: int = 1  # how many choices its request has (sampling n)
    choices: list[Sequence] = field(default_factory=list)  # its request's choices by index, itself included
    # For the prefix cache: the prompt, and the tenant it is cached under.
    prompt_ids: list[int] = field(default_factory=list)
    cache_salt: str = ""
    depths: bool = False  # a local prefill's first choice reports token depths (return_token_depths)
    # A local continuation's tokens so far (generated_ids): replayed as decode steps, or, when
    # prefilled with the prompt, counted as generated once its prefill is done (`answered`).
    replayed: list[int] = field(default_factory=list)
    answered: list[int] = field(default_factory=list)
    arrived_s: float = field(default_factory=time.monotonic)  # a local prefill's wait counts from here

    def __post_init__(self):
        self.choices = self.choices or [self]

    @classmethod
    def resumed(
        cls,
        request_id: str,
        decodings: list[Decoding],
        first_tokens: list[int],
        prompt_ids: list[int] | None = None,
        cache_salt: str = "",
    ) -> list[Sequence]:
        """A transferred cache, one Decoding per choice: each first token was sampled by the prefill
        worker and sent already."""
        outbox, cancelled, choices = queue.Queue(), threading.Event(), []
        for index, (decoding, token) in enumerate(zip(decodings, first_tokens)):
            decoding.accept(token)
            sequence = cls(request_id, decoding.generation, decoding=decoding, outbox=outbox, cancelled=cancelled)
            sequence.index, sequence.num_choices, sequence.choices = index, len(decodings), choices
            sequence.prompt_ids, sequence.cache_salt = prompt_ids or [], cache_salt
            choices.append(sequence)
        return choices

    @classmethod
    def local(cls, request_id: str, run: PrefillRun, params: SamplingParams, cache_salt: str = "") -> Sequence:
        """A prompt to prefill here; its other choices (params.n) join when the prefill is done."""
        prompt_ids = run.prompt_ids.tolist()
        return cls(
            request_id,
            Generation(),
            prefill=run,
            params=params,
            num_choices=params.n,
            prompt_ids=prompt_ids,
            cache_salt=cache_salt,
        )

    @property
    def slots(self) -> int:
        """Sequences it counts for: a local prefill counts its choices to come."""
        return self.num_choices if self.prefill is not None else 1

    @property
    def bytes_held(self) -> int:
        if self.decoding is not None:
            return self.decoding.cache.bytes_held
        return self.prefill.cache.bytes_held if self.prefill is not None else 0


# Tokens a sequence may have made that its client has not taken yet. A slow reader pauses its
# own sequence here (it sits out of the batch) instead of buffering without bound or holding the
# engine; the others keep stepping.
MAX_UNSENT_TOKENS = 256


class Scheduler:
    def __init__(
        self,
        model: EngineModel,
        max_sequences: int,
        max_batch_size: int = 32,
        max_batch_tokens: int = 2048,
        max_unsent: int = MAX_UNSENT_TOKENS,
        grammars: Grammars | None = None,
        prefix: PrefixReuse | None = None,
        compute: ComputeThread | None = None,
        budget: PrefillBudget | None = None,
    ):
        self.model, self.grammars = model, grammars  # grammars: for structured output
        # The prefix cache: a local prefill leaves its prompt there.
        self.prefix = prefix
        self.max_sequences, self.max_unsent = max_sequences, max_unsent
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        # Rows of local prefill each round may run beside its decode step.
        self.budget = budget or PrefillBudget(max_batch_tokens)
        # Every decoding sequence's K/V, a slot each: a step's layer is one write and one attention call.
        self.slots = DecodeSlots(model.spec, model.dtype, model.device)
        self.revived_token_layers = 0  # over finished sequences
        self.steps = 0  # batched decode steps run
        # Local prefill: its recent rate (the router predicts waits with it), the rounds that ran
        # some and the rows they ran, the prompts waiting now.
        self.prefill_rate = PrefillRate(model.spec.num_layers)
        self.prefill_rounds = 0
        self.prefill_rows = 0
        self.prefills_waiting = 0
        self._active: list[Sequence] = []  # in turn order: the front waited longest
        self._lock = threading.Lock()  # _active: changed on the compute thread, read by Status
        self._closed = False
        # The thread that loaded the model, or one of its own (tests hand it a model loaded elsewhere).
        self._owns_compute = compute is None
        self.compute = compute or ComputeThread("decode-engine")
        self.compute.drive(self._tick)

    def call(self, fn, /, *args, **kwargs):
        """Run `fn` on the engine's thread, between rounds (a request's setup, a transfer's frames)."""
        return self.compute.call(fn, *args, **kwargs)

    def submit(self, *sequences: Sequence) -> None:
        """Take a request's sequences (its choices), all or none."""
        self.compute.call(self._admit, sequences)

    def _admit(self, sequences: tuple[Sequence, ...]) -> None:
        needs = sum(sequence.slots for sequence in sequences)
        if needs > self.max_sequences:  # waiting cannot help: the gateway checks this before sending
            raise InvalidArgument(
                f"the request needs {needs} sequences at once; this worker generates at most {self.max_sequences}"
            )
        with self._lock:
            held = sum(sequence.slots for sequence in self._active)
            if held + needs > self.max_sequences:
                # Full, not broken: the gateway puts the request back in its queue.
                raise ResourceExhausted(
                    f"this worker is generating {held} of its {self.max_sequences} sequences; the request needs {needs}"
                )
            self._active.extend(sequences)

    @property
    def num_active(self) -> int:
        with self._lock:
            return len(self._active)

    def bytes_held(self) -> int:
        with self._lock:
            active = list(self._active)
        return sum(sequence.bytes_held for sequence in active)

    def close(self, reason: str = "the decode worker is shutting down") -> None:
        """Fail what is running (its streams end with `reason`) and stop; a second call does nothing."""
        with self._lock:
            closed, self._closed = self._closed, True
        if closed:
            return
        self.compute.call(self._shutdown, reason)
        if self._owns_compute:
            self.compute.close()

    def _shutdown(self, reason: str) -> None:
        self.compute.undrive(self._tick)
        with self._lock:
            active, self._active = self._active, []
        for sequence in active:
            sequence.outbox.put(ChoiceFailed(sequence.index, reason))

    def _tick(self) -> float | None:
        """One round, as the compute thread's driver: how long it may wait for a job before the next."""
        with self._lock:
            active = list(self._active)
        if not active:
            return None
        try:
            return self._round(active)
        except Exception:  # a bug in one round must not stop the engine thread
            log.exception("decode round failed")
            for sequence in active:
                self._retire(sequence, ChoiceFailed(sequence.index, "generation failed: internal error"))
            return 0

    # ------------------------------------------------------------------ one round
    def _round(self, active: list[Sequence]) -> float:
        batch, waiting = self._schedule(active)
        self.prefills_waiting = len(waiting)
        started = time.perf_counter()
        rows = 0
        if waiting:
            now = time.monotonic()
            line = [Waiting(self._rows_left(s.prefill), now - s.arrived_s) for s in waiting]
            rows = self._advance_prefills(waiting, self.budget.rows(len(batch), line))
            self.prefill_rounds += 1
            self.prefill_rows += rows
        if batch:
            stepped = time.perf_counter()
            self._decode(batch)
            self.budget.observe_step(time.perf_counter() - stepped)
        if waiting:  # the whole round: a prompt waiting here also waits for the decode step
            self.prefill_rate.add(rows, time.perf_counter() - started)
        if batch or waiting:
            return 0
        return 0.005  # every reader is behind: wait for one to take its tokens

    def _schedule(self, active: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        batch, waiting = [], []
        for sequence in active:
            decoding = sequence.decoding
            if sequence.cancelled.is_set():
                self._retire(sequence, ChoiceCancelled(sequence.index))
            elif decoding is not None and decoding.done:
                self._retire(sequence, ChoiceFinished(sequence.index, sequence.generation.finish_reason))
            elif sequence.prefill is not None:
                waiting.append(sequence)
            elif len(batch) < self.max_batch_size and sequence.outbox.qsize() < self.max_unsent * sequence.num_choices:
                batch.append(sequence)
        if len(batch) == self.max_batch_size:
            with self._lock:  # those that stepped go to the back: the others go first next time
                stepped = set(map(id, batch))
                self._active.sort(key=lambda sequence: id(sequence) in stepped)
        return batch, waiting

    def _rows_left(self, run: PrefillRun) -> int:
        """At most this many rows still to compute: the live set only shrinks with depth."""
        return run.next_rows * (self.model.spec.num_layers - run.layer)

    def _advance_prefills(self, waiting: list[Sequence], budget: int | None) -> int:
        """Whole layers of the waiting prompts, oldest first, within `budget` rows (None: the
        oldest to its end); at least one layer of the oldest. Returns the rows run. A prompt
        whose next layer does not fit stops the round's prefill: a later one does not pass it."""
        rows, started = 0, time.perf_counter()
        for sequence in waiting:
            run = sequence.prefill
            try:
                while not run.done and (budget is None or rows == 0 or rows + run.next_rows <= budget):
                    rows += run.step()
            except Exception as error:
                log.exception("local prefill of %s failed", sequence.request_id)
                self._retire(sequence, ChoiceFailed(sequence.index, f"generation failed: {type(error).__name__}"))
                continue
            if not run.done:
                break
            self._finish_prefill(sequence)
            if budget is None:  # it decodes from the next round on: the others wait for a budget
                break
        # The round's mix of layers (a pruned layer's few rows cost more each): one observation.
        self.budget.observe_rows(rows, time.perf_counter() - started)
        return rows

    def _finish_prefill(self, sequence: Sequence) -> None:
        run = sequence.prefill
        stats = finish_prefill(run, self.prefix)
        # Every choice decodes from the one prefill and joins the batch from here.
        decodings = choice_decodings(run.cache, run.config, sequence.params, sequence.prompt_ids, self.grammars, stats)
        decodings[0].depths = sequence.depths
        decodings[0].replay(sequence.replayed)  # checked when it arrived (DecodeServicer._replayed)
        decodings[0].resume(sequence.answered)
        siblings = [sequence] + [
            Sequence(
                sequence.request_id,
                d.generation,
                outbox=sequence.outbox,
                cancelled=sequence.cancelled,
                index=i,
                prompt_ids=sequence.prompt_ids,
                cache_salt=sequence.cache_salt,
            )
            for i, d in enumerate(decodings[1:], start=1)
        ]
        for sibling, decoding in zip(siblings, decodings):
            sibling.decoding, sibling.generation = decoding, decoding.generation
            sibling.num_choices, sibling.choices = len(decodings), sequence.choices
        sequence.choices.extend(siblings[1:])
        sequence.prefill = None
        with self._lock:
            self._active.extend(siblings[1:])
        for sibling in siblings:
            self._emit(sibling, run.logits)

    def _decode(self, batch: list[Sequence]) -> None:
        steps = [(s.decoding.cache, s.decoding.next_token, s.decoding.config) for s in batch]
        try:
            logits = decode_batch(self.model, steps, self.slots)
        except Exception as error:
            # Each cache took part of this step, so none can be retried: all of them fail.
            log.exception("a decode step of %d sequences failed", len(batch))
            for sequence in batch:
                self._retire(sequence, ChoiceFailed(sequence.index, f"generation failed: {type(error).__name__}"))
            return
        self.steps += 1
        for sequence, row in zip(batch, logits):
            self._emit(sequence, row)

    def _emit(self, sequence: Sequence, logits) -> None:
        sampled = sequence.decoding.advance(logits)
        if sampled is not None:
            sequence.outbox.put(ChoiceToken(sequence.index, sampled))
        if sequence.decoding.done:
            self._retire(sequence, ChoiceFinished(sequence.index, sequence.generation.finish_reason))

    def _retire(self, sequence: Sequence, end: ChoiceEnd) -> None:
        """Take a sequence out: its stats filled, then its last outbox item; nothing of it stays."""
        with self._lock:
            if sequence not in self._active:
                return
            self._active.remove(sequence)
        if sequence.decoding is not None:
            sequence.decoding.close(self.model.spec.num_layers)
            self.slots.leave(sequence.decoding.cache, keep=False)  # its stats are taken: no copy back
            self.revived_token_layers += sequence.generation.stats.revived_token_layers
        # A finished sequence's answer is not cached: decode computed its tokens one query row
        # at a time, which a prefill of the same text does not reproduce bit for bit; the next
        # turn starts from its cached prompt and prefills the answer (docs/results.md).
        if sequence.prefill is not None:
            abandon_prefill(sequence.prefill, self.prefix)  # a local prefill that did not finish
        sequence.prefill = None
        sequence.outbox.put(end)
