"""The vLLM frontend flags of the OpenAI HTTP API: its HTTP layer (CORS, response headers, the proxy
path prefix, uvicorn's logging) and server-wide choices in its responses (the chat role). Plain typed
data the launcher builds from RouterConfig (deploy/router_app.py) and start_http_server applies."""

from __future__ import annotations

from dataclasses import dataclass, field

UVICORN_LOG_LEVEL_NUMBERS = {"critical": 50, "error": 40, "warning": 30, "info": 20, "debug": 10, "trace": 5}
"""vLLM's --uvicorn-log-level choices -> logging levels (uvicorn's trace is 5)."""
UVICORN_LOG_LEVELS = tuple(UVICORN_LOG_LEVEL_NUMBERS)


@dataclass(frozen=True)
class CorsPolicy:
    """Which web pages may call the HTTP API from a browser: Starlette's CORSMiddleware with vLLM's
    --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials, and vLLM's
    defaults (no origin: a browser's cross-origin call gets no CORS headers, its preflight a 400)."""

    allowed_origins: tuple[str, ...] = ()
    """Origins allowed, e.g. ("https://chat.example",); "*" is any."""
    allowed_methods: tuple[str, ...] = ("*",)
    """HTTP methods a preflight allows; "*" is any."""
    allowed_headers: tuple[str, ...] = ("*",)
    """Request headers a preflight allows; "*" is any the browser asks for."""
    allow_credentials: bool = False
    """Answer `Access-Control-Allow-Credentials: true` (cookies, HTTP auth on cross-origin calls)."""


@dataclass(frozen=True)
class HttpOptions:
    """The HTTP layer's settings; the defaults are vLLM's."""

    cors: CorsPolicy = field(default_factory=CorsPolicy)
    """Browser access (see CorsPolicy)."""
    request_id_headers: bool = False
    """Every answer carries `X-Request-Id`: the request's own header, else a fresh uuid4 hex (vLLM's
    --enable-request-id-headers)."""
    root_path: str = ""
    """The path prefix a proxy in front serves the API under, which it strips before forwarding
    (vLLM's --root-path, FastAPI's root_path): the app's `root_path` (ASGI scope); routes and checks
    match the path without it. "": none."""
    uvicorn_log_level: str = "info"
    """Level of uvicorn's loggers (uvicorn.error, uvicorn.asgi), one of UVICORN_LOG_LEVELS (vLLM's
    --uvicorn-log-level). uvicorn writes no access log here (splitserve.access is the access log)."""
    access_log: bool = True
    """A request answered with an error before it ran (401, 404, 413, 429 at the edge, 400 in validation) gets
    a `refused` line on the access log (splitserve.access); the requests that ran get theirs from their records.
    router.access_log (vLLM's --disable-log-requests turns it off)."""
    acceptor_process: bool = True
    """Accept connections in an acceptor process that refuses a full router's generation requests itself
    (router/acceptor_process.py); not with TLS nor without an in-flight limit. router.http_acceptor_process."""
    response_role: str = "assistant"
    """The role of a chat completion's message (and first stream delta) when the request's
    add_generation_prompt is true, vLLM's --response-role; otherwise the role of its last message."""
    return_tokens_as_token_ids: bool = False
    """What a completion or chat request that leaves return_tokens_as_token_ids unset gets: logprob
    tokens as "token_id:<id>" (vLLM's --return-tokens-as-token-ids)."""
    enable_prompt_tokens_details: bool = False
    """Completion and chat usage carries prompt_tokens_details.cached_tokens (vLLM's
    --enable-prompt-tokens-details; without it vLLM reports none). The Responses API always does."""
