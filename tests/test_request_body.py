"""Request bodies (router/request_body.py): decoding errors, and the same parsed request or the same
refusal whether a body is parsed on the event loop or, when large, in the parser's process; a
parser process that dies is replaced without losing the body it was given."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import pickle
import signal

import pytest

from splitserve.common.config import SamplingDefaults
from splitserve.common.errors import ContextLengthExceededError, InvalidRequestError
from splitserve.common.generation_config import RequestDefaults
from splitserve.router.openai_protocol import parse_chat_request, parse_completion_request
from splitserve.router.request_body import LARGE_BODY_BYTES, BodyParser, MalformedBodyError, json_object
from splitserve.router.structured_output import LARGE_GRAMMAR_BYTES
from tests.factories import child_of_killed_process, make_request_limits, process_running
from tests.process_probe import process_id

LIMITS = make_request_limits()
PADDING = " " * LARGE_BODY_BYTES
LARGE_EMPTY_BODY = b"{}" + PADDING.encode()
"""An empty object padded past LARGE_BODY_BYTES: parsed in the parser's process."""
"""Whitespace that makes a body large (JSON ignores it) without changing what it says."""

COMPLETION = {
    "model": "tiny-llama", "prompt": ["The river runs", [5, 6, 7]], "max_tokens": 12, "temperature": 0.7,
    "top_p": 0.9, "top_k": 20, "seed": 3, "stop": ["\n\n", "END"], "stop_token_ids": [9], "n": 2, "best_of": 3,
    "logprobs": 2, "presence_penalty": 0.5, "request_id": "abc-1",
    "response_format": {"type": "json_schema",
                        "json_schema": {"name": "x", "schema": {"type": "object",
                                                                "properties": {"a": {"type": "integer"}}}}},
}
CHAT = {
    "messages": [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]}],
    "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 1, "stream": True,
    "stream_options": {"include_usage": True}, "continue_final_message": False, "chat_template_kwargs": {"k": 1},
}


def body_of(request: dict, large: bool) -> bytes:
    body = json.dumps(request).encode()
    return body + PADDING.encode() if large else body


@pytest.fixture(scope="module")
def bodies():
    parser = BodyParser(LIMITS)
    yield parser
    parser.close()


@pytest.fixture
def own_parser():
    """A parser of the test's own, whose process the test may signal or kill."""
    parser = BodyParser(LIMITS)
    yield parser
    parser.close()


def parse(parser: BodyParser, parse_fn, body: bytes):
    return asyncio.run(parser.parse(parse_fn, body))


@pytest.mark.parametrize("body, message", [
    (b"{", "request body is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
           "(char 1)"),
    (b"[1, 2]", "request body must be a JSON object, got list"),
    (b"\xff{}", "request body is not valid JSON: 'utf-8' codec can't decode byte 0xff in position 0: invalid start "
                "byte"),
    (b"[" * 100_000 + b"]" * 100_000, "request body is not valid JSON: maximum recursion depth exceeded while "
                                      "decoding a JSON array from a unicode string"),
])
def test_a_body_that_is_not_a_json_object_is_refused_saying_why(body, message):
    with pytest.raises(MalformedBodyError) as refused:
        json_object(body)
    assert str(refused.value) == message


def test_small_bodies_are_parsed_here_and_large_ones_in_the_parsers_process(bodies):
    assert parse(bodies, process_id, b"{}") == os.getpid()
    assert parse(bodies, process_id, LARGE_EMPTY_BODY) != os.getpid()


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "guided_json", "guided_grammar", "tools",
                                   "format"])
def test_a_middling_body_that_may_carry_a_grammar_is_parsed_in_the_parsers_process(bodies, field):
    """Its grammar is compiled while it is parsed (about 2 ms per KB of schema): off the event loop."""
    middling = b" " * LARGE_GRAMMAR_BYTES
    assert parse(bodies, process_id, b'{"%s": 1}' % field.encode() + middling) != os.getpid()
    assert parse(bodies, process_id, b'{"prompt": 1}' + middling) == os.getpid()
    assert parse(bodies, process_id, b'{"%s": 1}' % field.encode()) == os.getpid()


@pytest.mark.parametrize("request_body, parse_fn", [(COMPLETION, parse_completion_request), (CHAT, parse_chat_request)])
def test_a_large_body_parses_to_the_request_a_small_one_does(bodies, request_body, parse_fn):
    here = parse(bodies, parse_fn, body_of(request_body, large=False))
    there = parse(bodies, parse_fn, body_of(request_body, large=True))
    assert there == here
    assert there.sampling.max_tokens == (12 if parse_fn is parse_completion_request else 8)


