"""Helpers shared by tests: real text prompts, a KV transfer encoded from a real prefill."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from shared.engine import PruneConfig, SamplingParams, Stats, prefill
from shared.transfer import end_message, frame_messages, header_message


def text_ids(loaded, chars: int = 2000, topic: str = "assignment") -> list[int]:
    """Real English text from CPython's docs, tokenized: pruning and revival behave as on real prompts."""
    from pydoc_data.topics import topics

    return loaded.tokenizer(topics[topic][:chars]).input_ids


def random_ids(loaded, n: int, seed: int = 1) -> list[int]:
    vocab = loaded.engine.spec.vocab_size
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def encode_transfer(
    loaded, ids: list[int], config: PruneConfig, params: SamplingParams, transfer_id: str = "t1", budget: int = 1 << 20
):
    """(cache, messages): the in-process prefill's cache and the transfer a prefill worker would send."""
    model = loaded.engine
    frames = []
    cache, logits = prefill(model, torch.tensor(ids), config, on_layer=frames.append)
    messages = [header_message(transfer_id, loaded.name, model.spec, model.dtype, len(ids))]
    for frame in frames:
        messages += frame_messages(transfer_id, frame, budget)
    first = int(logits.argmax())
    states = [b""] * params.n
    messages.append(
        end_message(transfer_id, ids, [first] * params.n, config, params, states, len(messages) - 1, Stats())
    )
    return cache, messages


def assemble(loaded, messages):
    """Feed transfer messages to a TransferAssembler for `loaded`'s model; the Assembled, if an end came."""
    from shared.transfer import FrameError, TransferAssembler

    model = loaded.engine
    assembler = TransferAssembler(loaded.name, model.spec, model.dtype, model.device, model.spec.max_positions)
    result = None
    for message in messages:
        kind = message.WhichOneof("kind")
        if kind == "header":
            assembler.header(message.header)
        elif kind == "frame":
            assembler.frame(message.frame)
        elif kind == "end":
            result = assembler.end(message.end)
        else:
            raise FrameError("empty message")
    return result


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the generated tokens, as a transformers
    logits processor (transformers has none of its own): a reference for the sampler's."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        generated = input_ids[0, self.prompt_len :]
        if generated.numel():
            ids, counts = generated.unique(return_counts=True)
            scores[0, ids] -= counts.to(scores.dtype) * self.frequency + self.presence
        return scores
