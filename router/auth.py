"""Optional API-key auth for the router's public APIs: one check shared by the gRPC server (the
`authorization` metadata) and the OpenAI-compatible HTTP API (the `Authorization` header, or the
`x-api-key` header the Anthropic SDKs send).

Authorization carries `Bearer <key>`, x-api-key the key alone. The key is compared in constant time
(hmac.compare_digest). Standard library only (the router stays torch-free).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

MISSING = "missing API key"
INVALID = "invalid API key"
_SCHEME = "bearer"


def check_authorization(header: str | bytes | None, api_key: str) -> str | None:
    """None when `header` (an Authorization value) is `Bearer <api_key>`; otherwise why not:
    MISSING (no header, another scheme or an empty token) or INVALID (another key)."""
    raw = header.decode("latin-1") if isinstance(header, bytes) else (header or "")  # HTTP header bytes as is
    scheme, _, token = raw.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != _SCHEME or not token:
        return MISSING
    sent = token.encode("latin-1") if isinstance(header, bytes) else token.encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(sent, api_key.encode("utf-8")):
        return INVALID
    return None


def check_api_key(authorization: bytes | None, x_api_key: bytes | None, api_key: str) -> str | None:
    """None when either HTTP header carries `api_key` (Authorization as `Bearer <key>`, x-api-key as the key);
    otherwise why not: INVALID when a key was sent in either and none matches, else MISSING."""
    reason = check_authorization(authorization, api_key)
    if reason is None or not x_api_key:
        return reason
    return None if hmac.compare_digest(x_api_key.strip(), api_key.encode("utf-8")) else INVALID


def bearer(api_key: str) -> str:
    """The Authorization value that carries `api_key`."""
    return f"Bearer {api_key}"


def api_key_from_env(name: str, environ: Mapping[str, str] = os.environ) -> str:
    """The key held by environment variable `name`; ValueError when it is unset or empty (a
    server configured for auth must not start open by accident)."""
    key = environ.get(name, "").strip()
    if not key:
        raise ValueError(f"API key auth is configured with api_key_env={name!r}, but the environment variable "
                         f"{name} is {'empty' if name in environ else 'not set'}")
    return key
