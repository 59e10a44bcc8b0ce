"""Tool calling on the chat API (router/tool_calling.py, router/tool_parsers.py): the request's
validation (exact fields and messages), the chat template's view of tools and of a history with
tool calls (exactly transformers' rendering), and a served model through the official openai SDK:
named and required tool choice constrained to the tools' schemas, auto with the hermes parser,
streamed and not."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from transformers import AutoTokenizer

from splitserve.common.errors import InvalidRequestError
from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.common.structured_output import ONE_OF_RULE, StructuredOutputKind
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.router.openai_protocol import parse_chat_request, parse_tokenize_request
from splitserve.router.openai_server import start_http_server
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.router.tool_calling import ToolChoice
from splitserve.router.tool_parsers import AUTO_TOOL_CHOICE_OFF
from splitserve.testing.tiny_models import TOOLS_CHAT_TEMPLATE
from tests.factories import http_request, make_request_limits, served_apis

MODEL = "m"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
CLOCK_SCHEMA = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
                "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER_SCHEMA, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK_SCHEMA, "strict": True}}]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": CLOCK_SCHEMA}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    *USER,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "oslo", "unit": "c"}'}},
        {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone":"utc"}'}}]},
    {"role": "tool", "tool_call_id": "call-1", "content": "4 degrees"},
    {"role": "tool", "tool_call_id": "call-2", "name": "get_time", "content": "12:00"},
]
"""A chat in the OpenAI format: an assistant turn that called two tools (arguments as JSON text,
no content) and their results."""
HISTORY_FOR_TRANSFORMERS = [
    HISTORY[0], HISTORY[1],
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "oslo",
                                                                                              "unit": "c"}}},
        {"id": "call-2", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "utc"}}}]},
    HISTORY[3], HISTORY[4],
]
"""The same chat as vLLM hands it to the template: null content as "", arguments parsed."""
HISTORY_PARSED = [*HISTORY_FOR_TRANSFORMERS[:2], {**HISTORY_FOR_TRANSFORMERS[2], "content": []},
                  *HISTORY_FOR_TRANSFORMERS[3:]]
"""The same chat as the router's parse hands it to the tokenizer: null content as no text parts, which
a "string" content-format template (this one) gets as "" and an "openai" one as [], as in vLLM."""
CALL_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")


def chat(**fields) -> dict:
    return {"messages": USER, **fields}


def parse(body: dict):
    return parse_chat_request(body, make_request_limits())


# ---- the request ------------------------------------------------------------------------------

def test_an_empty_tools_list_is_no_tools():
    """Clients send `tools: []` for an agent without tools; splitserve takes it, as vLLM did before 0.32 (0.32 and
    OpenAI refuse it: docs/http_api.md)."""
    assert parse(chat(tools=[])).tool_calling is None
    assert parse(chat(tools=[], tool_choice="none")) == parse(chat())


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize(("body", "field", "message"), [
    (chat(tools={}), "tools", "must be a list of function tools, got {}"),
    (chat(tools=[5]), "tools[0]", 'must be an object {"type": "function", "function": {...}}, got 5'),
    (chat(tools=[{"type": "retrieval"}]), "tools[0].type", "must be \"function\" (the only tool type), got 'retrieval'"),
    (chat(tools=[{"type": "function"}]), "tools[0].function", "must be an object with a name, got null"),
    (chat(tools=[*TOOLS, {"type": "function", "function": {"name": ""}}]), "tools[2].function.name",
     "must be a non-empty string, got ''"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]),
     "tools[0].function.description", "must be a string"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
     "tools[0].function.parameters", "must be a JSON schema object, got []"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]),
     "tools[0].function.strict", "must be a boolean, got 'yes'"),
    (chat(tools=[TOOLS[0], TOOLS[0]]), "tools[1].function.name", "'get_weather' names two tools"),
    (chat(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]), "tools",
     "holds 129 tools; at most 128"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "description": "x" * (1 << 19)}}]), "tools",
     "has 524350 bytes as compact JSON; at most 524288"),
    (chat(tool_choice="required"), "tool_choice", "needs tools (send the tools it chooses from)"),
    (chat(tools=[], tool_choice="required"), "tool_choice", "needs tools (send the tools it chooses from)"),
    (chat(tools=TOOLS, tool_choice="always"), "tool_choice",
     'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, got "always"'),
    (chat(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice.function",
     'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, got {"type": '
     '"function"}'),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_date"}}),
     "tool_choice.function.name", "'get_date' is not one of the tools"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": 5}}), "tool_choice.function.name",
     "must be a non-empty string, got 5"),
    (chat(tools=TOOLS, tool_choice={"type": "custom", "custom": {}}), "tool_choice.type",
     "must be \"function\", got 'custom'"),
    (chat(tools=TOOLS, parallel_tool_calls="sure"), "parallel_tool_calls", "must be a boolean, got 'sure'"),
    (chat(tools=TOOLS, tool_choice=NAMED, structured_outputs={"json_object": True}), "structured_outputs",
     'cannot be combined with tool_choice naming a function, which constrains the output itself (use '
     'tool_choice "auto" or "none")'),
    (chat(tools=TOOLS, tool_choice=NAMED, response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "object", "not": {}}}}), "response_format",
     "json_schema: unsupported keyword 'not' at /"),
    (chat(tools=TOOLS, tool_choice="required", guided_regex="a+"), "guided_regex",
     'cannot be combined with tool_choice "required", which constrains the output itself (use tool_choice '
     '"auto" or "none")'),
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
          tool_choice={"type": "function", "function": {"name": "f"}}),
     "tools[0].function.parameters", "json_schema: unsupported keyword 'not' at /"),
    (chat(tools=[TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"oneOf": []}}}],
          tool_choice="required"), "tools[1].function.parameters",
     f"json_schema: unsupported keyword 'oneOf' at /: {ONE_OF_RULE}"),
    (chat(tools=TOOLS, functions=[{"name": "f"}]), "functions", "is not supported by this server: the deprecated "
     "functions API is not implemented (send tools and tool_choice) (got [{\"name\": \"f\"}])"),
    (chat(messages=[{"role": "assistant", "content": None, "tool_calls": {}}]), "messages[0].tool_calls",
     "must be a list of tool calls, got {}"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]), "messages[0].tool_calls[0].function.arguments",
     "is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "[" * 100_000}}]}]), "messages[0].tool_calls[0].function.arguments",
     "is not valid JSON: maximum recursion depth exceeded while decoding a JSON array from a unicode string"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]),
     "messages[0].tool_calls[0].function", 'must be an object with a string name, got {"arguments": "{}"}'),
    (chat(messages=[{"role": "tool", "tool_call_id": 7, "content": "x"}]), "messages[0].tool_call_id",
     "must be a string, got 7"),
])
def test_bad_tool_requests_are_refused_naming_the_field(body, field, message):
    with pytest.raises(InvalidRequestError) as error:
        parse(body)
    assert (error.value.field, error.value.message) == (field, message)


def test_tool_choice_defaults_as_in_vllm():
    assert parse(chat()).tool_calling is None
    assert parse(chat(tool_choice="none")).tool_calling is None  # "none" needs no tools
    assert parse(chat(tools=TOOLS)).tool_calling.choice == ToolChoice.AUTO
    named = parse(chat(tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False)).tool_calling
    assert (named.choice, named.function_name, named.parallel_tool_calls) == (ToolChoice.NAMED, "get_time", False)
    none = parse(chat(tools=TOOLS, tool_choice="none"))
    assert none.tool_calling.choice == ToolChoice.NONE and none.sampling.structured_output is None
    assert none.template.tools == tuple(TOOLS)  # rendered all the same (vLLM's default)
    auto = parse(chat(tools=TOOLS, tool_choice="auto", guided_regex="a+"))  # auto may constrain the text itself
    assert auto.sampling.structured_output.kind == StructuredOutputKind.REGEX


def test_named_tool_choice_generates_under_the_functions_schema():
    parsed = parse(chat(tools=TOOLS, tool_choice=NAMED))
    assert json.loads(parsed.sampling.structured_output.spec) == CLOCK_SCHEMA
    bare = parse(chat(tools=[{"type": "function", "function": {"name": "ping"}}],
                      tool_choice={"type": "function", "function": {"name": "ping"}}))
    assert json.loads(bare.sampling.structured_output.spec) == {"type": "object", "properties": {}}


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_a_forced_tool_choice_generates_its_calls_whatever_the_response_format(tool_choice):
    """OpenAI and vLLM take a forced choice beside a response_format (which shapes a text reply the forced turn
    does not make): the Agents SDK sends both for an agent with an output_type and a tool_choice."""
    report = {"type": "json_schema", "json_schema": {"name": "final_output", "strict": True, "schema": {
        "type": "object", "properties": {"sunny": {"type": "boolean"}}, "required": ["sunny"]}}}
    forced = parse(chat(tools=TOOLS, tool_choice=tool_choice))
    for response_format in (report, {"type": "json_object"}):
        assert parse(chat(tools=TOOLS, tool_choice=tool_choice, response_format=response_format)) == forced


@pytest.mark.parametrize("parameters", [None, {}])
def test_a_function_without_a_parameters_schema_is_called_with_an_object(parameters):
    """An empty schema accepts any JSON value; a call's arguments are an object (vLLM constrains
    both to one), else a named call's arguments could be `-1.09`, which the openai SDK's parsed
    tools and LangChain (a ValidationError building the AIMessage) refuse."""
    tools = [{"type": "function", "function": {"name": "ping", "parameters": parameters}}]
    named = parse(chat(tools=tools, tool_choice={"type": "function", "function": {"name": "ping"}}))
    required = parse(chat(tools=tools, tool_choice="required"))
    assert json.loads(named.sampling.structured_output.spec) == {"type": "object", "properties": {}}
    assert json.loads(required.sampling.structured_output.spec)["items"]["anyOf"][0]["properties"]["parameters"] == \
        {"type": "object", "properties": {}}


def test_required_tool_choice_generates_vllms_array_of_calls():
    with_defs = {"type": "object", "properties": {"at": {"$ref": "#/$defs/place"}}, "required": ["at"],
                 "$defs": {"place": {"type": "string"}}}
    tools = [*TOOLS, {"type": "function", "function": {"name": "go", "parameters": with_defs}}]
    parsed = parse(chat(tools=tools, tool_choice="required", parallel_tool_calls=False))
    item = {"type": "object", "required": ["name", "parameters"], "additionalProperties": False}
    assert json.loads(parsed.sampling.structured_output.spec) == {
        "type": "array", "minItems": 1, "maxItems": 1, "$defs": {"place": {"type": "string"}},
        "items": {"anyOf": [
            {**item, "properties": {"name": {"enum": ["get_weather"]}, "parameters": WEATHER_SCHEMA}},
            {**item, "properties": {"name": {"enum": ["get_time"]}, "parameters": CLOCK_SCHEMA}},
            {**item, "properties": {"name": {"enum": ["go"]}, "parameters": {
                "type": "object", "properties": {"at": {"$ref": "#/$defs/place"}}, "required": ["at"]}}}]}}
    clash = {**with_defs, "$defs": {"place": {"type": "integer"}}}
    with pytest.raises(InvalidRequestError) as error:
        parse(chat(tools=[*tools, {"type": "function", "function": {"name": "fly", "parameters": clash}}],
                   tool_choice="required"))
    assert (error.value.field, error.value.message) == (
        "tools[3].function.parameters", 'defines $defs/place differently from another tool (tool_choice "required" '
                                        "puts every tool's definitions together)")


def test_history_messages_reach_the_template_as_vllm_passes_them():
    parsed = parse(chat(messages=HISTORY, tools=TOOLS))
    assert [m.template_message() for m in parsed.messages] == HISTORY_PARSED


# ---- the chat template ------------------------------------------------------------------------

@pytest.mark.parametrize("template", [TOOLS_CHAT_TEMPLATE, None])
def test_a_chat_with_tools_renders_exactly_as_transformers(tiny_qwen2_dir, template):
    """With a template that renders tools and tool calls, and with the tiny model's own, which ignores tools."""
    ours = RouterTokenizer.from_model_dir(tiny_qwen2_dir, template)
    hf = AutoTokenizer.from_pretrained(tiny_qwen2_dir, local_files_only=True)
    for body in (chat(messages=HISTORY, tools=TOOLS), chat(tools=TOOLS[:1]), chat(messages=HISTORY)):
        parsed = parse(body)
        ids = ours.apply_chat_template([m.template_message() for m in parsed.messages], True, parsed.template)
        expected = hf.apply_chat_template(HISTORY_FOR_TRANSFORMERS if body["messages"] is HISTORY else USER,
                                          tools=body.get("tools"), chat_template=template, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        assert ids == expected
    rendered = ours.render_chat_template([m.template_message() for m in parse(chat(tools=TOOLS)).messages], True,
                                         parse(chat(tools=TOOLS)).template)
    assert ('"name": "get_weather"' in rendered) == (template is not None)


def test_tokenize_renders_a_chats_tools():
    parsed = parse_tokenize_request({"messages": HISTORY, "tools": TOOLS}, make_request_limits())
    assert parsed.template.tools == tuple(TOOLS)
    assert [m.template_message() for m in parsed.messages] == HISTORY_PARSED


# ---- served -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    with served_apis(resolve_model_path(DEFAULT_MODEL_NAME), MODEL, tool_call_parser="hermes",
                     chat_template=TOOLS_CHAT_TEMPLATE) as served:
        yield served


