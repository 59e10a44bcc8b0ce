"""Fuzzing the gRPC Generation API through a real channel to one served in-process cluster.

Malformed and extreme requests (random, empty, huge or invalid-UTF-8 prompts, token ids out of
range, every sampling field at its extremes, odd chat messages and request ids, unknown models, SLO
targets, 1 ms deadlines, corrupted wire bytes) must each end with OK and a well-formed stream, or with
a documented status: INVALID_ARGUMENT whose message names a field the request actually got wrong
(an oracle below re-derives which fields are invalid from the documented ranges and request
limits), RESOURCE_EXHAUSTED
(only for an oversized message or a request that set its own TTFT target), DEADLINE_EXCEEDED (only
for a short deadline). Never INTERNAL or UNKNOWN, never a hang (every call has a deadline). Afterwards
the server still serves, and every worker is idle with the router's own accounting back to zero
(nothing leaked). Examples are derandomized so a run is reproducible and bounded in time.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.proto.splitserve.v1 import generation_pb2_grpc as pb_grpc
from splitserve.router.server import MAX_MESSAGE_BYTES
from tests.factories import ServedApis, served_apis

MODEL = "tiny-llama"
MAX_MODEL_LEN = 64
"""Small, so a request allowed to run to the end of the context stays short."""
VOCAB_SIZE = 512
MAX_CHAT_MESSAGES = 1024
MAX_STOP_STRING_CHARS = 1024
MAX_REQUEST_ID_CHARS = 256
REQUEST_ID_ALPHABET = "".join(map(chr, range(0x21, 0x7F)))
"""The documented request limits (docs/serving.md), restated as the oracle; the prompt's byte
limit is (MAX_MODEL_LEN - 1) x the tokenizer's longest vocabulary entry in bytes."""
CALL_DEADLINE_S = 30.0
"""Every call's deadline: a call that outlives it is a hang, and fails the test."""
SHORT_DEADLINES_S = (0.001, 0.05)
FUZZ_SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

INT32 = st.integers(-2**31, 2**31 - 1)
EXTREME_INT32 = st.sampled_from([-2**31, -2, -1, 0, 1, 2, 20, 21, 2**31 - 1])
FLOAT32 = st.floats(width=32) | st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1.0, 2.0, -2.0, 3.4e38, math.nan, math.inf,
                                                 -math.inf])
_FLOAT_RULES = {
    "temperature": lambda v: 0 <= v <= 2,
    "top_p": lambda v: 0 < v <= 1,
    "min_p": lambda v: 0 <= v <= 1,
    "repetition_penalty": lambda v: math.isfinite(v) and v > 0,
    "frequency_penalty": lambda v: -2 <= v <= 2,
    "presence_penalty": lambda v: -2 <= v <= 2,
}
_INT_RULES = {
    "top_k": lambda v: v >= -1,
    "max_tokens": lambda v: v >= 1,
    "logprobs": lambda v: 0 <= v <= MAX_LOGPROBS,
}
"""The documented valid ranges (SamplingParams' field docs), restated here as the oracle."""


# ---- what each request may end with --------------------------------------------------------

