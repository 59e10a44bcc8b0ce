"""Real-world JSON schemas, as users send them for structured output: what pydantic v2's
`model_json_schema()` emits for typical models, OpenAI strict-mode schemas, tool definitions of
LangChain / instructor / the OpenAI Agents SDK, JSON Schema 2020-12 keywords and odd corners.

ACCEPTED: schemas the grammar engine enforces (every output that ends must validate with
`jsonschema`); REFUSED: schemas with a keyword it does not enforce, refused before generation
with the construct named (the expected message after the field's name).
"""

from __future__ import annotations

import datetime
import enum
import uuid
from dataclasses import dataclass
from decimal import Decimal
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AnyUrl, BaseModel, Field, IPvAnyAddress, Json, conint, constr
from typing_extensions import TypeAliasType

from splitserve.common.structured_output import ONE_OF_RULE


@dataclass(frozen=True)
class CorpusSchema:
    name: str
    """What the schema is (a test id)."""
    schema: Any
    """The JSON schema (a dict, or a boolean schema)."""
    runs_long: bool = False
    """It allows a value without bound (a number's digits, a string, an open object's keys) where the
    default model, sampling at temperature 1.0, may spend all of max_tokens: no output need end."""


@dataclass(frozen=True)
class RefusedSchema:
    name: str
    schema: Any
    message: str
    """The 400's message after the field name (`json_schema: unsupported ...`)."""


# ---- pydantic v2 models -----------------------------------------------------------------------

