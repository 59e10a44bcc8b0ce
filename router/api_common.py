"""What the router's gRPC services (Generation, Triton) share: a call's deadline and the status
a request's error ends it with. (Readiness is Orchestrator.is_ready.)"""

from __future__ import annotations

import time

import grpc

from splitserve.common.errors import InvalidRequestError
from splitserve.router.api_types import RouterError


def grpc_deadline(context: grpc.aio.ServicerContext, request_timeout_s: float | None) -> float | None:
    """The time.monotonic() by which a request must end: the earlier of the call's gRPC deadline
    (for a stream: the whole stream's) and now + request_timeout_s; None when neither is set."""
    now = time.monotonic()  # read first: the request's deadline is then never after the call's
    remaining = [s for s in (context.time_remaining(), request_timeout_s) if s is not None]
    return now + min(remaining) if remaining else None


def grpc_status(error: InvalidRequestError | RouterError) -> tuple[grpc.StatusCode, str]:
    """The status code and details a request's error ends a gRPC call with: INVALID_ARGUMENT
    (the message names the field), or the RouterError's own code."""
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    return grpc.StatusCode[error.code], error.message
