"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens; router/anthropic_protocol.py):
a request translated into exactly the chat request that asks for the same generation, the exact
stream events of scripted outputs, each stop_reason's cause, the errors' shapes and statuses, and a
served model driven by the official anthropic SDK (greedy text and token counts equal to the chat
endpoint's, a stream that accumulates to the unstreamed message, a tool_use round trip, thinking
blocks from a reasoning parser, x-api-key auth, 401 and 429, a prompt too long in Anthropic's words, the
request-id header)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import typing

import anthropic
import jsonschema
import openai
import pytest
from anthropic.types import message_create_params
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from splitserve.common.errors import ContextLengthExceededError, InvalidRequestError
from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.router.anthropic_protocol import (MESSAGES_HANDLED, MESSAGES_REFUSED, PASSED_TO_CHAT, MessageHeader,
                                                  MessagesRenderer, has_inline_system, merged_inline_system,
                                                  parse_count_tokens_request, parse_messages_request, stop_reason)
from splitserve.router.api_types import RouterError, StreamChunk, Usage
from splitserve.router.fanout import IndexedChunk
from splitserve.router.openai_protocol import parse_chat_request
from splitserve.router.openai_server import ApiError, _message_events
from splitserve.router.policy import RoutingConfig
from splitserve.router.tool_parsers import ToolOutput
from splitserve.testing.tiny_models import TOOLS_CHAT_TEMPLATE, build_thinking_model
from tests.factories import http_request, make_request_limits, served_apis
from tests.test_openai_fuzz import JSON_VALUES, bodies

MODEL = "m"
KEY = "sk-test-key"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_SCHEMA}]
"""Anthropic's custom tool."""
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA,
                                                "description": "The weather in a city."}}]
