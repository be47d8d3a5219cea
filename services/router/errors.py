"""The one translation of failures into HTTP statuses and OpenAI error bodies, for the gateway."""

from __future__ import annotations

import logging

import redis

from services.router.admission import ClientGone, QueueTimeout
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


def status_of(error: Exception) -> tuple[int, object]:
    """The one translation of failures into HTTP statuses and OpenAI error bodies."""
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
    if isinstance(error, redis.RedisError):
        return 503, error_body("shared state (Redis) is unavailable; retry shortly", KINDS[503], "state_unavailable")
    log.error("unexpected error", exc_info=error)
    return 500, error_body("internal error (see the gateway's log)", KINDS[500], "internal_error")


def outcome_of(status: int) -> str:
    """A completion request's `lazyserve_requests` outcome for an error status it ended with."""
    if status == 429:
        return "queue_full"
    if status == 499:
        return "cancelled"
    if status == 504:
        return "deadline"
    return "client_error" if status < 500 else "server_error"
