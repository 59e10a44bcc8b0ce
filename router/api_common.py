"""What the router's gRPC services (Generation, Triton) share: a call's deadline and the status
a request's error ends it with, and the access-log line of a refused one. (Readiness is Orchestrator.is_ready.)"""

from __future__ import annotations

import time

import grpc

from splitserve.common.errors import InvalidRequestError
from splitserve.router.access_log import grpc_refusal_fields, log_refusal
from splitserve.router.api_types import RouterError


def grpc_deadline(context: grpc.aio.ServicerContext, request_timeout_s: float | None) -> float | None:
    """The time.monotonic() by which a request must end: the earlier of the call's gRPC deadline
    (for a stream: the whole stream's) and now + request_timeout_s; None when neither is set."""
    now = time.monotonic()  # read first: the request's deadline is then never after the call's
    remaining = [s for s in (context.time_remaining(), request_timeout_s) if s is not None]
    return now + min(remaining) if remaining else None


def grpc_status(error: InvalidRequestError | RouterError) -> tuple[grpc.StatusCode, str]:
    """The status code and details a request's error ends a gRPC call with: INVALID_ARGUMENT, the details
    starting with the field at fault (`field: what is wrong`, even where the OpenAI API's message opens with
    OpenAI's context-length sentence), or the RouterError's own code."""
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, f"{error.field}: {error.message}"
    return grpc.StatusCode[error.code], error.message


def log_grpc_refusal(rpc: str, error: InvalidRequestError | RouterError, client_request_id: str) -> None:
    """The access log's `refused` line of a call (or of one request of a Triton stream) that `error` ended
    before it became a request of the router (admission, validation): the orchestrator writes the line of
    every request it ran, so exactly one of the two is written per request. `client_request_id`: the
    request's id field ("": none sent)."""
    code, message = grpc_status(error)
    param = error.field if isinstance(error, InvalidRequestError) else None
    log_refusal(grpc_refusal_fields(rpc, code.name, message, param, client_request_id or None))