"""The same tool in the chat's form."""
SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cch=7f3a"},
          {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
"""Claude Code's system prompt: its billing header first (dropped: it would defeat the prefix cache)."""
MESSAGES = [
    {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                 {"type": "text", "text": "in Oslo?", "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Ask the tool.", "signature": "abc"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "oslo", "unit": "c"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": [{"type": "text", "text": "4 degrees"}]},
                                 {"type": "text", "text": "And tomorrow?"}]},
    {"role": "assistant", "content": "Cold."},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"}]},
]
"""A conversation in Messages blocks: a tool round trip, then a text answer and a lone tool result."""
CHAT_MESSAGES = [
    {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
    {"role": "user", "content": [{"type": "text", "text": "What is the weather"},
                                 {"type": "text", "text": "in Oslo?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "reasoning": "Ask the tool.",
     "tool_calls": [{"id": "toolu_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "oslo", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": [{"type": "text", "text": "4 degrees"}]},
    {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    {"role": "assistant", "content": "Cold."},
    {"role": "tool", "tool_call_id": "toolu_2", "content": "sunny"},
]
"""The same conversation as chat messages."""


def parse(**fields):
    return parse_messages_request({"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}],
                                   **fields}, make_request_limits())


# ---- parsing ----------------------------------------------------------------------------------

def test_a_request_is_exactly_the_chat_request_for_the_same_generation():
    messages = parse(system=SYSTEM, messages=MESSAGES, tools=TOOLS, stop_sequences=["\n\n", "END"], temperature=0.5,
                     top_p=0.9, top_k=40, stream=True, metadata={"user_id": "u-1"},
                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    chat = parse_chat_request({"model": MODEL, "max_tokens": 16, "messages": CHAT_MESSAGES, "tools": CHAT_TOOLS,
                               "stop": ["\n\n", "END"], "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stream": True,
                               "tool_choice": "required", "parallel_tool_calls": False}, make_request_limits())
    assert messages == chat


@pytest.mark.parametrize(("tool_choice", "chat_choice"), [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}})])
def test_each_tool_choice_is_its_chat_counterpart(tool_choice, chat_choice):
    chat = parse_chat_request({"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}],
                               "tools": CHAT_TOOLS, "tool_choice": chat_choice}, make_request_limits())
    assert parse(tools=TOOLS, tool_choice=tool_choice).tool_calling == chat.tool_calling


def test_thinking_disabled_and_output_config_are_the_chats_reasoning_effort_and_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = parse_chat_request({"model": MODEL, "max_tokens": 2048, "messages": [{"role": "user", "content": "Hi"}],
                               "reasoning_effort": "none", "response_format": {
                                   "type": "json_schema", "json_schema": {"name": "output", "schema": schema}}},
                              make_request_limits())
    assert parse(max_tokens=2048, thinking={"type": "disabled"}, output_config={
        "effort": "high", "format": {"type": "json_schema", "schema": schema}}) == chat
    enabled = parse(max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024})
    assert enabled.template == parse(max_tokens=2048).template  # accepted, the budget not enforced


def test_what_only_asks_for_anthropics_own_service_is_accepted_with_no_effect():
    """Claude Code sends context_management with every request (gateways that refuse it break it; vLLM ignores it)."""
    assert parse(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}, speed="fast",
                 service_tier="standard_only", inference_geo="us", diagnostics={"previous_message_id": "msg_1"},
                 cache_control={"type": "ephemeral"}, metadata={"user_id": "u"}) == parse()


def test_count_tokens_takes_the_messages_request_without_max_tokens():
    body = {"model": MODEL, "system": "Be brief.", "messages": MESSAGES, "tools": TOOLS}
    counted = parse_count_tokens_request(body, make_request_limits())
    assert (counted.messages, counted.template) == (parse(**body).messages, parse(**body).template)


INLINE_SYSTEM = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                 {"role": "system", "content": [
                     {"type": "text", "text": "x-anthropic-billing-header: cch=1"},
                     {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"}]},
                 {"role": "system", "content": "x-anthropic-billing-header: cch=2"},
                 {"role": "user", "content": "Why?"}]
"""Claude Code's later conversations: system messages between the turns (its reminders)."""
CHAT_INLINE_SYSTEM = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."},
                      {"role": "system", "content": [{"type": "text",
                                                      "text": "<system-reminder>Be brief.</system-reminder>"}]},
                      {"role": "user", "content": "Why?"}]
"""The same with the system prompt "You are terse.", as chat messages: each reminder where it is (the billing
headers dropped, and a system message left empty with them)."""
MERGED_INLINE_SYSTEM = [{"role": "system", "content": "You are terse.\n\n<system-reminder>Be brief.</system-reminder>"},
                        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                        {"role": "user", "content": "Why?"}]
"""The same for a template that wants the system prompt first."""


def test_system_messages_between_turns_stay_where_they_are_or_merge_into_the_first():
    chat = parse_chat_request({"model": MODEL, "max_tokens": 16, "messages": CHAT_INLINE_SYSTEM},
                              make_request_limits())
    merged = parse_chat_request({"model": MODEL, "max_tokens": 16, "messages": MERGED_INLINE_SYSTEM},
                                make_request_limits())
    parsed = parse(system="You are terse.", messages=INLINE_SYSTEM)
    assert (parsed, has_inline_system(parsed), has_inline_system(parse())) == (chat, True, False)
    assert merged_inline_system(parsed) == merged


def test_every_field_of_the_anthropic_sdks_request_is_handled_or_refused():
    sdk_fields = set(typing.get_type_hints(message_create_params.MessageCreateParamsBase)) | {
        "stream", "temperature", "top_p", "top_k"}  # the SDK 2.x dropped the sampling fields; vLLM takes them
    known = MESSAGES_HANDLED | set(PASSED_TO_CHAT) | {rule.name for rule in MESSAGES_REFUSED}
    assert sdk_fields - known == set()


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"max_tokens": None}, "max_tokens", "is required: an integer >= 1, got null"),
    ({"max_tokens": 0}, "max_tokens", "is required: an integer >= 1, got 0"),
    ({"model": ""}, "model", 'is required: a non-empty string, got ""'),
    ({"messages": []}, "messages", "must be a non-empty list of {role, content} objects, got []"),
    ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].role",
     'must be "user", "assistant" or "system", got "tool"'),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}]}, "messages[0].content[0]",
     'must be a text block {"type": "text", "text": ...}, got {"type": "image"}'),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}}]}]},
     "messages[0].content[1].type",
     "image blocks are not supported: this server serves text models only (send the content as text)"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {}}]}]}]}, "messages[0].content[0].content[0].type",
     "image blocks are not supported: this server serves text models only (send the content as text)"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
     "messages[0].content[0].type", 'must be one of text, tool_use, thinking, redacted_thinking here, got '
                                    '"tool_result"'),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]},
     "messages[0].content[0].input", 'must be an object, got "{}"'),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "4"}]}]},
     "messages[0].content[0].tool_use_id", "must be a non-empty string, got null"),
    ({"system": [{"type": "image"}]}, "system[0]", 'must be a text block {"type": "text", "text": ...}, got '
                                                   '{"type": "image"}'),
    ({"stop_sequences": "END"}, "stop_sequences", 'must be a list of strings, got "END"'),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type",
     "only custom tools {name, description, input_schema} are supported (Anthropic's server and client tools are "
     'not), got "web_search_20250305"'),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema", "is required: a JSON schema object, got null"),
    ({"tools": [{"name": "", "input_schema": {"type": "object"}}]}, "tools[0].name",
     "must be a non-empty string, got ''"),
    ({"tools": [{"name": "f", "input_schema": {"type": "objec"}}], "tool_choice": {"type": "tool", "name": "f"}},
     "tools[0].input_schema", "json_schema: unsupported type 'objec' at /type"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice.name",
     "'g' is not one of the tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "required"}}, "tool_choice",
     'must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}, got {"type": "required"}'),
    ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "thinking.budget_tokens",
     "must be an integer >= 1024, got 512"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens",
     "must be less than max_tokens (16), got 1024"),
    ({"output_config": {"effort": "huge"}}, "output_config.effort",
     'must be one of none, minimal, low, medium, high, xhigh, max, got "huge"'),
    ({"metadata": {"user_id": 7}}, "metadata.user_id", "must be a string, got 7"),
    ({"stop_sequences": ["x"] * 65}, "stop_sequences", "must hold at most 64 strings, got 65"),
    ({"container": "c-1"}, "container", 'is not supported by this server: no code execution containers (got "c-1")'),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example"}]}, "mcp_servers",
     'is not supported by this server: no MCP connector (run the MCP client on your side and send its tools) (got '
     '[{"type": "url", "url": "https://mcp.example"}])'),
    ({"vllm_xargs": {"a": 1}}, "vllm_xargs", 'is not supported by this server: no custom extensions (got {"a": 1})'),
])
def test_bad_requests_are_refused_naming_the_messages_field(fields, field, message):
    with pytest.raises(InvalidRequestError) as error:
        parse(**fields)
    assert (error.value.field, error.value.message) == (field, message)


