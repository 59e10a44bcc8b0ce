"""Real-world JSON schemas (tests/schema_corpus.py: pydantic v2 models, OpenAI strict mode, tool
definitions, JSON Schema 2020-12 keywords, odd corners) through every way of asking for them, with
the default model sampling at temperature 1.0: every output that ends validates against its schema
(formats included, where a checker exists), and a schema the grammar engine does not enforce is a
400 naming the construct before anything is generated."""

from __future__ import annotations

import datetime
import json
import re

import jsonschema
import openai
import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.common.structured_output import StructuredOutput
from splitserve.engine import LLM, SamplingParams, StructuredOutputsParams
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.testing.tiny_models import TOOLS_CHAT_TEMPLATE
from splitserve.router.structured_output import parse_structured_output
from tests.factories import http_request, served_apis
from tests.schema_corpus import ACCEPTED, REFUSED, CorpusSchema, Owner

MODEL = "m"
CHAT = [{"role": "user", "content": "Answer in JSON."}]
PROMPT = "The record, as JSON: "
SEED = 11
SAMPLES = 2
"""Sequences per schema (n: seeds SEED, SEED + 1)."""
MAX_TOKENS = 160
RUNS_LONG_MAX_TOKENS = 40
"""max_tokens for a schema that runs long (CorpusSchema.runs_long): enough to see its output start
under the grammar, no more time spent on the rest."""
MAX_MODEL_LEN = 512
"""The served default model's context."""

RFC3339_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([zZ]|[+-]([01]\d|2[0-3]):[0-5]\d)"
"""RFC 3339's full-time (JSON Schema's `time`): a lower-case `t` / `z` is allowed (its section 5.6)."""


def _is_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
        return True
    except ValueError:
        return False


FORMATS = jsonschema.FormatChecker()
"""jsonschema's format checkers (date, email, ipv4, ipv6, uuid without optional packages), with
those formats llguidance enforces that jsonschema checks only with optional packages written here:
RFC 3339 date-time and time, ISO 8601 duration, RFC 1123 hostname. `uri` stays unchecked."""
FORMATS.checks("time")(lambda text: not isinstance(text, str) or re.fullmatch(RFC3339_TIME, text) is not None)
FORMATS.checks("date-time")(lambda text: not isinstance(text, str) or (
    re.fullmatch(r"\d{4}-\d{2}-\d{2}[tT]" + RFC3339_TIME, text) is not None and _is_date(text[:10])))
FORMATS.checks("duration")(lambda text: not isinstance(text, str) or re.fullmatch(
    r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?", text) is not None)
FORMATS.checks("hostname")(lambda text: not isinstance(text, str) or re.fullmatch(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
    text) is not None)


def assert_valid(text: str, schema) -> None:
    jsonschema.Draft202012Validator(schema, format_checker=FORMATS).validate(json.loads(text))


@pytest.fixture(scope="module")
def served():
    with served_apis(resolve_model_path(DEFAULT_MODEL_NAME), MODEL, tool_call_parser="hermes",
                     chat_template=TOOLS_CHAT_TEMPLATE) as served:
        yield served


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="none", max_retries=0)


def response_format(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def max_tokens(entry: CorpusSchema) -> int:
    return RUNS_LONG_MAX_TOKENS if entry.runs_long else MAX_TOKENS


def ids(corpus) -> list[str]:
    return [entry.name for entry in corpus]


@pytest.mark.parametrize("entry", ACCEPTED, ids=ids(ACCEPTED))
def test_every_sampled_output_that_ends_validates(served, entry: CorpusSchema):
    response = client(served).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=max_tokens(entry), n=SAMPLES, temperature=1.0, seed=SEED,
        response_format=response_format(entry.schema))
    ended = [choice.message.content for choice in response.choices if choice.finish_reason == "stop"]
    assert ended or entry.runs_long, [choice.message.content for choice in response.choices]
    for text in ended:
        assert_valid(text, entry.schema)


OBJECT_ROOTED = [entry for entry in ACCEPTED if isinstance(entry.schema, dict) and entry.schema.get("type") == "object"
                 and entry.name != "nested_20_levels"]
"""The schemas a function's parameters may be (20 levels of nesting, rendered into the prompt with
the tool, outgrow the default model's 512 tokens)."""


@pytest.mark.parametrize("entry", OBJECT_ROOTED, ids=ids(OBJECT_ROOTED))
def test_a_forced_strict_tool_calls_with_valid_arguments(served, entry: CorpusSchema):
    tools = [{"type": "function", "function": {"name": "act", "parameters": entry.schema, "strict": True}}]
    response = client(served).chat.completions.create(
        model=MODEL, messages=CHAT, tools=tools, tool_choice={"type": "function", "function": {"name": "act"}},
        max_tokens=max_tokens(entry), n=SAMPLES, temperature=1.0, seed=SEED)
    ended = [choice.message.tool_calls for choice in response.choices if choice.finish_reason == "stop"]
    # The tool's schema is in the prompt: a large one leaves less than max_tokens of the context.
    assert ended or entry.runs_long or response.usage.prompt_tokens + MAX_TOKENS > MAX_MODEL_LEN
    for [call] in ended:
        assert call.function.name == "act"
        assert_valid(call.function.arguments, entry.schema)


@pytest.mark.parametrize("entry", REFUSED, ids=ids(REFUSED))
@pytest.mark.parametrize("field", ["response_format", "guided_json", "tools"])
def test_an_unenforced_schema_is_a_400_before_the_stream_starts(served, entry, field):
    body = {"response_format": {"response_format": response_format(entry.schema)},
            "guided_json": {"guided_json": entry.schema},
            "tools": {"tools": [{"type": "function", "function": {"name": "act", "parameters": entry.schema,
                                                                  "strict": True}}],
                      "tool_choice": {"type": "function", "function": {"name": "act"}}}}[field]
    status, _, raw = http_request(served.http_port, "POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": CHAT, "max_tokens": 5, "stream": True, **body}).encode())
    reply = json.loads(raw)["error"]
    param = "tools[0].function.parameters" if field == "tools" else field
    assert (status, reply["param"], reply["message"]) == (400, param, f"{param}: {entry.message}")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(resolve_model_path(DEFAULT_MODEL_NAME), max_model_len=MAX_MODEL_LEN)


