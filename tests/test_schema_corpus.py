"""Real-world JSON schemas (tests/schema_corpus.py: pydantic v2 models, OpenAI strict mode, tool
definitions, JSON Schema 2020-12 keywords, odd corners) through every way of asking for them, with
the default model sampling at temperature 1.0: every output that ends validates against its schema
(formats included, where a checker exists), and a schema the grammar engine does not enforce is a
400 naming the construct before anything is generated."""

from __future__ import annotations

import datetime
import ipaddress
import json
import re

import jsonschema
import llguidance
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
from tests.schema_corpus import (ACCEPTED, REFUSED, TOOL_PARAMETERS, CorpusSchema, Inventory, Kennel, Message, Owner,
                                 Robot)

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

_URI_UNRESERVED_OR_SUB_DELIM = r"[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2}"
_URI_PCHAR = rf"(?:{_URI_UNRESERVED_OR_SUB_DELIM}|[:@])"
_URI_AUTHORITY = (rf"(?:(?:{_URI_UNRESERVED_OR_SUB_DELIM}|:)*@)?"
                  rf"(?:\[(?P<ip_literal>[^\]]*)\]|(?:{_URI_UNRESERVED_OR_SUB_DELIM})*)(?::[0-9]*)?")
RFC3986_URI = (rf"[A-Za-z][A-Za-z0-9+\-.]*:"
               rf"(?://{_URI_AUTHORITY}(?:/{_URI_PCHAR}*)*|/?(?:{_URI_PCHAR}+(?:/{_URI_PCHAR}*)*)?)"
               rf"(?:\?(?:{_URI_PCHAR}|[/?])*)?(?:#(?:{_URI_PCHAR}|[/?])*)?")
"""RFC 3986's URI (scheme ":" hier-part ["?" query] ["#" fragment]), its ABNF as a regex; an
IP-literal host is checked apart (is_uri). Agreed with the rfc3987 package (rule "URI", what
jsonschema checks `uri` with when it is installed; it is not here) on 600,000 random strings."""
IPV_FUTURE = r"v[0-9A-Fa-f]+\.[A-Za-z0-9\-._~!$&'()*+,;=:]+"


def is_uri(text: str) -> bool:
    match = re.fullmatch(RFC3986_URI, text)
    if match is None:
        return False
    ip_literal = match.group("ip_literal")
    if ip_literal is None or re.fullmatch(IPV_FUTURE, ip_literal):
        return True
    try:
        ipaddress.IPv6Address(ip_literal)
    except ValueError:
        return False
    return "%" not in ip_literal  # an IPv6 zone id has no place in a URI (RFC 3986 has none)


def _is_date(text: str) -> bool:
    try:
        datetime.date.fromisoformat(text)
        return True
    except ValueError:
        return False


FORMATS = jsonschema.FormatChecker()
"""jsonschema's format checkers (date, email (an `@` in it, no more), ipv4, ipv6, uuid without optional
packages), with those formats llguidance enforces that jsonschema checks only with optional packages
written here: RFC 3339 date-time and time, ISO 8601 duration, RFC 1123 hostname, RFC 3986 uri."""
FORMATS.checks("time")(lambda text: not isinstance(text, str) or re.fullmatch(RFC3339_TIME, text) is not None)
FORMATS.checks("date-time")(lambda text: not isinstance(text, str) or (
    re.fullmatch(r"\d{4}-\d{2}-\d{2}[tT]" + RFC3339_TIME, text) is not None and _is_date(text[:10])))
FORMATS.checks("duration")(lambda text: not isinstance(text, str) or re.fullmatch(
    r"P(?!$)(\d+Y)?(\d+M)?(\d+W)?(\d+D)?(T(?=\d)(\d+H)?(\d+M)?(\d+(\.\d+)?S)?)?", text) is not None)
FORMATS.checks("uri")(lambda text: not isinstance(text, str) or is_uri(text))
FORMATS.checks("hostname")(lambda text: not isinstance(text, str) or re.fullmatch(
    r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*",
    text) is not None)


def test_the_uri_checker_follows_rfc_3986():
    texts = ["https://u:p@example.com:8080/a/b?q=1#f", "urn:isbn:0451450523", "mailto:x@y", "a:", "http://[::1]/",
             "http://[v1.x]/", "x:%20", "1a:b", "a b:c", "a:%zz", "http://[::1%eth0]/", "http://h:x/", "a:[x]", "/a"]
    assert [is_uri(text) for text in texts] == [True] * 7 + [False] * 7


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


