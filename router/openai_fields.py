"""What the OpenAI front does with every request field of vLLM's completion and chat request
models: the fields it implements, and the ones it refuses (400 naming the field) when they ask
for anything but their default. Never silently ignored.

A field in neither table is not one of vLLM's (nor one of the OpenAI fields listed here): it is
ignored, as vLLM ignores fields its request models do not declare, so clients that send extra
fields keep working. tests/test_openai_fields.py checks that each field of vLLM 0.32's request
models (tests/fixtures/vllm_request_fields.json, extracted from vLLM's sources) is in a table here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.common.errors import InvalidRequestError, json_excerpt

COMMON_HANDLED = frozenset({
    "model", "frequency_penalty", "presence_penalty", "logprobs", "max_tokens", "n", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "stop_token_ids",
    "ignore_eos", "min_tokens", "skip_special_tokens", "add_special_tokens", "return_tokens_as_token_ids",
    "request_id", "logit_bias", "allowed_token_ids", "bad_words", "include_stop_str_in_output", "return_token_ids",
    "truncate_prompt_tokens", "truncation_side", "prompt_logprobs", "cache_salt", "stream_interval", "priority",
    # No effect on the output, by definition: an end-user id for abuse monitoring and a session
    # id that only steers routing (vLLM ignores both too); render-endpoint options that vLLM
    # itself ignores on the generation endpoints.
    "user", "session_id", "return_token_offsets", "return_mm_kwargs",
    # structured output (router/structured_output.py)
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    # beam search (router/openai_beam_search.py)
    "use_beam_search", "length_penalty",
})
"""Fields both endpoints implement."""
COMPLETION_HANDLED = COMMON_HANDLED | {"prompt", "best_of", "echo"}
CHAT_HANDLED = COMMON_HANDLED | {"messages", "echo", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
                                 "continue_final_message", "chat_template_kwargs", "documents",
                                 # rendered when the server trusts request templates (router/tokenizer.py)
                                 "chat_template",
                                 # tool calling (router/tool_calling.py)
                                 "tools", "tool_choice", "parallel_tool_calls",
                                 # reasoning (router/reasoning_parsers.py)
                                 "include_reasoning", "reasoning_effort"}


def asks_for_nothing(value: Any, accepted: tuple[Any, ...]) -> bool:
    """Whether `value` is one of `accepted` (a field's default and its equivalents), compared type-exact so
    that true is not 1 and 0.0 is not 0 unless listed."""
    return any(value == ok and type(value) is type(ok) for ok in accepted)


@dataclass(frozen=True)
class Refused:
    """A field this server does not implement: any value but `accepted` (and null, unless `non_null`) is a 400."""

    name: str
    accepted: tuple[Any, ...]
    """Values that ask for nothing: the field's default (and its equivalents)."""
    reason: str
    """Why it is refused, for the error message."""
    non_null: str | None = None
    """What the field must be where vLLM's model declares it without null ("a boolean", "an integer"): null is a 400
    naming it, as in vLLM; None: null is the default."""

    def check(self, body: Mapping[str, Any]) -> None:
        value = body.get(self.name)
        if value is None and self.non_null is not None and self.name in body:
            raise InvalidRequestError(self.name, f"must be {self.non_null}, got null")
        if value is None or asks_for_nothing(value, self.accepted):
            return
        raise InvalidRequestError(self.name, f"is not supported by this server: {self.reason} (got "
                                             f"{json_excerpt(value)})")



_STRUCTURED = "structured output has one grammar engine (llguidance) and compact JSON"
_NOT_IMPLEMENTED = "not implemented"
_FUNCTIONS = "the deprecated functions API is not implemented (send tools and tool_choice)"
_TEXT_ONLY = "text models only"
_OFF = (False,)
_BOOLEAN = "a boolean"
_EMPTY = ([], {})


COMMON_REFUSED = (
    Refused("guided_decoding_backend", ("auto", "guidance", "llguidance"), _STRUCTURED),
    Refused("guided_whitespace_pattern", (), _STRUCTURED),
    Refused("structural_tag", (), "structural tags are not implemented"),
    Refused("logprob_token_ids", (), _NOT_IMPLEMENTED),
    Refused("spaces_between_special_tokens", (True,), _NOT_IMPLEMENTED, _BOOLEAN),
    Refused("watermarking", _OFF, _NOT_IMPLEMENTED),
    Refused("repetition_detection", (), _NOT_IMPLEMENTED),
    Refused("thinking_token_budget", (-1,), "reasoning is never cut short (no thinking budgets)"),
    Refused("kv_transfer_params", _EMPTY, "KV transfer is the cluster's own"),
    Refused("ec_transfer_params", _EMPTY, _NOT_IMPLEMENTED),
    Refused("vllm_xargs", _EMPTY, "no custom extensions"),
    Refused("logits_processors", ([],), "no custom extensions"),
    Refused("routed_experts_prompt_start", (0,), "no mixture-of-experts models"),
    Refused("prompt_embeds", (), _TEXT_ONLY),
    Refused("mm_processor_kwargs", _EMPTY, _TEXT_ONLY),
    Refused("mm_payload", (), _TEXT_ONLY),
)
COMPLETION_REFUSED = (
    *COMMON_REFUSED,
    Refused("suffix", ("",), _NOT_IMPLEMENTED),
)
CHAT_REFUSED = (
    *COMMON_REFUSED,
    Refused("functions", ([],), _FUNCTIONS),
    Refused("function_call", ("none", "auto"), _FUNCTIONS),
    Refused("return_prompt_text", _OFF, _NOT_IMPLEMENTED),
    Refused("media_io_kwargs", _EMPTY, _TEXT_ONLY),
    Refused("audio", (), _TEXT_ONLY),
    Refused("modalities", (["text"],), _TEXT_ONLY),
    Refused("prediction", (), _NOT_IMPLEMENTED),
    Refused("web_search_options", (), _NOT_IMPLEMENTED),
)


def refuse_unsupported(body: Mapping[str, Any], refused: tuple[Refused, ...]) -> None:
    """InvalidRequestError naming the first refused field the body sets to something else than its default."""
    for rule in refused:
        rule.check(body)
