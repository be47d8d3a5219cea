"""Property test: no request body makes a 5xx, through the gateway and through run-batch.

Bodies are drawn field by field from every parameter the schemas take, with values a client can
get wrong: strings with lone surrogates and control characters, integers at and beyond every
protobuf range (uint32, int64, uint64), floats out of range and non-finite (Python's json writes
NaN and Infinity, which some clients send), wrong types, and unknown fields. Every answer is a
200 or a 4xx with a message; run-batch writes one output line per input line.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from services.batch.runner import run_batch
from shared.api.llm import LLM

EXAMPLES = int(os.environ.get("LAZYSERVE_PROPERTY_EXAMPLES", "40"))
EDGES = [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64]

texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["\ud800 hi", "a\udfffb", "\x00\x01\x1b[31m", "\u2028\u2029", "", " ", "tiny-llama"]),
)
ints = st.one_of(st.sampled_from(EDGES), st.integers(min_value=-5, max_value=40))
floats = st.one_of(
    st.sampled_from([0.0, -0.0, 1e-300, 2.0, 2.0001, 100.0, -100.5, 1e308, float("nan"), float("inf"), float("-inf")]),
    st.floats(min_value=-3, max_value=3),
)
scalars = st.one_of(texts, ints, floats, st.booleans(), st.none())
values = st.one_of(
    scalars,
    st.lists(scalars, max_size=3),
    st.lists(ints, max_size=3),
    st.dictionaries(st.one_of(texts, st.sampled_from(["5", "0", "99999999999"])), scalars, max_size=2),
)
SMALL_INT = st.one_of(ints.filter(lambda v: -2 <= v <= 4), ints)

# Every field either endpoint reads, each with its own plausible values and with any value.
COMMON = {
    "model": st.one_of(st.just("tiny-llama"), texts),
    "max_tokens": SMALL_INT,
    "temperature": floats,
    "top_p": floats,
    "n": SMALL_INT,
    "seed": ints,
    "stop": st.one_of(texts, st.lists(texts, max_size=5)),
    "stream": st.one_of(st.booleans(), texts),
    "stream_options": st.one_of(st.none(), st.just({"include_usage": True}), values),
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
    "logit_bias": st.dictionaries(st.sampled_from(["5", "0", "-1", "abc", "4294967296"]), floats, max_size=2),
    "top_k": ints,
    "min_p": floats,
    "min_tokens": SMALL_INT,
    "ignore_eos": st.one_of(st.booleans(), scalars),
    "stop_token_ids": st.lists(ints, max_size=3),
    "pruning": st.one_of(
        st.sampled_from(["off", "default", "fast", "lazyllm", "nope"]),
        st.fixed_dictionaries(
            {"mode": st.sampled_from(["lazy", "static", "random", "x"])},
            optional={"stages": st.lists(st.tuples(ints, floats), max_size=2), "seed": ints, "window": ints},
        ),
    ),
    "best_of": SMALL_INT,
    "response_format": st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])}),
        st.fixed_dictionaries(
            {
                "type": st.just("json_schema"),
                "json_schema": st.fixed_dictionaries(
                    {"name": texts, "schema": st.one_of(values, st.just({"type": "object"}), st.just({"enum": [1]}))}
                ),
            }
        ),
        values,
    ),
    "unknown_field": values,
}
CHAT = COMMON | {
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
            optional={"content": st.one_of(texts, st.lists(st.fixed_dictionaries({"type": texts, "text": texts})))},
        ),
        max_size=3,
    ),
    "logprobs": st.one_of(st.booleans(), ints),
    "top_logprobs": SMALL_INT,
    "max_completion_tokens": SMALL_INT,
}
COMPLETIONS = COMMON | {
    "prompt": st.one_of(texts, st.lists(ints, max_size=4), st.lists(texts, max_size=3), st.lists(st.lists(ints))),
    "logprobs": SMALL_INT,
    "echo": st.one_of(st.booleans(), scalars),
}


def _bodies(fields: dict, required: str):
    optional = {name: strategy for name, strategy in fields.items() if name != required}
    # Small generations: every accepted body runs on the tiny model.
    return st.fixed_dictionaries({required: fields[required]}, optional=optional).map(
        lambda body: (
            body | {"max_tokens": min(body["max_tokens"], 4)}
            if isinstance(body.get("max_tokens"), int) and not isinstance(body.get("max_tokens"), bool)
            else body
        )
    )


# Mostly valid bodies, so that generation runs too: each field in range...
unicode = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
VALID = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "n": st.integers(1, 2),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.lists(unicode.filter(bool), max_size=2),
    "stream": st.booleans(),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.sampled_from(["5", "0", "100"]), st.floats(-100, 100), max_size=2),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "min_tokens": st.integers(0, 2),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=2),
    "pruning": st.sampled_from(["off", "default", "fast", "lazyllm"]),
}
MESSAGE = st.fixed_dictionaries({"role": st.just("user"), "content": unicode})
VALID_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=2)},
    optional=VALID | {"logprobs": st.just(True), "top_logprobs": st.integers(0, 5)},
)
VALID_COMPLETIONS = st.fixed_dictionaries(
    {"prompt": st.one_of(unicode.filter(str.strip), st.lists(st.integers(0, 1000), min_size=1, max_size=8))},
    optional=VALID | {"logprobs": st.integers(0, 5), "echo": st.just(False)},
)


def _one_wrong(valid, fields: dict):
    """...then one field, any field, drawn from the adversarial values."""
    return st.tuples(valid, st.sampled_from(sorted(fields))).flatmap(
        lambda pair: fields[pair[1]].map(lambda value: pair[0] | {pair[1]: value})
    )


def _small(body: dict) -> dict:
    return body | {"max_tokens": 3} if "max_tokens" not in body else body


BODIES = st.one_of(
    _bodies(CHAT, "messages").map(lambda body: ("/v1/chat/completions", body)),
    _bodies(COMPLETIONS, "prompt").map(lambda body: ("/v1/completions", body)),
    VALID_CHAT.map(lambda body: ("/v1/chat/completions", _small(body))),
    VALID_COMPLETIONS.map(lambda body: ("/v1/completions", _small(body))),
    _one_wrong(VALID_CHAT, CHAT).map(lambda body: ("/v1/chat/completions", _small(body))),
    _one_wrong(VALID_COMPLETIONS, COMPLETIONS).map(lambda body: ("/v1/completions", _small(body))),
)
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example may decode
)


@pytest.fixture
def running(tiny_llama, decode_worker_session, gateway):
    return gateway(decode_workers=[decode_worker_session(tiny_llama)], request_timeout_s=120)


def _answered_well(reply: httpx.Response) -> None:
    assert reply.status_code < 500, reply.text
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["message"] and "Traceback" not in error["message"], error
    elif reply.headers["content-type"].startswith("text/event-stream"):
        assert reply.text.rstrip().endswith("data: [DONE]") and '"error"' not in reply.text, reply.text[-500:]


def test_no_body_makes_a_server_error_through_the_gateway(running):
    with httpx.Client(base_url=running.url, timeout=120) as client:

        @SETTINGS
        @given(case=BODIES)
        def check(case):
            url, body = case
            content = json.dumps(body, allow_nan=True, ensure_ascii=True)  # lone surrogates as \ud800 escapes
            _answered_well(client.post(url, content=content, headers={"content-type": "application/json"}))

        check()


def test_no_line_is_lost_or_crashes_run_batch(tiny_llama, tmp_path_factory):
    llm = LLM(tiny_llama)

    @SETTINGS
    @given(cases=st.lists(BODIES, min_size=1, max_size=3))
    def check(cases):
        folder = tmp_path_factory.mktemp("batch")
        lines = [
            json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}, allow_nan=True)
            for i, (url, body) in enumerate(cases)
        ]
        (folder / "in.jsonl").write_text("\n".join(lines) + "\n")
        run_batch(llm, folder / "in.jsonl", folder / "out.jsonl", "default", progress=False)
        out = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
        assert [line["custom_id"] for line in out] == [f"c{i}" for i in range(len(cases))]
        for line in out:
            assert line["response"] is None or line["response"]["status_code"] < 500, line
            assert line["response"] is not None or line["error"]["message"], line

    check()


# Structure, not values: nesting depth, array sizes and key counts at every field, up to the
# 4 MiB body limit. Before the bound on nesting, a 100,000-deep array was a 500 (json.loads ran
# out of recursion), and 10,000 wrong list items took 28 s to be refused (errors read in
# quadratic time).
FIELDS = ["prompt", "messages", "stop", "stop_token_ids", "logit_bias", "response_format", "pruning", "unknown"]


def _nested(depth: int, kind: str) -> str:
    if kind == "array":
        return "[" * depth + "1" + "]" * depth
    return '{"a":' * depth + "1" + "}" * depth


def _wide(count: int, field: str) -> str:
    item = {
        "prompt": "5",
        "messages": '{"role":"user","content":"a"}',
        "stop": '"a"',
        "stop_token_ids": "5",
        "response_format": '{"type":"text"}',
        "pruning": '"off"',
        "unknown": "[1]",
    }
    if field == "logit_bias":
        return "{" + ",".join(f'"{i}":1' for i in range(count)) + "}"
    return "[" + ",".join([item[field]] * count) + "]"


SHAPES = st.tuples(
    st.sampled_from(["deep", "wide", "keys"]),
    st.sampled_from(FIELDS),
    st.one_of(st.sampled_from([0, 1, 63, 64, 65, 999, 1000, 5000, 100_000, 400_000]), st.integers(0, 3000)),
    st.sampled_from(["array", "object"]),
    st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
)


def _structured(shape) -> tuple[str, str]:
    kind, field, size, nesting, url = shape
    base = '"messages":[{"role":"user","content":"hi"}]' if url.endswith("chat/completions") else '"prompt":"hi"'
    if kind == "keys":  # many members in the body itself
        return url, "{" + base + "".join(f',"k{i}":{i}' for i in range(size)) + "}"
    value = _nested(size, nesting) if kind == "deep" else _wide(size, field)
    name = "unknown_field" if field == "unknown" else field
    if name in ("prompt", "messages") and base.startswith(f'"{name}"'):
        return url, "{" + f'"{name}":{value},"max_tokens":2' + "}"
    return url, "{" + base + f',"{name}":{value},"max_tokens":2' + "}"


def test_no_body_structure_makes_a_server_error_or_a_slow_answer(running):
    import time

    with httpx.Client(base_url=running.url, timeout=60) as client:

        @SETTINGS
        @given(shape=SHAPES)
        def check(shape):
            url, content = _structured(shape)
            start = time.monotonic()
            reply = client.post(url, content=content, headers={"content-type": "application/json"})
            _answered_well(reply)
            assert time.monotonic() - start < 10, (shape[:3], reply.status_code, reply.text[:200])

        check()
