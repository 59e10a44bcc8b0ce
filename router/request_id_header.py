"""vLLM's --enable-request-id-headers: every HTTP answer carries an `X-Request-Id` header."""

from __future__ import annotations

import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class RequestIdHeader:
    """Adds `X-Request-Id` to every HTTP answer, as vLLM's XRequestIdMiddleware: the request's own
    `X-Request-Id` header when it sent one, else a fresh uuid4 in hex (32 characters)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex

        async def send_with_request_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-Id", request_id)
            await send(message)

        await self.app(scope, receive, send_with_request_id)