def client(served, port: int | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port or served.http_port}/v1", api_key="none", max_retries=0)


def calls_of(message) -> list[tuple[str, str, dict]]:
    """(type, name, parsed arguments) of each call; every id is vLLM-shaped."""
    assert all(CALL_ID.fullmatch(call.id) for call in message.tool_calls)
    return [(call.type, call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


def test_named_tool_choice_returns_that_call_with_valid_arguments(served):
    response = client(served).chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40, temperature=0.0)
    choice = response.choices[0]
    [(kind, name, arguments)] = calls_of(choice.message)
    jsonschema.validate(arguments, WEATHER_SCHEMA)
    assert (kind, name, choice.message.content, choice.finish_reason) == ("function", "get_weather", "", "stop")


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_valid_calls(served, parallel):
    response = client(served).chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel, max_tokens=120,
        temperature=1.0, seed=3)
    choice = response.choices[0]
    calls = calls_of(choice.message)
    assert len(calls) >= 1 and (parallel or len(calls) == 1)
    for kind, name, arguments in calls:
        assert kind == "function"
        jsonschema.validate(arguments, SCHEMAS[name])
    assert (choice.message.content, choice.finish_reason) == ("", "tool_calls")


@pytest.mark.parametrize(("cut", "finish_reason"), [({"max_tokens": 3}, "length"),
                                                    ({"max_tokens": 40, "stop": ["ame"]}, "stop")])