def test_a_chat_over_max_prompt_bytes_stays_a_context_length_refusal_in_anthropics_words():
    """Renamed to its Messages field, the chat parser's refusal keeps its class: Anthropic's "prompt is too long"."""
    with pytest.raises(ContextLengthExceededError) as error:
        parse_messages_request({"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "x" * 101}]},
                               make_request_limits(max_prompt_bytes=100))
    assert (error.value.field, ApiError.of(error.value).anthropic_body()["error"]["message"]) == (
        "messages", "prompt is too long: This model's maximum context length is 2048 tokens. However, messages has "
        "101 bytes (UTF-8); at most 100 can be served (router.max_prompt_bytes). Please reduce the length of the "
        "input.")


# ---- rendering ----------------------------------------------------------------------------------

HEADER = MessageHeader("msg_1", MODEL, 7)


def message_start(prompt_tokens: int = 7) -> dict:
    return {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}}


def test_a_text_output_streams_anthropics_events_in_order():
    renderer = MessagesRenderer(HEADER, None)
    chunks = [StreamChunk("1", (5,), "Hel", ()), StreamChunk("1", (6,), "", ()),
              StreamChunk("1", (7,), "lo.", (), "stop", "\n\n", Usage(7, 0, 3))]
    events = renderer.opening_events() + [event for chunk in chunks for event in renderer.stream_events(chunk)]
    assert events == [
        message_start(),
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo."}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"},
         "usage": {"input_tokens": 7, "output_tokens": 3}},
        {"type": "message_stop"}]
    assert MessagesRenderer(HEADER, None).response([chunks], Usage(7, 2, 3)) == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
        "content": [{"type": "text", "text": "Hello."}], "stop_reason": "stop_sequence", "stop_sequence": "\n\n",
        "usage": {"input_tokens": 7, "output_tokens": 3}}


def test_text_then_a_call_are_two_blocks_and_the_call_streams_its_input_as_json_deltas(monkeypatch):
    monkeypatch.setattr("splitserve.router.anthropic_protocol.new_tool_use_id", lambda: "toolu_x")
    calling = parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": CHAT_TOOLS},
                                 make_request_limits()).tool_calling
    tool_output = ToolOutput.for_request(calling, "hermes")
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "oslo", "unit": "c"}}</tool_call>'
    chunks = [StreamChunk("1", (5,), text[:20], ()), StreamChunk("1", (6,), text[20:], (), "stop", None,
                                                                  Usage(7, 0, 2))]
    renderer = MessagesRenderer(MessageHeader("msg_1", MODEL, 7, cache_details=True), tool_output)
    # message_start comes before the cache hits are known: the whole prompt, the split only in message_delta
    assert renderer.opening_events()[0]["message"]["usage"] == {
        "input_tokens": 7, "cache_read_input_tokens": 0, "output_tokens": 0}
    events = [event for chunk in chunks for event in renderer.stream_events(chunk)]
    assert [event["type"] for event in events] == [
        "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        *["content_block_delta"] * (len(events) - 7), "content_block_stop", "message_delta", "message_stop"]
    assert events[3] == {"type": "content_block_start", "index": 1, "content_block": {
        "type": "tool_use", "id": "toolu_x", "name": "get_weather", "input": {}}}
    assert "".join(event["delta"]["partial_json"] for event in events[4:-3]) == '{"city": "oslo", "unit": "c"}'
    assert {event["index"] for event in events[4:-3]} == {1}
    assert events[-2] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                          "usage": {"input_tokens": 7, "cache_read_input_tokens": 0, "output_tokens": 2}}
    whole = MessagesRenderer(MessageHeader("msg_1", MODEL, 7), tool_output).response([chunks], Usage(7, 4, 2))
    assert (whole["content"], whole["stop_reason"], whole["usage"]) == (
        [{"type": "text", "text": "Sure. "},
         {"type": "tool_use", "id": "toolu_x", "name": "get_weather", "input": {"city": "oslo", "unit": "c"}}],
        "tool_use", {"input_tokens": 7, "output_tokens": 2})


def test_an_empty_output_is_one_empty_text_block_streamed_and_not():
    last = StreamChunk("1", (2,), "", (), "stop", 2, Usage(7, 0, 1))
    events = MessagesRenderer(HEADER, None).stream_events(last)
    assert events[:3] == [{"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                          {"type": "content_block_stop", "index": 0},
                          {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"input_tokens": 7, "output_tokens": 1}}]
    assert MessagesRenderer(HEADER, None).response([[last]], Usage(7, 0, 1))["content"] == [{"type": "text",
                                                                                             "text": ""}]


def test_an_unstreamed_malformed_call_is_all_text_as_the_chats_message():
    calling = parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": CHAT_TOOLS},
                                 make_request_limits()).tool_calling
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": oops}}</tool_call>'
    chunks = [StreamChunk("1", (5,), text[:40], ()), StreamChunk("1", (6,), text[40:], (), "stop")]
    message = MessagesRenderer(HEADER, ToolOutput.for_request(calling, "hermes")).response([chunks], Usage(7, 0, 2))
    assert (message["content"], message["stop_reason"]) == ([{"type": "text", "text": text}], "end_turn")


