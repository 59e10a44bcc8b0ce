"""Tool calling at the OpenAI front, request side: a chat request's `tools` and `tool_choice`
parsed into one typed ToolCalling, the tool calls of an assistant message in the chat's history,
and the grammar a forced tool choice constrains generation to (vLLM's, through the structured
output engine).

`tool_choice` (vLLM's semantics):
- "none": the model answers in text (the tools are still rendered into the prompt);
- "auto" (the default when tools are given): the model decides; its output is split into text and
  calls by the server's tool call parser (router/tool_parsers.py), which the server must be started
  with (router.enable_auto_tool_choice and router.tool_call_parser), else a 400;
- "required": the output is constrained to a JSON array of one or more {"name", "parameters"}
  objects, each naming one of the tools and holding arguments its parameters schema accepts;
- {"type": "function", "function": {"name": NAME}}: the output is constrained to NAME's
  parameters schema, and is that call's arguments.
"""

from __future__ import annotations

import copy
import enum
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from splitserve.common.chat_template import parse_call_arguments
from splitserve.common.errors import InvalidRequestError, json_excerpt
from splitserve.common.structured_output import StructuredOutput
from splitserve.router.request_limits import RequestLimits
from splitserve.router.structured_output import STRUCTURED_OUTPUT_FIELDS, check_grammar

TOOL_CALL_ID_PREFIX = "chatcmpl-tool-"
GRAMMAR_FIELDS = tuple(field for field in STRUCTURED_OUTPUT_FIELDS if field != "response_format")
"""The structured output fields a forced tool choice refuses: vLLM's explicit grammars, which the
forced call's grammar would silently replace. `response_format` is not one: it shapes a text reply,
which a forced call does not make, so it is checked and then has no effect on that turn (OpenAI
and vLLM take the pair; the Agents SDK sends it for an agent with an output_type and a
tool_choice, and keeps it when it resets the choice to "auto" for the next turn)."""
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
"""The parameters schema of a function that declares none or sends `{}` (what vLLM constrains
both to): `{}` alone would accept any JSON value, and a call's arguments are an object."""
_DEFINITION_KEYWORDS = ("$defs", "definitions")
"""Where a schema keeps the subschemas its `$ref`s name ("#/$defs/X"): "required"'s combined schema
hoists each tool's to its own root, where those references then resolve."""


def make_tool_call_id() -> str:
    """A new call's id, in vLLM's form: chatcmpl-tool- and 32 hex digits."""
    return f"{TOOL_CALL_ID_PREFIX}{uuid.uuid4().hex}"


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"
    """{"type": "function", "function": {"name": ...}}: ToolCalling.function_name."""


@dataclass(frozen=True)
class FunctionTool:
    """One entry of `tools`, validated."""

    name: str
    parameters: Mapping[str, Any] | None
    """The arguments' JSON schema as sent; None: the function declares none."""
    definition: Mapping[str, Any]
    """The tool as the client sent it ({"type": "function", "function": {...}}): what the chat
    template renders (the Hugging Face convention for `tools`)."""


@dataclass(frozen=True)
class ToolCalling:
    """A chat request's tools and what it asks of them."""

    tools: tuple[FunctionTool, ...]
    choice: ToolChoice
    function_name: str | None = None
    """The function a NAMED choice forces; None otherwise."""
    parallel_tool_calls: bool = True
    """False: at most one call per choice ("required" is constrained to one, "auto" keeps the first)."""

    def template_tools(self) -> tuple[Mapping[str, Any], ...]:
        return tuple(tool.definition for tool in self.tools)

    def constraint(self) -> StructuredOutput | None:
        """The grammar a forced choice generates under (None for none and auto); its schema checked
        by the grammar engine: InvalidRequestError naming the tool's parameters otherwise."""
        if self.choice == ToolChoice.NAMED:
            index, tool = next((i, t) for i, t in enumerate(self.tools) if t.name == self.function_name)
            return _checked(StructuredOutput.json_schema, _parameters(tool), f"tools[{index}].function.parameters")
        if self.choice == ToolChoice.REQUIRED:
            for index, tool in enumerate(self.tools):  # each first, so that a 400 names the tool
                _checked(StructuredOutput.json_schema, _parameters(tool), f"tools[{index}].function.parameters")
            return _checked(StructuredOutput.json_schema, self._required_schema(), "tools")
        return None

    def _required_schema(self) -> dict[str, Any]:
        """vLLM's schema for "required": an array of {"name": <a tool's name>, "parameters": <its
        arguments>} objects (no other keys), with every tool's definitions hoisted to the root."""
        definitions: dict[str, dict[str, Any]] = {}
        variants = []
        for index, tool in enumerate(self.tools):
            parameters = copy.deepcopy(_parameters(tool))
            _hoist_definitions(parameters, definitions, f"tools[{index}].function.parameters")
            variants.append({"type": "object", "properties": {"name": {"enum": [tool.name]}, "parameters": parameters},
                             "required": ["name", "parameters"], "additionalProperties": False})
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        schema.update(definitions)
        return schema


def _parameters(tool: FunctionTool) -> Mapping[str, Any]:
    return tool.parameters or EMPTY_PARAMETERS


def _hoist_definitions(parameters: dict[str, Any], into: dict[str, dict[str, Any]], field: str) -> None:
    for keyword in _DEFINITION_KEYWORDS:
        for name, schema in parameters.pop(keyword, {}).items():
            known = into.setdefault(keyword, {})
            if known.get(name, schema) != schema:
                raise InvalidRequestError(field, f"defines {keyword}/{name} differently from another tool "
                                                 "(tool_choice \"required\" puts every tool's definitions together)")
            known[name] = schema


