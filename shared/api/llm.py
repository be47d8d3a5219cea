"""Text in, text out over the in-process engine: a TextModel plus the weights.

The engine sees token ids only; the text side (tokenizer, template, stop strings) is shared.models.text.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from shared.api.logprobs import LogprobFormatter
from shared.api.schemas import ChatCompletion, TextCompletion
from shared.api.serving import RequestError, build_response, parse_request, prepare
from shared.engine import Generation, PruneConfig, SamplingParams, stream
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
    def __init__(self, loaded: LoadedModel, default_preset: str = "default"):
        if loaded.tokenizer is None:
            raise ValueError(f"model {loaded.name} has no tokenizer; text requests need one")
        super().__init__(loaded.name, loaded.tokenizer, loaded.engine.spec, loaded.stop_token_ids, default_preset)
        self.loaded = loaded
        self.engine = loaded.engine
        self.formatter = LogprobFormatter(loaded.tokenizer)

    def stream_text(
        self,
        ids: list[int],
        sampling: SamplingParams,
        pruning: PruneConfig,
        stop: list[str] | None = None,
        completion: Completion | None = None,
    ) -> Iterator[str]:
        """Yield text deltas as tokens come; `completion` holds the final text and stats."""
        completion = completion if completion is not None else Completion()
        detokenizer = Detokenizer(self.tokenizer, stop)
        tokens = stream(self.engine, ids, pruning, sampling, completion.generation)
        # The same loop as the gateway's TextJob.deltas, over an in-process token stream.
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

    def complete(self, ids, sampling, pruning, stop=None) -> Completion:
        completion = Completion()
        for _ in self.stream_text(ids, sampling, pruning, stop, completion):
            pass
        return completion


def respond(llm: LLM, url: str, body: dict) -> ChatCompletion | TextCompletion:
    """Run one request to completion (no streaming). Raises RequestError for bad input."""
    request = parse_request(url, body)
    if request.stream:
        raise RequestError(400, "stream is not available here", param="stream")
    prepared = prepare(llm, request)
    completion = llm.complete(prepared.ids, prepared.sampling, prepared.pruning, prepared.stop)
    generation = completion.generation
    sampled = generation.logprobs[: completion.num_read]
    return build_response(
        llm.name, request, prepared, completion.text, completion.finish_reason, generation.stats, llm.formatter, sampled
    )
