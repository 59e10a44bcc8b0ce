"""Structured output at the router: the OpenAI / vLLM request fields that ask for it, parsed into
one typed StructuredOutput, and its grammar checked by the grammar engine before any worker sees
the request (an invalid regex, a bad grammar or an unsatisfiable schema is a 400 naming the field).

Fields (exactly one may be set):
- `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema", "strict", ...}}
- `structured_outputs` (vLLM >= 0.10): {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
- vLLM's earlier `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

llguidance is torch-free: the router compiles each grammar without a tokenizer (cheap), the
engine compiles it again with the model's tokenizer (cached there).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from splitserve.common.errors import InvalidRequestError, json_excerpt
from splitserve.common.structured_output import StructuredOutput, StructuredOutputKind, grammar_as_lark
from splitserve.proto.splitserve.v1 import generation_pb2 as pb

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's guided decoding fields before structured_outputs (still sent by many clients)."""
STRUCTURED_OUTPUT_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)
"""Every request field that asks for structured output (at most one may be set)."""
LARGE_GRAMMAR_BYTES = 16 << 10
"""A constraint (or a request carrying one) of more bytes is checked off the router's event loop:
llguidance compiles a grammar in about 2 ms per KB (a 780 KB schema: 1.6 s), which on the loop
would stall every stream the router serves (gRPC: a thread, router/server.py; HTTP: the body
parser's process, router/request_body.py)."""
STRUCTURED_OUTPUTS_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The constraint keys of vLLM's structured_outputs object."""
STRUCTURED_OUTPUTS_OPTIONS = {"disable_any_whitespace": (False, True), "disable_additional_properties": (False, True),
                              "whitespace_pattern": (), "structural_tag": ()}
"""structured_outputs' other keys and the values accepted besides null: JSON output is always
compact (so either whitespace setting is honoured) and objects that list their properties are
always closed (common/structured_output.closed_objects: what vLLM's default backend does, where the
option has no effect either); the rest is not implemented."""


def parse_structured_output(body: Mapping[str, Any]) -> StructuredOutput | None:
    """The request's constraint (None if it asks for none), its grammar checked; InvalidRequestError
    naming the field otherwise."""
    found = [(name, parse) for name, parse in _PARSERS.items() if _is_set(body, name)]
    if not found:
        return None
    if len(found) > 1:
        raise InvalidRequestError(found[1][0], f"only one structured output field may be set, got "
                                               f"{', '.join(name for name, _ in found)}")
    name, parse = found[0]
    try:
        constraint = parse(body[name])
        if constraint is not None:
            check_grammar(constraint)
        return constraint
    except InvalidRequestError as error:
        if error.field == name:
            raise
        raise InvalidRequestError(name, str(error)) from None


def structured_output_from_proto(message: pb.StructuredOutput) -> StructuredOutput | None:
    """The gRPC API's typed field (None when no constraint is set), its grammar checked;
    InvalidRequestError naming `structured_output` otherwise."""
    kind = message.WhichOneof("constraint")
    if kind is None:
        return None
    try:
        constraint = _FROM_PROTO[kind](message)
        check_grammar(constraint)
        return constraint
    except InvalidRequestError as error:
        raise InvalidRequestError("structured_output", str(error)) from None


def _json_object_from_proto(message: pb.StructuredOutput) -> StructuredOutput:
    if not message.json_object:
        raise InvalidRequestError("json_object", "must be true when set")
    return StructuredOutput(StructuredOutputKind.JSON_OBJECT)


def check_grammar(constraint: StructuredOutput) -> None:
    """InvalidRequestError (naming the constraint's kind) if the grammar engine cannot compile it."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(constraint.grammar())
    if is_error:
        raise InvalidRequestError(constraint.kind.value, " ".join(messages[0].split()))  # one line


def _is_set(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name)
    return value is not None and not (name == "response_format" and value == {"type": "text"})


def _response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError("response_format", "must be {\"type\": \"text\" | \"json_object\" | "
                                                     f"\"json_schema\", ...}}, got {json_excerpt(value)}")
    if value["type"] == "json_object":
        return StructuredOutput(StructuredOutputKind.JSON_OBJECT)
    if value["type"] == "text":
        return None
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise InvalidRequestError("response_format", "json_schema must be an object with a \"schema\", got "
                                                     f"{json_excerpt(spec)}")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise InvalidRequestError("response_format", f"json_schema.strict must be a boolean, got {spec['strict']!r}")
    return _schema(spec["schema"])


def _structured_outputs(value: Any) -> StructuredOutput:
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs", f"must be an object, got {json_excerpt(value)}")
    unknown = set(value) - set(STRUCTURED_OUTPUTS_KINDS) - set(STRUCTURED_OUTPUTS_OPTIONS)
    if unknown:
        raise InvalidRequestError("structured_outputs", f"unknown key {sorted(unknown)[0]!r}")
    for option, accepted in STRUCTURED_OUTPUTS_OPTIONS.items():
        if value.get(option) is not None and value[option] not in accepted:
            raise InvalidRequestError("structured_outputs", f"{option}={value[option]!r} is not supported")
    kinds = [kind for kind in STRUCTURED_OUTPUTS_KINDS if value.get(kind) is not None]
    if len(kinds) != 1:
        raise InvalidRequestError("structured_outputs", f"must set exactly one of {', '.join(STRUCTURED_OUTPUTS_KINDS)}"
                                                        f", got {kinds or 'none'}")
    if kinds[0] == "json_object":
        if value["json_object"] is not True:
            raise InvalidRequestError("structured_outputs", "json_object must be true")
        return StructuredOutput(StructuredOutputKind.JSON_OBJECT)
    return _GUIDED[f"guided_{kinds[0]}"](value[kinds[0]])


def _schema(value: Any) -> StructuredOutput:
    """A schema given as an object, a boolean or JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as error:  # nested deeper than the decoder goes
            raise InvalidRequestError("json_schema", f"is not valid JSON: {error}") from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError("json_schema", f"must be an object, got {json_excerpt(value)}")
    return StructuredOutput.json_schema(value)


def _regex(value: Any) -> StructuredOutput:
    if not isinstance(value, str):
        raise InvalidRequestError("regex", f"must be a string, got {json_excerpt(value)}")
    return StructuredOutput(StructuredOutputKind.REGEX, value)


def _choice(value: Any) -> StructuredOutput:
    return StructuredOutput.choice(value)


def _grammar(value: Any) -> StructuredOutput:
    """A Lark grammar, or a GBNF / EBNF one (llama.cpp's, what xgrammar takes), converted to Lark."""
    if not isinstance(value, str):
        raise InvalidRequestError("grammar", f"must be a string, got {json_excerpt(value)}")
    return StructuredOutput(StructuredOutputKind.GRAMMAR, grammar_as_lark(value, any_to_lark))


_GUIDED: dict[str, Callable[[Any], StructuredOutput]] = {
    "guided_json": _schema, "guided_regex": _regex, "guided_choice": _choice, "guided_grammar": _grammar,
}
_FROM_PROTO: dict[str, Callable[[pb.StructuredOutput], StructuredOutput]] = {
    "json_schema": lambda message: _schema(message.json_schema), "json_object": _json_object_from_proto,
    "regex": lambda message: _regex(message.regex), "choice": lambda message: _choice(list(message.choice.choices)),
    "grammar": lambda message: _grammar(message.grammar),
}
_PARSERS: dict[str, Callable[[Any], StructuredOutput | None]] = {
    "response_format": _response_format, "structured_outputs": _structured_outputs, **_GUIDED,
}
