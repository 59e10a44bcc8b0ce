"""Chat template rules shared by the router (torch-free rendering) and the offline `LLM.chat`
(transformers' apply_chat_template): how a message's content and its tool calls' arguments become
what a template sees, and which variables a caller's chat_template_kwargs may not set."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from splitserve.common.errors import InvalidRequestError, json_excerpt

TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
"""Variables every chat template is rendered with from the caller's own arguments (transformers'
render_jinja_template), never from chat_template_kwargs."""

TEXT_PART_KEYS = {"text": "text", "refusal": "refusal"}
"""Content part types read as text, and the key holding it: an assistant message's `refusal` part
(what the openai SDK sends back for a refused answer) is its text, as vLLM reads it."""


def content_text(value: Any, field: str) -> str:
    """A message's content as the string a template sees (vLLM's "string" content format): a string,
    null (""), or a list of text parts (OpenAI's [{"type": "text", "text": ...}]) joined with newlines.
    InvalidRequestError naming `field` (or the part) for anything else: models here are text-only."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            key = TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None  # a JSON list or object: unhashable
            if key is None or not isinstance(part.get(key), str):
                raise InvalidRequestError(f"{field}[{index}]", "only {\"type\": \"text\", \"text\": ...} (or "
                                                               "\"refusal\") content parts are supported, got "
                                                               f"{part!r}")
            texts.append(part[key])
        return "\n".join(texts)
    raise InvalidRequestError(field, f"must be a string or a list of text parts, got {value!r}")


def check_template_kwargs(template_kwargs: Mapping[str, Any], reserved: Mapping[str, str]) -> None:
    """InvalidRequestError `chat_template_kwargs.<key>` for the first key (in sorted order) that
    `reserved` holds, with `reserved[key]` (why it cannot be set there) as the message."""
    taken = sorted(reserved.keys() & template_kwargs.keys())
    if taken:
        raise InvalidRequestError(f"chat_template_kwargs.{taken[0]}", reserved[taken[0]])


def parse_call_arguments(value: Any, field: str) -> Any:
    """A call's arguments: JSON text parsed (vLLM's rule: null or "" is {}; an object already parsed
    is taken as it is); InvalidRequestError naming `field`.arguments otherwise."""
    if not value:
        return {}
    if isinstance(value, (dict, list)):
        return value
    if not isinstance(value, str):
        raise InvalidRequestError(f"{field}.arguments", f"must be a JSON string, got {json_excerpt(value)}")
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than the decoder goes
        raise InvalidRequestError(f"{field}.arguments", f"is not valid JSON: {error}") from None
