"""Errors that cross package boundaries (torch-free)."""

from __future__ import annotations

import json
from typing import Any


def json_excerpt(value: Any, max_chars: int = 64) -> str:
    """A client's value as JSON, cut to `max_chars` for an error message (a refused field may hold a
    whole JSON schema)."""
    text = json.dumps(value, default=str)
    return text if len(text) <= max_chars else f"{text[:max_chars]}...(+{len(text) - max_chars} chars)"


class InvalidRequestError(ValueError):
    """A request that can never be served as given; the message names the offending field.

    Raised before anything is allocated, so rejecting a request never leaks resources.
    """

    code: str | None = None
    """The OpenAI error object's `code` (null for most 400s)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Raised in the router's body-parsing process (router/request_body.py) and re-raised here:
        # pickle rebuilds an exception from its args, which hold the joined text, not (field, message).
        return type(self), (self.field, self.message)


CONTEXT_LENGTH_PHRASE = "this model's maximum context length is"
"""OpenAI's and vLLM's words for a prompt the context cannot hold, which client libraries match to tell
that error from other 400s (LiteLLM's ContextWindowExceededError, what its context-window fallbacks act on)."""


class ContextLengthExceededError(InvalidRequestError):
    """A prompt longer than the model's context can serve; its message holds CONTEXT_LENGTH_PHRASE."""

    code = "context_length_exceeded"
    """OpenAI's code for it (the openai SDK's `BadRequestError.code`)."""


class UnsupportedModelError(ValueError):
    """A model directory whose architecture or configuration the engine cannot run."""


class StartupError(RuntimeError):
    """A cluster that could not start (a worker failed to load, no node fits it); the message is
    one line saying which part failed and why."""
