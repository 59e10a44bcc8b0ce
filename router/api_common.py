"""What the router's public APIs share: readiness (OpenAI /health, Triton ServerReady and
ModelReady), and for the gRPC services (Generation, Triton) a call's deadline and the status a
request's error ends it with."""

from __future__ import annotations

import time

import grpc

from splitserve.common.errors import InvalidRequestError
from splitserve.router.orchestrator import Orchestrator, RouterError


def is_ready(orchestrator: Orchestrator) -> bool:
    """Requests can be served: some decode worker answers the router's report polls."""
    return any(orchestrator.monitor.load(worker_id) is not None for worker_id in orchestrator.decode_pool.clients)


def grpc_deadline(context: grpc.aio.ServicerContext, request_timeout_s: float | None) -> float | None:
    """The time.monotonic() by which a request must end: the earlier of the call's gRPC deadline
    (for a stream: the whole stream's) and now + request_timeout_s; None when neither is set."""
    remaining = [s for s in (context.time_remaining(), request_timeout_s) if s is not None]
    return time.monotonic() + min(remaining) if remaining else None


def grpc_status(error: InvalidRequestError | RouterError) -> tuple[grpc.StatusCode, str]:
    """The status code and details a request's error ends a gRPC call with: INVALID_ARGUMENT
    (the message names the field), or the RouterError's own code."""
    if isinstance(error, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error)
    return grpc.StatusCode[error.code], error.message
