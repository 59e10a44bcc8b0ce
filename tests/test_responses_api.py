"""The OpenAI Responses API (POST /v1/responses, router/responses_protocol.py): the request's
validation (exact fields and messages), its input items rendered to the exact prompt of the
equivalent chat, and a served model through the official openai SDK: greedy text equal to the
chat endpoint's, a stream that accumulates to the unstreamed response, a function tool round
trip, and the incomplete status of a response cut at max_output_tokens."""

from __future__ import annotations

import asyncio
import json

import typing

import jsonschema
import openai
import pytest
from openai.types.responses import response_create_params

from splitserve.common.errors import InvalidRequestError
from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.router.api_types import RouterError, StreamChunk, Usage
from splitserve.router.fanout import IndexedChunk
from splitserve.router.openai_protocol import ResponseHeader, parse_chat_request
from splitserve.router.openai_server import _response_events
from splitserve.router.openai_fields import CHAT_HANDLED, CHAT_REFUSED
from splitserve.router.responses_protocol import (PASSED_TO_CHAT, RESPONSES_HANDLED, RESPONSES_REFUSED,
                                                  ResponsesRenderer, parse_responses_request)
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.router.tool_parsers import ToolOutput
from splitserve.testing.tiny_models import TOOLS_CHAT_TEMPLATE
from tests.factories import http_request, make_request_limits, served_apis

MODEL = "m"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": WEATHER_SCHEMA, "strict": True}]
"""Responses' flat function tool."""
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                "parameters": WEATHER_SCHEMA, "strict": True}}]
"""The same tool in the chat's nesting."""
INPUT = [
    {"role": "developer", "content": "Answer in one word."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather"},
                                                    {"type": "input_text", "text": "in Oslo?"}]},
    {"type": "function_call", "call_id": "call-1", "name": "get_weather", "arguments": '{"city": "oslo", "unit": "c"}'},
    {"type": "function_call_output", "call_id": "call-1", "output": "4 degrees"},
    {"role": "assistant", "content": [{"type": "output_text", "text": "Cold.", "annotations": []}]},
    {"role": "user", "content": "And tomorrow?"},
]
"""A conversation in Responses input items: a tool round trip, then a text answer and a question."""
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "developer", "content": "Answer in one word."},
    {"role": "user", "content": "What is the weather\nin Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "oslo", "unit": "c"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "4 degrees"},
    {"role": "assistant", "content": "Cold."},
    {"role": "user", "content": "And tomorrow?"},
]
"""The same conversation as chat messages, with the instructions "You are terse." first."""


def parse(**fields):
    return parse_responses_request({"model": MODEL, "input": "Hi", **fields}, make_request_limits())


# ---- parsing ----------------------------------------------------------------------------------

_NOT_STORED = "is not supported by this server: responses are not stored (send the whole conversation as input)"


def test_logit_bias_and_include_stop_str_in_output_pass_to_the_chat_request():
    """vLLM's Responses endpoint takes both (OpenAI's has neither): they mean what they mean on chat."""
    sampling = parse(logit_bias={"7": -2.5}, include_stop_str_in_output=True).chat.sampling
    assert (sampling.logit_bias, sampling.include_stop_str_in_output) == (((7, -2.5),), True)


def test_null_min_tokens_is_its_default():
    """vLLM's chat model declares min_tokens without null (a 400 there); its Responses model does not declare it."""
    assert parse(min_tokens=None).chat.sampling.min_tokens == 0


def test_null_watermarking_is_its_default():
    """vLLM's Responses model declares `watermarking: bool | None = None` (as its chat and completion models do):
    null is no watermark, unlike the fields it declares without null."""
    assert parse(watermarking=None).chat == parse().chat
    with pytest.raises(InvalidRequestError) as error:
        parse(watermarking=True)
    assert (error.value.field, error.value.message) == ("watermarking", "is not supported by this server: not "
                                                                        "implemented (got true)")