WITH_REFERENCES = ("pydantic_Person", "pydantic_Owner", "openai_strict_recursive_ui")
TOOL_SCHEMAS = [*TOOL_PARAMETERS, *(entry for entry in ACCEPTED if entry.name in WITH_REFERENCES)]
"""A forced tool generates under the very grammar a response_format of its parameters does (both are
StructuredOutput.json_schema of the schema), which test_every_sampled_output_that_ends_validates
samples for every schema; through the tool-call path (the schema in the prompt, the arguments in
tool_calls) go the frameworks' tool definitions and schemas whose `$ref`s ($defs, `#`) point into
the parameters (a larger schema, in the prompt with the tool, outgrows the default model's 512
tokens)."""


@pytest.mark.parametrize("entry", TOOL_SCHEMAS, ids=ids(TOOL_SCHEMAS))
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


OFFLINE = [entry for entry in ACCEPTED if entry.name in (
    "pydantic_Person", "pydantic_Kennel", "openai_strict_recursive_ui", "string_formats", "large_enum")]
"""The offline LLM builds the same grammar as the router (StructuredOutputsParams(json=...) is
StructuredOutput.json_schema), so a few shapes suffice to show it samples what the server does:
`$ref`s and a rewritten oneOf, formats, a large grammar."""


@pytest.mark.slow
def test_the_offline_llm_samples_what_the_server_does(llm, served):
    """StructuredOutputsParams(json=...), the schemas in one batch, against the served completions API
    with the same seeds, one request at a time: the same finish reasons, the same outputs where they
    end, and every offline output that ends validates. An output cut by max_tokens may differ after a
    while: batches of other sizes round their logits differently (no batch invariance, as in vLLM)."""
    params = [SamplingParams(temperature=1.0, seed=SEED, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=entry.schema)) for entry in OFFLINE]
    offline = [output.outputs[0] for output in llm.generate([PROMPT] * len(OFFLINE), params)]

    served_choices = [client(served).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED,
        extra_body={"structured_outputs": {"json": entry.schema}}).choices[0] for entry in OFFLINE]
    assert [output.finish_reason for output in offline] == [choice.finish_reason for choice in served_choices]
    ended = [(entry, output.text, choice.text) for entry, output, choice in zip(OFFLINE, offline, served_choices)
             if output.finish_reason == "stop"]
    assert len(ended) >= len(OFFLINE) * 2 // 3
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


BYTES = llguidance.LLTokenizer("byte")
"""llguidance's tokenizer of one token per byte: what a grammar accepts, without a model."""


def grammar_accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    return matcher.consume_tokens(BYTES.tokenize_str(text)) and matcher.is_accepting()


def schema_grammar(schema) -> str:
    return parse_structured_output({"guided_json": schema}).grammar()


def is_valid(schema, text: str) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


def test_nested_and_referenced_discriminated_unions_are_enforced_as_any_of():
    """pydantic's discriminated unions with a Literal of several values in a branch, a union of unions
    and a union behind a $ref (a TypeAliasType) were refused; each oneOf is generated as anyOf, and
    the grammar takes exactly the values that validate."""
    message, kennel = Message.model_json_schema(), Kennel.model_json_schema()
    part = json.loads(schema_grammar(message))["grammars"][0]["json_schema"]["properties"]["part"]
    inner_discriminator = message["properties"]["part"]["oneOf"][0]["discriminator"]
    assert (part["anyOf"], "oneOf" in part) == ([{"discriminator": inner_discriminator,
                                                  "anyOf": [{"$ref": "#/$defs/Text"}, {"$ref": "#/$defs/Image"}]},
                                                 {"$ref": "#/$defs/Ping"}], False)
    texts = ['{"part":{"type":"content","format":"markdown","body":"hi"}}', '{"part":{"type":"content","format":"png",'
             '"width":3}}', '{"part":{"type":"ping"}}', '{"part":{"type":"content","format":"png","body":"hi"}}',
             '{"part":{"type":"ping","format":"png"}}']
    assert [grammar_accepts(schema_grammar(message), text) for text in texts] == [True, True, True, False, False]
    assert [is_valid(message, text) for text in texts] == [True, True, True, False, True]  # Ping is open
    texts = ['{"residents":[{"pet_type":"drone","battery":7},{"pet_type":"cat","lives":3}]}',
             '{"residents":[{"pet_type":"dog","battery":7}]}', '{"residents":[]}']
    assert [grammar_accepts(schema_grammar(kennel), text) for text in texts] == [True, False, False]
    assert [is_valid(kennel, text) for text in texts] == [True, False, False]
    assert Kennel.model_validate_json(texts[0]).residents[0] == Robot(pet_type="drone", battery=7)


