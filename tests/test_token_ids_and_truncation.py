"""vLLM's return_token_ids (the prompt's and the output's token ids in the response, where vLLM puts
them) and truncate_prompt_tokens / truncation_side (the prompt cut to its last or first N tokens)
on the OpenAI API (truncation on gRPC too), checked against the tokenizer's own ids."""

from __future__ import annotations

import json

import grpc
import pytest

from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from tests.factories import ServedApis, http_request, served_apis, stream_tokens

MODEL = "tiny-llama"
PROMPT = "The river runs by the old mill and the wheel turns slowly"
CHAT = [{"role": "user", "content": "Hello there"}]


class Served(ServedApis):
    def post(self, path: str, body: dict) -> tuple[int, dict]:
        status, _, raw = http_request(self.http_port, "POST", path, json.dumps(body).encode())
        return status, json.loads(raw)

    def events(self, path: str, body: dict) -> list[dict]:
        status, _, raw = http_request(self.http_port, "POST", path, json.dumps({**body, "stream": True}).encode())
        assert status == 200
        return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served) as served:
        yield served


GREEDY = {"model": MODEL, "temperature": 0, "max_tokens": 5, "ignore_eos": True}


# ---- return_token_ids ---------------------------------------------------------------------------

def test_a_completion_returns_each_prompts_and_each_choices_token_ids(served):
    tokenizer = served.cluster.tokenizer
    prompts = [PROMPT, "Once upon a time"]
    status, reply = served.post("/v1/completions", {**GREEDY, "prompt": prompts, "n": 2, "seed": 1,
                                                    "temperature": 1.0, "return_token_ids": True})
    assert status == 200
    for index, choice in enumerate(reply["choices"]):
        assert choice["prompt_token_ids"] == tokenizer.encode(prompts[index // 2])
        # (a sampled output may end inside a character: its text holds only whole ones)
        assert len(choice["token_ids"]) == 5 and tokenizer.decode(choice["token_ids"]).rstrip("\ufffd") == choice["text"]
    assert "prompt_token_ids" not in served.post("/v1/completions", {**GREEDY, "prompt": PROMPT})[1]["choices"][0]


def test_a_completion_stream_carries_the_prompt_ids_once_and_each_chunks_new_ids(served):
    tokenizer = served.cluster.tokenizer
    whole = served.post("/v1/completions", {**GREEDY, "prompt": PROMPT, "return_token_ids": True})[1]["choices"][0]
    events = served.events("/v1/completions", {**GREEDY, "prompt": PROMPT, "return_token_ids": True})
    choices = [event["choices"][0] for event in events if event["choices"]]
    assert choices[0]["prompt_token_ids"] == tokenizer.encode(PROMPT)
    assert all("prompt_token_ids" not in choice for choice in choices[1:])
    assert [t for choice in choices for t in choice["token_ids"]] == whole["token_ids"]


def test_a_chat_returns_the_prompt_ids_in_the_response_and_the_output_ids_in_each_choice(served):
    tokenizer = served.cluster.tokenizer
    prompt_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    status, reply = served.post("/v1/chat/completions", {**GREEDY, "messages": CHAT, "return_token_ids": True})
    assert status == 200 and reply["prompt_token_ids"] == prompt_ids
    (choice,) = reply["choices"]
    assert tokenizer.decode(choice["token_ids"]) == choice["message"]["content"] and len(choice["token_ids"]) == 5
    events = served.events("/v1/chat/completions", {**GREEDY, "messages": CHAT, "return_token_ids": True})
    assert events[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in event for event in events[1:])
    assert [t for event in events[1:] if event["choices"] for t in event["choices"][0]["token_ids"]] == \
        choice["token_ids"]


# ---- truncate_prompt_tokens, truncation_side ------------------------------------------------

@pytest.mark.parametrize(("side", "expected"), [(None, slice(-4, None)), ("left", slice(-4, None)),
                                                ("right", slice(0, 4))])
def test_the_prompt_keeps_its_last_or_first_n_tokens(served, side, expected):
    """vLLM's default side for generation is left (keep the last N); the output equals the
    output of the truncated prompt sent as token ids."""
    ids = served.cluster.tokenizer.encode(PROMPT)
    body = {**GREEDY, "prompt": PROMPT, "truncate_prompt_tokens": 4, "return_token_ids": True}
    if side is not None:
        body["truncation_side"] = side
    status, reply = served.post("/v1/completions", body)
    assert status == 200
    (choice,) = reply["choices"]
    assert choice["prompt_token_ids"] == ids[expected] and reply["usage"]["prompt_tokens"] == 4
    by_ids = served.post("/v1/completions", {**GREEDY, "prompt": ids[expected], "return_token_ids": True})[1]
    assert choice["token_ids"] == by_ids["choices"][0]["token_ids"]


def test_a_chat_and_a_token_id_prompt_are_truncated_too(served):
    tokenizer = served.cluster.tokenizer
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    reply = served.post("/v1/chat/completions", {**GREEDY, "messages": CHAT, "truncate_prompt_tokens": 3,
                                                 "return_token_ids": True})[1]
    assert reply["prompt_token_ids"] == chat_ids[-3:]
    max_model_len = served.cluster.orchestrator.max_model_len
    long_ids = list(range(5, 9)) * max_model_len  # longer than the context: only truncation makes it servable
    status, reply = served.post("/v1/completions", {**GREEDY, "prompt": long_ids, "truncate_prompt_tokens": -1,
                                                    "return_token_ids": True, "max_tokens": 1})
    assert status == 200, reply
    assert reply["choices"][0]["prompt_token_ids"] == long_ids[-(max_model_len - 1):]  # -1: max_model_len - 1


def test_a_prompt_shorter_than_the_truncation_is_kept_whole(served):
    ids = served.cluster.tokenizer.encode(PROMPT)
    reply = served.post("/v1/completions", {**GREEDY, "prompt": PROMPT, "truncate_prompt_tokens": len(ids) + 3,
                                            "return_token_ids": True})[1]
    assert reply["choices"][0]["prompt_token_ids"] == ids


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "must be an integer >= -1, got -2"),
    ({"truncate_prompt_tokens": "four"}, "truncate_prompt_tokens", "must be an integer >= -1, got 'four'"),
    ({"truncate_prompt_tokens": 5000}, "truncate_prompt_tokens",
     "truncate_prompt_tokens=5000 cannot be greater than max_model_len = 2048. Please request a smaller truncation "
     "size."),
    ({"truncation_side": "middle"}, "truncation_side", "must be 'left' or 'right', got 'middle'"),
    ({"return_token_ids": "sure"}, "return_token_ids", "must be a boolean, got 'sure'"),
])
def test_bad_values_are_400_naming_the_field(served, fields, param, message):
    status, reply = served.post("/v1/completions", {**GREEDY, "prompt": PROMPT, **fields})
    assert (status, reply["error"]["param"], reply["error"]["message"]) == (400, param, f"{param}: {message}")


