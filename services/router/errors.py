"""The one translation of failures into HTTP statuses and OpenAI error bodies, for the gateway,
and the exception handlers that answer with them: a route raises, a handler answers."""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.router.admission import ClientGone, QueueTimeout
from services.router.auth import KeyUnverifiable
from services.router.client import UpstreamError
from services.router.dispatch import DeadlineError
from services.router.policy import NoWorkerError
from shared.api.schemas import ErrorBody
from shared.api.serving import RequestError

log = logging.getLogger(__name__)

KINDS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable",
    504: "timeout",
    500: "server_error",
}


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> ErrorBody:
    return ErrorBody(message=message, type=kind, code=code, param=param)


def status_of(error: Exception) -> tuple[int, ErrorBody]:
    """The one translation of failures into HTTP statuses and OpenAI error bodies; what nobody
    expected is logged with its traceback and answered 500 without internals."""
    known = _known(error)
    if known is not None:
        return known
    log.error("unexpected error", exc_info=error)
    return 500, error_body("internal error (see the gateway's log)", KINDS[500], "internal_error")


def status_code_of(error: Exception) -> int:
    """status_of's status alone, without logging."""
    known = _known(error)
    return 500 if known is None else known[0]


def _known(error: Exception) -> tuple[int, ErrorBody] | None:
    if isinstance(error, StarletteHTTPException):
        error = RequestError(error.status_code, str(error.detail))
    elif isinstance(error, RequestValidationError):
        error = RequestError(400, str(error))
    if isinstance(error, RequestError):
        return error.status_code, error_body(
            error.message, KINDS.get(error.status_code, "invalid_request_error"), error.code, error.param
        )
    if isinstance(error, NoWorkerError):
        return 503, error_body(f"no worker can take the request: {error}", KINDS[503], "no_worker")
    if isinstance(error, UpstreamError):
        return 503, error_body(str(error), KINDS[503], "upstream_failed")
    if isinstance(error, QueueTimeout):
        return 504, error_body(str(error), KINDS[504], "queue_timeout")
    if isinstance(error, ClientGone):  # nobody reads it; nginx's code for the log and the metric
        return 499, error_body(str(error), KINDS[499], "client_closed_request")
    if isinstance(error, DeadlineError):
        return 504, error_body(str(error), KINDS[504], "deadline_exceeded")
    if isinstance(error, KeyUnverifiable):
        return 503, error_body(str(error), KINDS[503], "key_unverifiable")
    if isinstance(error, redis.RedisError):
        return 503, error_body("shared state (Redis) is unavailable; retry shortly", KINDS[503], "state_unavailable")
    return None


def error_response(error: Exception) -> JSONResponse:
    status, body = status_of(error)
    headers = {"retry-after": "1"} if status in (429, 503) else None  # when to try again
    return JSONResponse({"error": body.model_dump()}, status_code=status, headers=headers)


# What a route may raise on purpose. Exception is handled too, but Starlette answers it in its
# outermost middleware and then raises it again to the server, which logs it once more.
EXPECTED = (
    RequestError,
    NoWorkerError,
    UpstreamError,
    QueueTimeout,
    ClientGone,
    DeadlineError,
    KeyUnverifiable,
    redis.RedisError,
    StarletteHTTPException,
    RequestValidationError,
)


def install_handlers(app: FastAPI) -> None:
    """Every error, raised anywhere, leaves in OpenAI's format."""

    async def handle(request: Request, error: Exception) -> JSONResponse:
        return error_response(error)

    for kind in (*EXPECTED, Exception):
        app.add_exception_handler(kind, handle)


def outcome_of(status: int) -> str:
    """A completion request's `lazyserve_requests` outcome for an error status it ended with."""
    if status == 429:
        return "queue_full"
    if status == 499:
        return "cancelled"
    if status == 504:
        return "deadline"
    return "client_error" if status < 500 else "server_error"
