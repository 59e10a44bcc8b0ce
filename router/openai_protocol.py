"""The OpenAI API's wire format: JSON request bodies parsed into typed requests, and the router's
StreamChunks rendered as OpenAI responses and stream chunks (the shapes vLLM serves).

This module is the HTTP edge: JSON dicts exist only here and in the server that calls it. Parsing
raises InvalidRequestError naming the offending field (the error's `param`); sampling values are
validated by SamplingParams itself and sizes by router/request_limits.py (before the prompt is
read), so every API accepts and refuses the same values.
"""

from __future__ import annotations

import dataclasses
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.common.beam_search import BeamSearchParams
from splitserve.common.block_hash import check_cache_salt
from splitserve.common.chat_template import content_parts, joined_text
from splitserve.common.errors import InvalidRequestError, json_excerpt
from splitserve.common.generation_config import NO_REQUEST_DEFAULTS, RequestDefaults
from splitserve.common.pooling import PoolingParams
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import StructuredOutput
from splitserve.common.token_logprobs import TokenLogprobs
from splitserve.router.api_types import StreamChunk, Usage
from splitserve.router.lax_values import with_lax_values
from splitserve.router.openai_beam_search import CHAT_UNHONOURED, COMPLETION_UNHONOURED, parse_beam_search
from splitserve.router.openai_fields import CHAT_REFUSED, COMPLETION_REFUSED, Refused, refuse_unsupported
from splitserve.router.reasoning_parsers import ReasoningOutput, ReasoningParser, parse_reasoning
from splitserve.common.prompt_truncation import PromptTruncation
from splitserve.router.request_limits import MAX_SEQUENCES, RequestLimits, utf8_length
from splitserve.router.structured_output import parse_structured_output
from splitserve.router.tokenizer import ChatTemplateOptions, check_unicode
from splitserve.router.tool_calling import (HistoryToolCall, ToolCalling, parse_history_tool_calls,
                                            parse_tool_calling, parse_tools)
from splitserve.router.tool_parsers import OutputParser, ToolCallDelta, ToolOutput, parse_output

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""max_tokens of a completion request that sets none (the OpenAI and vLLM default)."""
MIN_LOGPROB = -9999.0
"""JSON has no -inf: a logprob below this is reported as this (what vLLM does)."""
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "stop_token_ids", "min_tokens")
"""Request fields passed to SamplingParams under the same name, validated there."""
_BOOL_SAMPLING_FIELDS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
"""Request fields passed to SamplingParams under the same name: booleans, never null (_flag)."""
_LOGIT_CONTROL_FIELDS = {"logit_bias": (dict, "an object mapping token ids to biases"),
                         "allowed_token_ids": (list, "a list of token ids"), "bad_words": (list, "a list of strings")}
"""Request fields passed to SamplingParams under the same name after a JSON type check (their
values are validated there and by RequestLimits)."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    """Text parts of a multi-part content list are joined with newlines; null is "" (what request
    limits count)."""
    tool_calls: tuple[HistoryToolCall, ...] = ()
    """An assistant message's tool calls."""
    tool_call_id: str | None = None
    """A tool message's: the call whose result it holds."""
    name: str | None = None
    """The message's author or tool name (any role), for templates that render it."""
    reasoning: str | None = None
    """An assistant message's reasoning (`reasoning`, or the older `reasoning_content`), sent back by
    a client for templates that render earlier reasoning (interleaved thinking, GPT-OSS's analysis)."""
    parts: tuple[str, ...] | None = None
    """The texts of the content's parts as the client sent them (null content: none); None when the
    content was a string. The tokenizer joins them or passes them as parts (its content format)."""

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template sees it (vLLM's keys; absent ones left out): the content as
        sent (a string, or text parts), the reasoning under both names, as vLLM hands it to templates, and as
        `thinking`, the name GPT-OSS's template reads an earlier turn's analysis by. That template refuses a turn
        with tool calls, content and thinking (it renders such a turn's content as its analysis), so that turn has
        no `thinking`."""
        content = self.content if self.parts is None else [{"type": "text", "text": text} for text in self.parts]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = self.reasoning
        if self.reasoning and not (self.tool_calls and self.content):
            message["thinking"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.template_value() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def extra_bytes(self) -> int:
        """UTF-8 bytes the tool calls (their names and arguments as JSON) and the reasoning add to the
        rendered chat."""
        return utf8_length(self.reasoning or "") + sum(
            utf8_length(call.name) + utf8_length(json.dumps(call.arguments, ensure_ascii=False))
            for call in self.tool_calls)


@dataclass(frozen=True)
class CompletionRequest:
    """POST /v1/completions."""

    model: str | None
    """None: the request named no model (the served one is used, as vLLM does)."""
    prompts: tuple[str | tuple[int, ...], ...]
    """The prompt, or each prompt of a batch: text or token ids."""
    n: int
    """Choices returned per prompt."""
    best_of: int
    """Sequences generated per prompt (>= n): the n with the highest cumulative logprob are returned."""
    echo: bool
    """Each choice's text starts with its prompt's text."""
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    """stream_options.include_usage: a last stream chunk with usage and no choices."""
    continuous_usage: bool
    """stream_options.continuous_usage_stats with include_usage (vLLM extension): every stream chunk
    also carries its choice's usage so far."""
    tokens_as_ids: bool | None
    """return_tokens_as_token_ids (vLLM extension): logprob tokens read "token_id:<id>"; None (absent
    or null): the server's --return-tokens-as-token-ids."""
    request_id: str
    """The client's id for the request (vLLM extension; "" : the router makes one)."""
    add_special_tokens: bool
    """Add the tokenizer's special tokens (a BOS) to a text prompt (vLLM extension, default true)."""
    return_token_ids: bool = False
    """Each choice also carries its prompt's and its output's token ids (vLLM extension)."""
    truncation: PromptTruncation | None = None
    """Each prompt cut to its last or first N tokens (vLLM extension); None: prompts are kept whole."""
    echo_only: bool = False
    """echo with max_tokens 0 (vLLM's): each choice is its prompt alone (text, and logprobs with logprobs);
    one token is generated (sampling.max_tokens is 1) and counted in usage, as vLLM does."""
    cache_salt: str | None = None
    """Salts the prefix cache for every prompt of the request (vLLM extension); None: unsalted."""
    beam_search: BeamSearchParams | None = None
    """use_beam_search (vLLM extension): each prompt's n choices are its best n beams; None: sampled."""
    stream_interval: int = 1
    """A streamed sequence's tokens are sent every this many (vLLM extension, router/stream_interval.py)."""
    priority: int = 0
    """vLLM extension: lower is scheduled earlier under the workers' priority policy (0 only under fcfs)."""


@dataclass(frozen=True)
class ChatCompletionRequest:
    """POST /v1/chat/completions."""

    model: str | None
    messages: tuple[ChatMessage, ...]
    n: int
    """Choices returned (parallel sampling)."""
    add_generation_prompt: bool
    sampling: SamplingParams
    """sampling.logprobs is top_logprobs when logprobs is true, else None."""
    max_tokens_param: str | None
    """The field that set sampling.max_tokens; None when defaulted (the Responses API repeats a set one)."""
    stream: bool
    include_usage: bool
    continuous_usage: bool
    tokens_as_ids: bool | None
    """As CompletionRequest's."""
    request_id: str
    template: ChatTemplateOptions
    """vLLM's chat extensions: continue_final_message, documents, chat_template_kwargs, add_special_tokens;
    and the tools the template renders."""
    tool_calling: ToolCalling | None = None
    """The request's tools and tool_choice; None: it sent no tools."""
    include_reasoning: bool = True
    """With a reasoning parser, return the reasoning (vLLM's include_reasoning); without one there is
    none to return either way."""
    return_token_ids: bool = False
    """The response carries the prompt's token ids and each choice its output's (vLLM extension)."""
    truncation: PromptTruncation | None = None
    """The rendered chat cut to its last or first N tokens (vLLM extension); None: kept whole."""
    cache_salt: str | None = None
    """Salts the prefix cache (vLLM extension); None: unsalted."""
    beam_search: BeamSearchParams | None = None
    """use_beam_search (vLLM extension): the n choices are the best n beams; None: sampled."""
    stream_interval: int = 1
    """A streamed choice's tokens are sent every this many (vLLM extension, router/stream_interval.py)."""
    priority: int = 0
    """vLLM extension: lower is scheduled earlier under the workers' priority policy (0 only under fcfs)."""
    echo: bool = False
    """Start the reply's content with the last message's, when the reply has its role (vLLM's chat echo)."""

    def response_role(self, server_role: str = "assistant") -> str:
        """The role of the reply's message: `server_role` (the server's --response-role) after a generation
        prompt, else the last message's (the output continues it, or follows it with no turn of its own), as
        vLLM answers."""
        return server_role if self.add_generation_prompt else self.messages[-1].role

    def echoed_text(self, server_role: str = "assistant") -> str:
        """What the reply's content starts with: with echo, the last message's content when that message
        has the reply's role (a continued message, say with continue_final_message), else nothing (vLLM's rule)."""
        last = self.messages[-1]
        return last.content if self.echo and last.role == self.response_role(server_role) else ""


# ---- parsing --------------------------------------------------------------------------------

def _typed(body: Mapping[str, Any], name: str, kind: type, what: str, default: Any = None,
           field: str | None = None) -> Any:
    """body[name] if it is a `kind` (never a bool where a number is wanted); absent or null: default.
    `field`: what an error names (default `name`: a top-level field)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise InvalidRequestError(field or name, f"must be {what}, got {value!r}")
    return value


def _refuse_null(body: Mapping[str, Any], name: str, what: str) -> None:
    """A field vLLM's request models declare without null (`int`, not `int | None`): null is a 400 naming it,
    as vLLM's validation answers (elsewhere null is the field's default, _typed); absent stays its default."""
    if name in body and body[name] is None:
        raise InvalidRequestError(name, f"must be {what}, got null")


def _flag(body: Mapping[str, Any], name: str, default: bool | None = None) -> bool | None:
    """A boolean vLLM's request models declare without null: absent is `default`; null is a 400 (_refuse_null)."""
    _refuse_null(body, name, "a boolean")
    return _typed(body, name, bool, "a boolean", default)


def _count(body: Mapping[str, Any], name: str, default: int) -> int:
    """A number of sequences: an integer in [1, MAX_SEQUENCES]."""
    value = _typed(body, name, int, f"an integer in [1, {MAX_SEQUENCES}]", default)
    if not 1 <= value <= MAX_SEQUENCES:
        raise InvalidRequestError(name, f"must be an integer in [1, {MAX_SEQUENCES}], got {value}")
    return value


def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, stream_options.include_usage, continuous usage): vLLM's continuous_usage_stats
    counts only with include_usage (as in vLLM)."""
    stream = _typed(body, "stream", bool, "a boolean", False)
    options = _typed(body, "stream_options", dict, "an object")
    if options is None:
        return stream, False, False
    if not stream:
        raise InvalidRequestError("stream_options", "is only allowed when stream is true")
    include_usage, continuous = (_stream_option(options, name) for name in ("include_usage", "continuous_usage_stats"))
    return stream, include_usage, include_usage and continuous


def _stream_interval(body: Mapping[str, Any]) -> int:
    """vLLM's stream_interval: an integer >= 1, null or absent 1 (no effect without stream, as in vLLM)."""
    value = _typed(body, "stream_interval", int, "an integer >= 1", 1)
    if value < 1:
        raise InvalidRequestError("stream_interval", f"must be an integer >= 1, got {value}")
    return value


