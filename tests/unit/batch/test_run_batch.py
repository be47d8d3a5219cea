"""run-batch: OpenAI Batch format in and out; every bad line gets its own error line, none is dropped."""

import json
import subprocess
import sys

import pytest

from services.batch.runner import run_batch
from shared.api.llm import LLM


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama)


def _chat(custom_id, content="Say something about lists.", **body):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0} | body
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _run(llm, tmp_path, lines, pruning="lazyllm"):  # a preset that prunes short prompts too
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    run_batch(llm, source, target, pruning, progress=False)
    return [json.loads(line) for line in target.read_text().splitlines()]


def test_good_lines_answer_in_openai_format(llm, tmp_path):
    # Seeded: unseeded sampling at temperature 1 may draw the end-of-sequence token first (a clean
    # clone's run once answered 0 tokens here; not reproduced in 1,800 tries in process).
    body = {"prompt": "A list is", "max_tokens": 3, "seed": 1}
    completion = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": body})
    out = _run(llm, tmp_path, [_chat("a"), completion])
    assert [line["custom_id"] for line in out] == ["a", "c"]
    chat = out[0]["response"]
    assert chat["status_code"] == 200 and out[0]["error"] is None
    body = chat["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 4
    metrics = body["metrics"]
    assert metrics["ttft_s"] > 0
    assert 0 < metrics["token_layers_computed"] < metrics["token_layers_full"]
    assert out[1]["response"]["body"]["object"] == "text_completion"
    assert out[1]["response"]["body"]["usage"]["completion_tokens"] == 3


def test_bad_lines_get_error_lines_and_the_rest_still_run(llm, tmp_path):
    too_long = "word " * 2100  # the tiny model's context is 2048 positions
    lines = [
        _chat("ok-1"),
        "{not json",
        json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
        _chat("too-long", content=too_long),
        _chat("overflow", max_tokens=2040, content="short"),
        _chat("bad-pruning", pruning={"stages": [[3, 0.2], [1, 0.5]]}),
        _chat("deep-stage", pruning={"stages": [[9, 0.5]]}),
        _chat("bad-param", temperature=7),
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),
        _chat("ok-2"),
    ]
    out = _run(llm, tmp_path, lines)
    assert len(out) == len(lines)
    by_id = {line["custom_id"]: line for line in out}
    assert by_id["ok-1"]["error"] is None and by_id["ok-2"]["error"] is None
    assert out[1]["custom_id"] is None and "invalid JSON" in out[1]["error"]["message"]
    assert by_id["bad-url"]["response"]["status_code"] == 404
    assert "/v1/embeddings" in by_id["bad-url"]["error"]["message"]
    message = by_id["too-long"]["error"]["message"]
    assert by_id["too-long"]["response"]["status_code"] == 400 and "2048" in message
    assert "2040" in by_id["overflow"]["error"]["message"]
    assert by_id["overflow"]["error"]["code"] == "context_length_exceeded"
    assert "strictly increase" in by_id["bad-pruning"]["error"]["message"]
    assert "below the last layer" in by_id["deep-stage"]["error"]["message"]
    assert "temperature" in by_id["bad-param"]["error"]["message"]
    assert "custom_id" in out[8]["error"]["message"]
    for line in out:
        if line["error"] is not None and line["response"] is not None:
            assert line["response"]["body"]["error"]["message"] == line["error"]["message"]


def test_body_pruning_overrides_the_flag(llm, tmp_path):
    out = _run(llm, tmp_path, [_chat("flag"), _chat("body", pruning="lazyllm")], pruning="off")
    flag, body = (line["response"]["body"]["metrics"] for line in out)
    assert flag["pruning"] == "off" and flag["token_layers_computed"] == flag["token_layers_full"]
    assert body["pruning"] == "lazyllm" and body["token_layers_computed"] < body["token_layers_full"]


def test_lines_without_pruning_get_the_default_preset(tiny_llama, tmp_path):
    """No flag, no body field: the process's preset, which does not prune prompts under its minimum length."""
    out = _run(LLM(tiny_llama, default_preset="lazyllm"), tmp_path, [_chat("a")], pruning=None)
    metrics = out[0]["response"]["body"]["metrics"]
    assert metrics["pruning"] == "lazyllm" and metrics["token_layers_computed"] < metrics["token_layers_full"]
    out = _run(LLM(tiny_llama), tmp_path, [_chat("b")], pruning=None)
    metrics = out[0]["response"]["body"]["metrics"]
    assert metrics["pruning"] == "default" and metrics["token_layers_computed"] == metrics["token_layers_full"]


def test_custom_schedule_in_body(llm, tmp_path):
    long = "alpha beta gamma delta " * 40
    out = _run(llm, tmp_path, [_chat("custom", content=long, pruning={"stages": [[1, 0.5]], "mode": "static"})])
    metrics = out[0]["response"]["body"]["metrics"]
    kept = metrics["kept_per_layer"]
    assert metrics["pruning"] == "custom"
    assert kept[0] == kept[1] and kept[2] == -(-kept[0] // 2)


def test_cli_end_to_end(tmp_path):
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_chat("x") + "\n{broken\n")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "run-batch",
            "-i",
            source,
            "-o",
            target,
            "--model",
            "tiny-llama",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    out = [json.loads(line) for line in target.read_text().splitlines()]
    assert len(out) == 2 and out[0]["error"] is None and out[1]["error"] is not None
    assert "1 succeeded, 1 failed" in done.stderr
    assert "Traceback" not in done.stderr


def test_inputs_that_gave_500s_are_400_lines(llm, tmp_path):
    bad_seed = {"stages": [[1, 0.5]], "seed": -1}
    out = _run(llm, tmp_path, [_chat("surrogate", content="\ud800 hi"), _chat("seed", pruning=bad_seed), _chat("ok")])
    assert [line["custom_id"] for line in out] == ["surrogate", "seed", "ok"]
    assert [line["response"]["status_code"] for line in out] == [400, 400, 200]
    assert "lone surrogate" in out[0]["response"]["body"]["error"]["message"]
    assert "pruning.seed" in out[1]["response"]["body"]["error"]["message"]


def test_unicode_line_breaks_inside_strings_keep_one_line_each(llm, tmp_path):
    """JSON allows U+2028, U+2029 and U+0085 raw in strings; str.splitlines() breaks lines at them."""
    prompt = "A list\u2028is\x85mutable\u2029."
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True}
    lines = [
        json.dumps({"custom_id": "raw", "method": "POST", "url": "/v1/completions", "body": body}, ensure_ascii=False),
        json.dumps({"custom_id": "odd\u2028id", "method": "POST", "url": "/v1/completions", "body": body}),
        "\u2028",  # not JSON whitespace: an error line, not a skipped one
    ]
    assert "\u2028" in lines[0]  # written raw, as JSON writers with ensure_ascii=False do
    out = _run(llm, tmp_path, lines, pruning="off")  # read back with str.splitlines()
    written = (tmp_path / "out.jsonl").read_text()
    assert not any(char in written for char in "\u2028\u2029\x85")  # escaped, so any reader sees 3 lines
    assert [line["custom_id"] for line in out] == ["raw", "odd\u2028id", None]
    for line in out[:2]:
        assert line["response"]["status_code"] == 200
        assert line["response"]["body"]["choices"][0]["text"].startswith(prompt)  # echoed back intact
    assert out[2]["error"]["code"] == "invalid_json"
