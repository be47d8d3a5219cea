"""The text side of a model, without its weights: tokenizer, chat template, context, stop tokens,
default pruning; and the detokenizer that turns a token stream into text deltas with stop strings.

The gateway tokenizes and detokenizes with this alone; workers hold the weights.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from shared.contract import ModelSpec, PruneConfig
from shared.models.catalog import DEFAULT_MODEL, INSTALL_HINT, ModelNotFoundError, resolve, stop_ids_of, tiny_config


class NoChatTemplateError(ValueError):
    """A chat request to a model without a chat template."""


@dataclass
class TextModel:
    name: str
    tokenizer: object  # a transformers tokenizer
    spec: ModelSpec
    stop_token_ids: tuple[int, ...]
    # The preset a request without its own `pruning` gets: the process's pruning_preset setting.
    default_preset: str = "default"
    # A Jinja chat template that replaces the tokenizer's (vLLM's --chat-template); a base model
    # has none of its own, and chat requests to it are refused without one.
    chat_template: str | None = None

    @property
    def max_positions(self) -> int:
        return self.spec.max_positions

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def default_pruning(self) -> PruneConfig:
        return self.spec.preset(self.default_preset)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's text in bytes (byte-level BPE: one character per byte). A text of
        more than max_positions times this many characters cannot fit the context."""
        vocab = self.tokenizer.get_vocab()
        return max((len(token) for token in vocab), default=1)

    @property
    def max_text_chars(self) -> int:
        """More characters than this cannot fit the context: refused before tokenizing (which
        would take seconds and memory for megabytes of text)."""
        return self.max_positions * self.max_token_chars

    @property
    def has_chat_template(self) -> bool:
        return (self.chat_template or getattr(self.tokenizer, "chat_template", None)) is not None

    def chat_ids(self, messages: list[dict]) -> list[int]:
        if not self.has_chat_template:
            raise NoChatTemplateError(
                f"model {self.name} has no chat template (a base model): send a prompt to /v1/completions, "
                "or start the server with --chat-template FILE"
            )
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=False
        )
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
            config = self.spec.preset(pruning)
        else:
            config = pruning
        return self.spec.check(config)


def read_chat_template(path: Path | None) -> str | None:
    """The template in the file `path` (None: none given); a clear error if it cannot be read."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ValueError(f"--chat-template {path}: {error.strerror or error}") from None


def load_text_model(name: str, cache_dir: Path | None = None, chat_template: Path | None = None) -> TextModel:
    """Tokenizer and config of `name` (resolved as for the weights), without the weights, and
    without torch: the config and generation config are read as JSON, and a checkpoint with a
    tokenizer.json gets transformers' tokenizers-backed class, which AutoTokenizer would also
    pick for it (tested) but only after importing torch."""
    template = read_chat_template(chat_template)
    source = resolve(name, cache_dir)
    if source.folder is None:
        raise ModelNotFoundError(
            f"tiny models borrow {DEFAULT_MODEL}'s tokenizer, which is not installed: {INSTALL_HINT}"
        )
    tokenizer = load_tokenizer(source.folder)
    if source.tiny is not None:
        config = tiny_config(source.tiny)
        spec = ModelSpec.from_config(config)
        return TextModel(source.label, tokenizer, spec, (config.eos_token_id,), chat_template=template)
    generation = source.folder / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    spec = ModelSpec.from_config_file(source.folder / "config.json")
    return TextModel(source.label, tokenizer, spec, stop_ids_of(eos, tokenizer), chat_template=template)


def load_tokenizer(folder: Path):
    if (folder / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


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
        """The held-back rest, once no more tokens come ('' after a stop string: nothing follows it)."""
        return "" if self.stopped else self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
