"""Text in, text out over the in-process engine: a TextModel plus the weights.

The engine sees token ids only; the text side (tokenizer, template, stop strings) is shared.models.text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from shared.api.logprobs import LogprobFormatter
from shared.api.schemas import ChatCompletion, TextCompletion
from shared.api.serving import Output, RequestError, build_response, parse_request, prepare_all
from shared.engine import (
    Generation,
    PrefixReuse,
    PruneConfig,
    Sampler,
    SamplingParams,
    choice_decodings,
    run_decoding,
    run_prefill,
    stream,
)
from shared.models.text import Detokenizer, TextModel
from shared.models.weights import LoadedModel


@dataclass
class Completion:
    text: str = ""
    generation: Generation = field(default_factory=Generation)
    num_read: int = 0  # tokens taken from the engine (a stop string may end it before the last)

    @property
    def finish_reason(self) -> str:
        return self.generation.finish_reason


class LLM(TextModel):
    def __init__(
        self,
        loaded: LoadedModel,
        default_preset: str = "default",
        prefix: PrefixReuse | None = None,
        chat_template: str | None = None,
    ):
        if loaded.tokenizer is None:
            raise ValueError(f"model {loaded.name} has no tokenizer; text requests need one")
        spec, stops = loaded.engine.spec, loaded.stop_token_ids
        super().__init__(loaded.name, loaded.tokenizer, spec, stops, default_preset, chat_template)
        self.loaded = loaded
        self.engine = loaded.engine
        self.formatter = LogprobFormatter(loaded.tokenizer)
        self.prefix = prefix  # a prefix cache: a batch's lines that share a document prefill it once

    def stream_text(
        self,
        ids: list[int],
        sampling: SamplingParams,
        pruning: PruneConfig,
        stop: list[str] | None = None,
        completion: Completion | None = None,
    ) -> Iterator[str]:
        """Yield text deltas as tokens come (one choice); `completion` holds the final text and stats."""
        completion = completion if completion is not None else Completion()
        sampler = Sampler(sampling, prompt_ids=ids, grammars=self.loaded.grammars)
        tokens = stream(self.engine, ids, pruning, sampling, completion.generation, sampler, self.prefix)
        yield from _read(tokens, Detokenizer(self.tokenizer, stop), completion)

    def complete(self, ids, sampling, pruning, stop=None) -> Completion:
        """One choice to the end (sampling.n must be 1; `complete_choices` takes any n)."""
        [completion] = self.complete_choices(ids, sampling, pruning, stop)
        return completion

    def complete_choices(
        self, ids, sampling: SamplingParams, pruning: PruneConfig, stop=None, depths: bool = False
    ) -> list[Completion]:
        """Every choice (sampling.n) decoded from one prefill, each with its own copy of the cache."""
        ids_t = torch.as_tensor(ids, dtype=torch.long)
        run, stats = run_prefill(self.engine, ids_t, pruning, prefix=self.prefix, reserve=sampling.max_new_tokens)
        logits, completions = run.logits, []
        decodings = choice_decodings(run.cache, pruning, sampling, ids, self.loaded.grammars, stats)
        decodings[0].depths = depths  # return_token_depths: the first choice reports them
        for decoding in decodings:
            completion = Completion(generation=decoding.generation)
            tokens = run_decoding(self.engine, decoding, logits)
            for _ in _read(tokens, Detokenizer(self.tokenizer, stop), completion):
                pass
            completions.append(completion)
        return completions


def _read(tokens: Iterator[int], detokenizer: Detokenizer, completion: Completion) -> Iterator[str]:
    """The same loop as the gateway's TextJob.deltas, over an in-process token stream."""
    for token in tokens:
        completion.num_read += 1
        if delta := detokenizer.add([token]):
            yield delta
        if detokenizer.stopped:
            completion.generation.finish_reason = "stop"
            tokens.close()  # runs the generator's cleanup, so stats are filled
            break
    completion.text = detokenizer.text
    if rest := detokenizer.flush():
        yield rest
    completion.text = detokenizer.text


def respond(llm: LLM, url: str, body: dict) -> ChatCompletion | TextCompletion:
    """Run one request to completion (no streaming). Raises RequestError for bad input."""
    request = parse_request(url, body)
    if request.stream:
        raise RequestError(400, "stream is not available here", param="stream")
    outputs, stats, cached = [], [], 0
    all_prepared = prepare_all(llm, request)
    for prepared in all_prepared:  # each prompt of a list, each with its n choices
        completions = llm.complete_choices(
            prepared.ids, prepared.sampling, prepared.pruning, prepared.stop, prepared.token_depths
        )
        outputs += [
            Output(prepared.echo + c.text, c.finish_reason, c.generation.logprobs[: c.num_read], len(prepared.echo))
            for c in completions
        ]
        stats += [c.generation.stats for c in completions]
        cached += completions[0].generation.stats.cached_tokens  # one prefill serves its choices
    total = dataclasses.replace(
        stats[0],
        prompt_tokens=sum(len(prepared.ids) for prepared in all_prepared),
        completion_tokens=sum(item.completion_tokens for item in stats),
        cached_tokens=cached,
    )
    return build_response(llm.name, request, all_prepared[0], outputs, total, llm.formatter)
