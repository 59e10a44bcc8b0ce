"""The OpenAI Responses API's wire format (POST /v1/responses), over the chat path.

A request is translated into the chat request that asks for the same generation (instructions
first as a system message, input items as chat messages, Responses' flat function tools in the
chat's nesting, text.format as response_format, max_output_tokens as max_completion_tokens) and
parsed by the chat endpoint's parser, so both endpoints validate, template, constrain and call
tools alike; an InvalidRequestError it raises is renamed to the Responses field it came from.
Fields that ask for what this server does not have (stored responses, background mode,
built-in tools, extra output data) are refused with a 400 naming them.

A response's output is its text read through the chat's reasoning parser (router/reasoning_parsers.py,
with --reasoning-parser) and tool call parser (router/tool_parsers.py): a `reasoning` item for the
reasoning (its text as one reasoning_text content part; no summary, as vLLM), then a `message` item
for the content and a `function_call` item per call. The streamed events and
the non-streamed response come from one ResponsesRenderer fed the same chunks, so a stream
accumulates to the response (a call that turns malformed aside: ResponsesRenderer.response).
This module is the HTTP edge: JSON dicts exist only here.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitserve.common.chat_template import parse_call_arguments
from splitserve.common.errors import InvalidRequestError, json_excerpt
from splitserve.common.generation_config import NO_REQUEST_DEFAULTS, RequestDefaults
from splitserve.router.api_types import StreamChunk, Usage
from splitserve.router.openai_fields import Refused, refuse_unsupported
from splitserve.router.openai_protocol import ChatCompletionRequest, ResponseHeader, _refuse_null, parse_chat_request
from splitserve.router.reasoning_parsers import ReasoningDelta, ReasoningOutput, ReasoningParser
from splitserve.router.request_limits import RequestLimits
from splitserve.router.tool_calling import ToolChoice
from splitserve.router.tool_parsers import OutputDelta, OutputParser, ToolCallDelta, ToolOutput

_NOT_STORED = "responses are not stored (send the whole conversation as input)"
RESPONSES_REFUSED = (
    Refused("previous_response_id", (), _NOT_STORED),
    Refused("conversation", (), _NOT_STORED),
    Refused("store", (False,), f"{_NOT_STORED}; send store false or leave it out"),
    Refused("background", (False,), "no background mode (responses are not stored)"),
    Refused("prompt", (), "stored prompt templates are not implemented"),
    Refused("include", ([],), "no extra output data (logprobs, reasoning, tool sources) is implemented"),
    Refused("top_logprobs", (0,), "logprobs are not implemented on this endpoint"),
    Refused("truncation", ("disabled",), "a conversation longer than the context is refused, never truncated"),
    Refused("max_tool_calls", (), "not implemented"),
    Refused("service_tier", ("auto", "default"), "one service tier",
            'one of "auto", "default", "flex", "scale" or "priority"'),  # vLLM's Literal, without null
    Refused("stream_options", ({}, {"include_obfuscation": False}), "stream obfuscation is not implemented"),
    Refused("background_options", (), "no background mode (responses are not stored)"),
    Refused("context_management", ([],), "no context compaction"),
    Refused("moderation", (), "no moderation"),
    Refused("access_programs", (), "not implemented"),
    Refused("image", (), "text models only"),
    # vLLM's extensions of its own Responses endpoint
    Refused("previous_input_messages", (), _NOT_STORED),
    Refused("enable_response_messages", (False,), "not implemented", "a boolean"),
)
"""Responses fields that ask for behaviour this server does not have unless left at their default."""
RESPONSES_HANDLED = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "stream", "metadata", "reasoning",
    # No effect on the output, by definition: end-user ids for abuse monitoring, and prompt caching
    # hints (the prefix cache is automatic).
    "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
})
"""The OpenAI Responses fields this endpoint implements (with PASSED_TO_CHAT's vLLM extensions)."""
PASSED_TO_CHAT = ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "user",
                  # vLLM's extensions that its Responses endpoint also takes: the chat parser implements
                  # them, or refuses them as it does on the chat endpoint
                  "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "stop",
                  "stop_token_ids", "min_tokens", "ignore_eos", "skip_special_tokens", "request_id", "session_id",
                  "structured_outputs", "chat_template_kwargs", "logit_bias", "include_reasoning",
                  "include_stop_str_in_output", "watermarking", "priority", "cache_salt", "vllm_xargs",
                  "kv_transfer_params", "ec_transfer_params", "media_io_kwargs", "mm_processor_kwargs", "mm_payload",
                  "return_mm_kwargs")