def invalid_fields(request: pb.GenerateRequest, tokenizer) -> set[str]:
    """Every field the server may name in INVALID_ARGUMENT for this request; empty: it is valid."""
    bad = {"model"} if request.model not in ("", MODEL) else set()
    if len(request.request_id) > MAX_REQUEST_ID_CHARS or not set(request.request_id) <= set(REQUEST_ID_ALPHABET):
        bad.add("request_id")
    sampling = request.sampling
    for name, valid in {**_FLOAT_RULES, **_INT_RULES}.items():
        if sampling.HasField(name) and not valid(getattr(sampling, name)):
            bad.add(name)
    if (any(s == "" or len(s) > MAX_STOP_STRING_CHARS for s in sampling.stop)
            or len(sampling.stop) > MAX_STOP_STRINGS):
        bad.add("stop")
    if (any(not 0 <= t < VOCAB_SIZE for t in sampling.stop_token_ids)
            or len(sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS):
        bad.add("stop_token_ids")
    for name in ("ttft_slo_s", "tpot_slo_s"):
        if request.HasField(name) and not 0 < getattr(request, name) < math.inf:
            bad.add(name)
    if request.HasField("cache_salt") and not request.cache_salt:
        bad.add("cache_salt")
    bad |= _truncation(request)[1]
    token_ids, prompt_bad = _prompt(request, tokenizer)
    if sampling.HasField("max_tokens") and sampling.max_tokens > MAX_MODEL_LEN:
        bad.add("max_tokens")  # one that does not fit after the prompt ends at the end of the context (vLLM's)
    return bad | prompt_bad


def _truncation(request: pb.GenerateRequest) -> tuple[tuple[int, bool] | None, set[str]]:
    """(tokens kept, whether the last ones) when the request validly truncates its prompt, else None; and
    the truncation fields it got wrong (RequestLimits.prompt_truncation: truncation_side 'left' or
    'right', -1 <= truncate_prompt_tokens <= MAX_MODEL_LEN, -1 meaning MAX_MODEL_LEN - 1)."""
    side = request.truncation_side if request.HasField("truncation_side") else "left"
    bad = set() if side in ("left", "right") else {"truncation_side"}
    if not request.HasField("truncate_prompt_tokens"):
        return None, bad
    keep = request.truncate_prompt_tokens
    if not -1 <= keep <= MAX_MODEL_LEN:
        return None, bad | {"truncate_prompt_tokens"}
    return (MAX_MODEL_LEN - 1 if keep == -1 else keep, side != "right"), bad


def _prompt(request: pb.GenerateRequest, tokenizer) -> tuple[list[int], set[str]]:
    """The prompt's token ids (truncated as the request asks), and the fields the server may name for it
    (empty: a valid prompt)."""
    max_bytes = (MAX_MODEL_LEN - 1) * tokenizer.max_bytes_per_token
    kind = request.WhichOneof("prompt")
    bad = set()
    if kind is None:
        return [], {"prompt"}
    if kind == "text":
        if len(request.text) > max_bytes:
            return [], {"prompt"}
        try:
            token_ids = tokenizer.encode(request.text.decode("utf-8"))
        except UnicodeDecodeError:
            return [], {"prompt.text"}
    elif kind == "chat":
        token_ids, bad = _chat_prompt(request.chat, tokenizer, max_bytes)
        if token_ids is None:  # refused before it rendered: the server names the messages only
            return [], bad
    else:
        token_ids = list(request.token_ids.ids)
    truncation = _truncation(request)[0]
    if truncation is not None and len(token_ids) > truncation[0]:
        keep, keep_last = truncation
        token_ids = token_ids[len(token_ids) - keep:] if keep_last else token_ids[:keep]
    if not 0 < len(token_ids) < MAX_MODEL_LEN:
        bad.add("prompt")
    if any(not 0 <= t < VOCAB_SIZE for t in token_ids):
        bad.add("prompt.token_ids")
    return token_ids, bad


def _chat_prompt(chat: pb.ChatMessages, tokenizer, max_bytes: int) -> tuple[list[int] | None, set[str]]:
    """The rendered chat's token ids (None: refused before rendering), and the message fields at fault."""
    if not chat.messages or len(chat.messages) > MAX_CHAT_MESSAGES:
        return None, {"messages"}
    bad = {"messages"} if sum(len(m.content.encode()) for m in chat.messages) > max_bytes else set()
    messages = [{"role": m.role, "content": m.content} for m in chat.messages]
    add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    try:
        token_ids = tokenizer.apply_chat_template(messages, add)
    except InvalidRequestError as error:  # the chat template refused the messages
        return None, bad | {error.field}
    if len(tokenizer.render_chat_template(messages, add).encode()) > max_bytes:
        bad.add("messages")
    return token_ids, bad  # _prompt names a rendered chat's token count outside (0, MAX_MODEL_LEN) `prompt`


@dataclass(frozen=True)
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: tuple[pb.GenerateResponse, ...]


def _summary(outcome: Outcome) -> str:
    """The status and, for INVALID_ARGUMENT, the field named (hypothesis statistics)."""
    if outcome.code == grpc.StatusCode.INVALID_ARGUMENT:
        return f"INVALID_ARGUMENT {outcome.details.partition(': ')[0]}"
    if outcome.code == grpc.StatusCode.OK:
        return f"OK {outcome.responses[-1].finish_reason}"
    return outcome.code.name


def check_outcome(request: pb.GenerateRequest, outcome: Outcome, tokenizer, deadline_s: float) -> None:
    """The outcome is one the API documents for this request (see the module docstring)."""
    code, details = outcome.code, outcome.details
    bad = invalid_fields(request, tokenizer)
    if code == grpc.StatusCode.OK:
        assert not bad, f"accepted a request with invalid {sorted(bad)}"
        check_stream(request, len(_prompt(request, tokenizer)[0]), outcome.responses)
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        field = details.partition(": ")[0]
        assert field in bad, f"INVALID_ARGUMENT names {field!r}; invalid fields are {sorted(bad)}: {details}"
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        assert request.HasField("ttft_slo_s"), details  # admission control against the request's own target
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        assert deadline_s < CALL_DEADLINE_S, f"a call hung past {CALL_DEADLINE_S} s: {details}"
    else:
        pytest.fail(f"undocumented status {code.name}: {details}")


def check_stream(request: pb.GenerateRequest, num_prompt_tokens: int,
                 responses: tuple[pb.GenerateResponse, ...]) -> None:
    """Only the last message ends the stream, with a finish reason, usage counting the prompt and
    every token streamed, and within the request's limits."""
    assert responses, "an OK stream without messages"
    assert all(r.finish_reason == "" for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason in ("stop", "length")
    token_ids = [t for r in responses for t in r.token_ids]
    usage = last.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (num_prompt_tokens, len(token_ids))
    assert usage.completion_tokens >= 1
    assert usage.prompt_tokens + usage.completion_tokens <= MAX_MODEL_LEN
    sampling = request.sampling
    max_tokens = sampling.max_tokens if sampling.HasField("max_tokens") else SamplingParams().max_tokens
    assert usage.completion_tokens <= max_tokens
    assert all(0 <= t < VOCAB_SIZE for t in token_ids)
    if sampling.HasField("logprobs"):
        assert [lp.token_id for r in responses for lp in r.logprobs] == token_ids
        assert all(len(lp.top) == sampling.logprobs for r in responses for lp in r.logprobs)
    if last.finish_reason == "length":
        assert MAX_MODEL_LEN == usage.prompt_tokens + usage.completion_tokens or usage.completion_tokens == max_tokens
    text = "".join(r.text for r in responses)
    assert not any(stop in text for stop in sampling.stop), "the text goes on past a stop string"
    if last.HasField("stop_string"):
        assert (last.finish_reason, last.stop_string in sampling.stop) == ("stop", True)


# ---- the served cluster -------------------------------------------------------------------

class Served(ServedApis):
    channel: grpc.Channel
    reference: list[int]

    def call(self, request: pb.GenerateRequest, deadline_s: float = CALL_DEADLINE_S) -> Outcome:
        return self._outcome(pb_grpc.GenerationStub(self.channel).Generate(request, timeout=deadline_s))

    def call_raw(self, data: bytes, deadline_s: float = CALL_DEADLINE_S) -> Outcome:
        """Send `data` as the request message's bytes, whatever they are."""
        generate = self.channel.unary_stream("/splitserve.v1.Generation/Generate", request_serializer=None,
                                             response_deserializer=pb.GenerateResponse.FromString)
        return self._outcome(generate(data, timeout=deadline_s))

    @staticmethod
    def _outcome(call) -> Outcome:
        try:
            return Outcome(grpc.StatusCode.OK, "", tuple(call))
        except grpc.RpcError as error:
            return Outcome(error.code(), error.details() or "", ())


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """The cluster, and the greedy tokens of _greedy(8) before any fuzzing (`reference`)."""
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, max_model_len=MAX_MODEL_LEN) as served:
        # The client sends anything; the server's own limit is what is being tested.
        with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}",
                                   options=[("grpc.max_send_message_length", -1)]) as channel:
            served.channel = channel
            served.reference = _tokens(served.call(_greedy(8)))
            yield served