def test_required_tool_choice_cut_before_a_calls_name_has_empty_content(served, cut, finish_reason):
    """An array cut short (max_tokens, a stop string) before its first call's name has no call and, as
    the stream and vLLM say, empty content: the unstreamed message carried the array's start as content."""
    request = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", temperature=0.0, **cut)
    whole = client(served).chat.completions.create(**request)
    accumulated = ChatCompletionStreamState()  # the SDK's accumulation (its stream() refuses a "length" finish)
    for chunk in client(served).chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                        **request):
        accumulated.handle_chunk(chunk)
    streamed = accumulated.current_completion_snapshot
    assert whole.usage.completion_tokens == streamed.usage.completion_tokens >= 2
    for response in (whole, streamed):
        choice = response.choices[0]
        assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == ("", None, finish_reason)


FORCED_CALL = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", ' \
              r'"unit": "[cf]"\}\}\n</tool_call>'
"""A hermes-format answer that a regex forces the (tool-unaware) test model to write, so that tool
choice "auto" sees a call to parse."""


@pytest.mark.parametrize(("tool_choice", "extra"), [
    ("required", {}),
    ({"type": "function", "function": {"name": "get_time"}}, {}),
    ("auto", {"structured_outputs": {"regex": FORCED_CALL}}),
])
def test_a_streamed_answer_accumulates_to_the_unstreamed_one(served, tool_choice, extra):
    """The openai SDK's own accumulation of the stream equals the response, call for call (ids
    aside), for each of two choices (each read by a parser of its own)."""
    request = dict(model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=1.0,
                   seed=11, n=2, extra_body=extra)
    whole = client(served).chat.completions.create(**request).choices
    with client(served).chat.completions.stream(**request) as stream:
        streamed = stream.get_final_completion().choices
    assert [calls_of(choice.message) for choice in streamed] == [calls_of(choice.message) for choice in whole]
    assert all(choice.message.tool_calls for choice in whole)
    assert [(choice.message.content or "", choice.finish_reason) for choice in streamed] == \
        [(choice.message.content or "", choice.finish_reason) for choice in whole]


