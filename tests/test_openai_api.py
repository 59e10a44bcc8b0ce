"""The OpenAI-compatible HTTP API against in-process workers, driven by the official `openai` SDK
(unmodified) and by raw HTTP: exact outputs (the gRPC API's text, transformers' token ids),
streaming framing, error statuses, and cancellation when a client disconnects."""

from __future__ import annotations

import http.client
import json
import time

import openai
import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.slo import SloConfig
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.router.openai_protocol import parse_chat_request
from splitserve.router.openai_server import ApiError, start_http_server
from splitserve.router.api_types import RouterError
from splitserve.router.policy import RoutingConfig
from splitserve.testing.workloads import GreedyCase
from tests.factories import ServedApis, hf_greedy, http_request, make_request_limits, served_apis, stream_tokens

MODEL = "tiny-llama"
PROMPT = "The river runs"
CHAT = [{"role": "user", "content": "Tell me about the river."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LONG = 2000
"""max_tokens of requests a test cancels; the tiny model decodes about 1000 tokens/s, so a cancelled
request generates a small fraction of them."""


class Served(ServedApis):
    def client(self, port: int | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{port or self.http_port}/v1", api_key="none",
                             max_retries=0, timeout=60)

    def decode_generation_tokens(self) -> int:
        return sum(self.loop.run(w.stats()).engine.num_generation_tokens for w in self.cluster.decode_workers)

    def wait_idle(self) -> None:
        self.loop.run(self.cluster.wait_idle())

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        status, _, raw = http_request(self.http_port, "POST", path, json.dumps(body).encode())
        return status, json.loads(raw)

    def post_stream(self, path: str, body: dict) -> tuple[int, list[dict]]:
        """The status and the SSE events' bodies, [DONE] left out."""
        status, _, raw = http_request(self.http_port, "POST", path, json.dumps(body).encode())
        events = raw.decode().removesuffix("\n\n").split("\n\n")
        return status, [json.loads(event.removeprefix("data: ")) for event in events if event != "data: [DONE]"]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """One cluster with both APIs over the same orchestrator; usage reports cached tokens."""
    with served_apis(tiny_llama_dir, MODEL, served_class=Served,
                     router_options={"enable_prompt_tokens_details": True}) as served:
        yield served


def _grpc(served: Served, prompt_field: dict, **sampling) -> tuple[list[int], str]:
    request = pb.GenerateRequest(model=MODEL, sampling=pb.SamplingParams(**sampling), **prompt_field)
    token_ids, text, _ = stream_tokens(served.grpc_port, request)
    return token_ids, text


def _ids(tokens: list[str]) -> list[int]:
    """Token ids from logprob tokens under return_tokens_as_token_ids."""
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.removeprefix("token_id:")) for t in tokens]


# ---- outputs ------------------------------------------------------------------------------

def test_greedy_completion_equals_grpc_and_transformers(served, tiny_llama_dir):
    completion = served.client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, logprobs=0, temperature=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    grpc_ids, grpc_text = _grpc(served, {"text": PROMPT.encode()}, temperature=0, max_tokens=12, ignore_eos=True)
    prompt_ids = served.cluster.tokenizer.encode(PROMPT)
    (choice,) = completion.choices
    assert _ids(choice.logprobs.tokens) == grpc_ids == hf_greedy(tiny_llama_dir, GreedyCase(tuple(prompt_ids), 12,
                                                                                             True))
    assert choice.text == grpc_text and choice.finish_reason == "length"
    assert (completion.object, completion.model, completion.id.startswith("cmpl-")) == ("text_completion", MODEL, True)
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(prompt_ids), 12,
                                                                                  len(prompt_ids) + 12)
    served.wait_idle()


def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(served):
    prompt = list(range(100, 143))  # 5 full blocks of 8 and 3 tokens
    client = served.client()
    first, second = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, **GREEDY) for _ in range(2))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 40
    assert second.usage.prompt_tokens == 43 and second.choices[0].text == first.choices[0].text


