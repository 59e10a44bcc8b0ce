"""vLLM's X-Request-Id: with --enable-request-id-headers every HTTP answer carries the header; and,
flag or not, a completion's or chat completion's request that sends it gets it as its id
(`cmpl-<id>`, `chatcmpl-<id>`), as vLLM's _base_request_id takes it."""

from __future__ import annotations

import dataclasses
import uuid

from typing import TypeVar

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Scope

from splitserve.router.request_limits import RequestLimits
from splitserve.router.response_id_header import ResponseIdHeader

REQUEST_ID_HEADER = "X-Request-Id"

Parsed = TypeVar("Parsed")
"""A parsed request with a `request_id` field (router.openai_protocol's CompletionRequest, ChatCompletionRequest)."""


def with_header_request_id(parsed: Parsed, headers: Headers, limits: RequestLimits) -> Parsed:
    """`parsed` with the request's X-Request-Id header as its request_id when it sent one (over the body's
    request_id, as vLLM: `cmpl-<id>` / `chatcmpl-<id>`), whether or not --enable-request-id-headers is on;
    InvalidRequestError naming the header for a value a body's request_id could not be (too long, a space
    or non-ASCII)."""
    request_id = headers.get(REQUEST_ID_HEADER)
    if request_id is None:
        return parsed
    limits.check_request_id(request_id, REQUEST_ID_HEADER)
    return dataclasses.replace(parsed, request_id=request_id)


def request_id_header(app: ASGIApp) -> ResponseIdHeader:
    """Adds `X-Request-Id` to every HTTP answer, as vLLM's XRequestIdMiddleware: the request's own
    `X-Request-Id` header when it sent one, else a fresh uuid4 in hex (32 characters)."""
    return ResponseIdHeader(app, REQUEST_ID_HEADER, _own_or_fresh_id, lambda scope: True)


def _own_or_fresh_id(scope: Scope) -> str:
    return Headers(scope=scope).get(REQUEST_ID_HEADER) or uuid.uuid4().hex
