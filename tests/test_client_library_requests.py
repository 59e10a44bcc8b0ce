"""The exact request bodies client libraries send (recorded through a proxy from openai-agents 0.24.0, the
openai SDK 3.57.0 and LiteLLM 1.110.2 against `splitserve serve default --enable-auto-tool-choice --tool-call-parser hermes`;
docs/http_api.md#client-libraries), answered as each library reads them. The libraries themselves are not needed.

An agent with an `output_type` and a forced `tool_choice` sends the forced choice beside `response_format` (chat)
or `text.format` (Responses): its first turn must be the forced call, and its next turn (the SDK resets the choice
to auto and keeps the format) the structured final output. LiteLLM tells a prompt too long for the context from
other 400s by OpenAI's and vLLM's words in the error (its ContextWindowExceededError, which its context-window
fallbacks act on)."""

from __future__ import annotations

import json
import re

import pytest

from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.engine.tiny_model import resolve_model_path
from tests.factories import http_request, post_json, served_apis, sse_json_events

MODEL = "default"
REPORT_SCHEMA = {"properties": {"sunny": {"title": "Sunny", "type": "boolean"}}, "required": ["sunny"],
                 "title": "Report", "type": "object", "additionalProperties": False}
"""An Agent(output_type=Report)'s schema, `class Report(BaseModel): sunny: bool`, as the Agents SDK makes it strict."""
WEATHER_PARAMETERS = {"properties": {"city": {"enum": ["Oslo", "Rome"], "title": "City", "type": "string"}},
                      "required": ["city"], "title": "get_weather_args", "type": "object",
                      "additionalProperties": False}
"""A @function_tool get_weather(city: Literal["Oslo", "Rome"])'s parameters."""
QUESTION = {"role": "user", "content": "weather in Oslo?"}
CALL_ID = "chatcmpl-tool-c11ed174cd4d4dc38f9e151808e6ba7d"