def test_a_cache_salt_shares_the_prefix_cache_only_with_requests_of_its_own_salt(served):
    prompt = list(range(150, 193))  # 5 full blocks of 8 and 3 tokens
    client = served.client()

    def completion(**salt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                         extra_body={"ignore_eos": True, **salt})

    salted = [completion(cache_salt=salt) for salt in ("user-a", "user-a", "user-b")]
    unsalted = completion()
    assert [c.usage.prompt_tokens_details.cached_tokens for c in (*salted, unsalted)] == [0, 40, 0, 0]
    assert len({c.choices[0].text for c in (*salted, unsalted)}) == 1
    messages = [{"role": "user", "content": "Tell me about the river and the old mill by the village road."}]
    chats = [client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                            extra_body={"cache_salt": "user-c"}) for _ in range(2)]
    prompt_tokens = chats[0].usage.prompt_tokens
    assert [c.usage.prompt_tokens_details.cached_tokens for c in chats] == [0, (prompt_tokens - 1) // 8 * 8]
    lone_surrogate = json.dumps({"prompt": prompt, "max_tokens": 2, "cache_salt": "\ud800"}).encode()
    assert b'"\\ud800"' in lone_surrogate  # JSON's escape, which Python decodes to an unencodable str
    cached = [json.loads(http_request(served.http_port, "POST", "/v1/completions", lone_surrogate)[2])["usage"]
              ["prompt_tokens_details"]["cached_tokens"] for _ in range(2)]
    assert cached == [0, 40]
    served.wait_idle()


def test_token_id_prompt_gives_the_text_prompts_output(served):
    prompt_ids = served.cluster.tokenizer.encode(PROMPT)
    client = served.client()
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, **GREEDY)
    by_ids = client.completions.create(model=MODEL, prompt=prompt_ids, max_tokens=8, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text != ""
    assert by_ids.usage.prompt_tokens == len(prompt_ids)


def test_greedy_chat_equals_grpc_chat(served):
    chat = served.client().chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10, **GREEDY)
    messages = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
    grpc_ids, grpc_text = _grpc(served, {"chat": messages}, temperature=0, max_tokens=10, ignore_eos=True)
    (choice,) = chat.choices
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", grpc_text, "length")
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    prompt_ids = served.cluster.tokenizer.apply_chat_template(CHAT)
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, len(grpc_ids)) == (len(prompt_ids), 10, 10)


def test_streamed_completion_with_usage_equals_the_whole_response(served):
    client = served.client()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in content] == [None] * (len(content) - 1) + ["length"]
    assert all(c.usage is None for c in content) and len({c.id for c in chunks}) == 1
    counts = lambda usage: (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)  # noqa: E731
    assert last.choices == [] and counts(last.usage) == counts(whole.usage)  # (the second one hits the cache)


def test_streamed_chat_opens_with_the_role_and_carries_the_content(served):
    client = served.client()
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks][-2:] == [None, "length"]
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_interval_sends_the_tokens_in_chunks_of_at_least_that_many(served, path):
    """vLLM's stream_interval 3 with max_tokens 8: the first token at once, then chunks of 3 or more (a
    decode step's tokens are never split), the finishing chunk with what waited; the same tokens and text."""
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
            **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT})}
    status, whole = served.post(path, body)
    status_streamed, events = served.post_stream(path, {**body, "stream": True, "stream_interval": 3})
    choices = [event["choices"][0] for event in events if event["choices"] and event["choices"][0].get("token_ids")]
    texts = [choice["text"] if path == "/v1/completions" else choice["delta"]["content"] for choice in choices]
    counts = [len(choice["token_ids"]) for choice in choices]
    assert (status, status_streamed, counts[0], sum(counts)) == (200, 200, 1, 8)
    assert all(count >= 3 for count in counts[1:-1]) and len(counts) <= 4, counts
    assert [choice["finish_reason"] for choice in choices] == [None] * (len(choices) - 1) + ["length"]
    output = whole["choices"][0]
    assert [t for choice in choices for t in choice["token_ids"]] == output["token_ids"]
    assert "".join(texts) == (output["text"] if path == "/v1/completions" else output["message"]["content"])


@pytest.mark.parametrize(("value", "message"), [(0, "must be an integer >= 1, got 0"),
                                                (2.5, "must be an integer >= 1, got 2.5"),
                                                ("two", "must be an integer >= 1, got 'two'")])