def _stream_option(options: Mapping[str, Any], name: str) -> bool:
    value = options.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(f"stream_options.{name}", f"must be a boolean, got {value!r}")
    return bool(value)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise InvalidRequestError("stop", f"must be a string or a list of strings, got {stop!r}")


def _max_tokens(body: Mapping[str, Any], names: Sequence[str], default: int) -> tuple[int, str | None]:
    """(max_tokens, the field that set it) from the first of `names` that is set, else (default, None)."""
    for name in names:
        value = _typed(body, name, int, "an integer >= 1")
        if value is not None:
            if value < 1:
                raise InvalidRequestError(name, f"must be an integer >= 1, got {value}")
            return value, name
    return default, None


def _sampling(body: Mapping[str, Any], max_tokens: int, max_tokens_param: str | None, logprobs: int | None,
              limits: RequestLimits, defaults: RequestDefaults,
              constraint: StructuredOutput | None = None) -> SamplingParams:
    """`defaults` fill the sampling fields the body leaves unset (or null); `constraint`: a forced
    tool choice's grammar, in place of the request's `response_format` (router/tool_calling.py
    refuses the other structured output fields beside it)."""
    _refuse_null(body, "min_tokens", f"an integer in [0, max_tokens={max_tokens}]")
    _refuse_null(body, "bad_words", _LOGIT_CONTROL_FIELDS["bad_words"][1])
    given = defaults.sampling_fields({name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None})
    for name in _BOOL_SAMPLING_FIELDS:
        value = _flag(body, name)
        if value is not None:
            given[name] = value
    for name, (kind, what) in _LOGIT_CONTROL_FIELDS.items():
        value = _typed(body, name, kind, what)
        if value is not None:
            given[name] = value
    requested = parse_structured_output(body)  # checked also when a forced tool choice's grammar replaces it
    params = SamplingParams(stop=_stop(body), max_tokens=max_tokens, logprobs=logprobs,
                            structured_output=requested if constraint is None else constraint, **given)
    limits.check_sampling(params, max_tokens_param)
    return params


