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
        super().__init__(self._text(field, message))
        self.field = field
        self.message = message

    @staticmethod
    def _text(field: str, message: str) -> str:
        """What a client reads (str(error)): the field, then what is wrong with it."""
        return f"{field}: {message}"

    def renamed(self, field: str) -> InvalidRequestError:
        """The same error naming `field` instead: a request parsed as another API's (the Responses and Messages
        APIs' bodies parsed as a chat's) names its own fields. The class, and so the code, is kept."""
        return InvalidRequestError(field, self.message)

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Raised in the router's body-parsing process (router/request_body.py) and re-raised here:
        # pickle rebuilds an exception from its args, which hold the joined text, not (field, message).
        return type(self), (self.field, self.message)


CONTEXT_LENGTH_PHRASE = "This model's maximum context length is"
"""OpenAI's and vLLM's opening words for a prompt the context cannot hold ("This model's maximum context length is
N tokens. However, ..."), which client libraries match to tell that error from other 400s: LiteLLM lower-cases the
message first (its ContextWindowExceededError, what its context-window fallbacks act on), others match it as is."""


class ContextLengthExceededError(InvalidRequestError):
    """A prompt longer than the model's context can serve. Its message opens with OpenAI's sentence
    (CONTEXT_LENGTH_PHRASE, max_model_len), then names the field and what it holds: "This model's maximum context
    length is 512 tokens. However, messages has 2410 tokens, and at least one output token must fit. Please reduce
    the length of the input." """

    code = "context_length_exceeded"
    """OpenAI's code for it (the openai SDK's `BadRequestError.code`)."""

    def __init__(self, field: str, excess: str, max_model_len: int, num_tokens: int | None = None,
                 max_prompt_tokens: int | None = None) -> None:
        super().__init__(field, f"{CONTEXT_LENGTH_PHRASE} {max_model_len} tokens. However, {field} {excess}. "
                                "Please reduce the length of the input.")
        self.excess = excess
        """What `field` holds beyond the context ("has 2410 tokens"), after its name."""
        self.max_model_len = max_model_len
        self.num_tokens = num_tokens
        """The prompt's tokens; None when it was refused by its size in bytes, before it was tokenized."""
        self.max_prompt_tokens = max_prompt_tokens
        """The most tokens a prompt may have (with num_tokens; Anthropic's message states both)."""

    @staticmethod
    def _text(field: str, message: str) -> str:
        return message  # OpenAI's sentence first; the message names the field after it

    def renamed(self, field: str) -> ContextLengthExceededError:
        return ContextLengthExceededError(field, self.excess, self.max_model_len, self.num_tokens,
                                          self.max_prompt_tokens)

    def __reduce__(self) -> tuple[type, tuple[str, str, int, int | None, int | None]]:
        return type(self), (self.field, self.excess, self.max_model_len, self.num_tokens, self.max_prompt_tokens)


class UnsupportedModelError(ValueError):
    """A model directory whose architecture or configuration the engine cannot run."""


class StartupError(RuntimeError):
    """A cluster that could not start (a worker failed to load, no node fits it); the message is
    one line saying which part failed and why."""
