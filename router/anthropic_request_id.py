"""Anthropic's `request-id` response header on the Messages API's answers (/v1/messages and its count_tokens),
which the anthropic SDK exposes as `_request_id` (of a message, and of an error) for a user to quote: every answer
carries one, as Anthropic's API sends it. A request that ran is named by its id, `req_<id>` (its message is
`msg_<id>`, its access-log line `request "<id>"`); any other answer (refused, counted) by a fresh `req_<hex>`.
vLLM sends none."""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.router.anthropic_protocol import is_messages_path
from splitserve.router.http_access import RAN_REQUEST_ID_SCOPE_KEY, route_path

ANTHROPIC_REQUEST_ID_HEADER = "request-id"


class AnthropicRequestId:
    """Adds `request-id` to every answer on the Messages API's paths, whichever layer answered (a 401 or 429 at
    the edge too)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(route_path(scope)):
            await self.app(scope, receive, send)
            return

        async def send_with_request_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                request_id = scope.get(RAN_REQUEST_ID_SCOPE_KEY) or uuid.uuid4().hex
                MutableHeaders(scope=message).append(ANTHROPIC_REQUEST_ID_HEADER, f"req_{request_id}")
            await send(message)

        await self.app(scope, receive, send_with_request_id)
