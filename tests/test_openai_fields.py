"""Every field of vLLM's completion and chat request models is handled or refused with a 400
naming it, never silently ignored (router/openai_fields.py)."""

from __future__ import annotations

import json

import pytest

from splitserve.router.openai_fields import (CHAT_HANDLED, CHAT_REFUSED, COMPLETION_HANDLED, COMPLETION_REFUSED,
                                             Refused)
from tests.factories import http_request, served_apis

VLLM_COMMON = (
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words", "add_special_tokens",
    "response_format", "structured_outputs", "priority", "request_id", "session_id", "return_tokens_as_token_ids",
    "return_token_ids", "routed_experts_prompt_start", "return_token_offsets", "return_mm_kwargs", "cache_salt",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection", "thinking_token_budget",
    "stream_interval",
    # earlier vLLM releases (guided decoding before structured_outputs, custom logits processors)
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structural_tag", "logits_processors",
)
"""Fields of vLLM's CompletionRequest and ChatCompletionRequest alike (vllm/entrypoints/openai/
completion/protocol.py and chat_completion/protocol.py)."""
VLLM_COMPLETION = VLLM_COMMON + ("prompt", "echo", "suffix", "prompt_embeds", "best_of")
VLLM_CHAT = VLLM_COMMON + (
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "reasoning_effort",
    "include_reasoning", "parallel_tool_calls", "echo", "add_generation_prompt", "continue_final_message",
    "documents", "chat_template", "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs",
    "return_prompt_text", "functions", "function_call", "audio")

BASE = {"/v1/completions": {"prompt": "The river", "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}}
REFUSED = {"/v1/completions": COMPLETION_REFUSED, "/v1/chat/completions": CHAT_REFUSED}


@pytest.mark.parametrize(("fields", "handled", "refused"), [(VLLM_COMPLETION, COMPLETION_HANDLED, COMPLETION_REFUSED),
                                                            (VLLM_CHAT, CHAT_HANDLED, CHAT_REFUSED)])
def test_every_vllm_field_is_handled_or_refused(fields, handled, refused):
    refused_names = {rule.name for rule in refused}
    assert not handled & refused_names
    assert [name for name in fields if name not in handled | refused_names] == []


@pytest.fixture(scope="module")
def port(tiny_llama_dir):
    with served_apis(tiny_llama_dir, "m") as served:
        yield served.http_port


def post(port: int, path: str, body: dict) -> tuple[int, dict]:
    status, _, raw = http_request(port, "POST", path, json.dumps(body).encode())
    return status, json.loads(raw)


def asking_value(rule: Refused) -> object:
    """A value that asks for the feature (anything but an accepted one)."""
    return False if any(ok is True for ok in rule.accepted) else True


@pytest.mark.parametrize("path", list(BASE))
def test_refused_fields_are_400_naming_the_field(port, path):
    for rule in REFUSED[path]:
        status, reply = post(port, path, {**BASE[path], rule.name: asking_value(rule)})
        assert (status, reply["error"]["param"]) == (400, rule.name), rule.name
        assert reply["error"]["message"].startswith(f"{rule.name}: is not supported by this server: {rule.reason}")


@pytest.mark.parametrize("path", list(BASE))
def test_refused_fields_at_their_defaults_are_accepted(port, path):
    defaults = {rule.name: rule.accepted[0] for rule in REFUSED[path] if rule.accepted}
    status, reply = post(port, path, {**BASE[path], **defaults, "user": "u", "session_id": "s"})
    assert status == 200, reply