BOUNDED = [entry for entry in ACCEPTED if not entry.runs_long]


@pytest.mark.slow
def test_the_offline_llm_samples_what_the_server_does(llm, served):
    """StructuredOutputsParams(json=...), the schemas in one batch, against the served completions API
    with the same seeds, one request at a time: the same finish reasons, the same outputs where they
    end, and every offline output that ends validates. An output cut by max_tokens may differ after a
    while: batches of other sizes round their logits differently (no batch invariance, as in vLLM)."""
    params = [SamplingParams(temperature=1.0, seed=SEED, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=entry.schema)) for entry in BOUNDED]
    offline = [output.outputs[0] for output in llm.generate([PROMPT] * len(BOUNDED), params)]

    served_choices = [client(served).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED,
        extra_body={"structured_outputs": {"json": entry.schema}}).choices[0] for entry in BOUNDED]
    assert [output.finish_reason for output in offline] == [choice.finish_reason for choice in served_choices]
    ended = [(entry, output.text, choice.text) for entry, output, choice in zip(BOUNDED, offline, served_choices)
             if output.finish_reason == "stop"]
    assert len(ended) >= len(BOUNDED) * 2 // 3
    assert [text for _, text, _ in ended] == [served_text for _, _, served_text in ended]
    for entry, text, _ in ended:
        assert_valid(text, entry.schema)


def test_properties_are_generated_in_the_schemas_order(served):
    """A schema's spec kept its keys sorted, so the grammar engine (which writes properties in the order
    `properties` lists them) wrote `answer` before the `reasoning` meant to lead to it; vLLM and OpenAI
    keep the client's order."""
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 12},
                                               "answer": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["reasoning", "answer"]}
    assert StructuredOutput.json_schema(schema).spec == (
        '{"type":"object","properties":{"reasoning":{"type":"string","maxLength":12},"answer":{"type":"integer",'
        '"minimum":0,"maximum":9}},"required":["reasoning","answer"]}')
    response = client(served).chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, n=SAMPLES, temperature=1.0, seed=SEED,
        response_format=response_format(schema))
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert list(json.loads(choice.message.content)) == ["reasoning", "answer"]


def test_a_discriminated_union_is_enforced_as_any_of():
    """pydantic's discriminated union (oneOf of `$ref`s, told apart by a required const property) was
    refused; it is generated as anyOf, the same set of values (no value matches two alternatives)."""
    schema = Owner.model_json_schema()
    grammar = json.loads(parse_structured_output({"guided_json": schema}).grammar())["grammars"][0]["json_schema"]
    assert grammar["properties"]["pet"] == {"discriminator": schema["properties"]["pet"]["discriminator"],
                                            "anyOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                            "title": "Pet"}
    assert grammar["$defs"]["Cat"]["additionalProperties"] is False


@pytest.mark.parametrize(("one_of", "path"), [
    ([{"type": "object", "properties": {"k": {"const": "a"}}}, {"type": "object", "properties": {"k": {"const": "b"}}}],
     "/properties/p"),  # k not required: {} matches both
    ([{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"const": 1.0}}, "required": ["k"]}], "/properties/p"),  # 1 == 1.0
    ([{"properties": {"k": {"const": "a"}}, "required": ["k"]},
      {"properties": {"k": {"const": "b"}}, "required": ["k"]}], "/properties/p"),  # not only objects: "x" matches both
    ([{"$ref": "#/$defs/missing"}], "/properties/p"),
])
def test_a_one_of_not_provably_exclusive_is_refused(one_of, path):
    with pytest.raises(InvalidRequestError) as error:
        parse_structured_output({"guided_json": {"properties": {"p": {"oneOf": one_of}}, "$defs": {}}})
    assert str(error.value).startswith(f"guided_json: json_schema: unsupported keyword 'oneOf' at {path}: ")
