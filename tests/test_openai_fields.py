"""Every field of vLLM's completion and chat request models is handled or refused with a 400
naming it, never silently ignored (router/openai_fields.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.router.lax_values import as_boolean, as_integer, as_number
from splitserve.router.openai_fields import (CHAT_HANDLED, CHAT_REFUSED, COMPLETION_HANDLED, COMPLETION_REFUSED,
                                             Refused)
from tests.factories import http_request, served_apis

VLLM_FIELDS = json.loads((Path(__file__).parent / "fixtures" / "vllm_request_fields.json").read_text())
"""Field names of vLLM's CompletionRequest and ChatCompletionRequest, read from vLLM's own sources
by tests/fixtures/vllm_request_fields.py (its docstring says how to regenerate it)."""
EARLIER_VLLM = ("best_of", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
                "guided_whitespace_pattern", "structural_tag", "logits_processors")
"""Fields of earlier vLLM releases (guided decoding before structured_outputs, best_of before V1,
custom logits processors) that clients still send."""
OPENAI_CHAT_ONLY = ("functions", "function_call", "audio", "modalities", "prediction", "web_search_options")
"""OpenAI chat fields vLLM's model does not declare (it ignores them; this server refuses them)."""
VLLM_COMPLETION = (*VLLM_FIELDS["completion"], *EARLIER_VLLM)
VLLM_CHAT = (*VLLM_FIELDS["chat"], *EARLIER_VLLM[1:], *OPENAI_CHAT_ONLY)


def test_the_fixture_is_vllms_field_list():
    """The fixture came from vLLM 0.32 and holds its core fields (a truncated file would pass the rest)."""
    assert VLLM_FIELDS["vllm_version"] == "0.32.0"
    assert (len(VLLM_FIELDS["completion"]), len(VLLM_FIELDS["chat"])) == (55, 68)
    assert {"prompt", "echo", "n", "mm_payload"} <= set(VLLM_FIELDS["completion"])
    assert {"messages", "tools", "n", "mm_payload"} <= set(VLLM_FIELDS["chat"])


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
    """A value that asks for the feature (anything but an accepted one, as pydantic reads it: true is 1 for a
    number, so a number field gets 2)."""
    if any(ok is True for ok in rule.accepted):
        return False
    return 2 if any(type(ok) in (int, float) for ok in rule.accepted) else True


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


NON_NULL_BOOLEANS = {
    "/v1/completions": ("add_special_tokens", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                        "use_beam_search", "spaces_between_special_tokens"),
    "/v1/chat/completions": ("add_generation_prompt", "continue_final_message", "echo", "add_special_tokens",
                             "include_reasoning", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
                             "use_beam_search", "spaces_between_special_tokens"),
}
"""The boolean fields vLLM's request models declare without null (`bool = ...`): null is a 400 there."""
_NON_NULL_SAMPLING = {"min_tokens": "must be an integer in [0, max_tokens=1], got null",
                      "bad_words": "must be a list of strings, got null",
                      "length_penalty": "must be a number, got null", "priority": "must be an integer, got null",
                      "request_id": "must be a string, got null"}
NON_NULL_OTHERS = {"/v1/completions": {**_NON_NULL_SAMPLING, "n": "must be an integer in [1, 128], got null"},
                   "/v1/chat/completions": _NON_NULL_SAMPLING}
"""The other fields vLLM's request models declare without null (`int = 0`, `str = Field(default_factory=...)`),
with the message naming each (a chat's n is `int | None`: NULLABLE)."""
NULLABLE = {
    "/v1/completions": {"echo": None, "stream": None, "stream_options": None, "logprobs": None,
                        "return_token_ids": None, "return_tokens_as_token_ids": None, "temperature": None,
                        "seed": None, "stop": None, "top_k": None, "prompt_logprobs": None, "cache_salt": None},
    "/v1/chat/completions": {"max_tokens": None, "max_completion_tokens": 1, "stream": None, "logprobs": None,
                             "top_logprobs": None, "n": None, "parallel_tool_calls": None, "tools": None,
                             "return_token_ids": None, "return_tokens_as_token_ids": None, "documents": None,
                             "chat_template_kwargs": None, "temperature": None, "stop": None, "reasoning_effort": None},
}
"""Fields vLLM declares `T | None`: null stays their default."""


@pytest.mark.parametrize("path", list(BASE))
def test_null_for_a_boolean_vllm_declares_without_null_is_400_naming_it(port, path):
    for name in NON_NULL_BOOLEANS[path]:
        status, reply = post(port, path, {**BASE[path], name: None})
        assert (status, reply["error"]["param"], reply["error"]["message"]) == (
            400, name, f"{name}: must be a boolean, got null"), name


