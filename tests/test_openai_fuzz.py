"""Fuzzing the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions) with malformed
and extreme JSON bodies through a real HTTP connection to one served in-process cluster.

Every request must end with 200 and a well-formed completion (or SSE stream ending in [DONE]),
or with an OpenAI error object under a documented status: 400 (its `param` names a field of the
body, or null for a body that is not a JSON object), 404 (unknown model), 413 (body too large).
Never a 500, never a hang (each request has a timeout); afterwards the server still serves and
every worker is idle. Examples are derandomized so a run is reproducible and bounded in time.
"""

from __future__ import annotations

import http.client
import json
import math
import socket

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from splitserve.router.request_limits import MAX_BODY_BYTES
from tests.factories import ServedApis, http_request, served_apis

MODEL = "tiny-llama"
MAX_MODEL_LEN = 64
TIMEOUT_S = 30.0
FUZZ_SETTINGS = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
DOCUMENTED_ERRORS = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error"}
"""Status -> the error object's type, for what a client can cause with a request body alone."""


class Served(ServedApis):
    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        status, _headers, raw = http_request(self.http_port, "POST", path, body, timeout_s=TIMEOUT_S)
        return status, raw


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, max_model_len=MAX_MODEL_LEN) as served:
        yield served


# ---- what each request may end with --------------------------------------------------------

def _root(param: str) -> str:
    """The body key a param names: 'messages[1].content' -> 'messages', 'prompt.token_ids' -> 'prompt'."""
    return param.split(".")[0].split("[")[0]


def check_response(path: str, body: object, status: int, answer: bytes) -> str:
    """The response is a documented one for this body; returns a summary for the statistics."""
    if status != 200:
        assert status in DOCUMENTED_ERRORS, (status, answer[:500])
        error = json.loads(answer)["error"]
        assert sorted(error) == ["code", "message", "param", "type"]
        assert error["type"] == DOCUMENTED_ERRORS[status]
        param = error["param"]
        if param is None:
            assert error["code"] in ("invalid_json", "request_too_large", "unknown_url"), error
        else:
            # A missing required field is named too; a chat whose rendered prompt is too long is
            # refused at `prompt`; tools without a tool_choice ask for "auto", which this server
            # (no tool call parser) refuses at `tool_choice`.
            keys = set(body) | ({"messages", "prompt"} if path.endswith("chat/completions") else {"prompt"})
            keys |= {"tool_choice"} if isinstance(body, dict) and "tools" in body else set()
            assert isinstance(body, dict) and _root(param) in keys, (param, body)
        if status == 404:
            assert (error["code"], param) == ("model_not_found", "model") and body["model"] != MODEL
        return f"{status} {param}"
    num_prompts, n = _fan_out(body)
    if body.get("stream") is True:
        return _check_stream(path, answer, num_prompts * n)
    completion = json.loads(answer)
    choices, usage = completion["choices"], completion["usage"]
    assert [choice["index"] for choice in choices] == list(range(num_prompts * n))
    for choice in choices:
        _check_choice(path, choice)
    # every prompt counted once, each at most the context; every choice generated >= 1 token
    assert usage["prompt_tokens"] <= num_prompts * (MAX_MODEL_LEN - 1)
    assert num_prompts * n <= usage["completion_tokens"] <= num_prompts * (body.get("best_of") or n) * MAX_MODEL_LEN
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    return f"200 {choices[0]['finish_reason']} x{len(choices)}"


def _fan_out(body: dict) -> tuple[int, int]:
    """(prompts, choices per prompt) of a request that was served."""
    prompt = body.get("prompt")
    batch = isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)
    return (len(prompt) if batch else 1), (body.get("n") or 1)


def _check_choice(path: str, choice: dict) -> None:
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    text = choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    assert isinstance(text, str) or (text is None and choice["message"]["tool_calls"])