def test_a_bad_stream_interval_is_a_400(served, value, message):
    status, reply = served.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "stream_interval": value})
    assert (status, reply["error"]["param"], reply["error"]["message"]) == (400, "stream_interval",
                                                                            f"stream_interval: {message}")


def test_stream_interval_null_or_without_stream_changes_nothing(served):
    for extra in ({"stream_interval": None}, {"stream_interval": 4}):
        status, reply = served.post("/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, **extra})
        assert (status, reply["usage"]["completion_tokens"]) == (200, 3)


def test_stop_strings_cut_the_text_and_name_the_stop(served):
    client = served.client()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, **GREEDY).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    for stops in (stop, [stop, "never-generated"]):
        choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stop=stops, **GREEDY).choices[0]
        assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", stop)
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stop=stop, stream=True,
                                              **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_follow_the_openai_shape(served):
    logprobs = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=2,
                                                  **GREEDY).choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 2 and max(top.values()) == logprob <= 0  # greedy: the sampled token is the best
        assert top[token] == logprob


@pytest.mark.parametrize("top", [0, 1])
def test_completion_top_logprobs_always_hold_the_sampled_token(served, top):
    """OpenAI: "The API will always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements"; a sampled token outside the top `logprobs` is added after them."""
    prompt = served.cluster.tokenizer.encode(PROMPT)
    params = {"temperature": 1.0, "seed": 11, "max_tokens": 8}
    logprobs = served.client().completions.create(
        model=MODEL, prompt=prompt, logprobs=top, **params,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0].logprobs
    chunks = served.loop.run(served.cluster.generate(
        "reference", tuple(prompt), SamplingParams(ignore_eos=True, logprobs=top, **params)))
    expected = [lp for chunk in chunks for lp in chunk.logprobs]
    assert any(lp.token_id not in [t for t, _ in lp.top] for lp in expected)  # a sample outside the top
    assert _ids(logprobs.tokens) == [lp.token_id for lp in expected]
    for entry, lp in zip(logprobs.top_logprobs, expected):
        ranked = [t for t, _ in lp.top] + ([] if lp.token_id in [t for t, _ in lp.top] else [lp.token_id])
        assert _ids(list(entry)) == ranked
        assert entry[f"token_id:{lp.token_id}"] == pytest.approx(lp.logprob, abs=1e-5)


def test_chat_logprobs_equal_the_orchestrators(served):
    response = served.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, temperature=0)
    content = response.choices[0].logprobs.content
    prompt = served.cluster.tokenizer.apply_chat_template(CHAT)
    chunks = served.loop.run(served.cluster.generate(
        "reference", prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)))
    expected = [lp for chunk in chunks for lp in chunk.logprobs]
    assert _ids([entry.token for entry in content]) == [lp.token_id for lp in expected]
    assert [entry.logprob for entry in content] == pytest.approx([lp.logprob for lp in expected], abs=1e-5)
    token_bytes = served.cluster.tokenizer.token_bytes
    for entry, lp in zip(content, expected):
        assert _ids([t.token for t in entry.top_logprobs]) == [t for t, _ in lp.top]
        assert entry.bytes == list(token_bytes(lp.token_id))  # the token's bytes, not its "token_id:" name
        assert [t.bytes for t in entry.top_logprobs] == [list(token_bytes(t)) for t, _ in lp.top]


def test_chat_logprob_bytes_join_into_the_text_where_characters_span_tokens(served):
    """OpenAI's `bytes` exist for characters split across tokens: each entry has its token's own
    bytes (one byte of a UTF-8 sequence for a byte-level piece, whose `token` reads U+FFFD), so
    joined they are the output's UTF-8 (here: every token's, none of them a stop token)."""
    response = served.client().chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, logprobs=True, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    content = response.choices[0].logprobs.content
    ids = _ids([entry.token for entry in content])
    joined = b"".join(bytes(entry.bytes) for entry in content)
    assert joined.decode("utf-8", errors="replace") == served.cluster.tokenizer.decode(ids)
    partial = [bytes(entry.bytes) for entry in content if len(entry.bytes) == 1 and entry.bytes[0] >= 0x80]
    assert partial  # the sample holds pieces of multi-byte characters (a random model: many)


