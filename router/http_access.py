"""The HTTP edge's part of the access log: a request the server answers with an error before it becomes a
request of the router (a 401 for its key, a 429 from the admission gate, a 400 from validation, a 404 for
an unknown URL) gets one `refused` line; a request that ran has the line its record writes when it ends
(router/access_log.py), so each such request is in the log once. A successful call of another endpoint
(/v1/models, /tokenize, /version, ...) has no line."""

from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.router.access_log import log_refusal, refusal_fields
from splitserve.router.request_id_header import REQUEST_ID_HEADER
from splitserve.router.response_id_header import ANTHROPIC_REQUEST_ID_HEADER, SENT_IDS_SCOPE_KEY

RAN_REQUEST_ID_SCOPE_KEY = "splitserve.ran_request_id"
"""Set in a request's ASGI scope once it is a request of the router (its record will write its line): the id the
router knows it by for its client (never empty), which a Messages answer's `request-id` names."""

PROBE_PATHS = frozenset({"/health", "/ping", "/metrics"})
"""Paths whose answer is itself the information (a 503 health probe, every few seconds): never logged."""

_MAX_ERROR_BODY_BYTES = 64 * 1024
"""An error answer's body is read for its message up to this size (error objects are far smaller)."""


def route_path(scope: Scope) -> str:
    """The request's path as the routes see it: uvicorn puts --root-path in front of every path (ASGI's
    `path` includes `root_path`), which Starlette's routing takes off again, and so must every check
    that reads the path before it (the admission gate, the API-key guard, this log)."""
    path, root_path = scope["path"], scope.get("root_path", "")
    if root_path and path.startswith(root_path + "/"):
        return path[len(root_path):]
    return path


@dataclass
class _Answer:
    """What the app sends back: its status and, for an error, the start of its body."""

    status: int = 0
    body: bytes = b""

    def see(self, message: Message) -> bool:
        """Note `message`; True when it is the last part of an error answer."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body" and self.status >= 400:
            self.body = (self.body + message.get("body", b""))[:_MAX_ERROR_BODY_BYTES]
            return not message.get("more_body", False)
        return False


class RefusalLog:
    """Writes the `refused` access line of every HTTP request answered with status >= 400 that did not run
    (RAN_REQUEST_ID_SCOPE_KEY unset), whichever layer answered it; probes (PROBE_PATHS) and CORS preflights (answered
    outside this app) are not requests of the API. The line is written before the answer's last part is
    sent, so a client that has its answer finds the line in the log; except for a full router's 429 that
    the acceptor process answered without this app (router/acceptor_process.py): the router writes that
    one once the acceptor reports it, in a batch after the answers (openai_server.account_busy_refusals)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        answer = _Answer()

        async def watched_send(message: Message) -> None:
            if answer.see(message) and RAN_REQUEST_ID_SCOPE_KEY not in scope:
                message_text, param = _error_message(answer.body)
                anthropic_id = _sent_ids(scope).get(ANTHROPIC_REQUEST_ID_HEADER)
                log_refusal(refusal_fields(scope["method"], route_path(scope), answer.status, message_text, param,
                                           _client_request_id(scope), anthropic_id))
            await send(message)

        await self.app(scope, receive, watched_send)


def _error_message(body: bytes) -> tuple[str | None, str | None]:
    """(message, param) of an OpenAI or Anthropic error object (both nest them under "error"); (None, None)
    for any other body."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None, None
    if not isinstance(error, dict):
        return None, None
    message, param = error.get("message"), error.get("param")
    return (message if isinstance(message, str) else None), (param if isinstance(param, str) else None)


def header(scope: Scope, name: bytes) -> bytes | None:
    """The request's first header `name` (lower case), if any."""
    return next((value for key, value in scope["headers"] if key == name), None)


def _client_request_id(scope: Scope) -> str | None:
    """The X-Request-Id the answer carries (--enable-request-id-headers: the request's own, else a fresh one), else
    the request's own, if any: what a client may quote to find its request in the log. The answer's start has gone
    out through the header's layer (outside this one) before its last part comes here."""
    sent = _sent_ids(scope).get(REQUEST_ID_HEADER)
    if sent is not None:
        return sent
    value = header(scope, REQUEST_ID_HEADER.lower().encode())
    return None if value is None else value.decode("latin-1")


def _sent_ids(scope: Scope) -> dict[str, str]:
    """The ids the answer's start carried, by header name (router/response_id_header.py)."""
    return scope.get(SENT_IDS_SCOPE_KEY, {})