def _check_stream(path: str, answer: bytes, num_choices: int) -> str:
    """data: events, each a JSON chunk (no error event), exactly one finish reason per choice, then [DONE]."""
    events = [line for line in answer.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all("error" not in chunk for chunk in chunks), chunks
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"] and c["choices"][0]["finish_reason"]}
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(reasons) == num_choices and sorted(finished) == list(range(num_choices)), reasons
    assert set(reasons) <= {"stop", "length", "tool_calls"}, reasons
    return f"200 stream {reasons[0]} x{num_choices}"


# ---- strategies ---------------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    | st.sampled_from([0, -1, 2**31, 2**64, 10**400, 1e308, math.nan, math.inf, -math.inf, "", "\ud800"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6)
"""Anything JSON can carry (NaN, Infinity and huge integers too: Python's json reads them)."""


_COMMON_FIELDS = {
    "model": st.just(MODEL),
    "max_tokens": st.integers(1, 8),
    "temperature": st.sampled_from([0, 0.0, 0.8, 2]), "top_p": st.sampled_from([0.5, 1]),
    "top_k": st.sampled_from([-1, 0, 5, 10**30]), "min_p": st.sampled_from([0, 0.1]),
    "presence_penalty": st.sampled_from([-2, 0.5]), "frequency_penalty": st.sampled_from([2, -0.5]),
    "repetition_penalty": st.sampled_from([0.5, 1.2]), "seed": st.integers(-2**63, 2**64 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 600), max_size=3), "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "n": st.integers(1, 3),
    "return_tokens_as_token_ids": st.booleans(),
}
_COMPLETION_FIELDS = {
    **_COMMON_FIELDS,
    "prompt": st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 511), min_size=1, max_size=20)
    | st.sampled_from([[[1, 2]], ["one"], "word " * 5_000])
    | st.lists(st.text(min_size=1, max_size=10) | st.lists(st.integers(0, 511), min_size=1, max_size=6), min_size=2,
               max_size=3),
    "logprobs": st.integers(0, 20), "echo": st.booleans(), "best_of": st.integers(1, 3),
}
_CHAT_FIELDS = {
    **_COMMON_FIELDS,
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", ""]) | st.text(max_size=5),
         "content": st.text(max_size=20) | st.none()
         | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=2)}),
        min_size=1, max_size=3),
    "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20), "max_completion_tokens": st.integers(1, 8),
    "add_generation_prompt": st.booleans(),
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g"])},
        optional={"parameters": st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}},
                                                  {"type": "object"}, {}])})}), min_size=1, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "f"}}]),
    "parallel_tool_calls": st.booleans(),
    "response_format": st.just({"type": "text"}),
}


@st.composite
def bodies(draw, fields: dict[str, st.SearchStrategy], required: str) -> dict:
    """Mostly valid values for some of the fields (the required one nearly always), then up to
    two fields replaced by any JSON value or removed: a good share of requests is served."""
    body = {name: draw(valid) for name, valid in fields.items() if name == required or draw(st.booleans())}
    if body.get("stream") is not True:
        body.pop("stream_options", None)  # only valid with stream: true
    if body.get("logprobs") is not True:
        body.pop("top_logprobs", None)  # chat: only valid with logprobs: true
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2, unique=True)):
        if draw(st.integers(0, 4)):
            body[name] = draw(JSON_VALUES | st.sampled_from(["other", MODEL.upper(), "m\ud800"]))
        else:
            body.pop(name, None)
    return body


def _encode(body: object) -> bytes:
    # ensure_ascii: a lone surrogate ("\ud800") travels as its JSON escape, as a client would send it
    return json.dumps(body, ensure_ascii=True).encode()


# ---- the fuzz tests -----------------------------------------------------------------------

@FUZZ_SETTINGS
@given(body=bodies(_COMPLETION_FIELDS, "prompt"))
def test_completions_bodies(served, body):
    status, answer = served.post("/v1/completions", _encode(body))
    event(check_response("/v1/completions", body, status, answer))