def _tokens(outcome: Outcome) -> list[int]:
    assert outcome.code == grpc.StatusCode.OK, outcome
    return [t for r in outcome.responses for t in r.token_ids]


# ---- strategies ---------------------------------------------------------------------------

def _sometimes(draw, valid: st.SearchStrategy, extreme: st.SearchStrategy):
    """Unset (None) half the time, else mostly a valid value and sometimes an extreme one: most
    requests then get past validation, so generation itself is fuzzed too."""
    roll = draw(st.integers(0, 19))
    if roll < 10:
        return None
    return draw(valid if roll < 17 else extreme)


_VALID_FLOATS = {
    "temperature": st.sampled_from([0.0, 0.7, 1.0, 1e-30, 2.0]),  # above 2: RequestLimits refuses it "top_p": st.sampled_from([1e-45, 0.5, 1.0]),
    "min_p": st.sampled_from([0.0, 0.2, 1.0]), "repetition_penalty": st.sampled_from([1e-45, 0.5, 1.3, 3e38]),
    "frequency_penalty": st.sampled_from([-2.0, 0.5, 2.0]), "presence_penalty": st.sampled_from([-2.0, 1.0, 2.0]),
}


@st.composite
def sampling_params(draw) -> pb.SamplingParams:
    message = pb.SamplingParams()
    for name, valid in _VALID_FLOATS.items():
        value = _sometimes(draw, valid, FLOAT32)
        if value is not None:
            setattr(message, name, value)
    for name, valid in (("top_k", st.sampled_from([-1, 0, 1, 5, 2**31 - 1])), ("logprobs", st.integers(0, 20)),
                        # mostly short outputs; a long one runs to the end of the (small) context
                        ("max_tokens", st.integers(1, 8) | st.just(2**31 - 1))):
        value = _sometimes(draw, valid, EXTREME_INT32 | INT32)
        if value is not None:
            setattr(message, name, value)
    if draw(st.booleans()):
        message.seed = draw(st.integers(0, 2**64 - 1))
    for name in ("ignore_eos", "skip_special_tokens"):
        if draw(st.booleans()):
            setattr(message, name, draw(st.booleans()))
    many_stops = [f"never{i}" for i in range(MAX_STOP_STRINGS)]
    message.stop.extend(_sometimes(draw, st.lists(st.text(min_size=1, max_size=4), max_size=4) | st.just(many_stops)
                                   | st.just(["x" * MAX_STOP_STRING_CHARS]),
                                   st.lists(st.text(max_size=4), min_size=1, max_size=3)
                                   | st.just(many_stops * 1000) | st.just(["x" * (MAX_STOP_STRING_CHARS + 1)])) or ())
    message.stop_token_ids.extend(_sometimes(draw, st.lists(st.integers(0, VOCAB_SIZE + 2), max_size=4)
                                             | st.just([VOCAB_SIZE - 1] * MAX_STOP_TOKEN_IDS),
                                             st.lists(EXTREME_INT32 | INT32, min_size=1, max_size=4)
                                             | st.just([VOCAB_SIZE] * 100_000)) or ())
    return message