"""Fields the chat request takes under the same name and meaning."""
_NULL_IS_DEFAULT = frozenset({"min_tokens"})
"""PASSED_TO_CHAT fields vLLM's chat model declares without null (null is a 400 there) but its Responses
model does not declare: null is left out, their default (vLLM ignores it)."""
_NON_NULL = (("tools", "a list of function tools"),
             ("tool_choice", 'one of "none", "auto", "required" or {"type": "function", "name": ...}'))
"""Fields vLLM's Responses model declares without null (`tools: list[Tool]`, `tool_choice: ToolChoice`) that the
chat model declares optional: null is a 400 here, as vLLM answers, though the chat endpoint takes it."""
_INPUT_ROLES = ("user", "system", "developer", "assistant")
"""A message item's roles: each is the chat message's role as it is (the chat endpoint hands a
developer message to the template as one, as vLLM does)."""
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
"""Content part types read as text, and the key holding it (an output message's refusal part, which
the openai SDK sends back, is its text, as the chat endpoint and vLLM read it)."""
_CHAT_FIELD_RENAMES = (("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"),
                       ("tool_choice.function.", "tool_choice."), ("reasoning_effort", "reasoning.effort"))
_CHAT_MESSAGE_FIELD = re.compile(r"messages\[(\d+)\]")
_CHAT_TOOL_FIELD = re.compile(r"tools\[(\d+)\]\.function")


@dataclass(frozen=True)
class ResponseSettings:
    """What a response object repeats of its request (OpenAI's echo of the request's settings)."""

    instructions: str | None
    max_output_tokens: int | None
    metadata: Mapping[str, str]
    tools: tuple[Mapping[str, Any], ...]
    """The function tools as sent (Responses' flat shape)."""
    text_format: Mapping[str, Any]
    """text.format as sent; {"type": "text"} when absent."""
    user: str | None
    reasoning: Mapping[str, Any] | None = None
    """The request's reasoning options as sent ({"effort", "summary"})."""


@dataclass(frozen=True)
class ResponsesRequest:
    """POST /v1/responses."""

    chat: ChatCompletionRequest
    """The chat request for the same generation (its max_tokens_param: whether max_output_tokens was set)."""
    settings: ResponseSettings


# ---- parsing --------------------------------------------------------------------------------

