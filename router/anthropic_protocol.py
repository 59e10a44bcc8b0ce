"""Anthropic's Messages API wire format (POST /v1/messages, /v1/messages/count_tokens), over the chat path.

A request is translated into the chat request that asks for the same generation (the system prompt
first as a system message; a user message's tool_result blocks as tool messages before its text; an
assistant message's tool_use blocks as its tool calls and its thinking blocks as its reasoning;
tools as function tools, their input_schema as the parameters; tool_choice auto / any / tool / none
as auto / required / a named function / none; stop_sequences as stop) and parsed by the chat
endpoint's parser, so both endpoints validate, template, constrain and call tools alike; an
InvalidRequestError it raises is renamed to the Messages field it came from. Image and document
blocks, server tools and the fields of features this server lacks are refused with a 400 naming them.

A response's content is the output read through the chat's reasoning parser (thinking blocks, with
--reasoning-parser) and tool call parser (tool_use blocks): a block opens when the output switches
kind, in output order. The streamed events and the non-streamed message come from one
MessagesRenderer fed the same chunks, so the anthropic SDK's accumulation of a stream equals the
message (a call that turns malformed aside: MessagesRenderer.response). This module is the HTTP edge:
JSON dicts exist only here.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from splitserve.common.errors import ContextLengthExceededError, InvalidRequestError, json_excerpt
from splitserve.common.generation_config import NO_REQUEST_DEFAULTS, RequestDefaults
from splitserve.router.api_types import StreamChunk, Usage
from splitserve.router.openai_fields import Refused, refuse_unsupported
from splitserve.router.openai_protocol import ChatCompletionRequest, ChatMessage, parse_chat_request
from splitserve.router.reasoning_parsers import ReasoningDelta, ReasoningOutput, ReasoningParser
from splitserve.router.request_limits import RequestLimits
from splitserve.router.tool_parsers import OutputDelta, OutputParser, ToolCallDelta, ToolOutput

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


def is_messages_path(path: str) -> bool:
    """Whether a request to `path` gets Anthropic's error objects (the Messages API's paths)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


_NOT_IMPLEMENTED = "not implemented"
MESSAGES_REFUSED = (
    Refused("container", (), "no code execution containers"),
    Refused("mcp_servers", ([],), "no MCP connector (run the MCP client on your side and send its tools)"),
    Refused("output_format", (), "send output_config.format"),
)
"""Messages fields that ask for behaviour this server does not have unless left at their default."""
MESSAGES_HANDLED = frozenset({"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature",
                              "top_p", "top_k", "tools", "tool_choice", "thinking", "metadata", "output_config",
                              # No effect, by definition: a prompt caching hint (the prefix cache is automatic),
                              # and whom the request is attributed to.
                              "cache_control", "user_profile_id", "workspace_id",
                              # Accepted with no effect, as vLLM ignores them: requests for Anthropic's own service
                              # (its speed and capacity tiers, its region, its cache diagnostics) and for its
                              # server-side context editing, which Claude Code sends with every request (the
                              # conversation is served as sent: one longer than the context is a 400).
                              "speed", "service_tier", "inference_geo", "diagnostics", "context_management"})
"""The Anthropic Messages fields this endpoint implements (with PASSED_TO_CHAT's vLLM extensions)."""
PASSED_TO_CHAT = ("model", "temperature", "top_p", "top_k", "stream",
                  # the chat's sampling seed (vLLM's Messages request has none: it ignores one)
                  "seed",
                  # vLLM's extensions of its Messages request: the chat parser implements them, or refuses them
                  # as it does on the chat endpoint
                  "cache_salt", "chat_template_kwargs", "watermarking", "kv_transfer_params", "ec_transfer_params",
                  "vllm_xargs", "mm_payload", "return_mm_kwargs")
"""Fields the chat request takes under the same name and meaning."""
BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
"""Claude Code's first system block: a per-request hash that would make every prompt's prefix differ (and miss
the prefix cache); dropped, as vLLM drops it."""
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
"""Anthropic's tool_choice types as the chat's (and "tool": a named function)."""
_CHAT_FIELD_RENAMES = (("stop", "stop_sequences"), ("tool_choice.function.name", "tool_choice.name"),
                       ("reasoning_effort", "output_config.effort"), ("response_format", "output_config.format"))