def test_a_seed_reproduces_the_sample_and_matches_grpc(served):
    client = served.client()

    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first, again, other = sample(1234), sample(1234), sample(4321)
    _, grpc_text = _grpc(served, {"text": PROMPT.encode()}, temperature=1.0, seed=1234, max_tokens=16,
                         ignore_eos=True)
    assert first == again == grpc_text and other != first


def test_metrics_are_served_on_the_http_port_too(served):
    finished = served.requests_ended("request_success", finished_reason="length")
    served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, **GREEDY)
    assert served.requests_ended("request_success", finished_reason="length") == finished + 1


def test_models_and_health(served):
    client = served.client()
    (model,) = client.models.list().data
    assert (model.id, model.owned_by, client.models.retrieve(MODEL).id) == (MODEL, "splitserve", MODEL)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    assert http_request(served.http_port, "GET", "/health")[0] == 200


def test_ping_is_vllms_health_check_for_sagemaker(served):
    assert [http_request(served.http_port, method, "/ping")[::2] for method in ("GET", "POST")] == [(200, b"")] * 2


# ---- errors -------------------------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"stop": [""]}, "stop"),
    ({"extra_body": {"stream_options": {"include_usage": True}}}, "stream_options"),
    ({"extra_body": {"cache_salt": ""}}, "cache_salt"),
    ({"extra_body": {"cache_salt": 5}}, "cache_salt"),
])
def test_bad_completion_parameters_are_400_naming_the_field(served, kwargs, param):
    with pytest.raises(openai.BadRequestError) as error:
        served.client().completions.create(model=MODEL, prompt=PROMPT, **kwargs)
    assert (error.value.status_code, error.value.param, error.value.type) == (400, param, "invalid_request_error")


def test_bad_chat_parameters_are_400_naming_the_field(served):
    client = served.client()
    cases = [({"top_logprobs": 2}, "top_logprobs"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
             ({"messages": []}, "messages"), ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
             ({"tools": {}}, "tools"), ({"extra_body": {"cache_salt": ""}}, "cache_salt"),
             ({"extra_body": {"cache_salt": ["user-a"]}}, "cache_salt")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**{"model": MODEL, "messages": CHAT, **kwargs})
        assert error.value.param == param, kwargs


def test_a_refusal_content_part_is_read_as_its_text():
    """What the openai SDK sends back for an answer the model refused (vLLM reads it as text)."""
    history = [{"role": "user", "content": "Hi"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."},
                                                 {"type": "text", "text": "Ask again."}]}]
    request = parse_chat_request({"messages": history}, make_request_limits())
    assert [message.content for message in request.messages] == ["Hi", "I can't.\nAsk again."]
    with pytest.raises(InvalidRequestError) as error:
        parse_chat_request({"messages": [{"role": "assistant", "content": [{"type": "refusal", "text": "x"}]}]},
                           make_request_limits())
    assert error.value.field == "messages[0].content[0]"


def test_plain_string_and_thinking_content_parts_are_read_as_text(served):
    """vLLM's request model takes a plain string as a content part (LangChain sends
    `HumanMessage(content=["...", {...}])` so) and a `{"type": "thinking", "thinking"}` part (gateways
    translating Anthropic messages send it), both read as text; they were a 400."""
    client = served.client()

    def chat(messages: list[dict]) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **GREEDY)

    question = [{"role": "user", "content": "Tell me about\nthe river."}]
    listed = [{"role": "user", "content": ["Tell me about", {"type": "text", "text": "the river."}]}]
    answer = [{"role": "assistant", "content": "It runs.\nIt is long."}]
    thinking = [{"role": "assistant", "content": [{"type": "thinking", "thinking": "It runs."}, "It is long."]}]
    follow_up = [{"role": "user", "content": "And the mill?"}]
    for plain, parts in ((question, listed), (question + answer + follow_up, listed + thinking + follow_up)):
        expected, got = chat(plain), chat(parts)
        assert got.usage.prompt_tokens == expected.usage.prompt_tokens
        assert got.choices[0].message.content == expected.choices[0].message.content