@pytest.mark.parametrize(("finish_reason", "engine_stop_reason", "called", "complete", "expected"), [
    ("length", None, False, True, ("max_tokens", None)),
    ("length", None, True, False, ("max_tokens", None)),  # a call cut short by max_tokens
    ("stop", None, False, True, ("end_turn", None)),  # EOS
    ("stop", 2, False, True, ("end_turn", None)),  # a stop token id
    ("stop", "END", False, True, ("stop_sequence", "END")),
    ("stop", "END", True, False, ("stop_sequence", "END")),  # a call cut short by a stop sequence must not run
    ("stop", "END", True, True, ("tool_use", None)),
    ("tool_calls", None, True, True, ("tool_use", None)),
    ("stop", None, True, True, ("tool_use", None)),  # a named tool choice ends as "stop"
])
def test_each_cause_has_its_stop_reason(finish_reason, engine_stop_reason, called, complete, expected):
    assert stop_reason(finish_reason, engine_stop_reason, called, complete) == expected


def test_a_failure_mid_stream_ends_it_with_an_error_event():
    renderer = MessagesRenderer(HEADER, None)

    async def chunks():
        yield IndexedChunk(0, StreamChunk("1", (5,), "Hel", ()))
        raise RouterError("UNAVAILABLE", "the decode worker died")

    async def events() -> list[bytes]:
        stream = chunks()
        return [event async for event in _message_events(await anext(stream), stream, renderer)]

    sent = asyncio.run(events())
    assert [event.split(b"\n")[0] for event in sent] == [
        b"event: message_start", b"event: content_block_start", b"event: content_block_delta", b"event: error"]
    assert sent[-1] == (b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
                        b'"message": "the decode worker died"}}\n\n')


# ---- served -----------------------------------------------------------------------------------

MAX_IN_FLIGHT = 3


@pytest.fixture(scope="module")
def served():
    with served_apis(resolve_model_path(DEFAULT_MODEL_NAME), MODEL, api_key=KEY, chat_template=TOOLS_CHAT_TEMPLATE,
                     routing=RoutingConfig(max_in_flight_requests=MAX_IN_FLIGHT)) as served:
        yield served


def client(port: int, api_key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=api_key, max_retries=0)


def chat_client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)


GREEDY = {"extra_body": {"temperature": 0}}
"""The anthropic SDK 2.x has no sampling fields: temperature rides in the body as vLLM takes it."""
CUT_MAX_TOKENS = 16
"""Ends the served model's forced get_weather call one token before its closing brace."""
CUT_PARTIAL_JSON = '{"city":"lls","unit":"c"'
CUT_SDK_INPUT = {"city": "lls", "unit": "c"}
"""What the SDK's accumulation parses of CUT_PARTIAL_JSON: every field, though the call never closed."""


def post(served, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    status, response_headers, raw = http_request(served.http_port, "POST", path, json.dumps(body).encode(),
                                                 headers={"x-api-key": KEY, **(headers or {})})
    return status, response_headers, json.loads(raw)


def test_greedy_output_equals_the_chat_endpoints(served):
    message = client(served.http_port).messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=MESSAGES,
                                                       tools=TOOLS, tool_choice={"type": "none"}, **GREEDY)
    chat = chat_client(served.http_port).chat.completions.create(
        model=MODEL, messages=CHAT_MESSAGES, tools=CHAT_TOOLS, tool_choice="none", max_tokens=12, temperature=0)
    [block] = message.content
    assert (block.type, block.text) == ("text", chat.choices[0].message.content)
    assert block.text != ""
    assert (message.usage.input_tokens, message.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                         chat.usage.completion_tokens)
    assert (message.type, message.role, message.model, message.id[:4], message.stop_reason) == (
        "message", "assistant", MODEL, "msg_", "max_tokens")


