"""What the gateway reads from an HTTP request before it knows what the request asks: its id, its
JSON body (within a size, a depth and a time), its schema, and whether its client is still there.
Knows nothing of workers, queues or models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from services.router.admission import ClientGone
from services.router.settings import GatewaySettings
from shared.api.serving import RequestError, validation_message, validation_param

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


def request_id_of(request: Request) -> str:
    """The client's X-Request-Id when it is a plain token (it is echoed and logged), else a new one."""
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.fullmatch(given) else f"req-{uuid.uuid4().hex[:16]}"


async def read_body(request: Request, settings: GatewaySettings) -> dict:
    """The JSON body, read within the size limit and the read timeout: a declared length over the
    limit is refused before reading, a chunked body as soon as it passes the limit."""
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise RequestError(413, f"a request body of {declared} bytes is over the limit of {limit}")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(settings.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestError(413, f"the request body is over the limit of {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(408, f"the request body did not arrive within {settings.body_timeout_s} s") from None
    except ClientDisconnect:  # gone before its body arrived: a client that left, not our error
        raise ClientGone("the client went away before its request body arrived") from None
    raw = b"".join(chunks)
    depth = settings.max_body_depth
    if nested_deeper_than(raw, depth):
        raise RequestError(400, f"the body nests arrays and objects more than {depth} levels deep")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(400, f"the body is not valid JSON: {error}") from None
    except RecursionError:  # the check above bounds nesting first; kept as a backstop
        raise RequestError(400, "the body nests too deep") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    return body


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_INNERMOST = re.compile(rb"\[\]|\{\}")


def nested_deeper_than(raw: bytes, limit: int) -> bool:
    """Whether JSON text nests arrays and objects more than `limit` deep, found without parsing
    it: strings dropped, then every innermost pair removed per pass, all in the regex engine
    (json.loads recurses once per level, so a body nested deeper than Python's recursion limit
    would fail inside it). At most `limit` passes over the brackets, usually a few hundred bytes."""
    brackets = _STRINGS.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(limit):
        if not brackets:
            return False
        brackets, removed = _INNERMOST.subn(b"", brackets)
        if not removed:
            return False  # unbalanced: json.loads says where
    return bool(brackets)


def validated(schema, body: dict):
    """`body` as `schema`, or a 400 that names the field."""
    try:
        return schema.model_validate(body)
    except ValidationError as error:
        raise RequestError(400, validation_message(error), param=validation_param(error)) from None


async def until_gone(request: Request, work):
    """Await `work` (a coroutine) unless the client goes away first: then it is cancelled (what it
    held is given back by its own cleanup) and ClientGone is raised. The request body must have
    been read: the next message the server has for this request is its disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # this task itself cancelled: so is the work
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone("the client went away before its request finished")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