class Address(BaseModel):
    street: str = Field(max_length=20, description="Street and number")
    city: str = Field(max_length=12)
    zip_code: constr(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    """A person with an address ($defs / $ref) and an optional nickname (anyOf with null)."""
    name: str = Field(max_length=16, title="Full name")
    age: conint(ge=0, le=130)
    nickname: Optional[str] = Field(default=None, max_length=8)
    address: Address


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Paint(BaseModel):
    color: Color
    finish: Literal["matte", "gloss"]
    kind: Literal["paint"] = "paint"
    coats: int = Field(default=2, ge=1, le=4)


class Team(BaseModel):
    """A dict: its keys are strings without bound."""
    name: str = Field(max_length=10)
    members: list[Address] = Field(min_length=1, max_length=2)
    scores: dict[str, Annotated[int, Field(ge=0, le=9)]]


class TreeNode(BaseModel):
    """Recursive: a tree of labelled nodes."""
    label: str = Field(max_length=6)
    children: list["TreeNode"] = Field(default_factory=list, max_length=2)


class Cat(BaseModel):
    pet_type: Literal["cat"]
    lives: conint(ge=1, le=9)


class Dog(BaseModel):
    pet_type: Literal["dog"]
    good: bool


class Owner(BaseModel):
    """A discriminated union: oneOf with a discriminator mapping."""
    pet: Annotated[Union[Cat, Dog], Field(discriminator="pet_type")]


class Circle(BaseModel):
    kind: Literal["circle", "round"]
    radius: conint(ge=1, le=9)


class Square(BaseModel):
    kind: Literal["square"]
    side: conint(ge=1, le=9)


class Drawing(BaseModel):  # a discriminated union whose branch has a Literal of two values (an enum)
    shape: Annotated[Union[Circle, Square], Field(discriminator="kind")]


class Text(BaseModel):
    type: Literal["content"]
    format: Literal["text", "markdown"]
    body: str = Field(max_length=12)


class Image(BaseModel):
    type: Literal["content"]
    format: Literal["png"]
    width: conint(ge=1, le=512)


class Ping(BaseModel):
    type: Literal["ping"]


class Message(BaseModel):  # a union (by `type`) of a union (by `format`) and a model: oneOf in a oneOf
    part: Annotated[Union[Annotated[Union[Text, Image], Field(discriminator="format")], Ping],
                    Field(discriminator="type")]


Pet = TypeAliasType("Pet", Annotated[Union[Cat, Dog], Field(discriminator="pet_type")])
"""A named discriminated union: a $def of its own (a oneOf), reached by $ref."""


class Robot(BaseModel):
    pet_type: Literal["robot", "drone"]
    battery: conint(ge=0, le=100)


class Kennel(BaseModel):  # a discriminated union, in a list, of a $ref'd discriminated union (Pet) and a model
    residents: list[Annotated[Union[Pet, Robot], Field(discriminator="pet_type")]] = Field(min_length=1, max_length=2)


class Inventory(BaseModel):  # a dict with a key pattern and bounds; other keys stay open (JSON Schema: no
    # additionalProperties), so it may run long
    counts: dict[constr(pattern=r"^[a-z]{1,4}$"), conint(ge=0, le=9)] = Field(min_length=1, max_length=2)


class PlainUnion(BaseModel):
    """An undiscriminated union: anyOf."""
    value: Union[int, bool, Annotated[str, Field(max_length=5)]]


class Event(BaseModel):
    """Formats; a duration's digits are without bound."""
    id: uuid.UUID
    day: datetime.date
    at: datetime.datetime
    duration: datetime.timedelta


class Reading(BaseModel):
    sensor: constr(pattern=r"^[A-Z]{2}-[0-9]{3}$")
    value: float = Field(ge=-50, le=50, multiple_of=0.5)
    ok: bool


class Pair(BaseModel):
    """A tuple: prefixItems."""
    point: tuple[int, int]


class Extraction(BaseModel):
    """instructor's typical response_model: a list of small models with descriptions."""
    entities: list[Annotated[str, Field(max_length=10)]] = Field(max_length=3, description="Named entities")
    sentiment: Literal["positive", "negative", "neutral"]
    confidence: float = Field(ge=0, le=1)


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Ticket(BaseModel):
    """An IntEnum by $ref, an optional list, a Decimal (anyOf number / string), a URL."""
    level: Level
    tags: Optional[list[Annotated[str, Field(max_length=6)]]] = Field(default=None, max_length=2)
    price: Decimal
    link: AnyUrl


class Host(BaseModel):
    """pydantic's own formats (`ipvanyaddress`, and Json's contentMediaType): refused below."""
    address: IPvAnyAddress
    settings: Json[int]


def _pydantic_schemas() -> list[CorpusSchema]:
    models = [Person, Paint, Team, TreeNode, Owner, Drawing, Message, Kennel, Inventory, PlainUnion, Event, Reading,
              Pair, Extraction, Ticket]
    return [CorpusSchema(f"pydantic_{model.__name__}", model.model_json_schema(),
                         runs_long=model in (Team, Event, Inventory))
            for model in models]


# ---- written literally --------------------------------------------------------------------------

STRING_OR_NULL = {"type": ["string", "null"], "maxLength": 12}

OPENAI_STRICT = [
    CorpusSchema("openai_strict_calendar_event", {
        "type": "object", "additionalProperties": False, "required": ["name", "date", "participants"],
        "properties": {"name": {"type": "string", "maxLength": 20}, "date": {"type": "string", "format": "date"},
                       "participants": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                        "maxItems": 3}}}),
    CorpusSchema("openai_strict_nullable_type_arrays", {
        "type": "object", "additionalProperties": False, "required": ["city", "zip", "unit"],
        "properties": {"city": STRING_OR_NULL, "zip": {"type": ["integer", "null"], "minimum": 0, "maximum": 99999},
                       "unit": {"type": ["string", "null"], "enum": ["c", "f", None]}}}),
    CorpusSchema("openai_strict_math_steps", {
        "type": "object", "additionalProperties": False, "required": ["steps", "final_answer"],
        "properties": {"steps": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "additionalProperties": False, "required": ["explanation", "output"],
            "properties": {"explanation": {"type": "string", "maxLength": 20},
                           "output": {"type": "string", "maxLength": 10}}}},
            "final_answer": {"type": "string", "maxLength": 10}}}),
    CorpusSchema("openai_strict_recursive_ui", {
        "type": "object", "additionalProperties": False, "required": ["type", "label", "children"],
        "properties": {"type": {"type": "string", "enum": ["div", "button", "field"]},
                       "label": {"type": "string", "maxLength": 8},
                       "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#"}}}}),
    CorpusSchema("openai_strict_defs_anyof", {
        "type": "object", "additionalProperties": False, "required": ["item"],
        "properties": {"item": {"anyOf": [{"$ref": "#/$defs/user"}, {"$ref": "#/$defs/address"}]}},
        "$defs": {"user": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                           "properties": {"name": {"type": "string", "maxLength": 8},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 99}}},
                  "address": {"type": "object", "additionalProperties": False, "required": ["number", "street"],
                              "properties": {"number": {"type": "string", "maxLength": 4},
                                             "street": {"type": "string", "maxLength": 12}}}}}),
]