@pytest.mark.parametrize(("schema", "texts", "accepted", "valid"), [
    (Inventory.model_json_schema(), ['{"counts":{"ab":1}}', '{"counts":{"ab":1,"c":2}}', '{"counts":{}}',
                                     '{"counts":{"ab":1,"c":2,"d":3}}', '{"counts":{"ab":10}}'],
     [True, True, False, False, False], [True, True, False, False, False]),
    (next(entry.schema for entry in ACCEPTED if entry.name == "pattern_properties_closed"),
     ['{"x_a":1,"12":true}', '{"x_abcd":1}', '{"12":1}', '{"y":1}', '{}', '{"x_a":1,"x_b":2,"x_c":3,"x_d":4}'],
     [True, False, False, False, False, False], [True, False, False, False, False, False]),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
     ['{"a":1}', '{"a":1,"b":2}', '{"a":1,"a":2}'], [True, False, False], [True, False, True]),
])
def test_pattern_properties_and_property_counts_are_enforced_exactly(schema, texts, accepted, valid):
    """patternProperties, minProperties up to 1 and maxProperties were refused; the grammar takes only
    what validates: exactly that, but for a repeated key, which counts twice against maxProperties
    (stricter than a parser, which keeps one key: never an invalid output)."""
    assert [grammar_accepts(schema_grammar(schema), text) for text in texts] == accepted
    assert [is_valid(schema, text) for text in texts] == valid


def test_min_properties_above_one_stays_refused_since_a_repeated_key_counts_twice():
    """llguidance takes {"a":1,"a":2} as two properties (it keeps only the keys `properties` lists
    unique); a JSON parser keeps one key, so minProperties 2 would let an invalid object through."""
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}
    assert grammar_accepts(json.dumps({"grammars": [{"json_schema": schema}]}), '{"a":1,"a":2}')
    assert not is_valid(schema, '{"a":1,"a":2}')
    with pytest.raises(InvalidRequestError) as error:
        schema_grammar(schema)
    assert str(error.value) == ("guided_json: json_schema: unsupported minProperties 2 (at most 1: the grammar engine "
                                "may write an additionalProperties or patternProperties key twice and count it twice, "
                                "where a JSON parser keeps one) at /minProperties")


@pytest.mark.parametrize(("one_of", "path"), [
    ([{"type": "object", "properties": {"k": {"const": "a"}}}, {"type": "object", "properties": {"k": {"const": "b"}}}],
     "/properties/p"),  # k not required: {} matches both
    ([{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"const": 1.0}}, "required": ["k"]}], "/properties/p"),  # 1 == 1.0
    ([{"properties": {"k": {"const": "a"}}, "required": ["k"]},
      {"properties": {"k": {"const": "b"}}, "required": ["k"]}], "/properties/p"),  # not only objects: "x" matches both
    ([{"$ref": "#/$defs/missing"}], "/properties/p"),
    ([{"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
                 {"type": "object", "properties": {"j": {"const": "a"}}, "required": ["j"]}]},
      {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}],
     "/properties/p"),  # {"j": "a", "k": "b"} matches both
    ([{"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]},
      {"type": "object", "properties": {"k": {"enum": ["b", "c"]}}, "required": ["k"]}], "/properties/p"),  # "b"
])
def test_a_one_of_not_provably_exclusive_is_refused(one_of, path):
    with pytest.raises(InvalidRequestError) as error:
        parse_structured_output({"guided_json": {"properties": {"p": {"oneOf": one_of}}, "$defs": {}}})
    assert str(error.value).startswith(f"guided_json: json_schema: unsupported keyword 'oneOf' at {path}: ")