def parse_responses_request(body: Mapping[str, Any], limits: RequestLimits,
                            defaults: RequestDefaults = NO_REQUEST_DEFAULTS) -> ResponsesRequest:
    """`defaults`: the server's sampling defaults (--generation-config), as for a chat request."""
    refuse_unsupported(body, RESPONSES_REFUSED)
    for name, what in _NON_NULL:
        _refuse_null(body, name, what)
    messages, sources = _conversation(body)
    tools = _tools(body.get("tools"))
    text_format = _text_format(body.get("text"))
    chat_body: dict[str, Any] = {name: body[name] for name in PASSED_TO_CHAT
                                 if name in body and not (name in _NULL_IS_DEFAULT and body[name] is None)}
    chat_body.update(messages=messages, max_completion_tokens=body.get("max_output_tokens"))
    if tools:
        chat_body["tools"] = [_chat_tool(tool) for tool in tools]
    if body.get("tool_choice") is not None:
        chat_body["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if text_format["type"] != "text":
        chat_body["response_format"] = _chat_response_format(text_format)
    reasoning = _reasoning(body.get("reasoning"))
    if reasoning.get("effort") is not None:
        chat_body["reasoning_effort"] = reasoning["effort"]
    try:
        chat = parse_chat_request(chat_body, limits, defaults)
    except InvalidRequestError as error:
        raise error.renamed(_responses_field(error.field, sources)) from None
    return ResponsesRequest(chat, ResponseSettings(
        _optional_string(body, "instructions"), chat.sampling.max_tokens if chat.max_tokens_param else None,
        _metadata(body.get("metadata")), tuple(tools), text_format, _optional_string(body, "user"),
        reasoning or None))


REASONING_SUMMARIES = ("auto", "concise", "detailed")
"""OpenAI's reasoning.summary values (and its deprecated generate_summary's)."""


def _reasoning(value: Any) -> Mapping[str, Any]:
    """`reasoning`: its effort is the chat's reasoning_effort (a template variable, as in vLLM); a
    summary is accepted and not made (vLLM's: the reasoning item holds the whole reasoning instead)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError("reasoning", f"must be an object {{effort, summary}}, got {json_excerpt(value)}")
    unknown = sorted(value.keys() - {"effort", "summary", "generate_summary"})
    if unknown:
        raise InvalidRequestError(f"reasoning.{unknown[0]}", "is not a reasoning option (effort, summary)")
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None and value[key] not in REASONING_SUMMARIES:
            raise InvalidRequestError(f"reasoning.{key}", f"must be one of {', '.join(REASONING_SUMMARIES)}, got "
                                                          f"{json_excerpt(value[key])}")
    return value


def _optional_string(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise InvalidRequestError(name, f"must be a string, got {json_excerpt(value)}")
    return value


def _metadata(value: Any) -> Mapping[str, str]:
    if value is None:
        return {}
    if not (isinstance(value, dict) and all(isinstance(v, str) for v in value.values())):
        raise InvalidRequestError("metadata", f"must be an object of strings, got {json_excerpt(value)}")
    return value


def _responses_field(chat_field: str, sources: Sequence[str]) -> str:
    """The Responses field a chat request's field came from: messages[i] -> its input item (or
    instructions), tools[i].function.x -> tools[i].x, and the renamed fields."""
    message = _CHAT_MESSAGE_FIELD.match(chat_field)
    if message is not None:
        return sources[int(message[1])]
    if chat_field == "messages":
        return "input"
    chat_field = _CHAT_TOOL_FIELD.sub(r"tools[\1]", chat_field)
    for chat_name, name in _CHAT_FIELD_RENAMES:
        if chat_field.startswith(chat_name):
            return name + chat_field[len(chat_name):]
    return chat_field


def _conversation(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(the chat messages, the Responses field each came from): the instructions as a system
    message, then the input. Consecutive function_call items join the assistant message before
    them (one assistant turn that called several tools, as the chat format has it)."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    instructions = _optional_string(body, "instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
        sources.append("instructions")
    value = body.get("input")
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}], [*sources, "input"]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input", f"must be a string or a non-empty list of input items, got "
                                           f"{json_excerpt(value)}")
    for index, item in enumerate(value):
        _add_item(item, f"input[{index}]", messages, sources)
    return messages, sources


def _add_item(item: Any, field: str, messages: list[dict[str, Any]], sources: list[str]) -> None:
    if not isinstance(item, dict):
        raise InvalidRequestError(field, f"must be an input item object, got {json_excerpt(item)}")
    kind = item.get("type", "message")
    if kind == "message":
        message = _message_item(item, field)
        if message["role"] == "assistant" and _open_turn(messages, "content"):
            messages[-1]["content"] = message["content"]
            return
        messages.append(message)
    elif kind == "reasoning":
        reasoning = _reasoning_item(item, field)
        if _open_turn(messages, "reasoning"):
            messages[-1]["reasoning"] = reasoning
            return
        messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
    elif kind == "function_call":
        call = _function_call_item(item, field)
        if messages and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("tool_calls", []).append(call)
            return
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _item_string(item, "call_id", field),
                         "content": _text(item.get("output"), f"{field}.output")})
    else:
        raise InvalidRequestError(f"{field}.type", "only message, reasoning, function_call and function_call_output "
                                                   f"items are supported, got {json_excerpt(kind)}")
    sources.append(field)


def _open_turn(messages: list[dict[str, Any]], key: str) -> bool:
    """Whether the last message is an assistant turn without `key` yet: one turn's reasoning, text and
    calls come as separate output items, which join one assistant message (as vLLM joins them)."""
    return bool(messages) and messages[-1]["role"] == "assistant" and messages[-1].get(key) is None


def _reasoning_item(item: Mapping[str, Any], field: str) -> str:
    """An earlier response's reasoning item: its reasoning_text parts (else its summary's text,
    as vLLM reads it), joined with newlines; the assistant message's `reasoning`."""
    if item.get("encrypted_content"):
        raise InvalidRequestError(f"{field}.encrypted_content", "is not supported (this server never encrypts "
                                                                "reasoning; send its content)")
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise InvalidRequestError(f"{field}.{key}", f"must be a list of {{type, text}} parts, got "
                                                        f"{json_excerpt(parts)}")
        if parts:
            return "\n".join(part["text"] for part in parts)
    return ""


