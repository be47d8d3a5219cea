"""The gateway's OpenAPI document with the real request and response schemas.

The endpoints read their bodies themselves (to answer 413 and bad JSON in OpenAI's format), so
FastAPI cannot infer them; the same pydantic models that validate the bodies are declared here,
which is what clients' generators and schemathesis read.
"""

from __future__ import annotations

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from shared.api.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorBody,
    TextCompletion,
    TokenizeRequest,
    TokenizeResponse,
)
from shared.api.serving import CHAT_URL, COMPLETIONS_URL


class ErrorResponse(BaseModel):
    error: ErrorBody


ERRORS = {
    "400": "bad input, or prompt + max_tokens over the context",
    "401": "missing or invalid API key",
    "404": "a model this server does not serve",
    "408": "the body did not arrive in time",
    "413": "body too large",
    "429": "too many requests in progress",
    "503": "no worker can take the request",
    "504": "past the request deadline",
}
REF = "#/components/schemas/{model}"
# One server-sent event: `data` is a JSON chunk (chat.completion.chunk / text_completion), an
# {"error": ...} object, or the literal [DONE].
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": REF.format(model=model.__name__)}


def build_openapi(app) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    models = [
        (ChatCompletionRequest, "validation"),
        (CompletionRequest, "validation"),
        (ChatCompletion, "serialization"),
        (TextCompletion, "serialization"),
        (ErrorResponse, "serialization"),
        (TokenizeRequest, "validation"),
        (TokenizeResponse, "serialization"),
        (DetokenizeRequest, "validation"),
        (DetokenizeResponse, "serialization"),
    ]
    _, definitions = models_json_schema(models, ref_template=REF)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
    for url, request, response in (
        (CHAT_URL, ChatCompletionRequest, ChatCompletion),
        (COMPLETIONS_URL, CompletionRequest, TextCompletion),
    ):
        operation = schema["paths"][url]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
        operation["responses"] = {
            "200": {
                "description": "the completion; with stream: true, server-sent events of chunks ending in [DONE]",
                "content": {"application/json": {"schema": _ref(response)}, "text/event-stream": {"schema": SSE_EVENT}},
            },
            **{
                code: {"description": text, "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
                for code, text in ERRORS.items()
            },
        }
    for url, request, response in (
        ("/tokenize", TokenizeRequest, TokenizeResponse),
        ("/detokenize", DetokenizeRequest, DetokenizeResponse),
    ):
        operation = schema["paths"][url]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
        operation["responses"] = {
            "200": {"description": "done", "content": {"application/json": {"schema": _ref(response)}}},
            **{
                code: {"description": ERRORS[code], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
                for code in ("400", "401", "404", "408", "413")
            },
        }
    errors = ("401", "404")
    operation = schema["paths"]["/v1/models/{model_id}"]["get"]
    operation["responses"] = {
        "200": operation["responses"]["200"],
        **{
            code: {"description": ERRORS[code], "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
            for code in errors
        },
    }
    return schema