def _set_prompt(request: pb.GenerateRequest, kind: str, value) -> None:
    if kind == "text":
        request.text = value
    elif kind == "token_ids":
        request.token_ids.ids.extend(value)
    elif kind == "chat":
        messages, add_generation_prompt = value
        request.chat.messages.extend(pb.ChatMessage(role=role, content=content) for role, content in messages)
        if add_generation_prompt is not None:
            request.chat.add_generation_prompt = add_generation_prompt


_ROLES = st.sampled_from(["user", "assistant", "system", "developer", "", "tool", "{{ x }}"]) | st.text(max_size=8)
PROMPTS = st.one_of(
    st.tuples(st.just("text"), st.text(min_size=1, max_size=60).map(str.encode)),
    st.tuples(st.just("text"), st.binary(max_size=40)),  # mostly invalid UTF-8
    st.tuples(st.just("text"), st.sampled_from([b"", b"The river runs", "\x00\u202e\U0001f600".encode(),
                                                b"river " * 40_000])),
    st.tuples(st.just("token_ids"), st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=30)),
    st.tuples(st.just("token_ids"), st.lists(EXTREME_INT32 | INT32, max_size=10)),
    st.tuples(st.just("token_ids"), st.sampled_from([[], [7] * (MAX_MODEL_LEN - 1), [7] * MAX_MODEL_LEN,
                                                     [7] * 100_000])),
    st.tuples(st.just("chat"), st.tuples(st.lists(st.tuples(_ROLES, st.text(max_size=30)), min_size=1, max_size=3),
                                         st.none() | st.booleans())),
    st.tuples(st.just("chat"), st.just(((), None))),
    st.tuples(st.just("none"), st.none()),
)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    request = pb.GenerateRequest(model=_sometimes(draw, st.sampled_from(["", MODEL]),
                                                  st.sampled_from(["gpt-4", "\x00", MODEL.upper(), MODEL + " "])) or "",
                                 request_id=draw(st.just("") | st.text(REQUEST_ID_ALPHABET, max_size=12)
                                                 | st.text(max_size=12)))
    _set_prompt(request, *draw(PROMPTS))
    if draw(st.integers(0, 3)):
        request.sampling.CopyFrom(draw(sampling_params()))
    for name in ("ttft_slo_s", "tpot_slo_s"):
        value = _sometimes(draw, st.sampled_from([1e-300, 0.5, 1e300]), st.floats() | st.sampled_from([0.0, -1.0]))
        if value is not None:
            setattr(request, name, value)
    cache_salt = _sometimes(draw, st.sampled_from(["user-a", "ünï ☕"]), st.just(""))
    if cache_salt is not None:
        request.cache_salt = cache_salt
    truncate = _sometimes(draw, st.sampled_from([-1, 0, 1, 8, MAX_MODEL_LEN - 1, MAX_MODEL_LEN]),
                          st.sampled_from([-2, MAX_MODEL_LEN + 1, -2 ** 31, 2 ** 31 - 1]))
    if truncate is not None:
        request.truncate_prompt_tokens = truncate
    side = _sometimes(draw, st.sampled_from(["left", "right"]), st.sampled_from(["", "middle", "LEFT", "\x00"]))
    if side is not None:
        request.truncation_side = side
    return request


