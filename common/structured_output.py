"""Structured output: the typed request field that constrains a request's output to a grammar
(torch-free; shared by the router, which validates it, and the engine, which enforces it).

A StructuredOutput is a kind and a spec string; `grammar()` turns it into the grammar text of the
grammar engine (llguidance's JSON grammar format: {"grammars": [{"json_schema" | "lark_grammar"}]}),
built here with the standard library so that router and engine compile the very same grammar.

JSON schemas are held to SUPPORTED_KEYWORDS: a keyword outside it is refused with its name (and
where it is), never silently ignored, since an ignored keyword would produce output that does not
validate against the client's schema.
"""

from __future__ import annotations

import decimal
import enum
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from splitserve.common.errors import InvalidRequestError

MAX_SPEC_CHARS = 1 << 20
"""Longest spec (a schema's JSON text, a regex, a grammar): larger ones are refused before parsing."""
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of subschemas a JSON schema may have."""
JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                         "readOnly", "writeOnly", "discriminator"})
"""Keywords that describe a value without constraining it: accepted and ignored (as by any validator;
`discriminator` is OpenAPI's, which pydantic writes beside a discriminated union's oneOf)."""
SCHEMA_VALUED = frozenset({"additionalProperties", "items"})
"""Keywords whose value is one subschema."""
SCHEMA_MAP_VALUED = frozenset({"properties", "patternProperties", "$defs", "definitions"})
"""Keywords whose value maps names to subschemas."""
SCHEMA_LIST_VALUED = frozenset({"anyOf", "allOf", "oneOf", "prefixItems"})
"""Keywords whose value is a list of subschemas."""
SUPPORTED_KEYWORDS = ANNOTATIONS | SCHEMA_VALUED | SCHEMA_MAP_VALUED | SCHEMA_LIST_VALUED | frozenset({
    "type", "enum", "const", "$ref", "required",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minItems", "maxItems", "minProperties", "maxProperties",
})
"""The JSON schema subset the grammar engine enforces exactly (oneOf only where its alternatives are
discriminated: _discriminator; minProperties only up to MAX_MIN_PROPERTIES). Not in it (refused by
name): propertyNames, dependentRequired, dependentSchemas, if/then/else, not, uniqueItems, contains,
unevaluated*, x-guidance."""
MAX_MIN_PROPERTIES = 1
"""Largest minProperties enforced: the grammar engine keeps the keys an object lists in `properties`
unique but not those of additionalProperties / patternProperties, and counts `{"a":1,"a":2}` as two
properties where a JSON parser keeps one (seen sampling minProperties 2 and 3). Up to 1 that cannot
matter: a non-empty object has a key. maxProperties is exact (a repeated key only counts more)."""
ONE_OF_RULE = ("only alternatives that are objects with a required property whose values (a const or an enum) "
               "differ from alternative to alternative (a discriminated union, as pydantic writes it) and no anyOf "
               "beside them; use anyOf")
"""Why a oneOf is refused: where its alternatives are discriminated, no value matches two of them, so
it is generated as anyOf (one_of_as_any_of); any other oneOf, so generated, could produce a value
that matches two alternatives and so does not validate."""
MAX_UNION_SCHEMAS = 256
"""Most schemas followed (through `$ref`s and nested oneOf / anyOf) to find the objects one oneOf
alternative allows: each oneOf is checked apart, so this bounds the work a schema of many unions
costs the router; a larger union is refused as not discriminated."""
NUMERIC_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
"""Keywords whose value is a number (the others hold counts)."""
MAX_EXACT_INTEGER = 2 ** 53
"""Largest integer magnitude a schema number may have: the grammar engine holds every schema number
as a 64-bit float, so 2**53 + 1 would be written (or bounded) as 2**53."""
MAX_SIGNIFICANT_DIGITS = 14
MAX_FRACTION_DIGITS = 20
"""Most significant digits, and digits after the point, of a schema number written with a point or
an exponent (a float): the grammar engine writes an enum or const number, and bounds a number, from
a decimal rendering of its float that loses digits beyond these (measured on llguidance 1.9: const
123456789.12345679 was written 123456789.1234568; a maximum with 23 digits after the point let a
larger number through; none of 6,000 random numbers within both limits was off)."""
FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri"})
"""String formats the grammar engine enforces."""
JSON_OPTIONS = {"whitespace_flexible": False}
"""Compact JSON (no whitespace between tokens): the grammar leaves the model no way to spend its
max_tokens on blank space, which an unconstrained whitespace rule allows."""


class StructuredOutputKind(enum.Enum):
    JSON_OBJECT = "json_object"
    """Any JSON object (OpenAI's response_format {"type": "json_object"}); spec is ""."""
    JSON_SCHEMA = "json_schema"
    """spec: a JSON schema (JSON text) within SUPPORTED_KEYWORDS."""
    REGEX = "regex"
    """spec: a regular expression (Rust regex syntax, anchored at both ends; no look-around)."""
    CHOICE = "choice"
    """spec: a JSON list of strings; the output is exactly one of them."""
    GRAMMAR = "grammar"
    """spec: a Lark grammar (llguidance's dialect; the router converts GBNF / EBNF to it)."""


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's whole output. Validated on construction; equal specs compile to
    the same grammar (the engine caches compiled grammars by `grammar()`)."""

    kind: StructuredOutputKind
    """What `spec` is."""
    spec: str = ""
    """The constraint's text, as described by its kind."""
    starts_after_token: int | None = None
    """The grammar applies to the output after the first time this token is generated (a reasoning
    parser's end tag: vLLM constrains only the answer after the reasoning); until then the output is
    free. None: it applies from the first output token."""

    def __post_init__(self) -> None:
        if self.starts_after_token is not None and (not isinstance(self.starts_after_token, int)
                                                    or self.starts_after_token < 0):
            raise InvalidRequestError("structured_output", f"starts_after_token must be a token id, got "
                                                           f"{self.starts_after_token!r}")
        if not isinstance(self.kind, StructuredOutputKind):
            raise InvalidRequestError("structured_output", f"unknown kind {self.kind!r}")
        if not isinstance(self.spec, str):
            raise InvalidRequestError(self.kind.value, f"must be a string, got {type(self.spec).__name__}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(self.kind.value, f"has {len(self.spec)} characters; at most {MAX_SPEC_CHARS}")
        _CHECKS[self.kind](self.spec)

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        """From a parsed schema (a dict, or a boolean schema), kept as compact JSON text in the client's key
        order: the grammar engine writes an object's properties in the order `properties` lists them (as
        vLLM's backends and OpenAI do), and clients put them in the order they want generated (a
        `reasoning` before the `answer` it leads to)."""
        return cls(StructuredOutputKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: Any) -> StructuredOutput:
        return cls(StructuredOutputKind.CHOICE, json.dumps(choices, separators=(",", ":")))

    def after_token(self, token_id: int) -> StructuredOutput:
        """This constraint, applied to the output after `token_id` only."""
        return StructuredOutput(self.kind, self.spec, token_id)

    def grammar(self) -> str:
        """The grammar engine's text for this constraint (llguidance's JSON grammar format)."""
        if self.kind == StructuredOutputKind.JSON_OBJECT:
            return _json_grammar({"type": "object"})
        if self.kind == StructuredOutputKind.JSON_SCHEMA:
            return _json_grammar(closed_objects(one_of_as_any_of(json.loads(self.spec))))
        if self.kind == StructuredOutputKind.REGEX:
            return _lark_grammar("start: " + _lark_regex(self.spec))
        if self.kind == StructuredOutputKind.CHOICE:
            # One terminal (a single lexeme), not `start: "a" | "b" | ...` as llguidance's own builder
            # writes it: as parser alternatives, more than 2000 choices sharing a prefix overflow the
            # parser's row ("Current row has 2001 items; max is 2000") after the first token.
            return _lark_grammar("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in json.loads(self.spec)))
        return _lark_grammar(self.spec)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's StructuredOutputsParams, as `SamplingParams(structured_outputs=...)` takes it: exactly one of
    `json` (a JSON schema: a dict or its JSON text), `regex`, `choice` (strings), `grammar` (a Lark grammar)
    or `json_object=True`. `disable_any_whitespace` and `disable_additional_properties` are accepted either
    way (JSON output is always compact, and objects that list their properties are always closed, as the
    HTTP API's structured_outputs), and so is `disable_fallback` (there is one grammar engine);
    `whitespace_pattern` and `structural_tag` are refused (not implemented). Checked on construction."""

    json: str | dict | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        self.constraint()

    def constraint(self) -> StructuredOutput:
        """The StructuredOutput these params ask for; InvalidRequestError naming the offending key."""
        for option in ("whitespace_pattern", "structural_tag"):
            if getattr(self, option) is not None:
                raise InvalidRequestError(f"structured_outputs.{option}", "is not supported")
        kinds = [kind for kind in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, kind) is not None]
        if len(kinds) != 1:
            raise InvalidRequestError("structured_outputs", f"must set exactly one of json, regex, choice, grammar, "
                                                            f"json_object, got {kinds or 'none'}")
        return self._constraint_of(kinds[0], getattr(self, kinds[0]))

    @staticmethod
    def _constraint_of(kind: str, value: Any) -> StructuredOutput:
        field = f"structured_outputs.{kind}"
        if kind == "json_object":
            if value is not True:
                raise InvalidRequestError(field, f"must be True, got {value!r}")
            return StructuredOutput(StructuredOutputKind.JSON_OBJECT)
        if kind == "json":
            return StructuredOutput.json_schema(_parsed_schema(value, field))
        if kind == "choice":
            if isinstance(value, str) or not all(isinstance(choice, str) for choice in _listed(value, field)):
                raise InvalidRequestError(field, f"must be a list of strings, got {value!r}")
            return StructuredOutput.choice(list(value))
        if not isinstance(value, str):
            raise InvalidRequestError(field, f"must be a string, got {type(value).__name__}")
        return StructuredOutput(StructuredOutputKind.REGEX if kind == "regex" else StructuredOutputKind.GRAMMAR, value)


@dataclass(frozen=True)
class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's name for StructuredOutputsParams before 0.10 (`SamplingParams(guided_decoding=...)`), with its
    `backend`: accepted and not read, since one grammar engine (llguidance) runs every constraint."""

    backend: str | None = None


def _parsed_schema(value: Any, field: str) -> dict | bool:
    """A JSON schema given as a dict, a boolean schema or JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as error:
            raise InvalidRequestError(field, f"is not valid JSON: {error}") from None
    if not isinstance(value, (dict, bool)):
        raise InvalidRequestError(field, f"must be a JSON schema (a dict or its JSON text), got {value!r}")
    return value


def _listed(value: Any, field: str) -> list:
    try:
        return list(value)
    except TypeError:
        raise InvalidRequestError(field, f"must be a list of strings, got {value!r}") from None


_ESCAPE = re.compile(r"\\\\|\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})")
"""An escaped backslash (kept, so that the `u` after it is not read as an escape), or a \\uXXXX or
\\UXXXXXXXX escape."""


def grammar_as_lark(grammar: str, any_to_lark: Callable[[str], str]) -> str:
    """A request's `grammar` (a Lark grammar, or a GBNF / EBNF one: llama.cpp's, what xgrammar and vLLM's
    offline examples take) as a Lark grammar; InvalidRequestError naming `grammar` if it is neither.
    `any_to_lark` is llguidance's converter (llguidance.gbnf_to_lark.any_to_lark), passed in by its two
    callers, the router and the offline LLM, since common/ imports no llguidance: both convert alike."""
    try:
        return any_to_lark(_without_unicode_escapes(grammar))
    except Exception as error:  # GbnfToLarkError, and a bare Exception for some inputs (no root rule)
        raise InvalidRequestError("grammar", f"is not a valid GBNF grammar: {error}") from None


def _without_unicode_escapes(grammar: str) -> str:
    """`grammar` with its \\uXXXX and \\UXXXXXXXX escapes (GBNF's, in literals and character classes)
    as llguidance reads them: \\xHH below 0x100, else the character itself (it has no meaning to the
    syntax). llguidance's GBNF converter writes \\u0041 as \\u41 and keeps \\U0001F600, both of which
    its Lark lexer refuses. A surrogate or an out-of-range escape stays as written (and is refused)."""
    def replace(match: re.Match) -> str:
        digits = match.group(1) or match.group(2)
        if digits is None:
            return match.group(0)
        code_point = int(digits, 16)
        if code_point < 0x100:
            return f"\\x{code_point:02x}"
        if code_point > 0x10FFFF or 0xD800 <= code_point <= 0xDFFF:
            return match.group(0)
        return chr(code_point)
    return _ESCAPE.sub(replace, grammar)


def one_of_as_any_of(schema: Any) -> Any:
    """`schema` with each `oneOf` written as `anyOf`, which the grammar engine enforces (its own oneOf
    takes only alternatives it proves exclusive, and no `$ref` among them: not pydantic's discriminated
    unions). Exact only for discriminated alternatives (a value matches at most one of them, so "any
    of" is "exactly one of"): _check_schema refuses every other oneOf before this runs."""
    if not isinstance(schema, dict):
        return schema
    return {("anyOf" if keyword == "oneOf" else keyword): _map_subschemas(keyword, value, one_of_as_any_of)
            for keyword, value in schema.items()}


def _map_subschemas(keyword: str, value: Any, rewrite: Callable[[Any], Any]) -> Any:
    """A keyword's value with `rewrite` applied to each subschema it holds (none: value as it is)."""
    if keyword in SCHEMA_VALUED:
        return rewrite(value)
    if keyword in SCHEMA_MAP_VALUED and isinstance(value, dict):
        return {name: rewrite(child) for name, child in value.items()}
    if keyword in SCHEMA_LIST_VALUED and isinstance(value, list):
        return [rewrite(child) for child in value]
    return value


def closed_objects(schema: Any) -> Any:
    """`schema` with `"additionalProperties": false` added to every (sub)schema that lists
    `properties` and says nothing of `additionalProperties`: its objects get only the keys it lists.

    vLLM's default grammar backend (xgrammar, strict mode) does this, as does its guidance backend
    with disable_additional_properties; a client writes `"additionalProperties": true` (or a schema)
    to allow other keys. Without it, a weak model takes the open object's way out and writes keys
    of its own until max_tokens.

    A schema with an intersection anywhere (`allOf` of two or more subschemas) is left as written:
    closing each part would refuse the keys the other parts list (only unevaluatedProperties, which
    the grammar engine lacks, closes an intersection), and a part may be a `$ref` to a definition."""
    return schema if _has_intersection(schema) else _closed(schema)


def _has_intersection(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return True
    return any(_has_intersection(child) for _, child in _subschemas(schema, ""))


def _closed(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    closed = {keyword: _map_subschemas(keyword, value, _closed) for keyword, value in schema.items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _json_grammar(schema: Any) -> str:
    schema = {**schema, "x-guidance": JSON_OPTIONS} if isinstance(schema, dict) else schema
    return json.dumps({"grammars": [{"name": "json_schema", "json_schema": schema, "lark_grammar": None}]})


def _lark_grammar(lark: str) -> str:
    return json.dumps({"grammars": [{"name": "lark", "json_schema": None, "lark_grammar": lark}]})


def _lark_regex(regex: str) -> str:
    """A Lark regex token of `regex`: its unescaped slashes (Lark's delimiter) escaped, escapes kept
    as they are (what llguidance's own regex grammars do)."""
    out: list[str] = []
    escaped = False
    for char in regex:
        out.append("\\/" if char == "/" and not escaped else char)
        escaped = char == "\\" and not escaped
    return "/" + "".join(out) + "/"


# ---- checks (cheap, torch-free: the grammar engine's own validation runs on the router) -------

def _check_nothing(spec: str) -> None:
    if spec:
        raise InvalidRequestError("json_object", "takes no spec")


def _check_non_empty(kind: str):
    def check(spec: str) -> None:
        if not spec:
            raise InvalidRequestError(kind, "must not be empty")
    return check


def _check_choice(spec: str) -> None:
    choices = _parse(spec, "choice")
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise InvalidRequestError("choice", "must be a non-empty list of non-empty strings")


def _check_schema(spec: str) -> None:
    schema = _parse(spec, "json_schema")
    for path, construct in unsupported_constructs(schema):
        raise InvalidRequestError("json_schema", f"unsupported {construct} at {path or '/'}")
    for path, subschema in _all_subschemas(schema, ""):
        if "oneOf" in subschema and ("anyOf" in subschema or _discriminator(subschema["oneOf"], schema) is None):
            raise InvalidRequestError("json_schema", f"unsupported keyword 'oneOf' at {path or '/'}: {ONE_OF_RULE}")


def _all_subschemas(schema: Any, path: str) -> Iterator[tuple[str, dict]]:
    """(JSON pointer, subschema) of the schema and each object subschema in it, depth first."""
    if isinstance(schema, dict):
        yield path, schema
        for child_path, child in _subschemas(schema, path):
            yield from _all_subschemas(child, child_path)


def _discriminator(alternatives: Any, root: Any) -> str | None:
    """The property that tells the alternatives apart, if one does: every object an alternative allows
    (through `$ref`s to local definitions, and nested `oneOf` / `anyOf`: a union of unions) requires
    it, with values (a `const`, an `enum`: a Literal of one or several values) that no other
    alternative allows, so no value matches two of them. None otherwise."""
    if not isinstance(alternatives, list) or not alternatives:
        return None
    leaves = [_object_leaves(alternative, root) for alternative in alternatives]
    if None in leaves:
        return None
    required = frozenset.intersection(*(frozenset(name for name in leaf["required"] if isinstance(name, str))
                                        for group in leaves for leaf in group))
    for name in sorted(required):
        tags = [_tag_values(group, name, root) for group in leaves]
        if None not in tags and sum(map(len, tags)) == len(frozenset().union(*tags)):  # pairwise disjoint
            return name
    return None


def _object_leaves(schema: Any, root: Any) -> list[dict] | None:
    """The object schemas (type object, with `required` and `properties`) one of which every value
    `schema` allows matches: schema itself, or those its `oneOf` / `anyOf` alternatives reach, each
    followed through local `$ref`s, each schema once (a union shared or reached again adds nothing).
    None if some value it allows need match none of them, or more than MAX_UNION_SCHEMAS are reached."""
    leaves: list[dict] = []
    seen: set[int] = set()
    pending = [schema]
    while pending:
        node = _resolved(pending.pop(), root)
        if not isinstance(node, dict) or len(seen) >= MAX_UNION_SCHEMAS:
            return None
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.get("type") == "object" and isinstance(node.get("required"), list) and isinstance(
                node.get("properties"), dict):
            leaves.append(node)
            continue
        alternatives = node.get("oneOf", node.get("anyOf"))  # with both, a value matches one of each
        if not isinstance(alternatives, list) or not alternatives:
            return None
        pending.extend(alternatives)
    return leaves


def _tag_values(leaves: list[dict], name: str, root: Any) -> frozenset[str] | None:
    """The values (canonical JSON) property `name`, which each of the object schemas `leaves` requires,
    may have in them, where each lists its values; else None."""
    values = [_allowed_values(leaf["properties"].get(name), root) for leaf in leaves]
    return None if None in values else frozenset().union(*values)


def _allowed_values(schema: Any, root: Any) -> frozenset[str] | None:
    """The values (canonical JSON) a property schema allows, where it lists them: a `const`, an
    `enum`, or a `$ref` to a definition that does (an enum type by reference); None otherwise."""
    for candidate in (schema, _resolved(schema, root)):
        if isinstance(candidate, dict) and "const" in candidate:
            return frozenset({_canonical(candidate["const"])})
        if isinstance(candidate, dict) and isinstance(candidate.get("enum"), list):
            return frozenset(map(_canonical, candidate["enum"]))
    return None


def _canonical(value: Any) -> str:
    """value's JSON text, equal for equal JSON values (keys sorted; 1.0 written 1, as the number 1)."""
    return json.dumps(_integral(value), sort_keys=True)


def _integral(value: Any) -> Any:
    """value with every integral float in it written as an int (1.0 and 1 are one JSON number)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(item) for item in value]
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    return value


def _resolved(schema: Any, root: Any) -> Any:
    """The definition a `$ref` subschema names in root (its siblings only narrow it), else schema;
    None for a reference that does not resolve."""
    for _ in range(MAX_SCHEMA_DEPTH):  # a chain of references, bounded (a cycle resolves to None)
        if not (isinstance(schema, dict) and isinstance(schema.get("$ref"), str)):
            return schema
        schema = _pointed(root, schema["$ref"])
    return None


def _pointed(root: Any, reference: str) -> Any:
    """The value `#/a/b` (a JSON pointer in a fragment) names in root; None if none."""
    if not reference.startswith("#"):
        return None
    value = root
    for token in filter(None, reference[1:].split("/")):
        token = token.replace("~1", "/").replace("~0", "~")
        if not isinstance(value, dict) or token not in value:
            return None
        value = value[token]
    return value


def _parse(spec: str, kind: str) -> Any:
    try:
        return json.loads(spec)
    except (ValueError, RecursionError) as error:  # RecursionError: nested deeper than the decoder goes
        raise InvalidRequestError(kind, f"is not valid JSON: {error}") from None


_CHECKS = {
    StructuredOutputKind.JSON_OBJECT: _check_nothing,
    StructuredOutputKind.JSON_SCHEMA: _check_schema,
    StructuredOutputKind.REGEX: _check_non_empty("regex"),
    StructuredOutputKind.CHOICE: _check_choice,
    StructuredOutputKind.GRAMMAR: _check_non_empty("grammar"),
}


def unsupported_constructs(schema: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, str]]:
    """(JSON pointer, what) of each construct outside the supported subset, depth first: a keyword,
    a type or format it does not know, a $ref outside the schema, a subschema that is not one."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        yield path, f"subschema of type {type(schema).__name__} (must be an object or a boolean)"
        return
    if depth > MAX_SCHEMA_DEPTH:
        yield path, f"nesting deeper than {MAX_SCHEMA_DEPTH}"
        return
    for keyword in sorted(set(schema) - SUPPORTED_KEYWORDS):
        yield path, f"keyword {keyword!r}"
    yield from _bad_values(schema, path)
    for child_path, child in _subschemas(schema, path):
        yield from unsupported_constructs(child, child_path, depth + 1)


def _bad_values(schema: dict, path: str) -> Iterator[tuple[str, str]]:
    types = schema.get("type", [])
    for name in [types] if isinstance(types, str) else types if isinstance(types, list) else [types]:
        if not (isinstance(name, str) and name in JSON_TYPES):
            yield f"{path}/type", f"type {name!r}"
    if "format" in schema and not (isinstance(schema["format"], str) and schema["format"] in FORMATS):
        yield f"{path}/format", f"format {schema['format']!r}"
    minimum = schema.get("minProperties")
    if isinstance(minimum, (int, float)) and not isinstance(minimum, bool) and minimum > MAX_MIN_PROPERTIES:
        yield f"{path}/minProperties", (f"minProperties {json.dumps(minimum)} (at most {MAX_MIN_PROPERTIES}: the "
                                        "grammar engine may write an additionalProperties or patternProperties key "
                                        "twice and count it twice, where a JSON parser keeps one)")
    for keyword in NUMERIC_KEYWORDS:
        if isinstance(schema.get(keyword), bool):  # draft 4 or 2020-12 (true: the bound 1)? Say which.
            yield f"{path}/{keyword}", (f"{keyword} {json.dumps(schema[keyword])} (a number is expected: draft 4's "
                                        "boolean exclusiveMinimum / exclusiveMaximum is written as the bound itself "
                                        "since draft 6)")
        yield from _inexact_numbers(schema.get(keyword), f"{path}/{keyword}")
    yield from _inexact_numbers(schema.get("enum"), f"{path}/enum")
    yield from _inexact_numbers(schema.get("const"), f"{path}/const")
    if "$ref" in schema and not (isinstance(schema["$ref"], str) and schema["$ref"].startswith("#")):
        yield f"{path}/$ref", f"$ref {schema['$ref']!r} (only references inside the schema, '#...')"


def _inexact_numbers(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(JSON pointer, what) of each number in value (a keyword's value, or an enum's or const's JSON
    value at any depth) that the grammar engine would not write or compare exactly."""
    if isinstance(value, list):
        for index, item in enumerate(value):
            yield from _inexact_numbers(item, f"{path}/{index}")
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _inexact_numbers(item, f"{path}/{_pointer_token(name)}")
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and not _is_exact(value):
        yield path, (f"number {value!r} (numbers must be finite integers within +-2**53, or decimals of at most "
                     f"{MAX_SIGNIFICANT_DIGITS} significant digits and {MAX_FRACTION_DIGITS} after the point)")


def _is_exact(number: int | float) -> bool:
    if isinstance(number, int):
        return abs(number) <= MAX_EXACT_INTEGER
    if not math.isfinite(number):
        return False
    _, digits, exponent = decimal.Decimal(repr(number)).normalize().as_tuple()
    return len(digits) <= MAX_SIGNIFICANT_DIGITS and -exponent <= MAX_FRACTION_DIGITS


def _pointer_token(name: str) -> str:
    """A property name as one JSON pointer token (RFC 6901): "a/b" is a~1b, so a path names one place."""
    return name.replace("~", "~0").replace("/", "~1")


def _subschemas(schema: dict, path: str) -> Iterator[tuple[str, Any]]:
    for keyword in SCHEMA_VALUED & schema.keys():
        yield f"{path}/{keyword}", schema[keyword]
    for keyword in SCHEMA_MAP_VALUED & schema.keys():
        children = schema[keyword]
        if not isinstance(children, dict):
            yield f"{path}/{keyword}", None
            continue
        for name, child in children.items():
            yield f"{path}/{keyword}/{_pointer_token(name)}", child
    for keyword in SCHEMA_LIST_VALUED & schema.keys():
        children = schema[keyword]
        for index, child in enumerate(children if isinstance(children, list) else [None]):
            yield f"{path}/{keyword}/{index}", child
