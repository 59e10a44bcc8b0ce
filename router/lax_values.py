"""vLLM's request models are pydantic models in lax mode, so vLLM takes `"max_tokens": 8.0`, `"8"`,
`"stream": "true"` or a completion's `"logprobs": true` (1) for the typed values they stand for. The
OpenAI front takes the same: before a request body is parsed, each scalar field below that holds
such a stand-in gets the value pydantic would have made of it (the table of conversions is
pydantic 2's, checked against the one vLLM 0.32 runs). Anything else is left as sent, and the
parser's own checks refuse it naming the field."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_TRUE_TEXT = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_TEXT = frozenset({"0", "off", "f", "false", "n", "no"})
"""pydantic's boolean strings, compared lower-cased ("TRUE" is true; " true" is not a boolean)."""
_INTEGER_TEXT = re.compile(r"\s*[+-]?\d+(_\d+)*(\.0*)?\s*")
"""pydantic's integer strings: digits with single underscores between them, optionally ".0", spaces around."""
MAX_INTEGER_TEXT_CHARS = 4096
"""Longer integer strings stay strings (and are refused by the parser naming the field): Python's int()
raises a ValueError past 4300 digits, and pydantic refuses long ones too."""
_NUMBER_TEXT = re.compile(r"\s*[+-]?(\d+(_\d+)*(\.(\d+(_\d+)*)?)?|\.\d+(_\d+)*)([eE][+-]?\d+)?\s*")
"""pydantic's float strings (the finite ones; "nan" and "inf", which it also takes, stay refused here)."""

INTEGER_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "n", "best_of", "top_logprobs", "top_k", "seed",
                            "min_tokens", "truncate_prompt_tokens", "prompt_logprobs", "priority", "stream_interval"})
NUMBER_FIELDS = frozenset({"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                           "repetition_penalty", "length_penalty"})
BOOLEAN_FIELDS = frozenset({"stream", "echo", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                            "add_special_tokens", "return_tokens_as_token_ids", "return_token_ids",
                            "add_generation_prompt", "continue_final_message", "parallel_tool_calls",
                            "include_reasoning", "use_beam_search", "return_token_strs"})
"""Fields both endpoints' models type alike; `logprobs` is an integer for completions, a boolean for chats."""
STREAM_OPTION_FIELDS = frozenset({"include_usage", "continuous_usage_stats"})


def as_integer(value: Any) -> Any:
    """pydantic's int in lax mode: a bool (true is 1), a float without a fraction, an integer string."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and len(value) <= MAX_INTEGER_TEXT_CHARS and _INTEGER_TEXT.fullmatch(value):
        return int(value.strip().replace("_", "").split(".")[0])
    return value


def as_number(value: Any) -> Any:
    """pydantic's float in lax mode: a bool, a (finite) number string; an int stays an int (a valid float)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value):
        return float(value.strip().replace("_", ""))
    return value


def as_boolean(value: Any) -> Any:
    """pydantic's bool in lax mode: 0 or 1 (as an int or float), a boolean string in any case."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE_TEXT | _FALSE_TEXT:
        return value.lower() in _TRUE_TEXT
    return value


def with_lax_values(body: Mapping[str, Any], logprobs_is_boolean: bool) -> dict[str, Any]:
    """The body with each field of the tables above (and stream_options' flags) as pydantic reads it;
    `logprobs_is_boolean`: a chat's logprobs (a completion's is an integer)."""
    converted = dict(body)
    for name, value in body.items():
        if name in INTEGER_FIELDS or (name == "logprobs" and not logprobs_is_boolean):
            converted[name] = as_integer(value)
        elif name in NUMBER_FIELDS:
            converted[name] = as_number(value)
        elif name in BOOLEAN_FIELDS or (name == "logprobs" and logprobs_is_boolean):
            converted[name] = as_boolean(value)
    options = body.get("stream_options")
    if isinstance(options, dict):
        converted["stream_options"] = {k: as_boolean(v) if k in STREAM_OPTION_FIELDS else v for k, v in options.items()}
    return converted
