"""The text side of a model, without its weights: tokenizer, chat template, context, stop tokens,
default pruning; and the detokenizer that turns a token stream into text deltas with stop strings.

The gateway tokenizes and detokenizes with this alone; workers hold the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.contract import ModelSpec, PruneConfig, preset


@dataclass
class TextModel:
    name: str
    tokenizer: object  # a transformers tokenizer
    spec: ModelSpec
    stop_token_ids: tuple[int, ...]
    # The preset a request without its own `pruning` gets: the process's pruning_preset setting.
    default_preset: str = "default"

    @property
    def max_positions(self) -> int:
        return self.spec.max_positions

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def default_pruning(self) -> PruneConfig:
        return preset(self.default_preset, self.spec.num_layers)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return list(prompt)
        return self.tokenizer(prompt).input_ids

    def resolve_pruning(self, pruning: str | PruneConfig | None) -> PruneConfig:
        """A preset name, a schedule, or None for this server's default preset."""
        if pruning is None:
            config = self.default_pruning
        elif isinstance(pruning, str):
            config = preset(pruning, self.spec.num_layers)
        else:
            config = pruning
        return config.check_for(self.spec.num_layers)


def stop_ids_of(generation_eos, tokenizer) -> tuple[int, ...]:
    ids = generation_eos
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (ids,)


def load_text_model(name: str, cache_dir: Path | None = None) -> TextModel:
    """Tokenizer and config of `name` (as shared.models.load_model names it), no weights."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from shared.models import DEFAULT_MODEL, TINY_MODELS, default_model_folder, tiny_config

    if name in TINY_MODELS:
        config = tiny_config(name)
        folder = default_model_folder(cache_dir)  # tiny models borrow SmolLM2's tokenizer
        return TextModel(
            name, AutoTokenizer.from_pretrained(folder), ModelSpec.from_config(config), (config.eos_token_id,)
        )
    folder = default_model_folder(cache_dir) if name == DEFAULT_MODEL else Path(name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    try:
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:  # no generation_config.json
        eos = None
    label = DEFAULT_MODEL if name == DEFAULT_MODEL else folder.name
    return TextModel(
        label, tokenizer, ModelSpec.from_config(AutoConfig.from_pretrained(folder)), stop_ids_of(eos, tokenizer)
    )


class Detokenizer:
    """Token ids in, text deltas out; stops at the first stop string.

    Holds back what may be the start of a stop string, or half of a multi-byte character, so a
    delta is never taken back. `text` is the final text so far (cut before a stop string).
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=0)
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        """Append tokens; return the new delta ('' if none). Sets `stopped` on a stop string."""
        if self.stopped:
            raise RuntimeError("tokens after a stop string")
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._take(cut)
        self.text = text
        safe = len(text) - max(self.hold - 1, 0)
        if text.endswith("\ufffd"):
            safe = min(safe, len(text) - 1)
        return self._take(safe)

    def flush(self) -> str:
        """The held-back rest, once no more tokens come."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