def test_a_stream_is_anthropics_events_and_accumulates_to_the_unstreamed_message(served):
    request = dict(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "Tell me about the river."}],
                   **GREEDY)
    whole = client(served.http_port).messages.create(**request)
    with client(served.http_port).messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    assert streamed.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    deltas = [event for event in events if event.type == "content_block_delta"]
    assert [event.type for event in events if event.type not in ("content_block_delta", "text")] == [
        "message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"]
    assert "".join(event.delta.text for event in deltas) == whole.content[0].text
    assert len(deltas) == 10  # one per token (this output's tokens each end a character)
    status, headers, raw = http_request(served.http_port, "POST", "/v1/messages", json.dumps(
        {**request.pop("extra_body"), **request, "stream": True}).encode(), headers={"x-api-key": KEY})
    sent = sse_events(raw)
    assert (status, headers["content-type"].split(";")[0]) == (200, "text/event-stream")
    assert all(name == data["type"] for name, data in sent)
    message_id = sent[0][1]["message"]["id"]
    assert [data for _, data in sent] == [
        {"type": "message_start", "message": {
            "id": message_id, "type": "message", "role": "assistant", "model": MODEL, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        *({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": event.delta.text}}
          for event in deltas),
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
         "usage": {"input_tokens": whole.usage.input_tokens, "output_tokens": 10}},
        {"type": "message_stop"}]
    assert message_id != whole.id and message_id.startswith("msg_")


def sse_events(raw: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event."""
    events = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


@pytest.mark.parametrize(("fields", "expected"), [
    ({"messages": [{"role": "user", "content": "import os"}], "stop_sequences": ["_get"]},
     ("stop_sequence", "_get", "\n\n\nimport ")),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "boolean"}}}},
     ("end_turn", None, "false")),  # the grammar's end: EOS
    ({"max_tokens": 3}, ("max_tokens", None, "\n#\n")),
])
def test_each_cause_of_an_end_has_its_stop_reason(served, fields, expected):
    request = {"model": MODEL, "max_tokens": 40, "messages": [{"role": "user", "content": "Tell me about the river."}],
               **GREEDY, **fields}
    message = client(served.http_port).messages.create(**request)
    with client(served.http_port).messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert (message.stop_reason, message.stop_sequence, message.content[0].text) == expected
    assert (streamed.stop_reason, streamed.stop_sequence, streamed.content[0].text) == expected


@pytest.mark.parametrize("tool_choice", [{"type": "tool", "name": "get_weather"},
                                         {"type": "any", "disable_parallel_tool_use": True}])
def test_a_tool_use_round_trip(served, tool_choice):
    """A forced tool choice returns a tool_use block with its parsed input (stop_reason tool_use), streamed alike;
    sent back with its tool_result, the model answers in text as the chat endpoint answers the same chat."""
    question = {"role": "user", "content": "What is the weather in Oslo?"}
    request = dict(model=MODEL, max_tokens=60, messages=[question], tools=TOOLS, tool_choice=tool_choice, **GREEDY)
    called = client(served.http_port).messages.create(**request)
    with client(served.http_port).messages.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    [call] = called.content
    assert (call.type, call.name, call.id[:6], called.stop_reason) == ("tool_use", "get_weather", "toolu_", "tool_use")
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    [streamed_call] = streamed.content
    assert (streamed_call.name, streamed_call.input, streamed.stop_reason, streamed.usage) == (
        call.name, call.input, "tool_use", called.usage)
    partial_json = "".join(event.delta.partial_json for event in events if event.type == "content_block_delta")
    assert json.loads(partial_json) == call.input
    answer = client(served.http_port).messages.create(model=MODEL, max_tokens=8, tools=TOOLS, **GREEDY, messages=[
        question, {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "4 degrees"}]}],
        tool_choice={"type": "none"})
    chat = chat_client(served.http_port).chat.completions.create(
        model=MODEL, tools=CHAT_TOOLS, tool_choice="none", max_tokens=8, temperature=0, messages=[
            question, {"role": "assistant", "content": None, "tool_calls": [{
                "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "4 degrees"}])
    assert [(block.type, block.text) for block in answer.content] == [("text", chat.choices[0].message.content)]


def test_a_call_cut_short_is_an_empty_input_unstreamed_and_the_sdks_partial_parse_streamed(served):
    """max_tokens ends a forced call inside its JSON: the message's input is {} (no object form), while the
    SDK's accumulation parses the partial_json it got as far as it goes (the documented exception)."""
    request = dict(model=MODEL, max_tokens=CUT_MAX_TOKENS, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                   tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    whole = client(served.http_port).messages.create(**request)
    with client(served.http_port).messages.stream(**request) as stream:
        partial_json = "".join(event.delta.partial_json for event in stream if event.type == "content_block_delta")
        streamed = stream.get_final_message()
    assert (whole.stop_reason, [(block.name, block.input) for block in whole.content]) == (
        "max_tokens", [("get_weather", {})])
    assert (partial_json, streamed.stop_reason) == (CUT_PARTIAL_JSON, "max_tokens")
    assert [(block.name, block.input) for block in streamed.content] == [("get_weather", CUT_SDK_INPUT)]


def test_count_tokens_is_the_rendered_chats_token_count(served):
    counted = client(served.http_port).messages.count_tokens(model=MODEL, system=SYSTEM, messages=MESSAGES,
                                                             tools=TOOLS)
    status, _, tokenized = post(served, "/tokenize", {"model": MODEL, "messages": CHAT_MESSAGES, "tools": CHAT_TOOLS})
    assert (status, counted.input_tokens) == (200, tokenized["count"])
    message = client(served.http_port).messages.create(model=MODEL, max_tokens=1, system=SYSTEM, messages=MESSAGES,
                                                       tools=TOOLS, tool_choice={"type": "none"})
    assert message.usage.input_tokens == counted.input_tokens


def test_a_last_assistant_message_is_a_finished_turn_not_continued_as_in_vllm(served):
    """The template closes the assistant turn and opens a new one (21 tokens), not the 14 that end with "Hel"."""
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    counted = client(served.http_port).messages.count_tokens(model=MODEL, messages=prefill)
    _, _, answered = post(served, "/tokenize", {"model": MODEL, "messages": prefill})
    _, _, continued = post(served, "/tokenize", {"model": MODEL, "messages": prefill, "add_generation_prompt": False,
                                                 "continue_final_message": True})
    assert (counted.input_tokens, answered["count"], continued["count"]) == (21, 21, 14)


def error(message: str, kind: str = "invalid_request_error") -> dict:
    return {"type": "error", "error": {"type": kind, "message": message}}


@pytest.mark.parametrize(("body", "status", "expected"), [
    ({"messages": [{"role": "user", "content": "Hi"}]}, 400,
     error("max_tokens: is required: an integer >= 1, got null")),
    ({"max_tokens": 4, "messages": [{"role": "developer", "content": "Hi"}]}, 400, error(
        'messages[0].role: must be "user", "assistant" or "system", got "developer"')),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "url", "url": "https://example.com/a.png"}}]}]}, 400, error(
        "messages[0].content[0].type: image blocks are not supported: this server serves text models only (send the "
        "content as text)")),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS}, 400, error(
        'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
        '(router.enable_auto_tool_choice, router.tool_call_parser); tool_choice defaults to "auto" when tools are '
        "sent")),
    ({"max_tokens": 4, "model": "claude-sonnet-4-5", "messages": [{"role": "user", "content": "Hi"}]}, 404,
     error("The model `claude-sonnet-4-5` does not exist; this server serves `m`.", "not_found_error")),
])
def test_errors_are_anthropic_error_objects_with_their_status(served, body, status, expected):
    answered, _, response = post(served, "/v1/messages", {"model": MODEL, **body})
    assert (answered, response) == (status, expected)