def test_a_parser_with_the_servers_sampling_defaults_bound_parses_the_same_in_the_process(bodies):
    """OpenAIServing binds --generation-config's defaults with functools.partial; the process gets them too."""
    defaults = RequestDefaults(SamplingDefaults(temperature=0.7, top_k=20), max_tokens_limit=5)
    parse_fn = functools.partial(parse_chat_request, defaults=defaults)
    here = parse(bodies, parse_fn, body_of(CHAT, large=False))
    there = parse(bodies, parse_fn, body_of(CHAT, large=True))
    assert there == here
    assert (there.sampling.temperature, there.sampling.top_k, there.sampling.max_tokens) == (0.7, 20, 5)


def test_a_prompt_too_long_keeps_its_token_counts_across_processes():
    """What Anthropic's message states (router/anthropic_protocol.py's prompt_too_long_message)."""
    error = pickle.loads(pickle.dumps(ContextLengthExceededError("messages", "has 2410 tokens", 512, 2410, 511)))
    assert (type(error), error.field, str(error), error.num_tokens, error.max_prompt_tokens) == (
        ContextLengthExceededError, "messages", "This model's maximum context length is 512 tokens. However, messages "
        "has 2410 tokens. Please reduce the length of the input.", 2410, 511)


@pytest.mark.parametrize("large", [False, True])
def test_a_refusal_is_the_same_from_the_process(bodies, large):
    too_long = {"prompt": "a" * (LIMITS.max_prompt_bytes + 1)}
    with pytest.raises(InvalidRequestError) as refused:
        parse(bodies, parse_completion_request, body_of(too_long, large))
    assert (type(refused.value), refused.value.field, refused.value.num_tokens) == (
        ContextLengthExceededError, "prompt", None)
    assert str(refused.value) == (f"This model's maximum context length is 2048 tokens. However, prompt has "
                                  f"{LIMITS.max_prompt_bytes + 1} bytes (UTF-8); at most {LIMITS.max_prompt_bytes} "
                                  "can be served (router.max_prompt_bytes). Please reduce the length of the input.")
    with pytest.raises(MalformedBodyError, match="^request body must be a JSON object, got list$"):
        parse(bodies, parse_completion_request, b"[]" + (PADDING.encode() if large else b""))


def test_an_invalid_request_error_survives_pickling():
    error = pickle.loads(pickle.dumps(InvalidRequestError("stop", "at most 16 stop strings")))
    assert (type(error), error.field, error.message, str(error)) == (
        InvalidRequestError, "stop", "at most 16 stop strings", "stop: at most 16 stop strings")


def test_a_dead_parser_process_is_replaced_and_the_body_still_parsed(own_parser):
    first = parse(own_parser, process_id, LARGE_EMPTY_BODY)
    os.kill(first, signal.SIGKILL)
    assert parse(own_parser, process_id, LARGE_EMPTY_BODY) == os.getpid()  # the pool broke: parsed here
    second = parse(own_parser, process_id, LARGE_EMPTY_BODY)
    assert second not in (first, os.getpid())
    assert parse(own_parser, parse_completion_request, body_of(COMPLETION, large=True)) == \
        parse_completion_request(COMPLETION, LIMITS)


def test_the_parser_process_keeps_parsing_through_a_ctrl_c(own_parser):
    # A terminal's Ctrl-C is a SIGINT to the whole process group; the router drains its requests after it.
    parser_pid = parse(own_parser, process_id, LARGE_EMPTY_BODY)
    os.kill(parser_pid, signal.SIGINT)
    assert parse(own_parser, process_id, LARGE_EMPTY_BODY) == parser_pid


_KILLED_ROUTER = f"""
import asyncio
import functools
from splitserve.router.request_body import BodyParser
from tests.factories import make_request_limits
from tests.process_probe import process_id
parser = BodyParser(make_request_limits())
print(asyncio.run(parser.parse(process_id, b"{{}}" + b" " * {LARGE_BODY_BYTES})), flush=True)
input()
"""


def test_the_parser_process_ends_with_a_router_that_is_killed():
    """A router's process killed outright (SIGKILL, the OOM killer) cannot close its parser: before,
    the parser process (and multiprocessing's resource tracker, which waits on it) lived on."""
    parser_pid, ran = child_of_killed_process(_KILLED_ROUTER)
    assert ran and not process_running(parser_pid)