_CHAT_MESSAGE_FIELD = re.compile(r"messages\[(\d+)\]")
_CHAT_TOOL_FIELDS = ((re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
                     (re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"))
"""A chat tool's fields as the Messages tool's (the chat nests them under `function`)."""
MIN_THINKING_BUDGET = 1024
"""Anthropic's smallest thinking.budget_tokens."""
INLINE_SYSTEM_PROBE = ({"role": "system", "content": "t"}, {"role": "user", "content": "t"},
                       {"role": "system", "content": "t"}, {"role": "user", "content": "t"})
"""A chat whose rendering tells whether a template takes a system message after the first message (vLLM's probe:
Qwen's templates refuse it)."""


# ---- parsing --------------------------------------------------------------------------------

def parse_messages_request(body: Mapping[str, Any], limits: RequestLimits,
                           defaults: RequestDefaults = NO_REQUEST_DEFAULTS) -> ChatCompletionRequest:
    """The chat request that asks for the generation a Messages request asks for. `defaults`: the
    server's sampling defaults (--generation-config), as for a chat request."""
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise InvalidRequestError("max_tokens", f"is required: an integer >= 1, got {json_excerpt(max_tokens)}")
    _metadata(body.get("metadata"))
    chat, sources = _chat_body(body, max_tokens)
    return _parsed_chat({**chat, "max_tokens": max_tokens}, sources, limits, defaults)


def parse_count_tokens_request(body: Mapping[str, Any], limits: RequestLimits) -> ChatCompletionRequest:
    """The chat request whose rendered prompt /v1/messages/count_tokens counts (what a Messages request
    with the same model, system, messages, tools and thinking would run)."""
    chat, sources = _chat_body(body, None)
    return _parsed_chat(chat, sources, limits, NO_REQUEST_DEFAULTS)


def _parsed_chat(chat_body: Mapping[str, Any], sources: Sequence[str], limits: RequestLimits,
                 defaults: RequestDefaults) -> ChatCompletionRequest:
    """The chat parser's request; its errors named by the Messages field they came from (`sources`: each chat
    message's)."""
    try:
        return parse_chat_request(chat_body, limits, defaults)
    except InvalidRequestError as error:
        raise error.renamed(_messages_field(error.field, sources)) from None


def _chat_body(body: Mapping[str, Any], max_tokens: int | None) -> tuple[dict[str, Any], list[str]]:
    """(the chat body less max_tokens, the Messages field each of its messages came from); `max_tokens`: the
    request's, which a thinking budget must stay under (None: count_tokens has none)."""
    refuse_unsupported(body, MESSAGES_REFUSED)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequestError("model", f"is required: a non-empty string, got {json_excerpt(model)}")
    messages, sources = _conversation(body)
    chat: dict[str, Any] = {name: body[name] for name in PASSED_TO_CHAT if name in body}
    chat["messages"] = messages
    stop = body.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list):
            raise InvalidRequestError("stop_sequences", f"must be a list of strings, got {json_excerpt(stop)}")
        chat["stop"] = stop
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequestError("tools", f"must be a list of tools, got {json_excerpt(tools)}")
        chat["tools"] = [_chat_tool(tool, f"tools[{index}]") for index, tool in enumerate(tools)]
    chat.update(_chat_tool_choice(body.get("tool_choice")))
    chat.update(_output_config(body.get("output_config")))
    if _thinking(body.get("thinking"), max_tokens) == "disabled":
        chat["reasoning_effort"] = "none"
    return chat, sources


def _output_config(value: Any) -> dict[str, Any]:
    """output_config: its effort as the chat's reasoning_effort (a template variable, as in vLLM), its
    format (a JSON schema) as the chat's json_schema response_format."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequestError("output_config", f"must be an object {{effort, format}}, got {json_excerpt(value)}")
    chat: dict[str, Any] = {}
    if value.get("effort") is not None:
        chat["reasoning_effort"] = value["effort"]
    output_format = value.get("format")
    if output_format is not None:
        if not isinstance(output_format, dict) or output_format.get("type") != "json_schema":
            raise InvalidRequestError("output_config.format", 'must be {"type": "json_schema", "schema": {...}}, got '
                                                              f"{json_excerpt(output_format)}")
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "output", "schema": output_format.get("schema")}}
    return chat


def _metadata(value: Any) -> None:
    """`metadata`: {"user_id": an opaque end-user id}, accepted with no effect (as vLLM)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidRequestError("metadata", f"must be an object, got {json_excerpt(value)}")
    user_id = value.get("user_id")
    if user_id is not None and not isinstance(user_id, str):
        raise InvalidRequestError("metadata.user_id", f"must be a string, got {json_excerpt(user_id)}")


def _thinking(value: Any, max_tokens: int | None) -> str | None:
    """thinking's type: "disabled" turns a reasoning model's thinking off (vLLM's reasoning_effort "none");
    the others leave the model as it is ("enabled"'s budget_tokens is checked, not enforced)."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("enabled", "disabled", "adaptive", "between_tools"):
        raise InvalidRequestError("thinking", 'must be {"type": "enabled", "budget_tokens": N}, {"type": "adaptive"}, '
                                              f'{{"type": "between_tools"}} or {{"type": "disabled"}}, got '
                                              f"{json_excerpt(value)}")
    if value["type"] == "enabled":
        budget = value.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
            raise InvalidRequestError("thinking.budget_tokens", f"must be an integer >= {MIN_THINKING_BUDGET}, got "
                                                                f"{json_excerpt(budget)}")
        if max_tokens is not None and budget >= max_tokens:
            raise InvalidRequestError("thinking.budget_tokens", f"must be less than max_tokens ({max_tokens}), got "
                                                                f"{budget}")
    return value["type"]


def _messages_field(chat_field: str, sources: Sequence[str]) -> str:
    """The Messages field a chat request's field came from: messages[i] -> the message or block it came
    from (or system), tools[i].function.parameters -> tools[i].input_schema, and the renamed fields."""
    message = _CHAT_MESSAGE_FIELD.match(chat_field)
    if message is not None:
        return sources[int(message[1])]
    for pattern, name in _CHAT_TOOL_FIELDS:
        if pattern.match(chat_field):
            return pattern.sub(name, chat_field)
    for chat_name, name in _CHAT_FIELD_RENAMES:
        if chat_field.startswith(chat_name):
            return name + chat_field[len(chat_name):]
    return chat_field


def _conversation(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(the chat messages, the Messages field each came from): the system prompt as a system message,
    then each message's."""
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    system = _system(body.get("system"), "system")
    if system:
        messages.append({"role": "system", "content": system})
        sources.append("system")
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("messages", f"must be a non-empty list of {{role, content}} objects, got "
                                              f"{json_excerpt(value)}")
    for index, message in enumerate(value):
        for chat_message, source in _chat_messages(message, f"messages[{index}]"):
            messages.append(chat_message)
            sources.append(source)
    return messages, sources


def _system(value: Any, field: str) -> str | list[dict[str, str]] | None:
    """A system prompt: a string, or text blocks (as text parts), less Claude Code's billing header."""
    if value is None or isinstance(value, str):
        return None if value is not None and value.startswith(BILLING_HEADER_PREFIX) else value
    if not isinstance(value, list):
        raise InvalidRequestError(field, f"must be a string or a list of text blocks, got {json_excerpt(value)}")
    texts = [_text_block(block, f"{field}[{index}]") for index, block in enumerate(value)]
    return [{"type": "text", "text": text} for text in texts if not text.startswith(BILLING_HEADER_PREFIX)]


def has_inline_system(chat: ChatCompletionRequest) -> bool:
    """Whether a system message follows the first message."""
    return any(message.role == "system" for message in chat.messages[1:])


def merged_inline_system(chat: ChatCompletionRequest) -> ChatCompletionRequest:
    """The chat with its system messages merged into one first, their non-empty texts joined by blank lines (the
    chat's rule for developer messages): for a template that refuses a system message after the first (vLLM's
    fallback; every new reminder then changes the prompt's prefix, which misses the prefix cache)."""
    texts = [message.content for message in chat.messages if message.role == "system" and message.content]
    others = tuple(message for message in chat.messages if message.role != "system")
    return dataclasses.replace(chat, messages=(ChatMessage("system", "\n\n".join(texts)), *others))


def _text_block(block: Any, field: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise InvalidRequestError(field, f'must be a text block {{"type": "text", "text": ...}}, got '
                                         f"{json_excerpt(block)}")
    if not isinstance(block.get("text"), str):
        raise InvalidRequestError(f"{field}.text", f"must be a string, got {json_excerpt(block.get('text'))}")
    return block["text"]


def _chat_messages(message: Any, field: str) -> list[tuple[dict[str, Any], str]]:
    """One Messages message as chat messages, each with the field it came from: a user message's tool
    results become tool messages ahead of its text (the order Anthropic requires of the blocks). A system
    message (Claude Code sends its reminders so, as vLLM serves them) is a chat system message where it is
    (merged_inline_system moves it for a template that wants the system prompt first)."""
    if not isinstance(message, dict):
        raise InvalidRequestError(field, f"must be an object {{role, content}}, got {json_excerpt(message)}")
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise InvalidRequestError(f"{field}.role", f'must be "user", "assistant" or "system", got '
                                                   f"{json_excerpt(role)}")
    content = message.get("content")
    if role == "system":
        text = _system(content, f"{field}.content")
        return [({"role": "system", "content": text}, field)] if text else []
    if isinstance(content, str):
        return [({"role": role, "content": content}, field)]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{field}.content", f"must be a string or a list of content blocks, got "
                                                      f"{json_excerpt(content)}")
    if role == "user":
        return _user_messages(content, field)
    return [(_assistant_message(content, field), field)]


def _block_type(block: Any, field: str, allowed: tuple[str, ...]) -> str:
    if not isinstance(block, dict):
        raise InvalidRequestError(field, f"must be a content block object, got {json_excerpt(block)}")
    kind = block.get("type")
    if kind in ("image", "document"):
        raise InvalidRequestError(f"{field}.type", f"{kind} blocks are not supported: this server serves text models "
                                                   "only (send the content as text)")
    if kind not in allowed:
        raise InvalidRequestError(f"{field}.type", f"must be one of {', '.join(allowed)} here, got "
                                                   f"{json_excerpt(kind)}")
    return kind


def _user_messages(blocks: list[Any], field: str) -> list[tuple[dict[str, Any], str]]:
    results: list[tuple[dict[str, Any], str]] = []
    texts: list[dict[str, str]] = []
    for index, block in enumerate(blocks):
        block_field = f"{field}.content[{index}]"
        if _block_type(block, block_field, ("text", "tool_result")) == "text":
            texts.append({"type": "text", "text": _text_block(block, block_field)})
        else:
            results.append((_tool_message(block, block_field), block_field))
    if texts or not results:
        results.append(({"role": "user", "content": texts}, field))
    return results


def _tool_message(block: Mapping[str, Any], field: str) -> dict[str, Any]:
    """A tool_result block as the chat's tool message (its is_error flag has no chat form, as in vLLM)."""
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise InvalidRequestError(f"{field}.tool_use_id", f"must be a non-empty string, got {json_excerpt(call_id)}")
    content = block.get("content", "")
    if isinstance(content, list):
        content = [{"type": "text", "text": _tool_result_text(part, f"{field}.content[{index}]")}
                   for index, part in enumerate(content)]
    elif not isinstance(content, str):
        raise InvalidRequestError(f"{field}.content", f"must be a string or a list of text blocks, got "
                                                      f"{json_excerpt(content)}")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _tool_result_text(block: Any, field: str) -> str:
    _block_type(block, field, ("text",))
    return _text_block(block, field)


def _assistant_message(blocks: list[Any], field: str) -> dict[str, Any]:
    """An assistant turn: its text blocks as the content's parts, its tool_use blocks as its tool calls,
    its thinking blocks as its reasoning (redacted thinking has no text: skipped, as in vLLM)."""
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for index, block in enumerate(blocks):
        block_field = f"{field}.content[{index}]"
        kind = _block_type(block, block_field, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text":
            texts.append({"type": "text", "text": _text_block(block, block_field)})
        elif kind == "tool_use":
            calls.append(_tool_call(block, block_field))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise InvalidRequestError(f"{block_field}.thinking", "must be a string")
            reasoning.append(block["thinking"])
    message: dict[str, Any] = {"role": "assistant", "content": texts if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    return message


def _tool_call(block: Mapping[str, Any], field: str) -> dict[str, Any]:
    for name in ("id", "name"):
        if not isinstance(block.get(name), str) or not block[name]:
            raise InvalidRequestError(f"{field}.{name}", f"must be a non-empty string, got "
                                                         f"{json_excerpt(block.get(name))}")
    if not isinstance(block.get("input"), dict):
        raise InvalidRequestError(f"{field}.input", f"must be an object, got {json_excerpt(block.get('input'))}")
    return {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": block["input"]}}


def _chat_tool(tool: Any, field: str) -> dict[str, Any]:
    """A custom tool {name, description?, input_schema} as the chat's function tool."""
    if not isinstance(tool, dict):
        raise InvalidRequestError(field, f"must be a tool object {{name, description, input_schema}}, got "
                                         f"{json_excerpt(tool)}")
    if tool.get("type", "custom") not in ("custom", None):
        raise InvalidRequestError(f"{field}.type", "only custom tools {name, description, input_schema} are supported "
                                                   f"(Anthropic's server and client tools are not), got "
                                                   f"{json_excerpt(tool['type'])}")
    if not isinstance(tool.get("input_schema"), dict):
        raise InvalidRequestError(f"{field}.input_schema", f"is required: a JSON schema object, got "
                                                           f"{json_excerpt(tool.get('input_schema'))}")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    function.update({key: tool[key] for key in ("description", "strict") if key in tool})
    return {"type": "function", "function": function}


def _chat_tool_choice(value: Any) -> dict[str, Any]:
    """tool_choice (and disable_parallel_tool_use) as the chat's tool_choice and parallel_tool_calls."""
    if value is None:
        return {}
    if not isinstance(value, dict) or value.get("type") not in (*_TOOL_CHOICES, "tool"):
        raise InvalidRequestError("tool_choice", 'must be {"type": "auto" | "any" | "none"} or {"type": "tool", '
                                                 f'"name": ...}}, got {json_excerpt(value)}')
    chat: dict[str, Any] = {}
    if value["type"] == "tool":
        chat["tool_choice"] = {"type": "function", "function": {"name": value.get("name")}}
    else:
        chat["tool_choice"] = _TOOL_CHOICES[value["type"]]
    disable_parallel = value.get("disable_parallel_tool_use")
    if disable_parallel is not None:
        if not isinstance(disable_parallel, bool):
            raise InvalidRequestError("tool_choice.disable_parallel_tool_use", f"must be a boolean, got "
                                                                               f"{json_excerpt(disable_parallel)}")
        chat["parallel_tool_calls"] = not disable_parallel
    return chat


# ---- rendering ------------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 504: "timeout_error"}
"""Anthropic's error type by HTTP status (its API's table; 503, a server with no decode worker answering
or draining, is its overloaded_error, which its SDKs retry)."""


def error_body(status: int, message: str) -> dict:
    """Anthropic's error object; a status not in ERROR_TYPES is an invalid_request_error (4xx) or api_error."""
    error_type = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def prompt_too_long_message(error: ContextLengthExceededError) -> str:
    """Anthropic's words for a prompt the context cannot hold, "prompt is too long: N tokens > M maximum", which
    its clients match on (Claude Code compacts the conversation, LiteLLM raises ContextWindowExceededError); M is the
    most tokens a prompt may have. A prompt refused by its size in bytes (before it was tokenized) has no token
    count: its message follows the same prefix."""
    if error.num_tokens is None or error.max_prompt_tokens is None:
        return f"prompt is too long: {error}"
    return f"prompt is too long: {error.num_tokens} tokens > {error.max_prompt_tokens} maximum"


def usage_body(prompt_tokens: int, cached_tokens: int, output_tokens: int, cache_details: bool) -> dict:
    """Anthropic's usage. With `cache_details` (--enable-prompt-tokens-details), cache_read_input_tokens holds
    the prompt tokens the prefix cache served, and input_tokens the rest (Anthropic's split, vLLM's rule)."""
    if not cache_details:
        return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens,
            "output_tokens": output_tokens}


def new_tool_use_id() -> str:
    """A tool_use block's id, in Anthropic's form (toolu_ and 24 characters)."""
    return f"toolu_{uuid.uuid4().hex[:24]}"


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@dataclass
class _TextBlock:
    text: list[str] = field(default_factory=list)

    def start(self) -> dict:
        return {"type": "text", "text": ""}

    def body(self) -> dict:
        return {"type": "text", "text": "".join(self.text)}


@dataclass
class _ThinkingBlock:
    """The output's reasoning. Its signature is opaque to clients, who send it back with the block; here it
    is a random id (the server checks none), sent as the last delta as Anthropic sends it."""

    signature: str = field(default_factory=lambda: uuid.uuid4().hex)
    thinking: list[str] = field(default_factory=list)

    def start(self) -> dict:
        return {"type": "thinking", "thinking": "", "signature": ""}

    def body(self) -> dict:
        return {"type": "thinking", "thinking": "".join(self.thinking), "signature": self.signature}


@dataclass
class _ToolUseBlock:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    """The input's JSON text, as streamed."""

    def start(self) -> dict:
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": {}}

    def body(self) -> dict:
        """The input parsed; an input cut short (max_tokens, a stop sequence) is {}: it has no object form."""
        text = "".join(self.arguments)
        value = json.loads(text) if is_complete_json(text) else {}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": value if isinstance(value, dict) else {}}


_Block = _TextBlock | _ThinkingBlock | _ToolUseBlock


@dataclass(frozen=True)
class MessageHeader:
    """What a message repeats of its request."""

    id: str
    model: str
    prompt_tokens: int
    """The prompt's length (message_start's input_tokens, before the request's usage is known)."""
    cache_details: bool = False
    """Usage splits the prompt into input and cache_read_input_tokens (--enable-prompt-tokens-details)."""


def stop_reason(finish_reason: str, engine_stop_reason: int | str | None, called: bool,
                calls_complete: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of an output (vLLM's mapping): max_tokens for max_tokens or the end of the
    context; tool_use when it made complete calls; stop_sequence (and which) for a stop string, also one that
    cut a call short (that call must not run); tool_use for other calls; else end_turn (EOS, a stop token)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called and calls_complete:
        return "tool_use", None
    if isinstance(engine_stop_reason, str):
        return "stop_sequence", engine_stop_reason
    return ("tool_use" if called else "end_turn"), None


class MessagesRenderer:
    """One message's content blocks and stream events as its chunks arrive: reasoning opens a thinking block,
    text a text block, each call the tool output parser reads a tool_use block, closing the block before; the
    last chunk (it has a finish reason) closes the open block (after opening an empty text block when the
    output had none, the content Anthropic gives an empty output) and the message."""

    def __init__(self, header: MessageHeader, tool_output: ToolOutput | None,
                 reasoning_output: ReasoningOutput | None = None) -> None:
        self.header = header
        self.tool_output = tool_output
        self.reasoning_output = reasoning_output
        self._parser: OutputParser | None = None if tool_output is None else tool_output.new_parser()
        self._reasoner: ReasoningParser | None = None if reasoning_output is None else reasoning_output.new_parser()
        self._blocks: list[_Block] = []
        """Content blocks in output order (a block's index is its position)."""
        self._open: _Block | None = None
        self._calls: dict[int, _ToolUseBlock] = {}
        """tool_use blocks by the parser's call index."""

    def opening_events(self) -> list[dict]:
        """message_start: the message without content yet."""
        h = self.header
        return [{"type": "message_start", "message": {
            "id": h.id, "type": "message", "role": "assistant", "model": h.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": usage_body(h.prompt_tokens, 0, 0, h.cache_details)}}]

    def stream_events(self, chunk: StreamChunk) -> list[dict]:
        """The events that carry `chunk`; the last chunk's end with message_stop."""
        split = self._split(chunk)
        events = self._delta_events(_ThinkingBlock, split.reasoning) if split.reasoning else []
        last = chunk.finish_reason is not None
        delta = OutputDelta(split.content) if self._parser is None else self._parser.feed_piece(split.content, last)
        if delta.content:
            events += self._delta_events(_TextBlock, delta.content)
        for call in delta.tool_calls:
            events += self._call_events(call)
        if last:
            events += self._closing_events(chunk)
        return events

    def response(self, choices: Sequence[Sequence[StreamChunk]], usage: Usage) -> dict:
        """The non-streamed message: its one choice's chunks fed as a stream would be, except an output that
        turned out malformed, which is one text block of the whole text (the chat's non-streamed message,
        vLLM's): a stream keeps what it sent of the broken call."""
        [chunks] = choices
        last = dataclasses.replace(chunks[-1], usage=usage)
        for chunk in chunks[:-1]:
            self.stream_events(chunk)
        message = self._message(self.stream_events(last)[-2])  # the events end with message_delta, message_stop
        if self._parser is None or not self._parser.malformed:
            return message
        as_text = MessagesRenderer(self.header, None, self.reasoning_output)
        whole = dataclasses.replace(last, text="".join(c.text for c in chunks),
                                    token_ids=tuple(t for c in chunks for t in c.token_ids))
        return as_text._message(as_text.stream_events(whole)[-2])

    def _message(self, message_delta: dict) -> dict:
        h = self.header
        return {"id": h.id, "type": "message", "role": "assistant", "model": h.model,
                "content": [block.body() for block in self._blocks], **message_delta["delta"],
                "usage": message_delta["usage"]}

    def _split(self, chunk: StreamChunk) -> ReasoningDelta:
        """The chunk's reasoning (none when it is not returned) and content."""
        if self._reasoner is None:
            return ReasoningDelta(content=chunk.text)
        split = self._reasoner.feed_piece(chunk.text, chunk.token_ids, last=chunk.finish_reason is not None)
        return split if self.reasoning_output.include_reasoning else ReasoningDelta(content=split.content)

    def _opened(self, block: _Block) -> list[dict]:
        """`block` opens (the open one closes first)."""
        events = self._closed()
        self._blocks.append(block)
        self._open = block
        return [*events, {"type": "content_block_start", "index": len(self._blocks) - 1,
                          "content_block": block.start()}]

    def _closed(self) -> list[dict]:
        """The open block's closing events (none open: none)."""
        block, self._open = self._open, None
        if block is None:
            return []
        index = self._blocks.index(block)
        events = []
        if isinstance(block, _ThinkingBlock):
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": block.signature}})
        return [*events, {"type": "content_block_stop", "index": index}]

    def _delta_events(self, kind: type[_TextBlock] | type[_ThinkingBlock], text: str) -> list[dict]:
        events = [] if isinstance(self._open, kind) else self._opened(kind())
        if isinstance(self._open, _ThinkingBlock):
            self._open.thinking.append(text)
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            self._open.text.append(text)
            delta = {"type": "text_delta", "text": text}
        return [*events, {"type": "content_block_delta", "index": len(self._blocks) - 1, "delta": delta}]

    def _call_events(self, delta: ToolCallDelta) -> list[dict]:
        events = []
        if delta.id is not None:
            self._calls[delta.index] = _ToolUseBlock(new_tool_use_id(), delta.name or "")
            events = self._opened(self._calls[delta.index])
        block = self._calls[delta.index]
        if delta.arguments:
            block.arguments.append(delta.arguments)
            events.append({"type": "content_block_delta", "index": self._blocks.index(block),
                           "delta": {"type": "input_json_delta", "partial_json": delta.arguments}})
        return events

    def _closing_events(self, last: StreamChunk) -> list[dict]:
        events = self._opened(_TextBlock()) if not self._blocks else []
        events += self._closed()
        called = self._parser is not None and self._parser.called and not self._parser.malformed
        complete = all(is_complete_json("".join(block.arguments)) for block in self._calls.values())
        reason, sequence = stop_reason(last.finish_reason, last.stop_reason, called, complete)
        usage = last.usage or Usage(self.header.prompt_tokens, 0, 0)
        return [*events,
                {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage_body(usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens,
                                     self.header.cache_details)},
                {"type": "message_stop"}]
