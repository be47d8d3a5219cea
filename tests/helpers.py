"""Helpers shared by tests: real text prompts, a KV transfer encoded from a real prefill."""

from __future__ import annotations

import math

import torch
from transformers import LogitsProcessor

from shared.engine import OFF, PruneConfig, SamplingParams, Stats, prefill
from shared.engine.generate import Generation, decode_tokens
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
    messages.append(end_message(transfer_id, ids, [first] * params.n, config, params, len(messages) - 1, Stats()))
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


def _bf16_step(reference: torch.Tensor) -> float:
    """The spacing of bfloat16 numbers at the largest magnitude in `reference`."""
    largest = float(reference.abs().max())
    return 2.0 ** (math.floor(math.log2(largest)) - 7)


def compare_with_transformers(loaded, ids: torch.Tensor, steps: int = 16) -> None:
    """Pruning off, the prompt `ids`: first-token logits as transformers' (float32: within 1e-4;
    bfloat16: six steps of the largest logit's spacing, see test_bfloat16), and greedy tokens that
    transformers ranks first at every step.

    The engine computes a prompt's rows in tiles of 64 (shared/engine/invariant.py), where
    transformers makes one call of the prompt's length, and the two can sum a row otherwise; so
    can a decode step's call of 16 rows under --batch-invariant against generate()'s single row.
    So each step is checked teacher-forced:
    transformers' forward over the prompt and our tokens must rank our token first, within the
    same bound as the first logits. Where it ties, generate() may take the other token and both
    continue differently; anywhere else the tokens are generate()'s."""
    model = loaded.engine
    device_ids = ids[None].to(model.device)
    eos = loaded.stop_token_ids
    with torch.inference_mode():
        # One prefill a side: generate()'s first logits are its forward over the prompt, and ours
        # are the prefill's that the decode loop starts from.
        out = model.hf.generate(
            device_ids, max_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        reference, expected = out.logits[0][0].float(), out.sequences[0, ids.shape[0] :].tolist()
        cache, logits = prefill(model, ids, OFF, reserve=steps)
        ours = Generation()
        params = SamplingParams(max_new_tokens=steps, stop_token_ids=eos)
        for _ in decode_tokens(model, cache, logits, OFF, params, ours, prompt_ids=ids):
            pass
    bound = 6 * _bf16_step(reference) if model.dtype == torch.bfloat16 else 1e-4
    difference = float((logits - reference).abs().max())
    assert difference <= bound, f"logits differ by {difference}"
    expected = [t for t in expected if t not in eos][: len(expected)]
    if ours.tokens == expected[: len(ours.tokens)] and len(ours.tokens) == len(expected):
        return
    sequence = torch.cat([ids, torch.tensor(ours.tokens, dtype=ids.dtype)])[None].to(model.device)
    with torch.inference_mode():
        forced = model.hf(sequence).logits[0, ids.shape[0] - 1 : -1].float()
    for step, token in enumerate(ours.tokens):
        row = forced[step]
        margin = float(row.max() - row[token])
        assert margin <= bound, f"step {step}: transformers ranks token {token} {margin} below its first"
    parted = next(i for i, (a, b) in enumerate(zip(ours.tokens + [-1], expected + [-1])) if a != b)
    row = forced[min(parted, forced.shape[0] - 1)]
    assert float(row.topk(2).values.diff().abs()) <= 2 * bound, f"parted from generate() at step {parted}, not at a tie"