def _message_item(item: Mapping[str, Any], field: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _INPUT_ROLES:
        raise InvalidRequestError(f"{field}.role", f"must be one of {', '.join(_INPUT_ROLES)}, got "
                                                   f"{json_excerpt(role)}")
    return {"role": role, "content": _text(item.get("content"), f"{field}.content")}


def _text(content: Any, field: str) -> str | list[dict[str, str]]:
    """A string, or a list of _TEXT_PARTS as the chat's text parts (which it joins with newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(field, f"must be a string or a list of text parts, got {json_excerpt(content)}")
    parts = []
    for index, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None or not isinstance(part.get(key), str):
            raise InvalidRequestError(f"{field}[{index}]", "only input_text, output_text and refusal parts are "
                                                           f"supported (text models only), got {json_excerpt(part)}")
        parts.append({"type": "text", "text": part[key]})
    return parts


def _function_call_item(item: Mapping[str, Any], field: str) -> dict[str, Any]:
    """The chat's tool call of an earlier function_call output item (its arguments JSON text, read
    here: the chat's error would name the assistant message the call joined, not this item)."""
    arguments = item.get("arguments", "")
    if not isinstance(arguments, str):
        raise InvalidRequestError(f"{field}.arguments", f"must be a JSON string, got {json_excerpt(arguments)}")
    parse_call_arguments(arguments, field)
    return {"id": _item_string(item, "call_id", field), "type": "function",
            "function": {"name": _item_string(item, "name", field), "arguments": arguments}}


def _item_string(item: Mapping[str, Any], key: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{field}.{key}", f"must be a non-empty string, got {json_excerpt(value)}")
    return value


def _tools(value: Any) -> list[Mapping[str, Any]]:
    """The function tools; an empty list is none (the Agents SDK sends one for an agent without tools)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidRequestError("tools", f"must be a list of function tools, got {json_excerpt(value)}")
    for index, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise InvalidRequestError(f"tools[{index}]", f"must be a function tool object, got {json_excerpt(tool)}")
        kind = tool.get("type")
        if kind != "function":
            raise InvalidRequestError(f"tools[{index}].type", "only function tools are supported (built-in tools "
                                                              f"are not implemented), got {json_excerpt(kind)}")
    return value


def _chat_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(value: Any) -> Any:
    """"none" / "auto" / "required" as they are; {"type": "function", "name"} in the chat's nesting."""
    if not isinstance(value, dict):
        return value
    if value.get("type") != "function":
        raise InvalidRequestError("tool_choice.type", "must be \"function\" (built-in tools are not implemented), got "
                                                      f"{json_excerpt(value.get('type'))}")
    return {"type": "function", "function": {"name": value.get("name")}}


def _text_format(value: Any) -> Mapping[str, Any]:
    if value is None:
        return {"type": "text"}
    if not isinstance(value, dict):
        raise InvalidRequestError("text", f"must be an object, got {json_excerpt(value)}")
    if value.get("verbosity") not in (None, "medium"):
        raise InvalidRequestError("text.verbosity", f"is not supported by this server: not implemented (got "
                                                    f"{json_excerpt(value['verbosity'])})")
    text_format = value.get("format") or {"type": "text"}
    if not isinstance(text_format, dict) or text_format.get("type") not in ("text", "json_object", "json_schema"):
        raise InvalidRequestError("text.format", "must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", "
                                                 f"...}}, got {json_excerpt(text_format)}")
    return text_format


def _chat_response_format(text_format: Mapping[str, Any]) -> dict[str, Any]:
    """Responses' flat json_schema format in the chat's nesting."""
    if text_format["type"] == "json_object":
        return {"type": "json_object"}
    spec = {key: text_format[key] for key in ("name", "schema", "strict", "description") if key in text_format}
    return {"type": "json_schema", "json_schema": spec}


# ---- rendering ------------------------------------------------------------------------------

def usage_body(usage: Usage, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _MessageItem:
    """The output's text (its only content part)."""

    id: str
    text: list[str] = field(default_factory=list)

    def body(self, status: str) -> dict:
        return {"id": self.id, "type": "message", "status": status, "role": "assistant",
                "content": [self.part("".join(self.text))] if status != "in_progress" else []}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class _ReasoningItem:
    """The output's reasoning (one reasoning_text content part; no summary)."""

    id: str
    text: list[str] = field(default_factory=list)
    closed: bool = False
    """The reasoning ended before the output did (content or a call followed): the item is complete."""

    def body(self, status: str) -> dict:
        status = "completed" if self.closed else status
        return {"id": self.id, "type": "reasoning", "summary": [], "status": status,
                "content": [self.part("".join(self.text))] if status != "in_progress" else []}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "reasoning_text", "text": text}


@dataclass
class _CallItem:
    id: str
    call_id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    def body(self, status: str) -> dict:
        return {"id": self.id, "type": "function_call", "status": status, "call_id": self.call_id,
                "name": self.name, "arguments": "".join(self.arguments) if status != "in_progress" else ""}


class ResponsesRenderer:
    """One response's output items and events as its chunks arrive: reasoning opens a reasoning item
    (one reasoning_text part, closed as soon as the reasoning ends), text a message item (one
    output_text part), each call the tool output parser reads a function_call item, in the order
    they open. The last chunk (it has a finish reason) closes every item and the
    response (status "incomplete" when generation hit max_output_tokens or the context's end,
    as vLLM reports it, still in a response.completed event). Every event carries the next
    sequence number."""

    def __init__(self, header: ResponseHeader, chat: ChatCompletionRequest, settings: ResponseSettings,
                 tool_output: ToolOutput | None, reasoning_output: ReasoningOutput | None = None) -> None:
        self.header = header
        self.chat = chat
        self.settings = settings
        self.reasoning_output = reasoning_output
        self._parser: OutputParser | None = None if tool_output is None else tool_output.new_parser()
        self._reasoner: ReasoningParser | None = None if reasoning_output is None else reasoning_output.new_parser()
        self._items: list[_ReasoningItem | _MessageItem | _CallItem] = []
        """Output items in output order (an item's output_index is its position)."""
        self._reasoning: _ReasoningItem | None = None
        self._message: _MessageItem | None = None
        self._calls: dict[int, _CallItem] = {}
        """Call items by the parser's call index."""
        self._sequence_number = 0

    def opening_events(self) -> list[dict]:
        """response.created and response.in_progress: the response without output yet."""
        return [self._event("response.created", response=self._body("in_progress", None)),
                self._event("response.in_progress", response=self._body("in_progress", None))]

    def stream_events(self, chunk: StreamChunk) -> list[dict]:
        """The events that carry `chunk`; the last chunk's end with response.completed."""
        split = self._split(chunk)
        events = self._reasoning_events(split.reasoning) if split.reasoning else []
        last = chunk.finish_reason is not None
        delta = OutputDelta(split.content) if self._parser is None else self._parser.feed_piece(split.content, last)
        if (delta.content or delta.tool_calls) and self._reasoning is not None and not self._reasoning.closed:
            events += self._reasoning_done_events(self._reasoning, "completed")
            self._reasoning.closed = True
        events += self._content_events(delta.content) if delta.content else []
        for call in delta.tool_calls:
            events += self._call_events(call)
        if last:
            events += self._closing_events(chunk.finish_reason, chunk.usage)
        return events

    def response(self, choices: Sequence[Sequence[StreamChunk]], usage: Usage) -> dict:
        """The non-streamed response: the one choice's chunks fed as a stream would be, except an
        output that turned out malformed, which is one message of the whole text and no calls (the
        chat's non-streamed message, vLLM's): a stream keeps what it sent of the broken call."""
        [chunks] = choices
        last = dataclasses.replace(chunks[-1], usage=usage)
        for chunk in chunks[:-1]:
            self.stream_events(chunk)
        response = self.stream_events(last)[-1]["response"]
        if self._parser is None or not self._parser.malformed:
            return response
        as_text = ResponsesRenderer(self.header, self.chat, self.settings, None, self.reasoning_output)
        whole = dataclasses.replace(last, text="".join(c.text for c in chunks),
                                    token_ids=tuple(t for c in chunks for t in c.token_ids))
        return as_text.stream_events(whole)[-1]["response"]

    def _split(self, chunk: StreamChunk) -> ReasoningDelta:
        """The chunk's reasoning (none when it is not returned) and content."""
        if self._reasoner is None:
            return ReasoningDelta(content=chunk.text)
        split = self._reasoner.feed_piece(chunk.text, chunk.token_ids, last=chunk.finish_reason is not None)
        return split if self.reasoning_output.include_reasoning else ReasoningDelta(content=split.content)

    def _opened(self, item: _ReasoningItem | _MessageItem) -> list[dict]:
        """`item` joins the output: the events that add it and its one (empty) content part."""
        self._items.append(item)
        return [self._item_event("response.output_item.added", item, "in_progress"),
                self._event("response.content_part.added", **self._part_ids(item), part=type(item).part(""))]

    def _reasoning_events(self, text: str) -> list[dict]:
        events = []
        if self._reasoning is None:
            self._reasoning = _ReasoningItem(_new_item_id("rs"))
            events = self._opened(self._reasoning)
        self._reasoning.text.append(text)
        events.append(self._event("response.reasoning_text.delta", **self._part_ids(self._reasoning), delta=text))
        return events

    def _reasoning_done_events(self, item: _ReasoningItem, status: str) -> list[dict]:
        text = "".join(item.text)
        return [self._event("response.reasoning_text.done", **self._part_ids(item), text=text),
                self._event("response.content_part.done", **self._part_ids(item), part=_ReasoningItem.part(text)),
                self._item_event("response.output_item.done", item, status)]

    def _content_events(self, text: str) -> list[dict]:
        events = []
        if self._message is None:
            self._message = _MessageItem(_new_item_id("msg"))
            events = self._opened(self._message)
        self._message.text.append(text)
        events.append(self._event("response.output_text.delta", **self._part_ids(self._message), delta=text,
                                  logprobs=[]))
        return events

    def _call_events(self, delta: ToolCallDelta) -> list[dict]:
        events = []
        if delta.id is not None:
            # call_<hex>, as OpenAI's and vLLM's Responses APIs (the chat's call id is chatcmpl-tool-<hex>)
            item = self._calls[delta.index] = _CallItem(_new_item_id("fc"), _new_item_id("call"), delta.name or "")
            self._items.append(item)
            events.append(self._item_event("response.output_item.added", item, "in_progress"))
        item = self._calls[delta.index]
        if delta.arguments:
            item.arguments.append(delta.arguments)
            events.append(self._event("response.function_call_arguments.delta", **self._item_ids(item),
                                      delta=delta.arguments))
        return events

    def _closing_events(self, finish_reason: str, usage: Usage | None) -> list[dict]:
        status = "incomplete" if finish_reason == "length" else "completed"
        events = []
        for item in self._items:
            if isinstance(item, _ReasoningItem):
                if not item.closed:
                    events += self._reasoning_done_events(item, status)
                continue
            if isinstance(item, _MessageItem):
                text = "".join(item.text)
                events.append(self._event("response.output_text.done", **self._part_ids(item), text=text,
                                          logprobs=[]))
                events.append(self._event("response.content_part.done", **self._part_ids(item),
                                          part=_MessageItem.part(text)))
            else:
                events.append(self._event("response.function_call_arguments.done", **self._item_ids(item),
                                          name=item.name, arguments="".join(item.arguments)))
            events.append(self._item_event("response.output_item.done", item, status))
        events.append(self._event("response.completed", response=self._body(status, usage)))
        return events

    def _body(self, status: str, usage: Usage | None) -> dict:
        """The response object; its items have its status."""
        chat, settings, h = self.chat, self.settings, self.header
        return {
            "id": h.id, "object": "response", "created_at": h.created, "status": status, "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": settings.instructions, "max_output_tokens": settings.max_output_tokens,
            "metadata": dict(settings.metadata), "model": h.model,
            "output": [item.body(status) for item in self._items],
            "parallel_tool_calls": chat.tool_calling is None or chat.tool_calling.parallel_tool_calls,
            "previous_response_id": None, "reasoning": self._reasoning_echo(), "service_tier": "auto",
            "store": False,
            "temperature": chat.sampling.temperature, "text": {"format": dict(settings.text_format)},
            "tool_choice": self._tool_choice(), "tools": [dict(tool) for tool in settings.tools],
            "top_p": chat.sampling.top_p, "truncation": "disabled",
            "usage": None if usage is None else usage_body(usage, self._reasoning_tokens()),
            "user": settings.user,
        }

    def _reasoning_echo(self) -> dict | None:
        sent = self.settings.reasoning
        return None if sent is None else {"effort": sent.get("effort"), "summary": sent.get("summary")}

    def _reasoning_tokens(self) -> int:
        return 0 if self._reasoner is None else self._reasoner.reasoning_tokens

    def _tool_choice(self) -> str | dict:
        calling = self.chat.tool_calling
        if calling is None:  # no tools: OpenAI's default choice
            return "auto"
        if calling.choice == ToolChoice.NAMED:
            return {"type": "function", "name": calling.function_name}
        return calling.choice.value

    @property
    def next_sequence_number(self) -> int:
        """The sequence number of the stream's next event (an error event's)."""
        return self._sequence_number

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        return event

    def _item_event(self, kind: str, item: _ReasoningItem | _MessageItem | _CallItem, status: str) -> dict:
        return self._event(kind, output_index=self._items.index(item), item=item.body(status))

    def _item_ids(self, item: _ReasoningItem | _MessageItem | _CallItem) -> dict:
        return {"item_id": item.id, "output_index": self._items.index(item)}

    def _part_ids(self, item: _ReasoningItem | _MessageItem) -> dict:
        return {**self._item_ids(item), "content_index": 0}
