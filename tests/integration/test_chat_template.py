"""A base model has no chat template: /v1/completions serves it, /v1/chat/completions answers a
clear 400 unless the server was given one (--chat-template FILE, vLLM's flag)."""

from __future__ import annotations

import copy
import dataclasses

import openai
import pytest

from shared.models.text import load_text_model

MESSAGES = [{"role": "user", "content": "Name a colour."}]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


@pytest.fixture
def base_text(tiny_text):
    """tiny-llama's text side with a tokenizer that has no chat template, as a base model's."""
    tokenizer = copy.deepcopy(tiny_text.tokenizer)
    tokenizer.chat_template = None
    return dataclasses.replace(tiny_text, tokenizer=tokenizer)


@pytest.fixture
def decode_address(tiny_llama, decode_worker):
    worker, _ = decode_worker(tiny_llama)
    return worker.address


def test_chat_without_a_template_is_a_400_and_completions_still_serve(gateway, base_text, decode_address):
    client = gateway(text=base_text, decode_workers=[decode_address]).openai()
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=4)
    assert "has no chat template" in str(refused.value) and "--chat-template" in str(refused.value)
    assert refused.value.body["param"] == "messages"
    reply = client.completions.create(model="tiny-llama", prompt="Red, green and", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4


def test_a_template_file_serves_chat(gateway, base_text, decode_address, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    text = dataclasses.replace(base_text, chat_template=load_text_model("tiny-llama", chat_template=path).chat_template)
    client = gateway(text=text, decode_workers=[decode_address]).openai()
    reply = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=4, temperature=0)
    expected = base_text.tokenizer("<user>Name a colour.\n<assistant>", add_special_tokens=False).input_ids
    assert reply.usage.prompt_tokens == len(expected)


def test_an_unreadable_template_file_is_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="--chat-template .*missing.jinja"):
        load_text_model("tiny-llama", chat_template=tmp_path / "missing.jinja")