def test_auto_tool_choice_splits_content_and_calls(served):
    response = client(served).chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=80, temperature=0.0,
        extra_body={"structured_outputs": {"regex": FORCED_CALL}})
    choice = response.choices[0]
    [(kind, name, arguments)] = calls_of(choice.message)
    jsonschema.validate(arguments, WEATHER_SCHEMA)
    assert (kind, name, choice.message.content, choice.finish_reason) == ("function", "get_weather", "Checking.\n",
                                                                          "tool_calls")
    plain = client(served).chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, max_tokens=5, temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["Sunny.", "Rain."]}}).choices[0]
    assert (plain.message.content in ("Sunny.", "Rain."), plain.message.tool_calls, plain.finish_reason) == \
        (True, None, "stop")


def test_auto_tool_choice_with_hermes_keeps_special_tokens_in_the_text(served):
    """vLLM's hermes parser turns skip_special_tokens off whenever tools are used: some models
    mark <tool_call> special (vLLM's reason), and with it skipped a call reaches the client as plain
    content (agent frameworks never send the field). The test model's tags are plain text; its
    special <|im_start|>, forced by a grammar, shows what the parser is given."""
    def content(tool_choice: str, **extra) -> str:
        return client(served).chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice, max_tokens=8, temperature=0.0,
            extra_body={"structured_outputs": {"grammar": 'start: <|im_start|> "Sunny."'}, **extra},
        ).choices[0].message.content
    assert content("auto") == "<|im_start|>Sunny."
    assert content("auto", skip_special_tokens=True) == "<|im_start|>Sunny."  # as vLLM: the parser's need wins
    assert content("none") == "Sunny."