def test_a_cache_salt_passes_to_the_chat_request():
    """vLLM's Responses endpoint takes cache_salt as its chat endpoint does."""
    assert (parse(cache_salt="user-a").chat.cache_salt, parse().chat.cache_salt) == ("user-a", None)


@pytest.mark.parametrize(("fields", "field", "message"), [
    ({"store": True}, "store", f"{_NOT_STORED}; send store false or leave it out (got true)"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", f'{_NOT_STORED} (got "resp_1")'),
    ({"background": True}, "background",
     "is not supported by this server: no background mode (responses are not stored) (got true)"),
    ({"reasoning": "low"}, "reasoning", 'must be an object {effort, summary}, got "low"'),
    ({"reasoning": {"effort": "huge"}}, "reasoning.effort",
     'must be one of none, minimal, low, medium, high, xhigh, max, got "huge"'),
    ({"reasoning": {"summary": "long"}}, "reasoning.summary", 'must be one of auto, concise, detailed, got "long"'),
    ({"reasoning": {"budget": 9}}, "reasoning.budget", "is not a reasoning option (effort, summary)"),
    ({"include": ["reasoning.encrypted_content"]}, "include",
     "is not supported by this server: no extra output data (logprobs, reasoning, tool sources) is implemented "
     '(got ["reasoning.encrypted_content"])'),
    ({"truncation": "auto"}, "truncation", "is not supported by this server: a conversation longer than the "
                                           'context is refused, never truncated (got "auto")'),
    ({"text": {"verbosity": "low"}}, "text.verbosity", 'is not supported by this server: not implemented (got "low")'),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type",
     'only function tools are supported (built-in tools are not implemented), got "web_search"'),
    ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice.type",
     'must be "function" (built-in tools are not implemented), got "file_search"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name",
     "'g' is not one of the tools"),
    ({"tools": [{**TOOLS[0], "parameters": {"type": "objec"}}], "tool_choice": {"type": "function",
                                                                              "name": "get_weather"}},
     "tools[0].parameters", "json_schema: unsupported type 'objec' at /type"),
    ({"input": [{"role": "user", "content": "x"},  # the second call joins the first's assistant message
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{oops"}]},
     "input[2].arguments", "is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
                           "(char 1)"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": "rs_1"}]}, "input[1].type",
     'only message, reasoning, function_call and function_call_output items are supported, got "item_reference"'),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, "input[0].encrypted_content",
     "is not supported (this server never encrypts reasoning; send its content)"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text"}]}]}, "input[0].content",
     'must be a list of {type, text} parts, got [{"type": "reasoning_text"}]'),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]",
     'only input_text, output_text and refusal parts are supported (text models only), got {"type": '
     '"input_image", "image_url": "x"}'),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role",
     'must be one of user, system, developer, assistant, got "tool"'),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id",
     "must be a non-empty string, got null"),
    ({"input": []}, "input", "must be a string or a non-empty list of input items, got []"),
    ({"max_output_tokens": 0}, "max_output_tokens", "must be an integer >= 1, got 0"),
    ({"request_id": None}, "request_id", "must be a string, got null"),  # vLLM's Responses model: `str`, `int`
    ({"priority": None}, "priority", "must be an integer, got null"),
    # vLLM's Responses model: `tools: list[Tool]`, `tool_choice: ToolChoice`, `service_tier: Literal[...]`,
    # `enable_response_messages: bool` (the chat model's tools and tool_choice are optional)
    ({"tools": None}, "tools", "must be a list of function tools, got null"),
    ({"tool_choice": None}, "tool_choice",
     'must be one of "none", "auto", "required" or {"type": "function", "name": ...}, got null'),
    ({"service_tier": None}, "service_tier",
     'must be one of "auto", "default", "flex", "scale" or "priority", got null'),
    ({"enable_response_messages": None}, "enable_response_messages", "must be a boolean, got null"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     'json_schema must be an object with a "schema", got {"name": "x"}'),
    ({"temperature": -1}, "temperature", "must be a finite number >= 0, got -1"),
    ({"cache_salt": ""}, "cache_salt", 'must be a non-empty string, got ""'),
    ({"cache_salt": 7}, "cache_salt", "must be a non-empty string, got 7"),
    ({"logit_bias": {"x": 2}}, "logit_bias", "contains key(s) that cannot be converted to integer token IDs: ['x']"),
    ({"logit_bias": {"512": 2}}, "logit_bias",
     "token_id(s) [512] in logit_bias contain out-of-vocab token ids. Vocabulary size: 512"),
    ({"structured_outputs": {"regex": "a"}, "text": {"format": {"type": "json_object"}}}, "structured_outputs",
     "only one structured output field may be set, got response_format, structured_outputs"),
])
def test_bad_requests_are_refused_naming_the_responses_field(fields, field, message):
    with pytest.raises(InvalidRequestError) as error:
        parse(**fields)
    assert (error.value.field, error.value.message) == (field, message)


