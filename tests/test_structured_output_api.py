"""Structured output through the served APIs (OpenAI HTTP with the official SDK, and gRPC's typed
field), colocated and disaggregated (where the first token is sampled on the prefill worker and
the decode worker's matcher is advanced over it), with the default model."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from tests.factories import http_request, served_apis, stream_tokens

MODEL = "m"
PROMPT = "def main():\n"
CHAT = [{"role": "user", "content": "Answer in JSON."}]
GREEDY = {"temperature": 0.0}
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
     "required": ["name", "age", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
]
REGEX = r"[a-z]{3,8}@example\.com"
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def served(request):
    with served_apis(resolve_model_path(DEFAULT_MODEL_NAME), MODEL, mode=request.param) as served:
        yield served


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="none", max_retries=0)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", SCHEMAS)
def test_chat_json_schema_validates_streaming_and_not(served, schema):
    chat = client(served).chat.completions
    whole = chat.create(model=MODEL, messages=CHAT, max_tokens=200, response_format=response_format(schema),
                        **GREEDY)
    chunks = list(chat.create(model=MODEL, messages=CHAT, max_tokens=200, response_format=response_format(schema),
                              stream=True, **GREEDY))
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs"])
def test_completion_vllm_json_fields_validate(served, field):
    schema = SCHEMAS[0]
    body = {"guided_json": schema} if field == "guided_json" else {"structured_outputs": {"json": schema}}
    for seed in range(3):
        completion = client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0.8,
                                                       seed=seed, extra_body=body)
        assert completion.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(completion.choices[0].text), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_every_one_of_n_sampled_choices_validates(served, stream):
    """n = 3 sampled sequences (seeds 7, 8, 9), each constrained by the schema on its own."""
    schema = SCHEMAS[0]
    response = client(served).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=200, n=3, temperature=0.8, seed=7, stream=stream,
        response_format=response_format(schema))
    texts, finish_reasons = {}, {}
    for chunk in (response if stream else [response]):
        for choice in chunk.choices:
            content = choice.delta.content if stream else choice.message.content
            texts[choice.index] = texts.get(choice.index, "") + (content or "")
            if choice.finish_reason is not None:
                finish_reasons[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2]
    assert finish_reasons == {0: "stop", 1: "stop", 2: "stop"}
    for text in texts.values():
        jsonschema.validate(json.loads(text), schema)


def test_json_object_is_an_object(served):
    """Any object: the sampled ones that end (most of them, with this model) parse as objects."""
    choices = [client(served).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0.8, seed=seed,
        extra_body={"response_format": {"type": "json_object"}}).choices[0] for seed in range(8)]
    ended = [choice.text for choice in choices if choice.finish_reason == "stop"]
    assert all(choice.text.startswith("{") for choice in choices) and len(ended) >= 5
    assert all(isinstance(json.loads(text), dict) for text in ended)


def test_regex_and_choice(served):
    completions = client(served).completions
    regex = completions.create(model=MODEL, prompt=PROMPT, max_tokens=50, extra_body={"guided_regex": REGEX},
                               **GREEDY).choices[0]
    assert (regex.text, regex.finish_reason) == ("classpro@example.com", "stop")
    choices = {completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.5, seed=seed,
                                  extra_body={"guided_choice": CHOICES}).choices[0].text for seed in range(8)}
    assert choices <= set(CHOICES) and len(choices) > 1
    grammar = completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, **GREEDY,
                                 extra_body={"guided_grammar": 'root ::= "x" [0-9] [0-9]'}).choices[0]
    assert re.fullmatch(r"x[0-9]{2}", grammar.text) and grammar.finish_reason == "stop"


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "propertyNames": {"pattern": "^x"}}}}},
     "response_format", "response_format: json_schema: unsupported keyword 'propertyNames' at /"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}},
     "guided_json", "guided_json: json_schema: unsupported keyword 'uniqueItems' at /properties/a"),
    ({"guided_regex": "a("}, "guided_regex", "guided_regex: regex: at 1(8): invalid regex \"a(\" (in regex): regex "
                                             "parse error: a( ^ error: unclosed group 1 | start: /a(/ ^"),
    ({"guided_choice": []}, "guided_choice", "guided_choice: choice: must be a non-empty list of non-empty strings"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice",
     "guided_choice: only one structured output field may be set, got guided_regex, guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format",
     "response_format: json_schema must be an object with a \"schema\", got {\"name\": \"a\"}"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs",
     "structured_outputs: structural_tag='{}' is not supported"),
])
def test_bad_constraints_are_400_naming_the_field(served, body, param, message):
    status, _, raw = http_request(served.http_port, "POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": CHAT, "max_tokens": 5, **body}).encode())
    reply = json.loads(raw)["error"]
    assert (status, reply["param"], reply["message"]) == (400, param, message)


DEAD_END = ("structured_output: its grammar refused the sampled token, so the output cannot go on: no token the "
            "grammar allows is allowed by the request's other token constraints (allowed_token_ids, bad_words, "
            "logit_bias, ...), or the grammar outgrew the parser's limits (the worker's log says which)")
X, A = 90, 67
"""The default model's tokens "x" and "a"."""


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_no_allowed_token_satisfies_is_a_400_not_an_abort(served, stream):
    """guided_choice with allowed_token_ids outside it leaves no first token; regex "xa" with "a" banned, none
    after "x". Such a request was answered with finish_reason "abort" and the token outside the grammar that
    the sampler fell back to (or a 503 when a prefill worker sampled it, which the SDK retries): as a request
    error, it is a 400 before the stream starts, an error event after it (vLLM fails it too, with a 500)."""
    completions = client(served).completions
    first = {"guided_choice": ["yes", "no"], "allowed_token_ids": [X]}
    with pytest.raises(openai.BadRequestError) as error:
        completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=stream, extra_body=first, **GREEDY)
    assert (error.value.body["param"], error.value.body["message"]) == ("structured_output", DEAD_END)
    later = {"guided_regex": "xa", "bad_words": ["a", "xa"]}
    if not stream:
        with pytest.raises(openai.BadRequestError) as error:
            completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body=later, **GREEDY)
        assert (error.value.body["param"], error.value.body["message"]) == ("structured_output", DEAD_END)
        return
    chunks = completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, stream=True, extra_body=later, **GREEDY)
    assert next(chunks).choices[0].text == "x"
    with pytest.raises(openai.APIError) as error:
        next(chunks)
    assert (error.value.body["param"], error.value.body["message"]) == ("structured_output", DEAD_END)


def _grpc_request(constraint: pb.StructuredOutput, max_tokens: int = 50) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, text=PROMPT.encode(), sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_output=constraint))


def test_grpc_typed_field(served):
    _, text, responses = stream_tokens(served.grpc_port, _grpc_request(pb.StructuredOutput(regex=REGEX)))
    assert (text, responses[-1].finish_reason) == ("classpro@example.com", "stop")
    _, text, _ = stream_tokens(served.grpc_port, _grpc_request(pb.StructuredOutput(
        choice=pb.Choices(choices=CHOICES))))
    assert text == "maybe"
    _, text, _ = stream_tokens(served.grpc_port, _grpc_request(pb.StructuredOutput(
        json_schema=json.dumps(SCHEMAS[2])), 200))
    jsonschema.validate(json.loads(text), SCHEMAS[2])


def test_grpc_bad_constraint_is_invalid_argument(served):
    with pytest.raises(grpc.RpcError) as caught:
        stream_tokens(served.grpc_port, _grpc_request(pb.StructuredOutput(json_schema=json.dumps(
            {"type": "object", "propertyNames": {}}))))
    assert (caught.value.code(), caught.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "structured_output: json_schema: unsupported keyword 'propertyNames' "
                                          "at /")