def test_grpc_truncates_text_chat_and_token_id_prompts_as_the_openai_api_does(served):
    tokenizer = served.cluster.tokenizer
    ids = tokenizer.encode(PROMPT)
    greedy = pb.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = served.post("/v1/completions", {**GREEDY, "prompt": ids[:4], "return_token_ids": True}
                           )[1]["choices"][0]["token_ids"]
    for request in (pb.GenerateRequest(text=PROMPT.encode(), truncate_prompt_tokens=4, truncation_side="right"),
                    pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids * 300), truncate_prompt_tokens=4,
                                       truncation_side="right")):
        request.sampling.CopyFrom(greedy)
        token_ids, _, responses = stream_tokens(served.grpc_port, request)
        assert (token_ids, responses[-1].usage.prompt_tokens) == (expected, 4)
    chat = pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hello there")]),
                              truncate_prompt_tokens=-1, sampling=greedy)
    assert stream_tokens(served.grpc_port, chat)[2][-1].usage.prompt_tokens == len(
        tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
    with pytest.raises(grpc.RpcError) as error:
        stream_tokens(served.grpc_port, pb.GenerateRequest(text=PROMPT.encode(), truncate_prompt_tokens=-5))
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                          "truncate_prompt_tokens: must be an integer >= -1, got -5")
