"""Anthropic's `request-id` response header on the Messages API's answers (/v1/messages and its count_tokens),
which the anthropic SDK exposes as `_request_id` (of a message, and of an error) for a user to quote: every answer
carries one, as Anthropic's API sends it. A request that ran is named by its id, `req_<id>` (its message is
`msg_<id>`, its access-log line `request "<id>"`); any other answer (refused, counted) by a fresh `req_<hex>`.
vLLM sends none."""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Scope

from splitserve.router.anthropic_protocol import is_messages_path
from splitserve.router.http_access import RAN_REQUEST_ID_SCOPE_KEY, route_path
from splitserve.router.response_id_header import ANTHROPIC_REQUEST_ID_HEADER, ResponseIdHeader


def anthropic_request_id(app: ASGIApp) -> ResponseIdHeader:
    """Adds `request-id` to every answer on the Messages API's paths."""
    return ResponseIdHeader(app, ANTHROPIC_REQUEST_ID_HEADER, _ran_or_fresh_id,
                            lambda scope: is_messages_path(route_path(scope)))


def _ran_or_fresh_id(scope: Scope) -> str:
    return f"req_{scope.get(RAN_REQUEST_ID_SCOPE_KEY) or uuid.uuid4().hex}"