TOOL_PARAMETERS = [
    CorpusSchema("langchain_tool_multiply", {  # convert_to_openai_tool of a @tool with int arguments
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}),
    CorpusSchema("langchain_tool_search_with_default", {
        "type": "object", "properties": {
            "query": {"type": "string", "maxLength": 16, "description": "search query to look up"},
            "max_results": {"type": "integer", "default": 5, "minimum": 1, "maximum": 10}},
        "required": ["query"]}),
    CorpusSchema("agents_sdk_strict_function", {  # function_tool's strict schema: every property required
        "type": "object", "additionalProperties": False, "required": ["city", "days"], "title": "get_forecast_args",
        "properties": {"city": {"type": "string", "title": "City", "maxLength": 10},
                       "days": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 7}, {"type": "null"}],
                                "title": "Days"}}}),
    CorpusSchema("instructor_user_info", {
        "type": "object", "title": "UserInfo", "required": ["name", "age"],
        "properties": {"name": {"type": "string", "title": "Name", "maxLength": 12},
                       "age": {"type": "integer", "title": "Age", "minimum": 0, "maximum": 120}}}),
    CorpusSchema("tool_no_parameters", {"type": "object", "properties": {}}),
]

ODD_ONES = [
    CorpusSchema("empty_schema", {}, runs_long=True),
    CorpusSchema("true_schema", True, runs_long=True),
    CorpusSchema("type_array_scalar", {"type": ["integer", "boolean", "null"]}),
    CorpusSchema("mixed_type_enum", {"enum": ["a", 1, True, None, 2.5, {"k": "v"}, [1, 2]]}),
    CorpusSchema("large_enum", {"enum": [f"item_{i:04d}" for i in range(1500)]}),
    CorpusSchema("const_object", {"const": {"version": 2, "tags": ["x"]}}),
    CorpusSchema("array_of_enums_bounded", {"type": "array", "items": {"enum": ["x", "y", 3]}, "minItems": 2,
                                            "maxItems": 4}),
    CorpusSchema("number_bounds_exclusive", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1,
                                             "multipleOf": 0.25}),
    CorpusSchema("string_formats", {
        "type": "object", "required": ["ip", "host", "email", "time", "link", "at"], "additionalProperties": False,
        "properties": {"ip": {"type": "string", "format": "ipv4"}, "host": {"type": "string", "format": "hostname",
                                                                              "maxLength": 12},
                       "email": {"type": "string", "format": "email", "maxLength": 20},
                       "time": {"type": "string", "format": "time"},
                       "link": {"type": "string", "format": "uri", "maxLength": 24},
                       "at": {"type": "string", "format": "date-time"}}}),
    CorpusSchema("allof_intersection", {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
        runs_long=True),  # an intersection stays open: other keys may follow
    CorpusSchema("definitions_draft7_ref", {
        "$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"id": {"type": "integer", "minimum": 0,
                                                                                     "maximum": 999}},
        "type": "object", "properties": {"ids": {"type": "array", "items": {"$ref": "#/definitions/id"},
                                                 "maxItems": 3}}, "required": ["ids"]}),
    CorpusSchema("pattern_properties_closed", {  # each key matches one of the (disjoint) patterns
        "type": "object", "patternProperties": {"^x_[a-z]{1,3}$": {"type": "integer", "minimum": 0, "maximum": 9},
                                                "^[0-9]{2}$": {"type": "boolean"}},
        "additionalProperties": False, "minProperties": 1, "maxProperties": 3}),
    CorpusSchema("additional_properties_schema", {
        "type": "object", "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}),
]


def _deeply_nested(depth: int) -> dict:
    schema: dict = {"type": "integer", "minimum": 0, "maximum": 9}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    return schema


ODD_ONES.append(CorpusSchema("nested_20_levels", _deeply_nested(20)))

ACCEPTED: list[CorpusSchema] = [*_pydantic_schemas(), *OPENAI_STRICT, *TOOL_PARAMETERS, *ODD_ONES]

_OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}}

