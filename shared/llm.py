"""Text in, text out over the engine: chat templates, tokenization, stop strings, streamed deltas.

The engine sees token ids only; this module owns the tokenizer side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from shared.engine import Generation, PruneConfig, SamplingParams, stream
from shared.engine.pruning import default_pruning
from shared.models import LoadedModel


@dataclass
class Completion:
    text: str = ""
    generation: Generation = field(default_factory=Generation)

    @property
    def finish_reason(self) -> str:
        return self.generation.finish_reason


class LLM:
    def __init__(self, loaded: LoadedModel):
        if loaded.tokenizer is None:
            raise ValueError(f"model {loaded.name} has no tokenizer; text requests need one")
        self.loaded = loaded
        self.engine = loaded.engine
        self.tokenizer = loaded.tokenizer
        self.name = loaded.name
        self.default_pruning = default_pruning(self.engine.spec.num_layers)

    @property
    def max_positions(self) -> int:
        return self.engine.spec.max_positions

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return self.tokenizer(prompt).input_ids

    def resolve_pruning(self, pruning: str | PruneConfig) -> PruneConfig:
        if pruning == "off":
            config = PruneConfig(mode="off")
        elif pruning == "default":
            config = self.default_pruning
        else:
            config = pruning
        return config.check_for(self.engine.spec.num_layers)

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
        stop = stop or []
        hold = max((len(s) for s in stop), default=0)
        emitted = 0
        tokens = stream(self.engine, ids, pruning, sampling, completion.generation)
        for _ in tokens:
            text = self.tokenizer.decode(completion.generation.tokens, skip_special_tokens=True)
            cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
            if cut >= 0:
                completion.text = text[:cut]
                completion.generation.finish_reason = "stop"
                tokens.close()  # runs the generator's cleanup, so stats are filled
                if cut > emitted:
                    yield text[emitted:cut]
                return
            completion.text = text
            # Hold back what may be the start of a stop string, or half of a multi-byte character.
            safe = len(text) - max(hold - 1, 0)
            if text.endswith("\ufffd"):
                safe = min(safe, len(text) - 1)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
        if len(completion.text) > emitted:
            yield completion.text[emitted:]

    def complete(self, ids, sampling, pruning, stop=None) -> Completion:
        completion = Completion()
        for _ in self.stream_text(ids, sampling, pruning, stop, completion):
            pass
        return completion