def _model(body: Mapping[str, Any]) -> str | None:
    return _typed(body, "model", str, "a string")


def _prompt(prompt: Any, limits: RequestLimits, field: str, truncated: bool) -> str | tuple[int, ...]:
    """One prompt: a string or a non-empty list of token ids; its size is checked before its ids are
    (a token-id prompt that will be `truncated` may be longer than the context: the body's size bounds it)."""
    if isinstance(prompt, str):
        check_unicode(prompt, field)  # here, where the field is known: the tokenizer would name it `prompt`
        limits.check_prompt_bytes(utf8_length(prompt), field)
        return prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list)) and not truncated:  # token ids
        limits.check_prompt_token_count(len(prompt), field)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(prompt)
    raise InvalidRequestError(field, "must be a string or a non-empty list of token ids")


def _prompts(body: Mapping[str, Any], limits: RequestLimits, best_of: int,
             truncated: bool, name: str = "prompt") -> tuple[str | tuple[int, ...], ...]:
    """A prompt, or a batch: a list of strings or of token-id lists (vLLM's batched prompts); `name`: the field
    that holds them (an embedding request's `input`)."""
    prompt = body.get(name)
    if not (isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)):
        return (_prompt(prompt, limits, name, truncated),)
    if len(prompt) * best_of > MAX_SEQUENCES:
        raise InvalidRequestError(name, f"{len(prompt)} prompts x {best_of} sequences each exceed "
                                        f"{MAX_SEQUENCES} sequences per request" if name == "prompt" else
                                        f"{len(prompt)} inputs exceed {MAX_SEQUENCES} inputs per request")
    return tuple(_prompt(p, limits, f"{name}[{i}]", truncated) for i, p in enumerate(prompt))


def _best_of(body: Mapping[str, Any], n: int, stream: bool, beam_search: bool = False) -> int:
    best_of = _count(body, "best_of", n)
    if best_of < n:
        raise InvalidRequestError("best_of", f"must be >= n ({n}), got {best_of}")
    if beam_search and best_of != n:
        raise InvalidRequestError("best_of", f"cannot be combined with use_beam_search, whose n ({n}) is its beam "
                                             f"width, got {best_of}")
    if stream and best_of > n:
        raise InvalidRequestError("best_of", f"cannot stream: the best {n} of {best_of} sequences are known only "
                                             "once all finished (set best_of to n, or stream to false)")
    return best_of


def _with_prompt_logprobs(body: Mapping[str, Any], sampling: SamplingParams, stream: bool,
                          echoed: int | None = None) -> SamplingParams:
    """sampling with vLLM's prompt_logprobs extra field, else `echoed` (what echo with logprobs needs: the
    prompt's logprobs with as many alternatives as the output's). The field is refused with stream, as
    vLLM does (a stream has no place for it; echo's own prompt logprobs stream with the echoed prompt)."""
    wanted = _typed(body, "prompt_logprobs", int, "an integer >= 0")
    if wanted is not None and stream and wanted > 0:
        raise InvalidRequestError("prompt_logprobs", "are not available when stream is true")
    count = wanted if wanted is not None else echoed
    return sampling if count is None else dataclasses.replace(sampling, prompt_logprobs=count)


def _cache_salt(body: Mapping[str, Any]) -> str | None:
    """cache_salt: absent or null (unsalted), else a non-empty string (400 naming it)."""
    cache_salt = body.get("cache_salt")
    check_cache_salt(cache_salt)
    return cache_salt


def _priority(body: Mapping[str, Any]) -> int:
    """priority (vLLM extension): an integer, 0 when absent, null a 400 (vLLM declares `int = 0`). Whether
    one other than 0 is served is the scheduling policy's call (Orchestrator.generate: a 400 under fcfs)."""
    _refuse_null(body, "priority", "an integer")
    return _typed(body, "priority", int, "an integer", 0)


def _request_id(body: Mapping[str, Any], limits: RequestLimits) -> str:
    _refuse_null(body, "request_id", "a string")
    request_id = _typed(body, "request_id", str, "a string", "")
    limits.check_request_id(request_id, "request_id")
    return request_id


def parse_completion_request(body: Mapping[str, Any], limits: RequestLimits,
                             defaults: RequestDefaults = NO_REQUEST_DEFAULTS) -> CompletionRequest:
    """`defaults`: the server's sampling defaults (--generation-config); a completion's max_tokens
    stays 16 when unset, as in vLLM, within their limit. Scalar fields are read as vLLM's pydantic
    models read them (router/lax_values.py: `8.0` or `"8"` is 8)."""
    body = with_lax_values(body, logprobs_is_boolean=False)
    refuse_unsupported(body, COMPLETION_REFUSED)
    logprobs = _typed(body, "logprobs", int, "an integer >= 0")
    echo = _typed(body, "echo", bool, "a boolean", False)
    echo_only = echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
    max_tokens, max_tokens_param = _max_tokens({**body, "max_tokens": 1} if echo_only else body, ("max_tokens",),
                                               COMPLETION_DEFAULT_MAX_TOKENS)
    stream, include_usage, continuous_usage = _stream_flags(body)
    _refuse_null(body, "n", f"an integer in [1, {MAX_SEQUENCES}]")  # a chat's n is optional: null is 1 there
    n = _count(body, "n", 1)
    sampling = _with_prompt_logprobs(body, _sampling(body, defaults.limited(max_tokens), max_tokens_param, logprobs,
                                                     limits, defaults), stream, logprobs if echo else None)
    beam_search = parse_beam_search(body, n, sampling, COMPLETION_UNHONOURED)
    limits.check_logprobs(sampling, beam_search)
    if beam_search is not None:  # vLLM answers a streamed beam search with one JSON response
        stream, include_usage, continuous_usage = False, False, False
    best_of = _best_of(body, n, stream, beam_search is not None)
    truncation = _truncation(body, limits)
    return CompletionRequest(_model(body), _prompts(body, limits, best_of, truncation is not None), n, best_of, echo,
                             sampling, stream, include_usage, continuous_usage,
                             _typed(body, "return_tokens_as_token_ids", bool, "a boolean"),
                             _request_id(body, limits), _flag(body, "add_special_tokens", True),
                             _return_token_ids(body), truncation, echo_only, _cache_salt(body), beam_search,
                             _stream_interval(body), _priority(body))


def _return_token_ids(body: Mapping[str, Any]) -> bool:
    return bool(_typed(body, "return_token_ids", bool, "a boolean", False))


def _truncation(body: Mapping[str, Any], limits: RequestLimits, pools: bool = False) -> PromptTruncation | None:
    """truncate_prompt_tokens and truncation_side (RequestLimits.prompt_truncation)."""
    return limits.prompt_truncation(_typed(body, "truncate_prompt_tokens", int, "an integer >= -1"),
                                    _typed(body, "truncation_side", str, "'left' or 'right'"), pools=pools)