def test_auto_tool_choice_needs_the_server_flags(served):
    server = served.loop.run(start_http_server(served.cluster.orchestrator, served.tokenizers, MODEL, port=0))
    try:
        with pytest.raises(openai.BadRequestError) as error:
            client(served, server.port).chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=2)
        ok = client(served, server.port).chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                                                 tool_choice="none", max_tokens=2)
    finally:
        served.loop.run(server.stop())
    assert (error.value.status_code, error.value.param, error.value.body["message"]) == (
        400, "tool_choice", f"tool_choice: {AUTO_TOOL_CHOICE_OFF}")
    assert ok.choices[0].message.tool_calls is None


def test_a_history_with_tool_calls_is_served_with_the_prompt_tokenize_gives(served):
    status, _, raw = http_request(served.http_port, "POST", "/tokenize",
                                  json.dumps({"messages": HISTORY, "tools": TOOLS}).encode())
    tokens = json.loads(raw)["tokens"]
    expected = served.tokenizers.tokenizer.apply_chat_template(
        HISTORY_FOR_TRANSFORMERS, True, parse(chat(messages=HISTORY, tools=TOOLS)).template)
    response = client(served).chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="none",
                                                      max_tokens=2)
    assert (status, tokens, response.usage.prompt_tokens) == (200, expected, len(expected))