@FUZZ_SETTINGS
@given(body=bodies(_CHAT_FIELDS, "messages"))
def test_chat_completions_bodies(served, body):
    status, answer = served.post("/v1/chat/completions", _encode(body))
    event(check_response("/v1/chat/completions", body, status, answer))


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(raw=st.binary(max_size=64) | JSON_VALUES.map(_encode), chat=st.booleans())
def test_bodies_that_are_not_requests(served, raw, chat):
    """Random bytes and JSON values that are not request objects: 400 invalid_json (or a field error)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, answer = served.post(path, raw)
    try:
        body = json.loads(raw)
    except ValueError:
        assert status == 400 and json.loads(answer)["error"]["code"] == "invalid_json", answer
        return
    event(check_response(path, body, status, answer))


# ---- targeted cases (each was a 500 before) -----------------------------------------------

def _error(served: Served, path: str, raw: bytes) -> tuple[int, dict]:
    status, answer = served.post(path, raw)
    return status, json.loads(answer)["error"]


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "request body is not valid JSON: maximum recursion depth exceeded while decoding a JSON array from a unicode "
     "string"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
     "request body is not valid JSON: Exceeds the limit (4300 digits) for integer string conversion: value has "
     "5000 digits; use sys.set_int_max_str_digits() to increase the limit"),
])
def test_json_the_parser_refuses_is_invalid_json(served, raw, message):
    assert _error(served, "/v1/completions", raw) == (400, {"message": message, "type": "invalid_request_error",
                                                            "param": None, "code": "invalid_json"})


def test_an_integer_beyond_float_range_is_a_field_error(served):
    status, error = _error(served, "/v1/completions", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}")
    assert (status, error["param"]) == (400, "temperature")
    assert error["message"] == f"temperature: must be a finite number >= 0, got {10**400}"


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/completions", {"prompt": "ok \ud800"}, "prompt",
     "prompt: is not valid Unicode (lone surrogate '\\ud800' at index 3)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, "messages[0].content",
     "messages[0].content: is not valid Unicode (lone surrogate '\\udfff' at index 0)"),
    ("/v1/chat/completions", {"messages": [{"role": "\ud800", "content": "hi"}]}, "messages[0].role",
     "messages[0].role: is not valid Unicode (lone surrogate '\\ud800' at index 0)"),
])
def test_lone_surrogates_are_field_errors(served, path, body, param, message):
    assert _error(served, path, _encode(body)) == (400, {"message": message, "type": "invalid_request_error",
                                                         "param": param, "code": None})


def test_an_unknown_model_named_with_a_lone_surrogate_is_404(served):
    status, answer = served.post("/v1/completions", _encode({"prompt": "x", "model": "m\ud800"}))
    assert status == 404
    assert b"m\\ud800" in answer  # escaped: the surrogate has no UTF-8 form
    assert json.loads(answer)["error"] == {
        "message": f"The model `m\ud800` does not exist; this server serves `{MODEL}`.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_body_over_the_limit_is_413(served):
    status, error = _error(served, "/v1/completions", b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}')
    assert (status, error["code"]) == (413, "request_too_large")


def test_a_body_larger_than_any_servable_request_is_413_before_it_is_read(served):
    """1 MiB + 128 prompts of 63 tokens x 13 bytes, escaped (6 bytes per byte): the largest body a
    servable request has at max_model_len 64. Only the headers are sent: an answer proves the
    server did not wait for the body."""
    limit = served.tokenizers.limits.max_body_bytes
    assert limit == (1 << 20) + 128 * (6 * 63 * 13 + 4)
    with socket.create_connection(("127.0.0.1", served.http_port), timeout=TIMEOUT_S) as client:
        client.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {limit + 1}\r\n\r\n".encode())
        answer = http.client.HTTPResponse(client)
        answer.begin()
        status, body = answer.status, answer.read()
    assert status == 413
    assert json.loads(body)["error"] == {
        "message": f"request body has {limit + 1} bytes; a servable request has at most {limit} (its prompts are "
                   "bounded by router.max_prompt_bytes and max_model_len)",
        "type": "invalid_request_error", "param": None, "code": "request_too_large"}


def test_after_the_fuzz_the_server_serves_and_nothing_leaked(served):
    served.loop.run(served.cluster.wait_idle())
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    status, answer = served.post("/v1/completions", _encode(body))
    assert (status, json.loads(answer)["usage"]["completion_tokens"]) == (200, 5)
    served.loop.run(served.cluster.wait_idle())