@pytest.mark.parametrize("part_type", [["text"], {"text": 1}])
def test_a_content_part_whose_type_is_not_a_string_is_refused_naming_it(part_type):
    """A JSON list or object as a part's type (unhashable): a field error, not a TypeError (a 500)."""
    with pytest.raises(InvalidRequestError) as error:
        parse_chat_request({"messages": [{"role": "user", "content": [{"type": part_type, "text": "x"}]}]},
                           make_request_limits())
    assert (error.value.field, error.value.message) == (
        "messages[0].content[0]", 'only text content parts are supported (a string, {"type": "text", "text": ...}, '
                                  '"refusal" or "thinking"), '
                                  f"got {{'type': {part_type!r}, 'text': 'x'}}")

def test_an_unknown_model_is_404_model_not_found(served):
    with pytest.raises(openai.NotFoundError) as error:
        served.client().chat.completions.create(model="gpt-4o", messages=CHAT)
    assert (error.value.status_code, error.value.code, error.value.param) == (404, "model_not_found", "model")


def test_the_request_timeout_is_504_and_frees_the_workers(served):
    server = served.loop.run(start_http_server(served.cluster.orchestrator, served.tokenizers, MODEL, port=0,
                                               request_timeout_s=0.2))
    try:
        with pytest.raises(openai.InternalServerError) as error:
            served.client(server.port).completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG, **GREEDY)
    finally:
        served.loop.run(server.stop())
    assert (error.value.status_code, error.value.code) == (504, "deadline_exceeded")
    served.wait_idle()


def test_admission_rejection_is_429(tiny_llama_dir):
    # Every prompt token is predicted to take 1 s to prefill: no request can meet a 1 ms TTFT.
    routing = RoutingConfig(disaggregation="always", admission_ttft_factor=2.0, default_prefill_s_per_token=1.0)
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, routing=routing,
                     slo=SloConfig(ttft_s=1e-3)) as served:
        client = served.client()
        for stream in (False, True):  # a streamed request is rejected before its response starts
            with pytest.raises(openai.RateLimitError) as error:
                client.completions.create(model=MODEL, prompt=PROMPT, stream=stream)
            assert (error.value.status_code, error.value.code) == (429, "resource_exhausted")
            assert "TTFT" in error.value.message
        assert dict(served.cluster.orchestrator.routing_stats().rejections) == {"ttft_slo": 2}
        assert http_request(served.http_port, "GET", "/health")[0] == 200


@pytest.mark.parametrize(("code", "status", "error_type"), [
    ("RESOURCE_EXHAUSTED", 429, "rate_limit_error"), ("UNAVAILABLE", 503, "server_error"),
    ("DEADLINE_EXCEEDED", 504, "server_error"), ("INTERNAL", 500, "server_error"),
    ("INVALID_ARGUMENT", 400, "invalid_request_error")])
def test_router_error_codes_map_to_http_statuses(code, status, error_type):
    error = ApiError.of(RouterError(code, "why"))
    assert (error.status, error.body()) == (status, {"error": {"message": "why", "type": error_type, "param": None,
                                                               "code": code.lower()}})


# ---- raw HTTP -----------------------------------------------------------------------------

def _completion_body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}).encode()


@pytest.mark.parametrize(("body", "param", "code"), [
    (b"{not json", None, "invalid_json"),
    (b"\xff\xfe", None, "invalid_json"),
    (b"[1, 2]", None, "invalid_json"),
    (_completion_body(max_tokens="ten"), "max_tokens", None),
    (_completion_body(stream="sure"), "stream", None),  # "yes" is true, as vLLM's pydantic model reads it
    (_completion_body(prompt={"text": "x"}), "prompt", None),
    (_completion_body(prompt=[1, 2, 10 ** 9]), "prompt", None),
    (_completion_body(ignore_eos=2), "ignore_eos", None),
    (_completion_body(seed="7.5"), "seed", None),
])
def test_malformed_requests_are_400_in_the_openai_error_shape(served, body, param, code):
    status, headers, raw = http_request(served.http_port, "POST", "/v1/completions", body)
    assert (status, headers["content-type"]) == (400, "application/json")
    error = json.loads(raw)["error"]
    assert (set(error), error["type"], error["param"], error["code"]) == (
        {"message", "type", "param", "code"}, "invalid_request_error", param, code)