def test_count_tokens_refuses_as_messages_does_less_what_only_generation_needs(served):
    """No max_tokens, and tools without a tool call parser are fine: nothing is generated."""
    hi = [{"role": "user", "content": "Hi"}]
    answers = [post(served, "/v1/messages/count_tokens", body)[::2] for body in (
        {"model": MODEL, "messages": hi, "tools": TOOLS}, {"model": "other", "messages": hi},
        {"model": MODEL, "messages": [{"role": "ctx", "content": "Hi"}]})]
    assert answers[0][0] == 200
    assert answers[1:] == [
        (404, error("The model `other` does not exist; this server serves `m`.", "not_found_error")),
        (400, error('messages[0].role: must be "user", "assistant" or "system", got "ctx"'))]


def test_a_prompt_too_long_is_anthropics_invalid_request_error_in_its_words(served):
    """Claude Code and LiteLLM match "prompt is too long: N tokens > M maximum" (to compact, or fall back)."""
    max_model_len = served.cluster.orchestrator.max_model_len
    long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "river " * max_model_len}]}
    status, _, counted = post(served, "/v1/messages/count_tokens", long_chat)
    answered, _, response = post(served, "/v1/messages", {**long_chat, "max_tokens": 4})
    assert (status, answered, response) == (200, 400, error(
        f"prompt is too long: {counted['input_tokens']} tokens > {max_model_len - 1} maximum"))


def test_every_answer_carries_anthropics_request_id_the_sdk_exposes(served):
    """A message's is its own id's (msg_<id>: req_<id>); a refused or counted request's a fresh one."""
    hi = [{"role": "user", "content": "Hi"}]
    message = client(served.http_port).messages.create(model=MODEL, max_tokens=2, messages=hi)
    with client(served.http_port).messages.stream(model=MODEL, max_tokens=2, messages=hi) as stream:
        streamed_request_id, streamed = stream.response.headers["request-id"], stream.get_final_message()
    counted = client(served.http_port).messages.with_raw_response.count_tokens(model=MODEL, messages=hi)
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client(served.http_port).messages.create(model="other", max_tokens=4, messages=hi)
    with pytest.raises(anthropic.AuthenticationError) as unauthenticated:
        client(served.http_port, api_key="wrong").messages.create(model=MODEL, max_tokens=4, messages=hi)
    assert message._request_id == "req_" + message.id.removeprefix("msg_")
    assert streamed_request_id == "req_" + streamed.id.removeprefix("msg_")
    fresh = [counted.headers["request-id"], unknown.value.request_id, unauthenticated.value.request_id]
    assert [re.fullmatch("req_[0-9a-f]{32}", request_id) is not None for request_id in fresh] == [True] * 3
    assert len(set(fresh)) == 3
    assert "request-id" not in http_request(served.http_port, "GET", "/v1/models", headers={"x-api-key": KEY})[1]


def test_the_sdk_raises_its_error_classes(served):
    with pytest.raises(anthropic.NotFoundError) as unknown:
        client(served.http_port).messages.create(model="other", max_tokens=4, messages=[{"role": "user",
                                                                                         "content": "Hi"}])
    with pytest.raises(anthropic.BadRequestError) as refused:
        client(served.http_port).messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user",
                                                                                       "content": "Hi"}],
                                                 extra_body={"container": "c-1"})
    with pytest.raises(anthropic.AuthenticationError) as unauthenticated:
        client(served.http_port, api_key="wrong").messages.create(model=MODEL, max_tokens=4,
                                                                  messages=[{"role": "user", "content": "Hi"}])
    assert (unknown.value.status_code, unknown.value.body["error"]["type"]) == (404, "not_found_error")
    assert (refused.value.status_code, refused.value.body["error"]["message"]) == (
        400, 'container: is not supported by this server: no code execution containers (got "c-1")')
    assert (unauthenticated.value.status_code, unauthenticated.value.body) == (
        401, error("invalid API key", "authentication_error"))


@pytest.mark.parametrize(("headers", "status"), [
    ({"x-api-key": KEY}, 200), ({"Authorization": f"Bearer {KEY}"}, 200),
    ({"x-api-key": "wrong", "Authorization": f"Bearer {KEY}"}, 200),
    ({"x-api-key": KEY, "Authorization": "Bearer no"}, 200),
    ({}, 401), ({"x-api-key": "wrong"}, 401), ({"x-api-key": ""}, 401), ({"Authorization": "Bearer wrong"}, 401)])