AGENTS_CHAT_FIRST_TURN = {
    "model": "default", "stream": True, "messages": [QUESTION], "max_tokens": 32,
    "response_format": {"type": "json_schema", "json_schema": {"name": "final_output", "strict": True,
                                                               "schema": REPORT_SCHEMA}},
    "temperature": 0.0, "tool_choice": "required",
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                                "parameters": WEATHER_PARAMETERS, "strict": True}}]}
"""Runner.run_streamed(Agent(model=OpenAIChatCompletionsModel(...), tools=[get_weather], output_type=Report,
model_settings=ModelSettings(max_tokens=32, temperature=0, tool_choice="required")), "weather in Oslo?")."""
AGENTS_CHAT_SECOND_TURN = {
    **{key: value for key, value in AGENTS_CHAT_FIRST_TURN.items() if key != "tool_choice"},
    "messages": [QUESTION, {"role": "assistant", "content": None, "tool_calls": [
        {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                 {"role": "tool", "tool_call_id": CALL_ID, "content": "sunny in Oslo"}]}
"""Its next turn: the call and the tool's output, tool_choice reset (reset_tool_choice) and the format kept."""
AGENTS_RESPONSES_FIRST_TURN = {
    "model": "default", "stream": True, "include": [], "input": [{"content": "weather in Oslo?", "role": "user"}],
    "max_output_tokens": 32, "temperature": 0.0,
    "text": {"format": {"type": "json_schema", "name": "final_output", "schema": REPORT_SCHEMA, "strict": True}},
    "tool_choice": "required",
    "tools": [{"name": "get_weather", "parameters": WEATHER_PARAMETERS, "strict": True, "type": "function",
               "description": "Weather in a city."}]}
"""The same agent on OpenAIResponsesModel."""
AGENTS_RESPONSES_SECOND_TURN = {
    **{key: value for key, value in AGENTS_RESPONSES_FIRST_TURN.items() if key != "tool_choice"},
    "input": [{"content": "weather in Oslo?", "role": "user"},
              {"arguments": "{\"city\": \"Oslo\"}", "call_id": CALL_ID, "name": "get_weather", "type": "function_call",
               "id": "fc_4aeb5b2c56f14cf798717b973b6c9909", "status": "completed"},
              {"call_id": CALL_ID, "output": "sunny in Oslo", "type": "function_call_output"}]}
SDK_PARSE_WITH_TOOLS = {
    "model": "default", "stream": False, "messages": [QUESTION], "max_tokens": 48,
    "response_format": {"type": "json_schema", "json_schema": {"schema": REPORT_SCHEMA, "name": "Report",
                                                               "strict": True}},
    "temperature": 0, "tool_choice": "required",
    "tools": [{"type": "function", "function": {"name": "GetWeather", "strict": True, "parameters": {
        **WEATHER_PARAMETERS, "title": "GetWeather"}}}]}
"""client.chat.completions.parse(response_format=Report, tools=[openai.pydantic_function_tool(GetWeather)],
tool_choice="required", max_tokens=48, temperature=0)."""


@pytest.fixture(scope="module")
def served():
    with served_apis(resolve_model_path(DEFAULT_MODEL_NAME), MODEL, tool_call_parser="hermes") as served:
        yield served


def post(served, path: str, body: dict) -> tuple[int, dict]:
    return post_json(served.http_port, path, body)


def stream(served, path: str, body: dict) -> list[dict]:
    return sse_json_events(served.http_port, path, body)


def accumulated_chat(chunks: list[dict]) -> tuple[str, list[tuple[str, str]], str]:
    """(content, [(call name, arguments)], finish_reason) of a one-choice chat stream, as the SDKs accumulate it."""
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", ()):
                name, arguments = calls.get(call["index"], ("", ""))
                calls[call["index"]] = (name + call.get("function", {}).get("name", ""),
                                        arguments + call.get("function", {}).get("arguments", ""))
            finish_reason = choice["finish_reason"] or finish_reason
    return content, [calls[index] for index in sorted(calls)], finish_reason


def without(body: dict, *fields: str) -> dict:
    return {key: value for key, value in body.items() if key not in fields}


def test_agents_chat_output_type_with_forced_tool_choice_calls_then_answers_in_the_format(served):
    """The forced turn is the call the same request without response_format makes (the format has no effect on it);
    the next turn's text follows the format: what Runner reads as its final_output Report."""
    first = accumulated_chat(stream(served, "/v1/chat/completions", AGENTS_CHAT_FIRST_TURN))
    forced_alone = accumulated_chat(stream(served, "/v1/chat/completions",
                                           without(AGENTS_CHAT_FIRST_TURN, "response_format")))
    assert first == forced_alone
    assert (first[0], [name for name, _ in first[1]], first[2]) == ("", ["get_weather"], "tool_calls")
    assert json.loads(first[1][0][1])["city"] in ("Oslo", "Rome")
    content, calls, finish_reason = accumulated_chat(stream(served, "/v1/chat/completions", AGENTS_CHAT_SECOND_TURN))
    assert (calls, finish_reason) == ([], "stop")
    assert list(json.loads(content)) == ["sunny"] and isinstance(json.loads(content)["sunny"], bool)


def test_agents_responses_output_type_with_forced_tool_choice_calls_then_answers_in_the_format(served):
    def final_response(body: dict) -> dict:
        events = stream(served, "/v1/responses", body)
        assert events[-1]["type"] == "response.completed"
        return events[-1]["response"]

    first = final_response(AGENTS_RESPONSES_FIRST_TURN)
    forced_alone = final_response(without(AGENTS_RESPONSES_FIRST_TURN, "text"))
    assert first["status"] == "completed" and first["text"] == AGENTS_RESPONSES_FIRST_TURN["text"]
    assert [(item["type"], item["name"], item["arguments"]) for item in first["output"]] == \
        [(item["type"], item["name"], item["arguments"]) for item in forced_alone["output"]]
    assert [item["name"] for item in first["output"]] == ["get_weather"]
    assert re.fullmatch(r"fc_[0-9a-f]{32}", first["output"][0]["id"])
    assert re.fullmatch(r"call_[0-9a-f]{32}", first["output"][0]["call_id"])  # OpenAI's and vLLM's form
    second = final_response(AGENTS_RESPONSES_SECOND_TURN)
    assert (second["status"], [item["type"] for item in second["output"]]) == ("completed", ["message"])
    text = second["output"][0]["content"][0]["text"]
    assert list(json.loads(text)) == ["sunny"] and isinstance(json.loads(text)["sunny"], bool)


def test_openai_sdk_parse_with_a_response_format_and_required_tools_returns_the_calls(served):
    """chat.completions.parse reads parsed_arguments from the calls (and would parse content into the format)."""
    status, response = post(served, "/v1/chat/completions", SDK_PARSE_WITH_TOOLS)
    _, forced_alone = post(served, "/v1/chat/completions", without(SDK_PARSE_WITH_TOOLS, "response_format"))
    assert status == 200, response
    (choice,), (alone,) = response["choices"], forced_alone["choices"]
    assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", "")
    assert [call["function"] for call in choice["message"]["tool_calls"]] == \
        [call["function"] for call in alone["message"]["tool_calls"]]
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["GetWeather"]


def test_litellm_reads_a_prompt_too_long_for_the_context_as_its_context_window_error(served):
    """litellm.completion(model="hosted_vllm/default", ...) reads the raw error body, `openai/default` the openai
    SDK's message; either must hold the words its exception mapping matches (lower-cased), and the message opens with
    OpenAI's own sentence, for clients that match it as written."""
    status, _, raw = http_request(served.http_port, "POST", "/v1/chat/completions", json.dumps({
        "model": "default", "messages": [{"role": "user", "content": "def f(x): return x\n" * 300}],
        "max_tokens": 8}).encode())
    error = json.loads(raw)["error"]
    assert (status, error["type"], error["param"], error["code"]) == (
        400, "invalid_request_error", "messages", "context_length_exceeded")
    assert "this model's maximum context length is 512 tokens" in error["message"].lower()
    assert "this model's maximum context length is" in raw.decode().lower()
    assert error["message"].startswith("This model's maximum context length is 512 tokens. However, messages has ")