def _checked(build, schema: Any, field: str) -> StructuredOutput:
    try:
        constraint = build(schema)
        check_grammar(constraint)
        return constraint
    except InvalidRequestError as error:
        raise InvalidRequestError(field, str(error)) from None


# ---- parsing ----------------------------------------------------------------------------------

def parse_tool_calling(body: Mapping[str, Any], limits: RequestLimits) -> ToolCalling | None:
    """The request's tools and tool_choice (None when it has neither); InvalidRequestError naming
    the field otherwise. A forced choice's grammar is checked by ToolCalling.constraint."""
    tools = parse_tools(body, limits)
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", f"must be a boolean, got {parallel!r}")
    if tools is None:
        return None
    if choice in (ToolChoice.NAMED, ToolChoice.REQUIRED):
        given = [field for field in GRAMMAR_FIELDS if body.get(field) is not None]
        if given:
            forced = "naming a function" if choice == ToolChoice.NAMED else "\"required\""
            raise InvalidRequestError(given[0], f"cannot be combined with tool_choice {forced}, which constrains the "
                                                "output itself (use tool_choice \"auto\" or \"none\")")
    return ToolCalling(tools, choice, name, parallel)


def parse_tools(body: Mapping[str, Any], limits: RequestLimits) -> tuple[FunctionTool, ...] | None:
    """The request's `tools` (None when absent or empty: clients send `[]` for "no tools", and vLLM
    took it so until 0.32, which refuses it as OpenAI does), each validated; InvalidRequestError naming the entry."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", f"must be a list of function tools, got {json_excerpt(tools)}")
    if not tools:
        return None
    limits.check_tools(len(tools), len(json.dumps(tools, separators=(",", ":"), default=str).encode()))
    parsed = tuple(_tool(tool, f"tools[{index}]") for index, tool in enumerate(tools))
    names = [tool.name for tool in parsed]
    for index, name in enumerate(names):
        if name in names[:index]:
            raise InvalidRequestError(f"tools[{index}].function.name", f"{name!r} names two tools")
    return parsed


def _tool(tool: Any, field: str) -> FunctionTool:
    if not isinstance(tool, dict):
        raise InvalidRequestError(field, f"must be an object {{\"type\": \"function\", \"function\": {{...}}}}, got "
                                         f"{json_excerpt(tool)}")
    if tool.get("type", "function") != "function":
        raise InvalidRequestError(f"{field}.type", f"must be \"function\" (the only tool type), got {tool['type']!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{field}.function", f"must be an object with a name, got {json_excerpt(function)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(f"{field}.function.name", f"must be a non-empty string, got {name!r}")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise InvalidRequestError(f"{field}.function.description", "must be a string")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(f"{field}.function.parameters", f"must be a JSON schema object, got "
                                                                  f"{json_excerpt(parameters)}")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidRequestError(f"{field}.function.strict", f"must be a boolean, got {function['strict']!r}")
    return FunctionTool(name, parameters, tool)


def _tool_choice(value: Any, tools: tuple[FunctionTool, ...] | None) -> tuple[ToolChoice, str | None]:
    """(choice, forced function name); the default is auto with tools, none without (vLLM's)."""
    if value is None:
        return (ToolChoice.AUTO if tools else ToolChoice.NONE), None
    if value == "none":
        return ToolChoice.NONE, None
    if tools is None:
        raise InvalidRequestError("tool_choice", "needs tools (send the tools it chooses from)")
    if value in ("auto", "required"):
        return ToolChoice(value), None
    usage = "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}"
    if not isinstance(value, dict):
        raise InvalidRequestError("tool_choice", f"{usage}, got {json_excerpt(value)}")
    if value.get("type", "function") != "function":
        raise InvalidRequestError("tool_choice.type", f"must be \"function\", got {value['type']!r}")
    function = value.get("function")
    if not isinstance(function, dict):
        raise InvalidRequestError("tool_choice.function", f"{usage}, got {json_excerpt(value)}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError("tool_choice.function.name", f"must be a non-empty string, got {name!r}")
    if name not in {tool.name for tool in tools}:
        raise InvalidRequestError("tool_choice.function.name", f"{name!r} is not one of the tools")
    return ToolChoice.NAMED, name


@dataclass(frozen=True)
class HistoryToolCall:
    """A call in an assistant message of the chat's history."""

    id: str
    name: str
    arguments: Any
    """The arguments parsed from their JSON text: chat templates iterate them (vLLM and transformers
    pass them as a mapping)."""

    def template_value(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_history_tool_calls(value: Any, field: str) -> tuple[HistoryToolCall, ...]:
    """An assistant message's `tool_calls`; InvalidRequestError naming the entry otherwise."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidRequestError(field, f"must be a list of tool calls, got {json_excerpt(value)}")
    return tuple(_history_call(call, f"{field}[{index}]") for index, call in enumerate(value))


def _history_call(call: Any, field: str) -> HistoryToolCall:
    if not isinstance(call, dict):
        raise InvalidRequestError(field, f"must be an object {{id, type, function}}, got {json_excerpt(call)}")
    if call.get("type", "function") != "function":
        raise InvalidRequestError(f"{field}.type", f"must be \"function\", got {call['type']!r}")
    call_id = call.get("id", "")
    if not isinstance(call_id, str):
        raise InvalidRequestError(f"{field}.id", f"must be a string, got {call_id!r}")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(f"{field}.function", f"must be an object with a string name, got "
                                                       f"{json_excerpt(function)}")
    arguments = parse_call_arguments(function.get("arguments"), f"{field}.function")
    return HistoryToolCall(call_id, function["name"], arguments)