def test_the_key_is_accepted_in_x_api_key_or_authorization_on_every_guarded_path(served, headers, status):
    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}).encode()
    answers = [http_request(served.http_port, "POST", path, body, headers=headers)[0]
               for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions")]
    answers.append(http_request(served.http_port, "GET", "/v1/models", headers=headers)[0])
    assert answers == [status] * 4


def test_a_missing_key_is_anthropics_401_on_its_paths_and_openais_elsewhere(served):
    body = json.dumps({"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}).encode()
    status, headers, raw = http_request(served.http_port, "POST", "/v1/messages", body)
    chat_status, _, chat_raw = http_request(served.http_port, "POST", "/v1/chat/completions", body)
    assert (status, headers["www-authenticate"], json.loads(raw)) == (401, "Bearer", error(
        "missing API key", "authentication_error"))
    assert (chat_status, json.loads(chat_raw)["error"]["code"]) == (401, "invalid_api_key")


def test_a_full_router_answers_429_with_retry_after(served):
    orchestrator = served.cluster.orchestrator

    async def take_every_slot():
        return [orchestrator.admit() for _ in range(MAX_IN_FLIGHT)]

    slots = served.loop.run(take_every_slot())
    try:
        status, headers, response = post(served, "/v1/messages", {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": "Hi"}]})
        with pytest.raises(anthropic.RateLimitError) as limited:
            client(served.http_port).messages.create(model=MODEL, max_tokens=1,
                                                     messages=[{"role": "user", "content": "Hi"}])
    finally:
        for slot in slots:
            slot.release()
    message = (f"the router has {MAX_IN_FLIGHT} requests in flight, its limit (router.routing.max_in_flight_requests); "
               "retry later")
    assert (status, headers["retry-after"], response) == (429, "1", error(message, "rate_limit_error"))
    assert limited.value.status_code == 429
    assert orchestrator.admission.in_flight == 0


def test_a_messages_request_is_recorded_and_cancelled_as_every_request(served):
    """One orchestration path: the router's request metrics count a Messages request, and a client that goes
    away mid-stream cancels it (its slot freed)."""
    succeeded = served.requests_ended("request_success", finished_reason="length")
    cancelled = served.requests_ended("request_failure", code="CANCELLED")
    client(served.http_port).messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    with client(served.http_port).messages.stream(model=MODEL, max_tokens=400, messages=[
            {"role": "user", "content": "Hi"}]) as stream:
        next(iter(stream))
    deadline = time.monotonic() + 10.0
    while served.requests_ended("request_failure", code="CANCELLED") == cancelled:
        assert time.monotonic() < deadline, "the stream's request was not cancelled"
        time.sleep(0.05)
    assert served.requests_ended("request_success", finished_reason="length") == succeeded + 1
    assert served.cluster.orchestrator.admission.in_flight == 0


def test_framework_errors_on_its_paths_are_anthropic_error_objects(served):
    status, headers, raw = http_request(served.http_port, "GET", "/v1/messages", headers={"x-api-key": KEY})
    unknown_status, _, unknown = http_request(served.http_port, "POST", "/v1/messages/batches", b"{}",
                                              headers={"x-api-key": KEY})
    assert (status, headers["allow"], json.loads(raw)) == (405, "POST", error("Method Not Allowed"))
    assert (unknown_status, json.loads(unknown)) == (404, error("Invalid URL (POST /v1/messages/batches)",
                                                                "not_found_error"))


# ---- a reasoning model --------------------------------------------------------------------------

THINKING_REQUEST = {"model": MODEL, "max_tokens": 60, "messages": [{"role": "user", "content": "Why?"}],
                    "extra_body": {"temperature": 1.0, "seed": 0}}
"""tests/test_reasoning_api.py's request: its output ends its reasoning after some text, then says more."""


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    model_dir = build_thinking_model(tmp_path_factory.mktemp("thinking") / "model")
    with served_apis(model_dir, MODEL, tool_call_parser="hermes", reasoning_parser="qwen3") as served:
        yield served


def test_a_reasoning_parsers_reasoning_is_a_thinking_block_before_the_text(thinking):
    message = client(thinking.http_port).messages.create(**THINKING_REQUEST)
    chat = chat_client(thinking.http_port).chat.completions.create(
        model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Why?"}], temperature=1.0, seed=0)
    with client(thinking.http_port).messages.stream(**THINKING_REQUEST) as stream:
        kinds = [(event.type, getattr(event, "index", None), event.delta.type if event.type == "content_block_delta"
                  else None) for event in stream if event.type.startswith("content_block")]
        streamed = stream.get_final_message()
    thought, said = message.content
    assert (thought.type, thought.thinking, said.type, said.text) == (
        "thinking", chat.choices[0].message.model_extra["reasoning"], "text", chat.choices[0].message.content)
    assert [block.model_dump(exclude={"signature"}) for block in streamed.content] == [
        block.model_dump(exclude={"signature"}) for block in message.content]
    assert (len(thought.signature), len(streamed.content[0].signature)) == (32, 32)
    thinking_deltas = kinds.index(("content_block_delta", 0, "signature_delta")) - 1
    text_deltas = len(kinds) - thinking_deltas - 5
    assert kinds == [("content_block_start", 0, None),
                     *[("content_block_delta", 0, "thinking_delta")] * thinking_deltas,
                     ("content_block_delta", 0, "signature_delta"), ("content_block_stop", 0, None),
                     ("content_block_start", 1, None), *[("content_block_delta", 1, "text_delta")] * text_deltas,
                     ("content_block_stop", 1, None)]
    assert streamed.usage == message.usage
    disabled = client(thinking.http_port).messages.create(**THINKING_REQUEST, thinking={"type": "disabled"})
    assert [block.type for block in disabled.content] == ["text"]


# ---- a template that wants the system prompt first -------------------------------------------------

SYSTEM_FIRST_TEMPLATE = ("{%- for message in messages %}{%- if message['role'] == 'system' and not loop.first %}"
                         "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
                         "{%- endfor %}" + TOOLS_CHAT_TEMPLATE)
"""TOOLS_CHAT_TEMPLATE with Qwen's refusal of a system message after the first."""


@pytest.fixture(scope="module")
def system_first():
    with served_apis(resolve_model_path(DEFAULT_MODEL_NAME), MODEL, chat_template=SYSTEM_FIRST_TEMPLATE) as served:
        yield served


@pytest.mark.parametrize(("fixture", "chat_messages"), [("served", CHAT_INLINE_SYSTEM),
                                                        ("system_first", MERGED_INLINE_SYSTEM)])
def test_system_messages_between_turns_render_in_place_unless_the_template_wants_them_first(
        request, fixture, chat_messages):
    """Where the template takes them, they stay (the prompt's prefix stays cached); else they join the first."""
    served = request.getfixturevalue(fixture)
    fields = dict(model=MODEL, max_tokens=6, system="You are terse.", messages=INLINE_SYSTEM)
    message = client(served.http_port).messages.create(**fields, **GREEDY)
    counted = client(served.http_port).messages.count_tokens(model=MODEL, system="You are terse.",
                                                             messages=INLINE_SYSTEM)
    chat = chat_client(served.http_port).chat.completions.create(model=MODEL, messages=chat_messages, max_tokens=6,
                                                                 temperature=0)
    assert (message.content[0].text, message.usage.input_tokens, counted.input_tokens) == (
        chat.choices[0].message.content, chat.usage.prompt_tokens, chat.usage.prompt_tokens)
    refused = chat_client(served.http_port).chat.completions.with_raw_response.create
    if fixture == "system_first":  # the chat endpoint renders what it is sent: the template refuses it
        with pytest.raises(openai.BadRequestError) as error:
            refused(model=MODEL, messages=CHAT_INLINE_SYSTEM, max_tokens=6)
        assert error.value.body["message"] == ("messages: rejected by the chat template: System message must be at "
                                               "the beginning.")


# ---- fuzzing ------------------------------------------------------------------------------------

_TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
_BLOCKS = (_TEXT_BLOCK
           | st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.sampled_from(["t1", ""]),
                                    "name": st.sampled_from(["f", "g"]), "input": st.just({"a": 1}) | JSON_VALUES})
           | st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": st.just("t1"),
                                    "content": st.text(max_size=8) | st.lists(_TEXT_BLOCK, max_size=2) | JSON_VALUES})
           | st.fixed_dictionaries({"type": st.sampled_from(["thinking", "redacted_thinking", "image", "document",
                                                             "server_tool_use", ""]),
                                    "thinking": st.text(max_size=8)}))
_MESSAGES_FIELDS = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 8),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system", "developer"]),
        "content": st.text(max_size=20) | st.lists(_BLOCKS, max_size=3)}), min_size=1, max_size=3),
    "system": st.text(max_size=20) | st.lists(_TEXT_BLOCK, max_size=2),
    "stop_sequences": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "temperature": st.sampled_from([0, 0.5, 1]), "top_p": st.sampled_from([0.5, 1]), "top_k": st.sampled_from([0, 5]),
    "stream": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]), "input_schema": st.sampled_from(
        [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "object"}, {}])}), min_size=1,
        max_size=2),
    "tool_choice": st.sampled_from([{"type": "none"}, {"type": "auto"}, {"type": "any"},
                                    {"type": "tool", "name": "f"}, {"type": "any", "disable_parallel_tool_use": True}]),
    "metadata": st.fixed_dictionaries({"user_id": st.text(max_size=5)}),
    "thinking": st.sampled_from([{"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}]),
    "output_config": st.sampled_from([{"effort": "low"}, {"format": {"type": "json_schema",
                                                                      "schema": {"type": "boolean"}}}]),
}


@st.composite
def messages_bodies(draw) -> dict:
    """tests/test_openai_fuzz.py's bodies, with the two other required fields unless they replaced them (a body
    without them is tested above)."""
    return {"model": MODEL, "max_tokens": 4, **draw(bodies(_MESSAGES_FIELDS, "messages"))}


ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large"}
"""Status -> the error's type, for what a client can cause with a request body alone."""


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(body=messages_bodies())
def test_messages_bodies_get_a_message_or_a_documented_error(served, body):
    """Malformed and extreme Messages bodies: a message (or a stream of Anthropic's events ending in
    message_stop), or an Anthropic error object under 400 (naming a field of the body), 404 or 413. Never a 500."""
    status, _, raw = http_request(served.http_port, "POST", "/v1/messages", json.dumps(body).encode(),
                                  timeout_s=30.0, headers={"x-api-key": KEY})
    if status != 200:
        answer = json.loads(raw)
        assert (status in ERROR_TYPES, sorted(answer), sorted(answer["error"])) == (True, ["error", "type"],
                                                                                   ["message", "type"]), raw
        assert (answer["type"], answer["error"]["type"]) == ("error", ERROR_TYPES[status])
        field = answer["error"]["message"].split(":")[0].split(".")[0].split("[")[0]
        assert field in set(body) | {"max_tokens", "model", "messages", "tool_choice"}, (field, body)
        event(f"{status} {field}")
        return
    if body.get("stream") is True:
        names = [name for name, _ in sse_events(raw)]
        assert (names[0], names[-2:], "error" in names) == ("message_start", ["message_delta", "message_stop"], False)
        event("200 stream")
        return
    message = json.loads(raw)
    assert (message["type"], message["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use")) == (
        "message", True)
    assert message["content"] and 1 <= message["usage"]["output_tokens"] <= body["max_tokens"]
    event(f"200 {message['stop_reason']}")
