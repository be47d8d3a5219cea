"""From an OpenAI-format request to an engine call and back: shared by run-batch and the services.

Every way a request can be wrong becomes a RequestError with an HTTP status and a message that
says what to change; the edges (batch lines, FastAPI handlers, gRPC) translate it once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pydantic import ValidationError

from shared.api.logprobs import LogprobFormatter
from shared.api.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    Metrics,
    PromptTokensDetails,
    ResponseFormat,
    TextCompletion,
    Usage,
)
from shared.contract import PruneConfig, Sampled, SamplingParams, Stats
from shared.models.text import NoChatTemplateError, TextModel

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
DEFAULT_MAX_TOKENS = 256


class RequestError(Exception):
    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code


# Parts of a pydantic error location that name a union branch or a validator, not a field.
_BRANCH_TYPES = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> str:
    """`pruning.function-after[_check_mode(), PruneConfig].stages` -> `pruning.stages`."""
    parts = [
        str(part)
        for part in loc
        if isinstance(part, int) or not ("[" in part or "(" in part or part.lower() in _BRANCH_TYPES)
    ]
    return ".".join(parts)


# A body with one wrong value in each of 10,000 list items gets 10,000 errors from every union
# branch: only the first ones are read (this took 28 s, quadratically, before), and said.
MAX_ERRORS_READ, MAX_ERRORS_SAID = 64, 4


def _errors(error: ValidationError) -> list[tuple[str, str]]:
    """(field path, message) pairs, without a union branch's complaint about a field when another
    branch got further into it (`pruning: should be 'off', ...` when the schedule's seed was wrong)."""
    found = [
        # A model-level check names its field in ctx ("not_served", "named"); others by location.
        (item["ctx"]["name"] if item["type"] in ("not_served", "named") else _field_path(item["loc"]), item["msg"])
        for item in error.errors(include_url=False, include_input=False)[:MAX_ERRORS_READ]
    ]
    prefixes = {".".join(path.split(".")[:i]) for path, _ in found for i in range(1, path.count(".") + 1)}
    kept = []
    for path, message in found:
        if not (path and path in prefixes) and (path, message) not in kept:
            kept.append((path, message))
    return kept


def validation_message(error: ValidationError) -> str:
    errors = _errors(error)
    said = "; ".join(f"{path or 'body'}: {message}" for path, message in errors[:MAX_ERRORS_SAID])
    more = error.error_count() - min(len(errors), MAX_ERRORS_SAID)
    return f"{said}; and {more} more" if len(errors) > MAX_ERRORS_SAID else said


def validation_param(error: ValidationError) -> str | None:
    """OpenAI's `param`: the field at fault."""
    errors = _errors(error)
    return (errors[0][0] or None) if errors else None


def chat_ids(llm: TextModel, messages: list[dict]) -> list[int]:
    """The messages templated and tokenized; a 400 for a model without a chat template."""
    try:
        return llm.chat_ids(messages)
    except NoChatTemplateError as error:
        raise RequestError(400, str(error), param="messages") from None


def parse_request(url: str, body: dict) -> ChatCompletionRequest | CompletionRequest:
    kinds = {CHAT_URL: ChatCompletionRequest, COMPLETIONS_URL: CompletionRequest}
    if url not in kinds:
        raise RequestError(404, f"unknown url {url!r}; use {CHAT_URL} or {COMPLETIONS_URL}", param="url")
    try:
        return kinds[url].model_validate(body)
    except ValidationError as error:
        raise RequestError(400, validation_message(error), param=validation_param(error)) from None


@dataclass
class Prepared:
    ids: list[int]
    sampling: SamplingParams
    pruning: PruneConfig
    pruning_label: str
    stop: list[str]
    echo: str = ""  # completions with echo: the prompt's text, put before the output
    cache_salt: str = ""  # the prefix cache's tenant, set by the gateway from the API key
    token_depths: bool = False  # return_token_depths


def prepare_all(llm: TextModel, request: ChatCompletionRequest | CompletionRequest) -> list[Prepared]:
    """One Prepared per prompt: a completions request may carry a list of prompts (each gets
    its n choices, numbered in order); every prompt is checked before any runs."""
    if isinstance(request, ChatCompletionRequest):
        return [prepare(llm, request)]
    if len(request.prompts) == 1:  # a single prompt, or a list of one
        return [prepare(llm, request.model_copy(update={"prompt": request.prompts[0]}))]
    prepared = []
    for index, prompt in enumerate(request.prompts):
        try:
            prepared.append(prepare(llm, request.model_copy(update={"prompt": prompt})))
        except RequestError as error:
            raise RequestError(error.status_code, f"prompt {index}: {error.message}", error.param, error.code) from None
    return prepared


def prepare(llm: TextModel, request: ChatCompletionRequest | CompletionRequest) -> Prepared:
    chat = isinstance(request, ChatCompletionRequest)
    if chat:
        chars = sum(len(m.content) for m in request.messages)
    else:  # token ids are checked against the context below, with everything else
        chars = len(request.prompt) if isinstance(request.prompt, str) else 0
    if chars > llm.max_text_chars:
        raise RequestError(
            400,
            f"the prompt has {chars} characters; at most {llm.max_text_chars} can fit the model's context of "
            f"{llm.max_positions} tokens",
            param="messages" if chat else "prompt",
        )
    if isinstance(request, ChatCompletionRequest):
        ids = chat_ids(llm, [m.model_dump() for m in request.messages])
    else:
        if isinstance(request.prompt, list):
            _in_vocabulary(llm, request.prompt, "prompt")
        ids = llm.prompt_ids(request.prompt)
    if not ids:
        raise RequestError(400, "the prompt is empty", param="prompt")
    if request.return_token_depths and len(ids) > MAX_DEPTH_TOKENS:
        raise RequestError(
            400,
            f"return_token_depths is for prompts of up to {MAX_DEPTH_TOKENS} tokens; this one has {len(ids)}",
            param="return_token_depths",
        )
    room = llm.max_positions - len(ids)
    max_tokens = request.requested_max_tokens
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    if len(ids) + max_tokens > llm.max_positions:
        raise RequestError(
            400,
            f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: together {len(ids) + max_tokens}, "
            f"over the model's context of {llm.max_positions} tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        # As named, not as it applies to this prompt: the engine turns a schedule off for prompts
        # under its min_prompt_tokens itself, and the prefix cache files a short first turn under
        # the schedule's layers, so that the conversation's later, pruned turns find it.
        pruning = llm.resolve_pruning(request.pruning)
    except ValueError as error:
        raise RequestError(400, f"bad pruning config: {error}", param="pruning") from None
    label = request.pruning if isinstance(request.pruning, str) else "custom" if request.pruning else llm.default_preset
    sampling = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop_token_ids=_stop_token_ids(llm, request),
        # At or over the vocabulary it keeps every token: off, as 0 (which also keeps any value the
        # client sends within the wire's uint32).
        top_k=request.top_k if 0 < request.top_k < llm.spec.vocab_size else 0,
        min_p=request.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias=_logit_bias(llm, request),
        min_tokens=_min_tokens(request, max_tokens),
        logprobs=request.logprobs_count,
        n=request.n,
        grammar=grammar_of(request.response_format),
    )
    echo = ""
    if isinstance(request, CompletionRequest) and request.echo:
        echo = request.prompt if isinstance(request.prompt, str) else llm.tokenizer.decode(ids)
    return Prepared(ids, sampling, pruning, label, request.stop_strings, echo, token_depths=request.return_token_depths)


def grammar_of(response_format: ResponseFormat | None) -> str | None:
    """`response_format` as an llguidance grammar (shared.engine.grammar applies it), checked here
    so that a schema it cannot compile is a 400, not a failure on a worker."""
    if response_format is None or response_format.type == "text":
        return None
    from llguidance import LLMatcher  # torch-free: the gateway checks schemas too

    schema = {"type": "object"} if response_format.type == "json_object" else response_format.json_schema.json_schema
    try:
        # Compact JSON unless the schema's own x-guidance says otherwise: a small model given free
        # whitespace can loop on it until max_tokens.
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})
        problem = LLMatcher.validate_grammar(grammar)
    except (ValueError, TypeError) as error:
        problem = str(error)
    if problem:
        raise RequestError(400, f"response_format: the schema cannot be used: {problem}", "response_format")
    return grammar