def _messages(body: Mapping[str, Any], limits: RequestLimits) -> tuple[ChatMessage, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content} objects")
    limits.check_message_count(len(messages))
    parsed = tuple(_message(message, f"messages[{index}]") for index, message in enumerate(messages))
    limits.check_chat(parsed)
    if any(message.tool_calls or message.reasoning for message in parsed):
        limits.check_prompt_bytes(sum(utf8_length(m.content) + m.extra_bytes() for m in parsed), "messages")
    return parsed


def _message(message: Any, field: str) -> ChatMessage:
    """One message; as in vLLM, only an assistant's tool_calls and reasoning and a tool message's
    tool_call_id are read."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise InvalidRequestError(field, f"must be an object with a string role, got {message!r}")
    role = message["role"]
    calls = parse_history_tool_calls(message.get("tool_calls"), f"{field}.tool_calls") if role == "assistant" else ()
    call_id = None if role != "tool" else _typed(message, "tool_call_id", str, "a string",
                                                 field=f"{field}.tool_call_id")
    content = message.get("content")
    texts = content_parts(content, f"{field}.content")
    return ChatMessage(role, joined_text(texts), calls, call_id, _typed(message, "name", str, "a string",
                                                                     field=f"{field}.name"),
                       _history_reasoning(message, field) if role == "assistant" else None,
                       None if isinstance(content, str) else texts)


def _history_reasoning(message: Mapping[str, Any], field: str) -> str | None:
    """`reasoning`, else the older `reasoning_content` (vLLM reads the latter as the former)."""
    name = "reasoning" if message.get("reasoning") is not None else "reasoning_content"
    return _typed(message, name, str, "a string", field=f"{field}.{name}")


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """The number of top alternatives per token when logprobs is true, else None."""
    wanted = _typed(body, "logprobs", bool, "a boolean", False)
    top = _typed(body, "top_logprobs", int, "an integer >= 0")
    if top is not None and top < 0:  # how many is the server's --max-logprobs (RequestLimits.check_logprobs)
        raise InvalidRequestError("top_logprobs", f"must be an integer >= 0, got {top}")
    if top is not None and not wanted:
        raise InvalidRequestError("top_logprobs", "requires logprobs to be true")
    return (top or 0) if wanted else None


def _echoed_prompt_logprobs(body: Mapping[str, Any]) -> int:
    """A chat with echo returns its prompt's logprobs with top_logprobs alternatives (0 when unset), as
    vLLM's does (its echo asks for them); a stream has no place for them, so a streamed one computes none."""
    return _typed(body, "top_logprobs", int, "an integer >= 0") or 0


def _documents(body: Mapping[str, Any]) -> tuple[Mapping[str, str], ...] | None:
    documents = _typed(body, "documents", list, "a list of objects of strings")
    if documents is None:
        return None
    for index, document in enumerate(documents):
        if not (isinstance(document, dict) and all(isinstance(v, str) for v in document.values())):
            raise InvalidRequestError(f"documents[{index}]", f"must be an object of strings, got {document!r}")
    return tuple(documents)


def parse_chat_template_options(body: Mapping[str, Any], add_generation_prompt: bool) -> ChatTemplateOptions:
    """vLLM's chat template extensions (also taken by /tokenize), the request's own chat_template among them
    (RouterTokenizer renders it only when the server trusts request templates)."""
    continue_final = _flag(body, "continue_final_message", False)
    if continue_final and add_generation_prompt:
        raise InvalidRequestError("continue_final_message", "cannot be true while add_generation_prompt is true "
                                                            "(set add_generation_prompt to false)")
    kwargs = _typed(body, "chat_template_kwargs", dict, "an object", {})
    return ChatTemplateOptions(continue_final, _documents(body), kwargs, _flag(body, "add_special_tokens", False),
                               chat_template=_typed(body, "chat_template", str, "a string (a Jinja template)"))


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
"""vLLM's reasoning_effort values."""


def _with_reasoning_effort(body: Mapping[str, Any], template: ChatTemplateOptions) -> ChatTemplateOptions:
    """vLLM's reasoning_effort: the template variable of that name, and enable_thinking (false for
    "none") unless chat_template_kwargs sets it (templates that declare neither ignore both)."""
    effort = body.get("reasoning_effort")
    if effort is None:
        return template
    if effort not in REASONING_EFFORTS:
        raise InvalidRequestError("reasoning_effort", f"must be one of {', '.join(REASONING_EFFORTS)}, got "
                                                      f"{json_excerpt(effort)}")
    kwargs = {"reasoning_effort": effort, "enable_thinking": effort != "none", **template.template_kwargs}
    return dataclasses.replace(template, template_kwargs=kwargs)


def parse_chat_request(body: Mapping[str, Any], limits: RequestLimits,
                       defaults: RequestDefaults = NO_REQUEST_DEFAULTS) -> ChatCompletionRequest:
    """The default max_tokens is the defaults' max_new_tokens, else max_model_len: generation may
    then run to the end of the context (the engine ends it there with finish_reason "length"), as
    in vLLM. `defaults`: the server's sampling defaults (--generation-config). Scalar fields are read
    as vLLM's pydantic models read them (router/lax_values.py)."""
    body = with_lax_values(body, logprobs_is_boolean=True)
    refuse_unsupported(body, CHAT_REFUSED)
    messages = _messages(body, limits)
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    template = _with_reasoning_effort(body, parse_chat_template_options(body, add_generation_prompt))
    tool_calling = parse_tool_calling(body, limits)
    if tool_calling is not None:
        template = dataclasses.replace(template, tools=tool_calling.template_tools())
    max_tokens, max_tokens_param = _max_tokens(body, ("max_completion_tokens", "max_tokens"),
                                               defaults.default_max_tokens(limits.max_model_len))
    stream, include_usage, continuous_usage = _stream_flags(body)
    echo = _flag(body, "echo", False)
    sampling = _with_prompt_logprobs(body, _sampling(body, defaults.limited(max_tokens), max_tokens_param,
                                                     _chat_logprobs(body), limits, defaults,
                                                     None if tool_calling is None else tool_calling.constraint()),
                                     stream, _echoed_prompt_logprobs(body) if echo and not stream else None)
    n = _count(body, "n", 1)
    beam_search = parse_beam_search(body, n, sampling, CHAT_UNHONOURED)
    limits.check_logprobs(sampling, beam_search)
    return ChatCompletionRequest(
        _model(body), messages, n, add_generation_prompt, sampling, max_tokens_param, stream,
        include_usage, continuous_usage, _typed(body, "return_tokens_as_token_ids", bool, "a boolean"),
        _request_id(body, limits), template, tool_calling, _flag(body, "include_reasoning", True),
        _return_token_ids(body), _truncation(body, limits), _cache_salt(body), beam_search, _stream_interval(body),
        _priority(body), echo)