VLLM_RESPONSES_FIELDS = {
    "background", "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model",
    "logit_bias", "parallel_tool_calls", "previous_response_id", "prompt", "reasoning", "include_reasoning",
    "service_tier", "store", "stream", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "top_k",
    "min_p", "truncation", "user", "skip_special_tokens", "include_stop_str_in_output", "presence_penalty",
    "frequency_penalty", "prompt_cache_key", "watermarking", "request_id", "session_id", "media_io_kwargs",
    "mm_processor_kwargs", "priority", "mm_payload", "return_mm_kwargs", "cache_salt", "enable_response_messages",
    "previous_input_messages", "structured_outputs", "repetition_penalty", "seed", "stop", "stop_token_ids",
    "ignore_eos", "vllm_xargs", "kv_transfer_params", "ec_transfer_params", "chat_template_kwargs"}
"""The fields of vLLM 0.32's ResponsesRequest (vllm/entrypoints/openai/responses/protocol.py)."""


def test_every_field_of_the_openai_sdks_and_vllms_requests_is_handled_or_refused():
    """Each is this endpoint's, refused here, or passed to the chat parser, which implements or refuses it."""
    fields = set(typing.get_type_hints(response_create_params.ResponseCreateParamsStreaming)) | VLLM_RESPONSES_FIELDS
    handled, refused = set(RESPONSES_HANDLED), {rule.name for rule in RESPONSES_REFUSED}
    passed = set(PASSED_TO_CHAT)
    chat_known = CHAT_HANDLED | {rule.name for rule in CHAT_REFUSED}
    assert (fields - handled - refused - passed, handled & refused, passed - chat_known) == (set(), set(), set())


def test_default_valued_fields_that_clients_send_are_accepted():
    """What the openai Agents SDK sends for an agent without tools or settings (store, include and
    tools empty), and the other defaults."""
    parsed = parse(store=False, include=[], tools=[], background=False, reasoning=None, truncation="disabled",
                   text={"verbosity": "medium", "format": {"type": "text"}}, metadata={"k": "v"}, user="u",
                   instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9)
    chat = parse_chat_request({"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": "Hi"}],
                               "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "user": "u"},
                              make_request_limits())
    assert parsed.chat == chat
    assert (parsed.settings.instructions, parsed.settings.max_output_tokens, parsed.settings.metadata,
            parsed.settings.tools, parsed.settings.user) == ("Be brief.", 7, {"k": "v"}, (), "u")