def _in_vocabulary(llm: TextModel, ids, param: str) -> None:
    if any(not 0 <= token < llm.vocab_size for token in ids):
        raise RequestError(400, f"token ids must be in [0, {llm.vocab_size})", param)


def _stop_token_ids(llm: TextModel, request) -> tuple[int, ...]:
    extra = request.stop_token_ids or []
    _in_vocabulary(llm, extra, "stop_token_ids")
    eos = () if request.ignore_eos else llm.stop_token_ids
    return tuple(dict.fromkeys([*eos, *extra]))


def _logit_bias(llm: TextModel, request) -> tuple[tuple[int, float], ...]:
    biases = {int(key): bias for key, bias in (request.logit_bias or {}).items()}
    _in_vocabulary(llm, biases, "logit_bias")
    return tuple(sorted(biases.items()))


def _min_tokens(request, max_tokens: int) -> int:
    if request.min_tokens > max_tokens:
        raise RequestError(400, f"min_tokens ({request.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    return request.min_tokens


USAGE_FIELDS = ("prompt_tokens", "completion_tokens")
MAX_DEPTH_TOKENS = 4096  # return_token_depths: two numbers per prompt token in the response


def metrics_of(stats: Stats, pruning_label: str) -> Metrics:
    """Stats as the response's `metrics`: every field but the token counts (those are `usage`);
    token depths only when they were asked for (and so filled)."""
    figures = {name: value for name, value in stats.to_dict().items() if name not in USAGE_FIELDS}
    if not figures["token_depths"]:
        figures["token_depths"] = figures["revived_positions"] = None
    return Metrics(**figures, pruning=pruning_label)


def usage_of(stats: Stats) -> Usage:
    return Usage(
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        total_tokens=stats.prompt_tokens + stats.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens),
    )


