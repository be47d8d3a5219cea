"""Log-probabilities in OpenAI's two shapes: chat's `logprobs.content` and completions' parallel lists.

The figures are the engine's (shared.contract.Sampled: the model's log-softmax before any
sampling parameter applies; under pruning, the pruned model's). Each token is shown as its own
decoded text and, for chat, its UTF-8 bytes (a byte-level BPE token that is part of a character
decodes to U+FFFD alone; its bytes say what it is).
"""

from __future__ import annotations

from functools import lru_cache

from shared.contract import Sampled


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a BPE token uses for each byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = self.tokenizer.decode([token])
        return self._text[token]

    def bytes(self, token: int) -> list[int]:
        if token not in self._bytes:
            piece, decoder = self.tokenizer.convert_ids_to_tokens(token), _byte_decoder()
            if piece is not None and all(char in decoder for char in piece):
                self._bytes[token] = [decoder[char] for char in piece]
            else:
                self._bytes[token] = list(self.text(token).encode("utf-8"))
        return self._bytes[token]

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.text(token), "logprob": logprob, "bytes": self.bytes(token)}

    def chat(self, sampled: list[Sampled]) -> dict:
        """A chat choice's `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
        content = [
            self._entry(item.token, item.logprob) | {"top_logprobs": [self._entry(t, lp) for t, lp in item.top]}
            for item in sampled
        ]
        return {"content": content, "refusal": None}

    def completion(self, sampled: list[Sampled], text_offset: int = 0) -> dict:
        """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs (one dict per
        token) and text_offset (each token's start in the choice's text, from `text_offset`)."""
        tokens, offsets, offset = [], [], text_offset
        for item in sampled:
            tokens.append(self.text(item.token))
            offsets.append(offset)
            offset += len(tokens[-1])
        return {
            "tokens": tokens,
            "token_logprobs": [item.logprob for item in sampled],
            "top_logprobs": [{self.text(t): lp for t, lp in item.top} for item in sampled],
            "text_offset": offsets,
        }