# ---- the fuzz tests -----------------------------------------------------------------------

_unique = itertools.count()


@FUZZ_SETTINGS
@given(request=generate_requests(), deadline_s=st.sampled_from((CALL_DEADLINE_S,) * 4 + SHORT_DEADLINES_S))
def test_every_request_ends_with_a_documented_outcome(served, request, deadline_s):
    if request.request_id:
        # A deadline-cut call may still be ending at the router when the next one arrives: ids
        # that repeat across examples would then be refused as duplicates (tested on its own below).
        request.request_id += f"#{next(_unique)}"
    outcome = served.call(request, deadline_s)
    event(_summary(outcome))
    check_outcome(request, outcome, served.cluster.tokenizer, deadline_s)


@st.composite
def corrupted_requests(draw) -> bytes:
    """A serialized request with a few bytes replaced, cut or appended, or random bytes."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=64))
    data = bytearray(draw(generate_requests()).SerializeToString())
    for position, value in draw(st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4)):
        if data:
            data[position % len(data)] = value
    cut = draw(st.none() | st.integers(0, 10_000))
    if cut is not None and data:
        del data[cut % len(data):]
    return bytes(data) + draw(st.binary(max_size=4))


@FUZZ_SETTINGS
@given(data=corrupted_requests())
def test_corrupted_wire_bytes_are_invalid_argument(served, data):
    """Bytes that do not parse name `request`; bytes that do are judged like any request."""
    outcome = served.call_raw(data)
    event(_summary(outcome))
    try:
        request = pb.GenerateRequest.FromString(data)
    except DecodeError:
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, outcome
        assert outcome.details.startswith("request: cannot be parsed (Error parsing message with type "
                                          "'splitserve.v1.GenerateRequest': "), outcome.details
        return
    check_outcome(request, outcome, served.cluster.tokenizer, CALL_DEADLINE_S)


# ---- targeted cases -----------------------------------------------------------------------

def _greedy(max_tokens: int, request_id: str = "", **prompt) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, **(prompt or {"text": b"The river runs"}),
                              sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


def test_the_oracle_names_a_refused_chat_as_the_server_does(served):
    """A chat refused before it renders is invalid in its messages only, never its token count (`prompt`):
    the oracle may not accept a field the server would be wrong to name."""
    refused = pb.GenerateRequest(model=MODEL, chat=pb.ChatMessages())
    assert invalid_fields(refused, served.cluster.tokenizer) == {"messages"}
    outcome = served.call(refused)
    assert (outcome.code, outcome.details) == (grpc.StatusCode.INVALID_ARGUMENT,
                                               "messages: must be a non-empty list of {role, content} messages")


def test_malformed_bytes_name_the_request(served):
    valid = _greedy(2).SerializeToString()
    cases = {b"\xff\xff\xff\xff": "Wire format was corrupt", valid[:-1]: "Wire format was corrupt",
             b"\x0a\x02\xff\xfe" + valid: "String field had bad UTF-8"}  # request_id: not UTF-8
    for data, reason in cases.items():
        outcome = served.call_raw(data)
        assert (outcome.code, outcome.details) == (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request: cannot be parsed (Error parsing message with type 'splitserve.v1.GenerateRequest': {reason})")


def test_oversized_message_is_resource_exhausted(served):
    request = pb.GenerateRequest(text=b"a" * (MAX_MESSAGE_BYTES + 1))
    outcome = served.call(request)
    assert (outcome.code, outcome.details) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"SERVER: Received message larger than max ({request.ByteSize()} vs. {MAX_MESSAGE_BYTES})")


def test_max_tokens_2_31_is_refused_as_on_every_api(served):
    outcome = served.call(_greedy(2**31 - 1, token_ids=pb.TokenIds(ids=[5, 6, 7])))
    assert (outcome.code, outcome.details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"max_tokens: must be at most max_model_len {MAX_MODEL_LEN}, got {2**31 - 1}")


def test_max_tokens_filling_the_context_and_more_runs_to_its_end(served):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), sampling=pb.SamplingParams(ignore_eos=True))
    request.sampling.max_tokens = MAX_MODEL_LEN - 3  # exactly what the context leaves
    outcome = served.call(request)
    last = outcome.responses[-1]
    assert (outcome.code, last.finish_reason, last.usage.completion_tokens) == (
        grpc.StatusCode.OK, "length", MAX_MODEL_LEN - 3)
    request.sampling.max_tokens = MAX_MODEL_LEN  # more than it leaves: ends there too, as vLLM 0.32
    outcome = served.call(request)
    assert (outcome.code, outcome.responses[-1].finish_reason, outcome.responses[-1].usage.completion_tokens) == (
        grpc.StatusCode.OK, "length", MAX_MODEL_LEN - 3)


def test_one_millisecond_deadline(served):
    outcome = served.call(_greedy(MAX_MODEL_LEN - 8, token_ids=pb.TokenIds(ids=[5, 6, 7])), deadline_s=0.001)
    assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED
    served.loop.run(served.cluster.wait_idle())


def test_concurrent_fuzz_burst(served):
    """Invalid, valid and deadline-cut requests at once, from several threads."""
    to_the_end = _greedy(MAX_MODEL_LEN - 3, token_ids=pb.TokenIds(ids=[5, 6, 7]))
    requests = [to_the_end, _greedy(0), _greedy(4, token_ids=pb.TokenIds(ids=[-1])), _greedy(6),
                pb.GenerateRequest(text=b"\xc3\x28"), to_the_end] * 3
    deadlines = [CALL_DEADLINE_S, CALL_DEADLINE_S, CALL_DEADLINE_S, CALL_DEADLINE_S, CALL_DEADLINE_S, 0.05] * 3
    outcomes: list[Outcome | None] = [None] * len(requests)

    def run(index: int) -> None:
        outcomes[index] = served.call(requests[index], deadlines[index])

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(CALL_DEADLINE_S * 2)
    codes = [outcome.code.name for outcome in outcomes]
    assert [codes[i] for i in range(len(codes)) if i % 6 != 5] == [
        "OK", "INVALID_ARGUMENT", "INVALID_ARGUMENT", "OK", "INVALID_ARGUMENT"] * 3
    for request, outcome, deadline_s in zip(requests, outcomes, deadlines):
        check_outcome(request, outcome, served.cluster.tokenizer, deadline_s)


def test_after_the_fuzz_the_server_serves_and_nothing_leaked(served):
    """Last in this module: every worker idle (no request, lease, transfer or KV block held) and
    the router's in-flight and per-worker accounting back to zero; health and a normal request
    still work, with the same tokens as at the start of the run."""
    served.loop.run(served.cluster.wait_idle())
    assert len(served.reference) == 8
    assert _tokens(served.call(_greedy(8))) == served.reference
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING
    served.loop.run(served.cluster.wait_idle())