@dataclass
class Output:
    """One choice as generated: its text (after echo, before a stop string), why it ended, and with
    logprobs asked each of its tokens' figures."""

    text: str
    finish_reason: str
    sampled: list[Sampled] = field(default_factory=list)
    offset: int = 0  # where the generated text starts in `text` (after an echoed prompt)


def build_response(
    model: str,
    request: ChatCompletionRequest | CompletionRequest,
    prepared: Prepared,
    outputs: list[Output],
    stats: Stats,
    formatter: LogprobFormatter | None = None,
) -> ChatCompletion | TextCompletion:
    """The response body: one choice per output, in order; `stats` the request's (usage, metrics)."""
    usage, metrics = usage_of(stats), metrics_of(stats, prepared.pruning_label)
    model = request.model or model
    wants_logprobs = prepared.sampling.logprobs is not None
    if isinstance(request, ChatCompletionRequest):
        choices = [
            ChatChoice(
                index=index,
                message=ChatMessageOut(content=out.text),
                finish_reason=out.finish_reason,
                logprobs=formatter.chat(out.sampled) if wants_logprobs else None,
            )
            for index, out in enumerate(outputs)
        ]
        return ChatCompletion(model=model, choices=choices, usage=usage, metrics=metrics)
    choices = [
        CompletionChoice(
            index=index,
            text=out.text,
            finish_reason=out.finish_reason,
            logprobs=formatter.completion(out.sampled, out.offset) if wants_logprobs else None,
        )
        for index, out in enumerate(outputs)
    ]
    return TextCompletion(model=model, choices=choices, usage=usage, metrics=metrics)


def choice_text(body: dict) -> str:
    """The generated text of a dumped chat.completion or text_completion body."""
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]