@dataclass(frozen=True)
class TokenizeRequest:
    """POST /tokenize (vLLM's): a completion's prompt, or a chat's messages."""

    model: str | None
    prompt: str
    """The text to tokenize ("" for a chat)."""
    messages: tuple[ChatMessage, ...] | None
    """The chat to render and tokenize; None for a prompt."""
    add_generation_prompt: bool
    template: ChatTemplateOptions
    add_special_tokens: bool
    """For a prompt (default true); a chat's is template.add_special_tokens (default false)."""
    return_token_strs: bool
    """Also return each token's vocabulary entry."""


_TOKENIZE_REFUSED = tuple(rule for rule in CHAT_REFUSED if rule.name in ("mm_processor_kwargs", "media_io_kwargs"))
_PROMPT_TOOLS = Refused("tools", (), "a prompt is tokenized as it is (send messages: the template renders tools)")


def parse_tokenize_request(body: Mapping[str, Any], limits: RequestLimits) -> TokenizeRequest:
    """A chat's `tools` are rendered as the chat endpoint renders them; flags are read as vLLM's pydantic
    model reads them (router/lax_values.py)."""
    body = with_lax_values(body, logprobs_is_boolean=True)
    refuse_unsupported(body, _TOKENIZE_REFUSED)
    return_token_strs = _typed(body, "return_token_strs", bool, "a boolean", False)
    if "messages" in body:
        add_generation_prompt = _flag(body, "add_generation_prompt", True)
        template = parse_chat_template_options(body, add_generation_prompt)
        tools = parse_tools(body, limits)
        if tools is not None:
            template = dataclasses.replace(template, tools=tuple(tool.definition for tool in tools))
        return TokenizeRequest(_model(body), "", _messages(body, limits), add_generation_prompt, template,
                               template.add_special_tokens, return_token_strs)
    _PROMPT_TOOLS.check(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt", f"must be a string (or send messages), got {prompt!r}")
    limits.check_prompt_bytes(utf8_length(prompt), "prompt")
    return TokenizeRequest(_model(body), prompt, None, False, ChatTemplateOptions(),
                           _flag(body, "add_special_tokens", True), return_token_strs)


@dataclass(frozen=True)
class DetokenizeRequest:
    """POST /detokenize (vLLM's)."""

    model: str | None
    tokens: tuple[int, ...]


def parse_detokenize_request(body: Mapping[str, Any], limits: RequestLimits) -> DetokenizeRequest:
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise InvalidRequestError("tokens", f"must be a list of token ids, got {tokens!r}")
    limits.check_prompt_token_count(len(tokens), "tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab_size for t in tokens):
        raise InvalidRequestError("tokens", f"must be token ids in [0, {limits.vocab_size})")
    return DetokenizeRequest(_model(body), tuple(tokens))


# ---- rendering ------------------------------------------------------------------------------

def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def usage_body(usage: Usage, prompt_tokens_details: bool = False) -> dict:
    """The usage object; `prompt_tokens_details` ({"cached_tokens"}) only when asked, as vLLM reports it
    only under --enable-prompt-tokens-details."""
    body: dict[str, Any] = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
                            "total_tokens": usage.prompt_tokens + usage.completion_tokens}
    if prompt_tokens_details:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


def _logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB  # also maps -inf (and nan) to the floor


def _entries(logprobs: Iterable[TokenLogprobs]) -> list[tuple[int, TokenLogprobs | None]]:
    """Sampled tokens' logprobs as (token id, logprobs) pairs, as the completion renderer takes them."""
    return [(lp.token_id, lp) for lp in logprobs]


def _ranked(logprobs: TokenLogprobs) -> dict[int, tuple[float, int]]:
    """token id -> (logprob, rank) of the token, then of its top alternatives, as vLLM orders them (the
    token once when it is among its own top alternatives)."""
    ranked = {logprobs.token_id: (logprobs.logprob, logprobs.rank)}
    for rank, (token_id, logprob) in enumerate(logprobs.top, start=1):
        ranked.setdefault(token_id, (logprob, rank))
    return ranked


def _prompt_logprobs_of(chunks: Sequence[StreamChunk]) -> tuple[TokenLogprobs | None, ...] | None:
    """The prompt logprobs one of a choice's chunks carries (its first token's), if any."""
    return next((chunk.prompt_logprobs for chunk in chunks if chunk.prompt_logprobs is not None), None)


@dataclass(frozen=True)
class ResponseHeader:
    """What every response and stream chunk of one request repeats."""

    id: str
    created: int
    """Unix seconds."""
    model: str
    system_fingerprint: str
    """Identifies the serving configuration (version, model, KV layout): equal fingerprints, and
    a seed, mean reproducible output (the OpenAI meaning)."""


class _Renderer(ABC):
    """Turns one request's StreamChunks into OpenAI JSON, each choice under its `index`;
    `token_text` names a token id in logprobs (its decoded text, or "token_id:<id>"), which are
    reported when `with_logprobs`. With `prompt_tokens` (each choice's prompt length), every stream
    chunk carries its choice's usage so far (vLLM's stream_options.continuous_usage_stats). With
    `prompt_token_ids` (each choice's prompt, for vLLM's return_token_ids), every choice carries its
    output's `token_ids` (a stream chunk: its new ones) and the response its `prompt_token_ids`
    (a stream: the first chunk of each choice), where vLLM puts them (prompt_ids_in_choice)."""

    object_name = ""
    chunk_object_name = ""
    prompt_ids_in_choice = True
    """return_token_ids: a choice holds its prompt_token_ids (completions), or the response does (chat)."""

    def __init__(self, header: ResponseHeader, token_text: Callable[[int], str], include_usage: bool,
                 with_logprobs: bool, prompt_tokens: Sequence[int] | None = None) -> None:
        self.header = header
        self.token_text = token_text
        self.include_usage = include_usage
        self.with_logprobs = with_logprobs
        self.prompt_tokens = None if prompt_tokens is None else tuple(prompt_tokens)
        self.prompt_token_ids: tuple[Sequence[int], ...] | None = None
        """return_token_ids: each choice's prompt token ids (set by with_token_ids); None: not returned."""
        self._completion_tokens: dict[int, int] = {}
        """Tokens streamed so far per choice (for continuous usage)."""
        self._prompt_ids_sent: set[int] = set()
        """return_token_ids: choices whose stream carried their prompt's token ids already."""
        self.returns_output_ids = True
        """return_token_ids returns the output's ids too (not where they would show hidden reasoning)."""
        self.prompt_tokens_details = False
        """The usage carries prompt_tokens_details.cached_tokens (set by with_prompt_tokens_details)."""

    def with_token_ids(self, prompt_token_ids: Sequence[Sequence[int]]) -> _Renderer:
        """This renderer, returning token ids (vLLM's return_token_ids): `prompt_token_ids` per choice."""
        self.prompt_token_ids = tuple(prompt_token_ids)
        return self

    def with_prompt_tokens_details(self, enabled: bool) -> _Renderer:
        """This renderer, its usage with prompt_tokens_details when `enabled` (--enable-prompt-tokens-details)."""
        self.prompt_tokens_details = enabled
        return self

    def _token_id_fields(self, index: int, token_ids: Sequence[int], in_choice: bool) -> dict:
        """return_token_ids' fields (none without it) of choice `index` (`in_choice`) or of the
        response or chunk that carries it: its output's `token_ids` in the choice, and its prompt's
        once (every response; a stream's first chunk of the choice) where prompt_ids_in_choice says."""
        if self.prompt_token_ids is None:
            return {}
        fields: dict[str, Any] = {"token_ids": list(token_ids)} if in_choice and self.returns_output_ids else {}
        if in_choice == self.prompt_ids_in_choice and index not in self._prompt_ids_sent:
            fields["prompt_token_ids"] = list(self.prompt_token_ids[index])
        return fields

    def _prompt_ids_streamed(self, index: int) -> None:
        """Choice `index`'s stream carried its prompt's token ids (in the chunk just built)."""
        self._prompt_ids_sent.add(index)

    def _count_tokens(self, index: int, chunk: StreamChunk) -> None:
        """Note choice `index`'s tokens in `chunk`: the stream chunks built next carry them in their usage."""
        self._completion_tokens[index] = self._completion_tokens.get(index, 0) + len(chunk.token_ids)

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        h = self.header
        return {"id": h.id, "object": object_name, "created": h.created, "model": h.model,
                "system_fingerprint": h.system_fingerprint, "choices": choices}

    def _chunk(self, choice: dict) -> dict:
        body = self._envelope(self.chunk_object_name, [choice])
        if self.prompt_tokens is not None:
            body["usage"] = self._usage_so_far(choice["index"])
        elif self.include_usage:
            body["usage"] = None  # every chunk but the last usage one (the OpenAI convention)
        return body

    def _usage_so_far(self, index: int) -> dict:
        """Choice `index`'s usage up to its latest counted chunk (vLLM's continuous usage stats)."""
        prompt_tokens, completion_tokens = self.prompt_tokens[index], self._completion_tokens.get(index, 0)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def prompt_logprobs_body(self, prompt_logprobs: Sequence[TokenLogprobs | None]) -> list[dict | None]:
        """vLLM's prompt_logprobs field: per prompt token null (the first) or {token id: {logprob, rank,
        decoded_token}} of the prompt token, then its top alternatives (rank 1, 2, ...)."""
        return [None if lp is None else {str(token_id): {"logprob": _logprob(logprob), "rank": rank,
                                                         "decoded_token": self.token_text(token_id)}
                                         for token_id, (logprob, rank) in _ranked(lp).items()}
                for lp in prompt_logprobs]

    def usage_chunk(self, usage: Usage) -> dict:
        """The stream's last data chunk under stream_options.include_usage."""
        return {**self._envelope(self.chunk_object_name, []), "usage": self._usage_body(usage)}

    def _usage_body(self, usage: Usage) -> dict:
        return usage_body(usage, self.prompt_tokens_details)

    def response(self, choices: Sequence[Sequence[StreamChunk]], usage: Usage) -> dict:
        """The non-streaming response: each choice's chunks in choice order (the last of each has
        its finish reason), and the whole request's usage."""
        rendered = []
        for index, chunks in enumerate(choices):
            message = self._message(index, chunks)  # before the finish reason, which may depend on what it read
            token_ids = self._output_token_ids(chunks)
            rendered.append({"index": index, **message, "finish_reason": self._finish_reason(index, chunks[-1]),
                             "stop_reason": chunks[-1].stop_reason, **self._token_id_fields(index, token_ids, True)})
        return {**self._envelope(self.object_name, rendered), **self._token_id_fields(0, (), False),
                "usage": self._usage_body(usage)}

    def _output_token_ids(self, chunks: Sequence[StreamChunk]) -> list[int]:
        """A choice's output token ids as return_token_ids reports them."""
        return [t for chunk in chunks for t in chunk.token_ids]

    def _finish_reason(self, index: int, last: StreamChunk) -> str | None:
        """Choice `index`'s finish reason, given its last chunk (None while it runs)."""
        return last.finish_reason

    @abstractmethod
    def stream_chunks(self, index: int, chunk: StreamChunk) -> list[dict]:
        """The stream chunks (in order) that carry choice `index`'s next StreamChunk."""

    @abstractmethod
    def _message(self, index: int, chunks: Sequence[StreamChunk]) -> dict:
        """Choice `index`'s content fields (text or message, logprobs) of its whole output."""


class CompletionRenderer(_Renderer):
    """text_completion objects; logprobs as tokens / token_logprobs / top_logprobs / text_offset.
    With `echo` (each prompt's text, prompt-major like the choices, `choices_per_prompt` choices
    each), a choice's text starts with its prompt's, and its logprobs with its prompt's tokens
    (`echo_token_ids`, the first with a null logprob and top_logprobs, as in vLLM). A request with
    prompt logprobs also gets vLLM's `prompt_logprobs` field on each choice (not streamed)."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, header: ResponseHeader, token_text: Callable[[int], str], include_usage: bool,
                 with_logprobs: bool, echo: Sequence[str] = (), choices_per_prompt: int = 1,
                 prompt_tokens: Sequence[int] | None = None,
                 echo_token_ids: Sequence[tuple[int, ...]] = (), echo_only: bool = False) -> None:
        """echo_only: a choice is its echoed prompt without the output (CompletionRequest.echo_only)."""
        super().__init__(header, token_text, include_usage, with_logprobs, prompt_tokens)
        self.echo = tuple(echo)
        self.echo_token_ids = tuple(echo_token_ids)
        self.echo_only = echo_only
        self.choices_per_prompt = choices_per_prompt
        self._text_offset: dict[int, int] = {}
        """Characters of token text reported so far per choice: where its next token's text_offset starts."""
        self._echoed: set[int] = set()
        """Choices whose stream carried their prompt's text already."""

    def stream_chunks(self, index: int, chunk: StreamChunk) -> list[dict]:
        self._count_tokens(index, chunk)
        echoed = self._echo_once(index)
        output = ("", (), ()) if self.echo_only else (chunk.text, chunk.logprobs, chunk.token_ids)
        output_text, output_logprobs, output_token_ids = output
        logprobs = self._echoed_logprobs(index, chunk.prompt_logprobs if echoed else None) + _entries(output_logprobs)
        rendered = [self._chunk({"index": index, "text": echoed + output_text,
                                 "logprobs": self._logprobs(index, logprobs), "finish_reason": chunk.finish_reason,
                                 "stop_reason": chunk.stop_reason,
                                 **self._token_id_fields(index, output_token_ids, True)})]
        self._prompt_ids_streamed(index)
        return rendered

    def _output_token_ids(self, chunks: Sequence[StreamChunk]) -> list[int]:
        """None with echo_only: the choice is its prompt alone."""
        return [] if self.echo_only else super()._output_token_ids(chunks)

    def _echoed_logprobs(self, index: int, prompt_logprobs: Sequence[TokenLogprobs | None] | None) -> list[
            tuple[int, TokenLogprobs | None]]:
        """(token id, its logprobs) of choice `index`'s echoed prompt; none without echo or prompt logprobs."""
        if not self.echo or prompt_logprobs is None:
            return []
        return list(zip(self.echo_token_ids[index // self.choices_per_prompt], prompt_logprobs))

    def _echo_once(self, index: int) -> str:
        if not self.echo or index in self._echoed:
            return ""
        self._echoed.add(index)
        return self.echo[index // self.choices_per_prompt]

    def _message(self, index: int, chunks: Sequence[StreamChunk]) -> dict:
        prompt_logprobs = _prompt_logprobs_of(chunks)
        echoed = self._echo_once(index)
        output = () if self.echo_only else chunks
        logprobs = (self._echoed_logprobs(index, prompt_logprobs if echoed else None)
                    + _entries(lp for chunk in output for lp in chunk.logprobs))
        message = {"text": echoed + "".join(chunk.text for chunk in output), "logprobs": self._logprobs(index, logprobs)}
        if prompt_logprobs is not None:
            message["prompt_logprobs"] = self.prompt_logprobs_body(prompt_logprobs)
        return message

    def _logprobs(self, index: int, logprobs: Sequence[tuple[int, TokenLogprobs | None]]) -> dict | None:
        """OpenAI's logprobs object of (token id, its logprobs) pairs: a token without logprobs (the
        prompt's first) has null token_logprobs and top_logprobs entries."""
        if not self.with_logprobs:
            return None
        tokens = [self.token_text(token_id) for token_id, _ in logprobs]
        offsets = []
        offset = self._text_offset.get(index, 0)
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._text_offset[index] = offset
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else _logprob(lp.logprob) for _, lp in logprobs],
                "top_logprobs": [None if lp is None else self._top_logprobs(lp) for _, lp in logprobs],
                "text_offset": offsets}

    def _top_logprobs(self, logprobs: TokenLogprobs) -> dict[str, float]:
        """The `logprobs` most likely tokens, best first, and the sampled token when it is not one
        of them: OpenAI's API always returns the sampled token's logprob here ("up to logprobs + 1
        elements"), as vLLM does. Two tokens with the same text share one key (the first kept)."""
        top = {}
        for token_id, logprob in (*logprobs.top, (logprobs.token_id, logprobs.logprob)):
            top.setdefault(self.token_text(token_id), _logprob(logprob))
        return top


class ChatRenderer(_Renderer):
    """chat.completion objects; each choice's stream opens with the assistant role, then content
    deltas. A logprob entry's `bytes` are its token's own bytes (`token_bytes`), which put together
    a character split across tokens (OpenAI's meaning; the text of such a token alone is U+FFFD)."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    prompt_ids_in_choice = False

    def __init__(self, header: ResponseHeader, token_text: Callable[[int], str], token_bytes: Callable[[int], bytes],
                 include_usage: bool, with_logprobs: bool, prompt_tokens: Sequence[int] | None = None,
                 tool_output: ToolOutput | None = None, reasoning_output: ReasoningOutput | None = None,
                 role: str = "assistant", echoed_text: str = "") -> None:
        """`tool_output`: how each choice's content is split into content and tool calls (None: all
        content); `reasoning_output`: how each choice's text is split into reasoning and content first
        (None: no reasoning parser; the message then has no `reasoning` field). With reasoning hidden
        (include_reasoning false) no logprobs and no output token ids are returned (they would show
        it), as in vLLM. `role`: the message's role (ChatCompletionRequest.response_role()); `echoed_text`:
        what its content starts with (ChatCompletionRequest.echoed_text()), streamed as one chunk after the role's."""
        shown = reasoning_output is None or reasoning_output.include_reasoning
        super().__init__(header, token_text, include_usage, with_logprobs and shown, prompt_tokens)
        self.returns_output_ids = shown
        self.token_bytes = token_bytes
        self.tool_output = tool_output
        self.reasoning_output = reasoning_output
        self.role = role
        self.echoed_text = echoed_text
        self._role_sent: set[int] = set()
        self._parsers: dict[int, OutputParser] = {}
        """Each choice's parser (with tool_output): its stream's, or the one that read its whole output."""
        self._reasoners: dict[int, ReasoningParser] = {}
        """Each choice's reasoning parser (with reasoning_output), as _parsers."""

    def response(self, choices: Sequence[Sequence[StreamChunk]], usage: Usage) -> dict:
        """With prompt logprobs, vLLM's prompt_logprobs field on the response (the choices share the prompt)."""
        body = super().response(choices, usage)
        prompt_logprobs = _prompt_logprobs_of([chunk for chunks in choices for chunk in chunks])
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs_body(prompt_logprobs)
        return body

    def stream_chunks(self, index: int, chunk: StreamChunk) -> list[dict]:
        chunks = []
        if index not in self._role_sent:
            self._role_sent.add(index)
            chunks.append({**self._chunk({"index": index, "delta": {"role": self.role, "content": ""},
                                          "logprobs": None, "finish_reason": None}),
                           **self._token_id_fields(index, (), False)})
            self._prompt_ids_streamed(index)
            if self.echoed_text:
                chunks.append(self._chunk({"index": index, "delta": {"content": self.echoed_text}, "logprobs": None,
                                           "finish_reason": None}))
        self._count_tokens(index, chunk)  # after the role (and echo) chunk: they carry no tokens
        delta, logprobs = self._delta(index, chunk), self._logprobs(chunk.logprobs)
        finish_reason = self._finish_reason(index, chunk)
        returns_ids = self.prompt_token_ids is not None and self.returns_output_ids and chunk.token_ids
        # a tool call's held text sends nothing yet, unless its token ids are returned
        if delta or logprobs is not None or finish_reason is not None or returns_ids:
            chunks.append(self._chunk({"index": index, "delta": delta, "logprobs": logprobs,
                                       "finish_reason": finish_reason, "stop_reason": chunk.stop_reason,
                                       **self._token_id_fields(index, chunk.token_ids, True)}))
        return chunks

    def _delta(self, index: int, chunk: StreamChunk) -> dict:
        if self.reasoning_output is None:
            return self._content_delta(index, chunk.text, chunk.finish_reason is not None, {"content": chunk.text})
        reasoner = self._reasoners.setdefault(index, self.reasoning_output.new_parser())
        split = reasoner.feed_piece(chunk.text, chunk.token_ids, last=chunk.finish_reason is not None)
        delta = self._content_delta(index, split.content, chunk.finish_reason is not None,
                                    {"content": split.content} if split.content else {})
        if split.reasoning and self.reasoning_output.include_reasoning:
            delta["reasoning"] = split.reasoning
        return delta

    def _content_delta(self, index: int, text: str, last: bool, plain: dict) -> dict:
        """The delta of choice `index`'s next content text (`plain` without tool calling)."""
        if self.tool_output is None:
            return plain
        parser = self._parsers.setdefault(index, self.tool_output.new_parser())
        parsed = parser.feed_piece(text, last)
        delta: dict[str, Any] = {"content": parsed.content} if parsed.content else {}
        if parsed.tool_calls:
            delta["tool_calls"] = [_tool_call_delta(call) for call in parsed.tool_calls]
        return delta

    def _finish_reason(self, index: int, last: StreamChunk) -> str | None:
        if self.tool_output is None:
            return last.finish_reason
        return self.tool_output.finish_reason(last.finish_reason, self._parsers[index])

    def _message(self, index: int, chunks: Sequence[StreamChunk]) -> dict:
        logprobs = [lp for chunk in chunks for lp in chunk.logprobs]
        text = "".join(chunk.text for chunk in chunks)
        message: dict[str, Any] = {"role": self.role, "content": text}
        if self.reasoning_output is not None:
            self._reasoners[index] = self.reasoning_output.new_parser()
            split = parse_reasoning(self._reasoners[index], text, [t for chunk in chunks for t in chunk.token_ids])
            message["reasoning"] = split.reasoning if self.reasoning_output.include_reasoning else None
            message["content"] = split.content
            text = split.content or ""
        if self.tool_output is not None:
            self._parsers[index] = self.tool_output.new_parser()
            parsed = parse_output(self._parsers[index], text)
            # The parser's content, "" for a forced choice cut short before its first call (as its stream and
            # vLLM say); an output that is all reasoning keeps its null content.
            if message["content"] is not None or parsed.tool_calls:
                message["content"] = parsed.content
            if parsed.tool_calls:
                message["tool_calls"] = [{"id": call.id, "type": "function",
                                          "function": {"name": call.name, "arguments": call.arguments}}
                                         for call in parsed.tool_calls]
        if self.echoed_text:
            message["content"] = self.echoed_text + (message["content"] or "")
        return {"message": message, "logprobs": self._logprobs(logprobs)}

    def _usage_body(self, usage: Usage) -> dict:
        """With a reasoning parser, also the reasoning tokens of the choices read so far (vLLM's
        completion_tokens_details)."""
        return self._with_reasoning_tokens(usage_body(usage, self.prompt_tokens_details), self._reasoners.values())

    def _usage_so_far(self, index: int) -> dict:
        reasoner = self._reasoners.get(index)
        return self._with_reasoning_tokens(super()._usage_so_far(index), () if reasoner is None else (reasoner,))

    def _with_reasoning_tokens(self, body: dict, parsers: Iterable[ReasoningParser]) -> dict:
        if self.reasoning_output is not None:
            body["completion_tokens_details"] = {"reasoning_tokens": sum(p.reasoning_tokens for p in parsers)}
        return body

    def _logprobs(self, logprobs: Sequence[TokenLogprobs]) -> dict | None:
        if not self.with_logprobs:
            return None
        return {"content": [{**self._token(lp.token_id, lp.logprob),
                             "top_logprobs": [self._token(t, v) for t, v in lp.top]} for lp in logprobs]}

    def _token(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token_text(token_id), "logprob": _logprob(logprob),
                "bytes": list(self.token_bytes(token_id))}


def _tool_call_delta(call: ToolCallDelta) -> dict:
    """A stream's piece of a tool call: the first carries id, type and name (sent once: the openai
    SDK joins string fields of pieces with the same index), every one an arguments fragment."""
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


EMBEDDING_ENCODING_FORMATS = ("float", "base64")
"""How a response carries each vector: a JSON list of floats, or base64 of its little-endian float32 bytes (what the
OpenAI Python client asks for by default and decodes)."""


@dataclass(frozen=True)
class ChatInput:
    """A pooling request's chat (vLLM's EmbeddingChatRequest): its messages rendered by the chat template, one prompt;
    add_generation_prompt and add_special_tokens (template.add_special_tokens) default false there."""

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool
    template: ChatTemplateOptions


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    """`input`: a string, a list of strings, a list of token ids, or a list of token-id lists; () with `chat`."""
    encoding_format: str
    pooling: PoolingParams
    """`dimensions` (Matryoshka models only) and vLLM's `use_activation` (normalize)."""
    truncation: PromptTruncation | None
    add_special_tokens: bool
    user: str | None
    """OpenAI's end-user id: accepted and not used (as vLLM)."""
    request_id: str
    priority: int
    chat: ChatInput | None = None
    """`messages` instead of `input` (vLLM's chat form): one input, the rendered chat."""


def parse_embedding_request(body: Mapping[str, Any], limits: RequestLimits) -> EmbeddingRequest:
    """Scalar fields read as vLLM's pydantic model reads them (router/lax_values.py); a batch of inputs is limited
    like a completion's batched prompts (MAX_SEQUENCES); `messages` (without `input`) is one chat input."""
    body = with_lax_values(body, logprobs_is_boolean=False)
    chat = _chat_input(body, limits) if "messages" in body and "input" not in body else None
    if "input" not in body and chat is None:
        raise InvalidRequestError("input", "is required: a string, a list of strings, a list of token ids or a list "
                                           "of token-id lists (or send messages)")
    encoding_format = _typed(body, "encoding_format", str, "'float' or 'base64'", "float")
    if encoding_format not in EMBEDDING_ENCODING_FORMATS:
        raise InvalidRequestError("encoding_format", f"must be 'float' or 'base64', got {encoding_format!r}")
    dimensions = _typed(body, "dimensions", int, "an integer")
    use_activation = _typed(body, "use_activation", bool, "a boolean")
    truncation = _truncation(body, limits, pools=True)
    # Token-id inputs are counted after truncation by Orchestrator.validate_prompt(pools=True), which lets one fill
    # max_model_len (the completion parser's early count leaves room for an output token); the body's size bounds them.
    return EmbeddingRequest(_model(body), () if chat else _prompts(body, limits, 1, True, "input"), encoding_format,
                            PoolingParams(dimensions, use_activation), truncation,
                            bool(_flag(body, "add_special_tokens", True)), _typed(body, "user", str, "a string"),
                            _request_id(body, limits), _priority(body), chat)


def _chat_input(body: Mapping[str, Any], limits: RequestLimits) -> ChatInput:
    """vLLM's chat form of a pooling request: its ChatRequestOptionsMixin's defaults (no generation prompt, no
    special tokens beyond the template's)."""
    add_generation_prompt = bool(_flag(body, "add_generation_prompt", False))
    return ChatInput(_messages(body, limits), add_generation_prompt,
                     parse_chat_template_options(body, add_generation_prompt))
