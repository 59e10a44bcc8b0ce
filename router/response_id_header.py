"""One middleware for the response headers that name an answer by an id: vLLM's X-Request-Id
(router/request_id_header.py) and Anthropic's request-id (router/anthropic_request_id.py). Each adds its header
to the answers it applies to, whichever layer answered (a 401 or 429 at the edge too)."""

from __future__ import annotations

from typing import Callable

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ANTHROPIC_REQUEST_ID_HEADER = "request-id"
"""Anthropic's id of an answer on the Messages API (router/anthropic_request_id.py)."""
SENT_IDS_SCOPE_KEY = "splitserve.sent_ids"
"""Set in a request's ASGI scope as its answer starts: {header name: the id sent}, for the layers inside
(RefusalLog), which read it once their answer's start has gone out through every layer."""


class ResponseIdHeader:
    """Adds the header `name` to the start of every HTTP answer whose request `applies_to` takes, its value
    `make_id(scope)`: called as the answer starts, so that it sees what the app put in the scope while it ran; the
    value is kept in the scope (SENT_IDS_SCOPE_KEY)."""

    def __init__(self, app: ASGIApp, name: str, make_id: Callable[[Scope], str],
                 applies_to: Callable[[Scope], bool]) -> None:
        self.app = app
        self.name = name
        self.make_id = make_id
        self.applies_to = applies_to

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.applies_to(scope):
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent_id = self.make_id(scope)
                scope.setdefault(SENT_IDS_SCOPE_KEY, {})[self.name] = sent_id
                MutableHeaders(scope=message).append(self.name, sent_id)
            await send(message)

        await self.app(scope, receive, send_with_id)