def test_unknown_routes_and_methods_get_openai_errors_and_the_server_carries_on(served):
    status, _, raw = http_request(served.http_port, "POST", "/v1/embeddings", b"{}")
    assert (status, json.loads(raw)["error"]["code"]) == (404, "unknown_url")
    status, _, raw = http_request(served.http_port, "GET", "/v1/completions")
    assert status == 405 and json.loads(raw)["error"]["type"] == "invalid_request_error"
    status, _, raw = http_request(served.http_port, "POST", "/v1/completions", _completion_body(temperature=0))
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 4


def test_sse_framing_ends_with_done(served):
    status, headers, raw = http_request(served.http_port, "POST", "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": CHAT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}}).encode())
    assert (status, headers["content-type"]) == (200, "text/event-stream; charset=utf-8")
    text = raw.decode()
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    assert events[-1] == "data: [DONE]"
    bodies = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert bodies[-1]["choices"] == [] and bodies[-1]["usage"]["completion_tokens"] == 5
    assert [b["choices"][0]["finish_reason"] for b in bodies[:-1]][-1] == "length"


# ---- cancellation -------------------------------------------------------------------------

def test_a_client_disconnecting_mid_stream_cancels_the_request(served):
    before, cancelled = served.decode_generation_tokens(), served.requests_ended("request_failure", code="CANCELLED")
    stream = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG, stream=True, **GREEDY)
    received = [next(stream) for _ in range(3)]
    stream.close()
    served.wait_idle()
    assert all(chunk.choices[0].finish_reason is None for chunk in received)
    assert served.decode_generation_tokens() - before < LONG // 2
    assert served.requests_ended("request_failure", code="CANCELLED") == cancelled + 1
    assert served.cluster.orchestrator.admission.in_flight == 0  # the request's slot was released


def test_a_client_disconnecting_before_a_whole_response_cancels_the_request(served):
    before, cancelled = served.decode_generation_tokens(), served.requests_ended("request_failure", code="CANCELLED")
    connection = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=60)
    connection.request("POST", "/v1/completions", body=_completion_body(max_tokens=LONG, temperature=0,
                                                                        ignore_eos=True))
    deadline = time.monotonic() + 30
    while served.decode_generation_tokens() == before:  # the request is decoding
        assert time.monotonic() < deadline, "the request never reached the decode worker"
        time.sleep(0.01)
    connection.close()
    served.wait_idle()
    assert served.decode_generation_tokens() - before < LONG // 2
    assert served.requests_ended("request_failure", code="CANCELLED") == cancelled + 1
    assert served.cluster.orchestrator.admission.in_flight == 0  # the request's slot was released


def test_a_chat_too_long_for_the_context_is_400_naming_messages(served):
    """With OpenAI's code and OpenAI's and vLLM's words, which LiteLLM matches for its ContextWindowExceededError."""
    long_chat = [{"role": "user", "content": "the river runs " * 400}]
    status, _, raw = http_request(served.http_port, "POST", "/v1/chat/completions",
                          json.dumps({"model": MODEL, "messages": long_chat, "max_tokens": 1}).encode())
    error = json.loads(raw)["error"]
    _, _, counted = http_request(served.http_port, "POST", "/tokenize", json.dumps({"messages": long_chat}).encode())
    max_model_len = json.loads(counted)["max_model_len"]
    assert (status, error["param"], error["code"]) == (400, "messages", "context_length_exceeded")
    assert error["message"] == (f"This model's maximum context length is {max_model_len} tokens. However, messages "
                                f"has {json.loads(counted)['count']} tokens, and at least one output token must fit. "
                                "Please reduce the length of the input.")


def test_the_http_servers_connections_send_small_writes_at_once():
    """TCP_NODELAY on every accepted connection: without it each streamed chunk after the first
    waits for the client's delayed ACK (40 ms on Linux)."""
    import asyncio
    import socket

    from splitserve.router.http_server import listening_socket

    async def scenario():
        accepted = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer):
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listening_socket("127.0.0.1", 0))
        _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        nodelay = await asyncio.wait_for(accepted, 5)
        writer.close()
        server.close()
        return nodelay

    assert asyncio.run(scenario()) == 1