@pytest.mark.parametrize("path", list(BASE))
def test_null_for_another_field_vllm_declares_without_null_is_400_naming_it(port, path):
    for name, message in NON_NULL_OTHERS[path].items():
        status, reply = post(port, path, {**BASE[path], name: None})
        assert (status, reply["error"]["param"], reply["error"]["message"]) == (400, name, f"{name}: {message}"), name


@pytest.mark.parametrize("path", list(BASE))
def test_null_stays_the_default_where_vllm_declares_the_field_optional(port, path):
    status, reply = post(port, path, {**BASE[path], **NULLABLE[path]})
    assert status == 200, reply


def test_tokenize_refuses_null_for_its_chat_template_booleans(port):
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens"):
        status, reply = post(port, "/tokenize", {**chat, name: None})
        assert (status, reply["error"]["message"]) == (400, f"{name}: must be a boolean, got null"), name
    status, reply = post(port, "/tokenize", {"prompt": "The river", "add_special_tokens": None})
    assert (status, reply["error"]["message"]) == (400, "add_special_tokens: must be a boolean, got null")
    assert post(port, "/tokenize", {**chat, "return_token_strs": None})[0] == 200


# ---- values as vLLM's pydantic models read them (router/lax_values.py) ---------------------------

@pytest.mark.parametrize(("value", "read"), [
    (8, 8), (8.0, 8), ("8", 8), (" 8 ", 8), ("8.0", 8), ("+8", 8), ("1_000", 1000), (True, 1),
    (8.5, 8.5), ("8.5", "8.5"), ("0x10", "0x10"), ("1e3", "1e3"), ("", ""), (float("inf"), float("inf")), (None, None),
])
def test_an_integer_is_read_as_pydantic_reads_one(value, read):
    assert as_integer(value) == read and type(as_integer(value)) is type(read)


@pytest.mark.parametrize(("value", "read"), [
    (0.5, 0.5), (1, 1), ("0.5", 0.5), (" 0.5", 0.5), ("1e-2", 0.01), ("1_0.5", 10.5), (True, 1.0),
    ("nan", "nan"), ("hot", "hot"), ("", ""),
])
def test_a_number_is_read_as_pydantic_reads_one(value, read):
    assert as_number(value) == read and type(as_number(value)) is type(read)


@pytest.mark.parametrize(("value", "read"), [
    (True, True), (1, True), (0, False), (1.0, True), ("true", True), ("TRUE", True), ("yes", True), ("on", True),
    ("1", True), ("t", True), ("y", True), ("off", False), ("no", False), ("f", False),
    (2, 2), (0.5, 0.5), (" true", " true"), ("2", "2"), ("sure", "sure"),
])
def test_a_boolean_is_read_as_pydantic_reads_one(value, read):
    assert as_boolean(value) == read and type(as_boolean(value)) is type(read)


def test_a_completion_takes_what_vllms_pydantic_model_takes(port):
    """What vLLM 0.32 answered with 200 (tests/fixtures/vllm_conformance.py): the same request typed exactly."""
    exact = post(port, "/v1/completions", {"prompt": "The river", "max_tokens": 8, "temperature": 0, "logprobs": 1,
                                           "ignore_eos": True})
    lax = post(port, "/v1/completions", {"prompt": "The river", "max_tokens": 8.0, "temperature": "0",
                                         "logprobs": True, "ignore_eos": "yes"})
    assert exact[0] == lax[0] == 200
    assert lax[1]["choices"] == exact[1]["choices"] and lax[1]["usage"]["completion_tokens"] == 8
    for unreadable in ("8.5", "9" * 5000):  # 5,000 digits: past int()'s own limit, which raises
        status, reply = post(port, "/v1/completions", {"prompt": "The river", "max_tokens": unreadable})
        assert (status, reply["error"]["param"]) == (400, "max_tokens")


def test_a_stream_flag_given_as_a_string_streams(port):
    status, headers, raw = http_request(port, "POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": "2", "stream": "true",
        "stream_options": {"include_usage": 1}}).encode())
    events = [line.removeprefix(b"data: ") for line in raw.split(b"\n\n") if line]
    assert status == 200 and events[-1] == b"[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 2


def test_tokenize_reads_its_flags_as_vllms_pydantic_model_does(port):
    exact = post(port, "/tokenize", {"prompt": "Hello", "add_special_tokens": False, "return_token_strs": True})
    lax = post(port, "/tokenize", {"prompt": "Hello", "add_special_tokens": "false", "return_token_strs": 1})
    assert exact == lax and exact[0] == 200 and exact[1]["token_strs"] is not None