def test_text_format_and_a_named_function_reach_the_chat_request_as_their_chat_forms():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    structured = parse(text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}})
    chat = parse_chat_request({"messages": [{"role": "user", "content": "Hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}}, make_request_limits())
    named = parse(tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    chat_named = parse_chat_request({"messages": [{"role": "user", "content": "Hi"}], "tools": CHAT_TOOLS,
                                     "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                                     "parallel_tool_calls": False}, make_request_limits())
    assert structured.chat.sampling.structured_output == chat.sampling.structured_output
    assert named.chat.tool_calling == chat_named.tool_calling
    assert named.chat.sampling.structured_output == chat_named.sampling.structured_output


def test_input_items_render_the_prompt_of_the_equivalent_chat(tiny_qwen2_dir):
    tokenizer = RouterTokenizer.from_model_dir(tiny_qwen2_dir, TOOLS_CHAT_TEMPLATE)
    ours = parse(instructions="You are terse.", input=INPUT, tools=TOOLS, tool_choice="none").chat
    chat = parse_chat_request({"messages": MESSAGES, "tools": CHAT_TOOLS, "tool_choice": "none"},
                              make_request_limits())
    rendered, expected = (tokenizer.apply_chat_template([m.template_message() for m in parsed.messages], True,
                                                        parsed.template) for parsed in (ours, chat))
    assert rendered == expected
    assert tokenizer.decode(rendered, skip_special_tokens=False).count("get_weather") == 2  # the tool and the call



def test_a_refusal_part_is_read_as_its_text_as_the_chats():
    """An output message the openai SDK sends back may hold a refusal part (vLLM reads it as text)."""
    parsed = parse(input=[{"role": "user", "content": "Hi"}, {"type": "message", "role": "assistant", "content": [
        {"type": "refusal", "refusal": "I can't."}, {"type": "output_text", "text": "Ask again.", "annotations": []}]}])
    assert [(message.role, message.content) for message in parsed.chat.messages] == [
        ("user", "Hi"), ("assistant", "I can't.\nAsk again.")]

def test_a_failure_mid_stream_ends_it_with_an_error_event():
    parsed = parse()
    renderer = ResponsesRenderer(ResponseHeader("resp_1", 0, MODEL, "fp_0"), parsed.chat, parsed.settings, None)

    async def chunks():
        yield IndexedChunk(0, StreamChunk("1", (5,), "Hel", ()))
        raise RouterError("UNAVAILABLE", "the decode worker died")

    async def events() -> list[bytes]:
        stream = chunks()
        return [event async for event in _response_events(await anext(stream), stream, renderer)]

    sent = asyncio.run(events())
    assert [event.split(b"\n")[0] for event in sent] == [
        b"event: response.created", b"event: response.in_progress", b"event: response.output_item.added",
        b"event: response.content_part.added", b"event: response.output_text.delta", b"event: error"]
    assert json.loads(sent[-1].split(b"data: ")[1]) == {
        "type": "error", "code": "unavailable", "message": "the decode worker died", "param": None,
        "sequence_number": 5}


def test_an_unstreamed_malformed_call_is_all_text_as_the_chats_message():
    """A call that turns malformed after its name was read: the unstreamed response is the chat's
    non-streamed message (vLLM's), one message item with the whole output and no function_call
    item (a stream keeps what it sent of the call, the one documented difference)."""
    parsed = parse(tools=TOOLS)
    tool_output = ToolOutput.for_request(parsed.chat.tool_calling, "hermes")
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": oops}}</tool_call>'
    chunks = [StreamChunk("1", (5,), text[:40], ()), StreamChunk("1", (6,), text[40:], (), "stop")]
    renderer = ResponsesRenderer(ResponseHeader("resp_1", 0, MODEL, "fp_0"), parsed.chat, parsed.settings,
                                 tool_output)
    output = renderer.response([chunks], Usage(3, 0, 2))["output"]
    assert [(item["type"], item["status"], item.get("content")) for item in output] == [
        ("message", "completed", [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}])]


# ---- served -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    with served_apis(resolve_model_path(DEFAULT_MODEL_NAME), MODEL, chat_template=TOOLS_CHAT_TEMPLATE) as served:
        yield served


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="none", max_retries=0)


def without_ids(response) -> dict:
    """The response as JSON without what differs between two runs of one request (ids, time, and
    the prompt tokens the second found in the prefix cache), and without what the stream helper
    adds to its parsed response (the `parsed` output of a text format)."""
    body = response.model_dump(mode="json", exclude={"id": True, "created_at": True,
                                                     "usage": {"input_tokens_details": {"cached_tokens"}}})
    for item in body["output"]:
        item.pop("id")
        item.pop("call_id", None)
        item.pop("parsed_arguments", None)
        for part in item.get("content", ()):
            part.pop("parsed", None)
    return body


def test_greedy_output_equals_the_chat_endpoints(served):
    response = client(served).responses.create(model=MODEL, instructions="You are terse.", input=INPUT, tools=TOOLS,
                                               tool_choice="none", max_output_tokens=12, temperature=0.0)
    chat = client(served).chat.completions.create(model=MODEL, messages=MESSAGES, tools=CHAT_TOOLS,
                                                  tool_choice="none", max_completion_tokens=12, temperature=0.0)
    [message] = response.output
    assert (message.type, message.role, [part.type for part in message.content]) == ("message", "assistant",
                                                                                    ["output_text"])
    assert response.output_text == chat.choices[0].message.content != ""
    assert (response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert (response.object, response.model, response.instructions, response.id[:5]) == ("response", MODEL,
                                                                                       "You are terse.", "resp_")


@pytest.mark.parametrize("tool_choice", ["none", {"type": "function", "name": "get_weather"}])
def test_a_stream_accumulates_to_the_unstreamed_response(served, tool_choice):
    """The openai SDK's stream helper's final response equals the unstreamed one (ids aside), and
    the deltas it received add up to each item's text and arguments."""
    request = dict(model=MODEL, input="What is the weather in Oslo?", tools=TOOLS, tool_choice=tool_choice,
                   max_output_tokens=40, temperature=0.0)
    whole = client(served).responses.create(**request)
    with client(served).responses.stream(**request) as stream:
        events = list(stream)
        streamed = stream.get_final_response()
    assert without_ids(streamed) == without_ids(whole)
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert (events[0].type, events[1].type, events[-1].type) == ("response.created", "response.in_progress",
                                                                 "response.completed")
    deltas = "".join(event.delta for event in events if event.type in ("response.output_text.delta",
                                                                       "response.function_call_arguments.delta"))
    [item] = streamed.output
    assert deltas == (item.content[0].text if item.type == "message" else item.arguments) != ""


def test_a_function_tool_round_trip(served):
    """A named tool choice returns a function_call item; sent back with its output, the model answers in text."""
    call_request = client(served).responses.create(
        model=MODEL, input="What is the weather in Oslo?", tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40, temperature=0.0)
    [call] = call_request.output
    assert (call.type, call.name, call.status, call_request.status) == ("function_call", "get_weather", "completed",
                                                                        "completed")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    answer = client(served).responses.create(
        model=MODEL, input=[{"role": "user", "content": "What is the weather in Oslo?"}, call.model_dump(),
                            {"type": "function_call_output", "call_id": call.call_id, "output": "4 degrees"}],
        tools=TOOLS, tool_choice="none", max_output_tokens=8, temperature=0.0)
    chat = client(served).chat.completions.create(
        model=MODEL, tools=CHAT_TOOLS, tool_choice="none", max_completion_tokens=8, temperature=0.0, messages=[
            {"role": "user", "content": "What is the weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                "name": "get_weather", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "4 degrees"}])
    assert [item.type for item in answer.output] == ["message"]
    assert answer.output_text == chat.choices[0].message.content


def test_a_response_cut_at_max_output_tokens_is_incomplete(served):
    response = client(served).responses.create(model=MODEL, input="Tell me a story.", max_output_tokens=3,
                                               temperature=0.0, extra_body={"ignore_eos": True})
    assert (response.status, response.incomplete_details.reason, response.output[0].status,
            response.usage.output_tokens) == ("incomplete", "max_output_tokens", "incomplete", 3)


def test_input_tokens_counts_the_prompt_the_response_runs(served):
    """The openai SDK's responses.input_tokens.count: the input_tokens the same Responses request reports."""
    counted = client(served).responses.input_tokens.count(model=MODEL, instructions="You are terse.", input=INPUT,
                                                          tools=TOOLS, tool_choice="none")
    response = client(served).responses.create(model=MODEL, instructions="You are terse.", input=INPUT, tools=TOOLS,
                                               tool_choice="none", max_output_tokens=1)
    status, _, body = http_request(served.http_port, "POST", "/v1/responses/input_tokens", json.dumps(
        {"model": MODEL, "input": "Hi", "store": True}).encode())
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", response.usage.input_tokens)
    assert (status, json.loads(body)["error"]["param"]) == (400, "store")


def test_errors_are_openai_error_objects(served):
    with pytest.raises(openai.NotFoundError) as unknown:
        client(served).responses.create(model="other", input="Hi")
    with pytest.raises(openai.BadRequestError) as refused:
        client(served).responses.create(model=MODEL, input="Hi", store=True)
    status, _, body = http_request(served.http_port, "POST", "/v1/responses", json.dumps(
        {"model": MODEL, "input": "Hi", "tools": TOOLS}).encode())
    assert (unknown.value.status_code, unknown.value.body["code"]) == (404, "model_not_found")
    assert (refused.value.status_code, refused.value.body["param"]) == (400, "store")
    assert (status, json.loads(body)["error"]["param"]) == (400, "tool_choice")  # auto needs --tool-call-parser


def test_a_large_body_is_parsed_in_the_body_parsers_process(served):
    """A body above router/request_body.py's LARGE_BODY_BYTES is parsed in another process: the
    request (a large schema, repeated in the response and constraining it) and its errors (named by
    their Responses field) cross it."""
    large = [{"role": "user", "content": "word " * 30_000}]
    status, _, body = http_request(served.http_port, "POST", "/v1/responses", json.dumps(
        {"model": MODEL, "input": large}).encode())
    error = json.loads(body)["error"]
    schema = {"type": "object", "description": "x" * (130 << 10)}
    response = client(served).responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0.0, text={
        "format": {"type": "json_schema", "name": "big", "schema": schema}})
    assert (status, error["param"], error["code"], error["message"]) == (
        400, "input", "context_length_exceeded", "This model's maximum context length is 512 tokens. However, input "
        "has 150000 bytes (UTF-8); at most 45990 can be served (router.max_prompt_bytes). Please reduce the length of "
        "the input.")
    assert (response.text.format.schema_, response.output_text[0], response.status) == (schema, "{", "incomplete")


@pytest.mark.parametrize("stream", [False, True])
def test_a_lone_surrogate_echoed_in_the_response_is_escaped_not_a_500(served, stream):
    """metadata, user and a text format's name come back in the response object (streamed: in its events);
    a lone surrogate in one (JSON allows the escape) comes back as that escape, streamed or not."""
    body = json.dumps({"model": MODEL, "input": "hi", "max_output_tokens": 2, "stream": stream,
                       "metadata": {"k": "\ud800"}, "user": "\udfff",
                       "text": {"format": {"type": "json_schema", "name": "x\ud800", "schema": {"type": "object"}}}},
                      ensure_ascii=True).encode()
    status, _, raw = http_request(served.http_port, "POST", "/v1/responses", body)
    assert status == 200, raw
    events = [json.loads(line.removeprefix(b"data: ")) for chunk in raw.split(b"\n\n") for line in chunk.split(b"\n")
              if line.startswith(b"data: ")] if stream else [{"response": json.loads(raw)}]
    echoed = events[-1]["response"]
    assert (echoed["metadata"], echoed["user"], echoed["text"]["format"]["name"]) == ({"k": "\ud800"}, "\udfff",
                                                                                     "x\ud800")