REFUSED: list[RefusedSchema] = [
    RefusedSchema("unevaluated_properties", {**_OBJECT, "unevaluatedProperties": False},
                  "json_schema: unsupported keyword 'unevaluatedProperties' at /"),
    RefusedSchema("if_then_else", {**_OBJECT, "if": {"required": ["a"]}, "then": {"required": ["b"]},
                                   "else": {"required": ["c"]}},
                  "json_schema: unsupported keyword 'else' at /"),
    RefusedSchema("dependent_required", {**_OBJECT, "dependentRequired": {"a": ["b"]}},
                  "json_schema: unsupported keyword 'dependentRequired' at /"),
    RefusedSchema("min_properties_2", {"type": "object", "additionalProperties": {"type": "integer"},
                                       "minProperties": 2},
                  "json_schema: unsupported minProperties 2 (at most 1: the grammar engine may write an "
                  "additionalProperties or patternProperties key twice and count it twice, where a JSON parser keeps "
                  "one) at /minProperties"),
    RefusedSchema("max_properties_beside_optional_properties", {
        "type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "integer"},
        "maxProperties": 3},  # llguidance bounds only the keys beyond those `properties` lists, all required
                  'json_schema: min/maxProperties only supported when all keys listed in "properties" are required'),
    RefusedSchema("pattern_properties_overlapping", {"type": "object", "patternProperties": {
        "^x": {"type": "integer"}, "y$": {"type": "string"}}},  # "xy" matches both
                  "json_schema: patternProperty regexes /^x/ and /y$/ are not disjoint"),
    RefusedSchema("unique_items", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
                  "json_schema: unsupported keyword 'uniqueItems' at /"),
    RefusedSchema("contains", {"type": "array", "contains": {"const": 1}},
                  "json_schema: unsupported keyword 'contains' at /"),
    RefusedSchema("property_names", {"type": "object", "propertyNames": {"maxLength": 3}},
                  "json_schema: unsupported keyword 'propertyNames' at /"),
    RefusedSchema("not", {"properties": {"a": {"not": {"type": "null"}}}},
                  "json_schema: unsupported keyword 'not' at /properties/a"),
    RefusedSchema("one_of_overlapping", {"properties": {"n": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}},
                  f"json_schema: unsupported keyword 'oneOf' at /properties/n: {ONE_OF_RULE}"),
    RefusedSchema("one_of_tags_shared", {"$defs": {  # "b" is a tag of both alternatives
        "A": {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"]},
        "B": {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}},
        "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]},
                  f"json_schema: unsupported keyword 'oneOf' at /: {ONE_OF_RULE}"),
    RefusedSchema("pydantic_secret_str_format", {"type": "object", "properties": {"token": {
        "type": "string", "format": "password", "writeOnly": True}}},
                  "json_schema: unsupported format 'password' at /properties/token/format"),
    RefusedSchema("pydantic_bytes_format", {"type": "object", "properties": {"data": {"type": "string",
                                                                                   "format": "binary"}}},
                  "json_schema: unsupported format 'binary' at /properties/data/format"),
    RefusedSchema("pydantic_ip_any_address_and_json", Host.model_json_schema(),
                  "json_schema: unsupported format 'ipvanyaddress' at /properties/address/format"),
    RefusedSchema("remote_ref", {"$ref": "https://example.com/schemas/address.json"},
                  "json_schema: unsupported $ref 'https://example.com/schemas/address.json' (only references inside "
                  "the schema, '#...') at /$ref"),
    RefusedSchema("draft4_boolean_exclusive_minimum", {"type": "number", "minimum": 0, "exclusiveMinimum": True},
                  "json_schema: unsupported exclusiveMinimum true (a number is expected: draft 4's boolean "
                  "exclusiveMinimum / exclusiveMaximum is written as the bound itself since draft 6) at "
                  "/exclusiveMinimum"),
    RefusedSchema("required_not_in_closed_properties", {  # a typo in `required`: the object is closed
        "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name", "nmae"]},
                  "json_schema: Unsatisfiable schema: required property 'nmae' is unsatisfiable"),
    RefusedSchema("closed_allof_intersection", {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}],
        "additionalProperties": False},  # no property is allowed beside allOf: unsatisfiable, as written
                  "json_schema: Unsatisfiable schema: required property 'a' is unsatisfiable"),
]
