"""Request and response schemas in OpenAI's format, shared by run-batch, the gateway and the router.

Only the fields lazyserve acts on are modelled; other OpenAI fields are accepted and ignored, as
vLLM and SGLang do, so unmodified clients keep working. `pruning` is lazyserve's extension field,
`metrics` its extension of the response.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from shared.contract import MAX_LOGPROBS, MAX_N, PRESET_NAMES, PruneConfig

PruningField = Literal[PRESET_NAMES] | PruneConfig


def _encodable(text: str) -> str:
    """A string the tokenizer and the response can carry: no lone surrogate (JSON allows "\ud800";
    UTF-8 does not), which would otherwise fail deep inside tokenizing or writing the response."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone surrogate (an unpaired \\ud800-\\udfff escape); send valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


# Parameter -> its values that change nothing (accepted); any other value is a 400.
NOT_SERVED: dict[str, tuple] = {
    "best_of": (1,),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "suffix": ("",),
}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: Text = "response"
    json_schema: dict[str, Any] = Field(alias="schema", description="the JSON Schema the output must match")
    strict: StrictBool | None = None
    description: Text | None = None


class ResponseFormat(BaseModel):
    """OpenAI's structured output: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # Strict where a JSON client could be misread: `"stream": "yes"` or `"max_tokens": true` is a 400.
    model: Text | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=MAX_N, description="choices, sampled from one prefill")
    seed: StrictInt | None = Field(None, ge=-(2**63), lt=2**64, description="any 64-bit integer, signed or not")
    stop: Text | list[Text] | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    # Sampling as vLLM's OpenAI server takes it (shared.engine.sampling says in which order).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM's; 1: off")
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> added to its logit, in [-100, 100]"
    )
    top_k: StrictInt = Field(-1, ge=-1, description="vLLM's; -1 or 0: off")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="vLLM's; 0: off")
    min_tokens: StrictInt = Field(0, ge=0, description="vLLM's: stop tokens are masked until this many are out")
    ignore_eos: StrictBool = Field(False, description="vLLM's: keep generating past the end-of-sequence token")
    stop_token_ids: list[StrictInt] | None = Field(None, description="vLLM's: more token ids that end the output")
    response_format: ResponseFormat | None = None
    pruning: PruningField | None = Field(
        None, description="a preset name or a schedule; absent: the server's default preset (pruning_preset)"
    )
    return_token_depths: StrictBool = Field(
        False,
        description="lazyserve's: metrics.token_depths (each prompt token's layers at the end) and "
        "metrics.revived_positions, for prompts of up to MAX_DEPTH_TOKENS tokens",
    )

    @model_validator(mode="before")
    @classmethod
    def _not_served(cls, body):
        """OpenAI parameters this server does not act on are refused with a 400 naming them, not
        accepted and silently ignored (their neutral values pass)."""
        if isinstance(body, dict):
            for name, neutral in NOT_SERVED.items():
                value = body.get(name)
                if value is not None and value not in neutral:
                    raise PydanticCustomError(
                        "not_served",
                        "{name} is not supported by this server (supported parameters: docs in the README)",
                        {"name": name},
                    )
        return body

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, biases):
        for key, bias in (biases or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids written as strings, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return biases

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])


class TextPart(BaseModel):
    """A content part as LangChain and the Agents SDK send it; only text parts are served."""

    model_config = ConfigDict(extra="ignore")

    type: str
    text: Text | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; this model reads text parts only")
        if self.text is None:
            raise ValueError("a text part needs `text`")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart]

    @field_validator("role", mode="before")
    @classmethod
    def _no_tools(cls, role):
        if role in ("tool", "function"):
            raise ValueError(f"role {role!r} carries a tool result, and this server does not serve tools")
        return role

    @field_validator("content")
    @classmethod
    def _join_parts(cls, content):
        """Text parts are joined into one string, as the chat template takes it."""
        return content if isinstance(content, str) else "".join(part.text for part in content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("named", "needs logprobs: true", {"name": "top_logprobs"})
        return self

    @property
    def logprobs_count(self) -> int | None:
        """How many likeliest tokens to report with each token's logprob; None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


MAX_PROMPTS = 16  # prompts in one completions request (each with its n choices)
TokenIds = list[StrictInt]


class CompletionRequest(_Request):
    prompt: (
        Text
        | TokenIds
        | Annotated[list[Text], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description=f"a string or token ids, or a list of up to {MAX_PROMPTS} of either (one choice each)")
    max_tokens: StrictInt | None = Field(16, ge=1)  # OpenAI's default for completions
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = Field(False, description="the prompt's text before the completion's")

    @model_validator(mode="after")
    def _echo_without_logprobs(self):
        if self.echo and self.logprobs is not None:
            # The prompt's own log-probabilities would need logits at every prompt position; a
            # LazyLLM prefill computes the last position's only.
            message = "echo with logprobs is not served (prompt log-probabilities are not computed)"
            raise PydanticCustomError("named", message, {"name": "echo"})
        return self

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: one, or the list's."""
        prompt = self.prompt
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose shared layers came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class Metrics(BaseModel):
    """lazyserve's extension: what pruning did for this request. Its fields are Stats' (less the
    token counts, which are `usage`) plus `pruning`; a test keeps the two in step."""

    model_config = ConfigDict(extra="forbid")

    ttft_s: float
    decode_s: float
    token_layers_computed: int
    token_layers_full: int
    computed_fraction: float
    prefill_token_layers: int
    revived_token_layers: int
    kept_per_layer: list[int]
    kv_cache_bytes: int
    aux_cache_bytes: int
    cached_tokens: int
    # Only with return_token_depths (absent otherwise): per prompt token its depth (layers it was
    # computed at, prefill and decode together) and the prompt positions decode revived.
    token_depths: list[int] | None = None
    revived_positions: list[int] | None = None
    pruning: str

    @model_serializer(mode="wrap")
    def _without_unasked(self, handler):
        data = handler(self)
        for name in ("token_depths", "revived_positions"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]
    logprobs: dict[str, Any] | None = None  # shared.api.logprobs' chat shape


def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ChatCompletion(BaseModel):
    id: str = Field(default_factory=lambda: _id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    metrics: Metrics


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: dict[str, Any] | None = None  # shared.api.logprobs' completion shape


class TextCompletion(BaseModel):
    id: str = Field(default_factory=lambda: _id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    metrics: Metrics


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None  # only on the last chunk, when stream_options.include_usage
    metrics: Metrics | None = None  # only on the last chunk


class CompletionChunkChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: dict[str, Any] | None = None


class CompletionChunk(BaseModel):
    """One server-sent event of a streamed text completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    metrics: Metrics | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = Field(
        False, description="vLLM's: also token_strs, each token as text (decoded alone, as logprobs show tokens)"
    )

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "lazyserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    """OpenAI's error object."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class BatchInputLine(BaseModel):
    model_config = ConfigDict(extra="ignore")

    custom_id: str
    method: Literal["POST"] = "POST"
    url: str
    body: dict[str, Any]


class BatchResponse(BaseModel):
    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchOutputLine(BaseModel):
    id: str = Field(default_factory=lambda: _id("batch_req"))
    custom_id: str | None
    response: BatchResponse | None = None
    error: ErrorBody | None = None
