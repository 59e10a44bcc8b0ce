"""The prompt's logprobs over the OpenAI API (what lm-evaluation-harness's local-completions sends):
completions with echo + logprobs, vLLM's prompt_logprobs field on completions and chat, and their
refusals; and over gRPC. Exact values against transformers' log_softmax of the prompt (fp32, tiny Llama)."""

from __future__ import annotations

import json

import openai
import pytest
import torch

from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from tests.factories import _hf_model, http_request, served_apis, stream_tokens

MODEL = "tiny-llama"
PROMPT = "The river runs past the old mill"
AS_IDS = {"ignore_eos": True, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def prompt_ids(served) -> list[int]:
    return served.cluster.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, prompt_ids) -> torch.Tensor:
    """[len(prompt), vocab]: row p is log p(next token | prompt[: p + 1])."""
    with torch.inference_mode():
        return torch.log_softmax(_hf_model(tiny_llama_dir)(torch.tensor([prompt_ids])).logits[0].float(), dim=-1)


def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="none", max_retries=0,
                         timeout=60)


def post(served, path: str, **body) -> tuple[int, dict]:
    status, _, raw = http_request(served.http_port, "POST", path, json.dumps({"model": MODEL, **body}).encode())
    return status, json.loads(raw)


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_echo_with_logprobs_scores_the_prompt_like_transformers(served, prompt_ids, reference):
    choice = client(served).completions.create(model=MODEL, prompt=prompt_ids, max_tokens=1, logprobs=2, echo=True,
                                               temperature=0, extra_body=AS_IDS).choices[0]
    logprobs, count = choice.logprobs, len(prompt_ids)
    assert _ids(logprobs.tokens)[:count] == prompt_ids and len(logprobs.tokens) == count + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing precedes it
    for position in range(1, count):
        row = reference[position - 1]
        assert logprobs.token_logprobs[position] == pytest.approx(float(row[prompt_ids[position]]), abs=1e-4)
        top = _ids(list(logprobs.top_logprobs[position]))
        best = torch.topk(row, 2).indices.tolist()
        assert top[:2] == best and set(top) == set(best) | {prompt_ids[position]}
    assert _ids(logprobs.tokens)[count] == int(torch.argmax(reference[-1]))  # greedy output after the prompt
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(count + 1)]


def test_echo_with_logprobs_on_a_text_prompt_starts_with_its_text(served, prompt_ids):
    choice = client(served).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=0, echo=True,
                                               temperature=0, extra_body={"ignore_eos": True}).choices[0]
    assert choice.text.startswith(PROMPT)
    assert len(choice.logprobs.tokens) == len(prompt_ids) + 3
    assert "".join(choice.logprobs.tokens[:len(prompt_ids)]) == served.cluster.tokenizer.decode(prompt_ids)


@pytest.mark.parametrize("best_of", [2, 3])
def test_echo_with_logprobs_for_n_choices_of_batched_prompts(served, prompt_ids, best_of):
    """Each choice starts with its own prompt's tokens and logprobs, the same as a single request's (also
    when best_of sequences per prompt are ranked down to n)."""
    other = prompt_ids[3:]
    args = dict(model=MODEL, max_tokens=2, logprobs=2, echo=True, temperature=0, extra_body=AS_IDS)
    api = client(served)
    alone = {len(p): api.completions.create(prompt=p, **args).choices[0].logprobs for p in (prompt_ids, other)}
    choices = api.completions.create(prompt=[prompt_ids, other], n=2, best_of=best_of, **args).choices
    assert [c.index for c in choices] == [0, 1, 2, 3]
    for choice, prompt in zip(choices, [prompt_ids, prompt_ids, other, other]):
        count = len(prompt)
        assert _ids(choice.logprobs.tokens)[:count] == prompt
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:count] == pytest.approx(alone[count].token_logprobs[1:count], abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_alone(served, prompt_ids, stream):
    """vLLM's echo without generation: the prompt's text and logprobs only (one token is generated and
    counted in usage, as vLLM does)."""
    args = dict(model=MODEL, prompt=prompt_ids, max_tokens=0, logprobs=1, echo=True, temperature=0, extra_body=AS_IDS)
    scored = client(served).completions.create(model=MODEL, prompt=prompt_ids, max_tokens=1, logprobs=1, echo=True,
                                               temperature=0, extra_body=AS_IDS).choices[0].logprobs
    if stream:
        chunks = [c.choices[0] for c in client(served).completions.create(stream=True, **args)]
        text = "".join(c.text for c in chunks)
        tokens = [t for c in chunks for t in c.logprobs.tokens]
        token_logprobs = [lp for c in chunks for lp in c.logprobs.token_logprobs]
    else:
        completion = client(served).completions.create(**args)
        choice = completion.choices[0]
        text, tokens, token_logprobs = choice.text, choice.logprobs.tokens, choice.logprobs.token_logprobs
        assert choice.finish_reason == "length" and completion.usage.completion_tokens == 1
    assert text == served.cluster.tokenizer.decode(prompt_ids)
    assert _ids(tokens) == prompt_ids
    assert token_logprobs == scored.token_logprobs[:len(prompt_ids)]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_ids_but_no_output_ids(served, prompt_ids, stream):
    """return_token_ids follows the text: the choice is its prompt alone, so its output ids are empty."""
    body = {"prompt": prompt_ids, "max_tokens": 0, "echo": True, "temperature": 0, "return_token_ids": True}
    if stream:
        status, _, raw = http_request(served.http_port, "POST", "/v1/completions",
                                      json.dumps({"model": MODEL, "stream": True, **body}).encode())
        assert status == 200
        choices = [json.loads(line.removeprefix(b"data: "))["choices"][0] for line in raw.split(b"\n\n")
                   if line.startswith(b"data: {")]
        assert [t for c in choices for t in c["token_ids"]] == []
        assert [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c] == [prompt_ids]
        return
    status, response = post(served, "/v1/completions", **body)
    assert status == 200
    assert response["choices"][0]["token_ids"] == [] and response["choices"][0]["prompt_token_ids"] == prompt_ids


def test_streamed_echo_with_logprobs_equals_the_whole_response(served, prompt_ids):
    api = client(served)
    args = dict(model=MODEL, prompt=prompt_ids, max_tokens=5, logprobs=1, echo=True, temperature=0, extra_body=AS_IDS)
    whole = api.completions.create(**args).choices[0]
    chunks = [c.choices[0] for c in api.completions.create(stream=True, **args)]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [(t, lp, off) for c in chunks for t, lp, off in zip(c.logprobs.tokens, c.logprobs.token_logprobs,
                                                                     c.logprobs.text_offset)]
    assert streamed == list(zip(whole.logprobs.tokens, whole.logprobs.token_logprobs, whole.logprobs.text_offset))
    assert len(chunks[0].logprobs.tokens) == len(prompt_ids) + 1  # the prompt comes with the first token


def test_prompt_logprobs_field_on_completions_follows_vllm(served, prompt_ids, reference):
    status, body = post(served, "/v1/completions", prompt=prompt_ids, max_tokens=2, temperature=0, prompt_logprobs=1,
                        return_tokens_as_token_ids=True)
    assert status == 200
    entries = body["choices"][0]["prompt_logprobs"]
    assert body["choices"][0]["logprobs"] is None and len(entries) == len(prompt_ids) and entries[0] is None
    for position in range(1, len(prompt_ids)):
        row, token = reference[position - 1], prompt_ids[position]
        entry = entries[position]
        assert list(entry)[0] == str(token)  # the prompt token first, then the top alternative
        assert entry[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert entry[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
        best = int(torch.argmax(row))
        assert entry[str(best)]["rank"] == 1 and entry[str(best)]["decoded_token"] == f"token_id:{best}"
        assert set(entry) == {str(token), str(best)}


def test_prompt_logprobs_field_on_chat_is_on_the_response(served):
    messages = [{"role": "user", "content": "hello there"}]
    status, body = post(served, "/v1/chat/completions", messages=messages, max_tokens=2, prompt_logprobs=0)
    assert status == 200
    prompt = served.cluster.tokenizer.apply_chat_template(messages)
    entries = body["prompt_logprobs"]
    assert len(entries) == len(prompt) and entries[0] is None
    assert [list(entry) for entry in entries[1:]] == [[str(token)] for token in prompt[1:]]


def test_without_them_no_field_is_added(served):
    status, body = post(served, "/v1/completions", prompt=PROMPT, max_tokens=2)
    assert status == 200 and "prompt_logprobs" not in body["choices"][0]


@pytest.mark.parametrize(("path", "fields", "message"), [
    ("/v1/completions", {"prompt": PROMPT, "stream": True, "prompt_logprobs": 1}, "stream"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21},
     "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": "two"}, "integer"),
    ("/v1/completions", {"prompt": PROMPT, "echo": True, "logprobs": 21},
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1, "max_tokens": 0}, ">= 1"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True, "prompt_logprobs": 2},
     "stream"),
])
def test_bad_requests_are_400_naming_the_field(served, path, fields, message):
    status, body = post(served, path, **{"max_tokens": 2, **fields})
    assert status == 400
    assert body["error"]["param"] in ("prompt_logprobs", "logprobs", "max_tokens") and message in body["error"]["message"]


def test_grpc_returns_them_on_the_first_message(served, prompt_ids, reference):
    """gRPC's SamplingParams.prompt_logprobs: GenerateResponse.prompt_logprobs on the message with the first
    token, one per prompt token after the first."""
    request = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=prompt_ids),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2))
    _, _, responses = stream_tokens(served.grpc_port, request)
    first, *rest = responses
    assert [lp.token_id for lp in first.prompt_logprobs] == prompt_ids[1:]
    for position, lp in enumerate(first.prompt_logprobs, start=1):
        row = reference[position - 1]
        assert lp.logprob == pytest.approx(float(row[prompt_ids[position]]), abs=1e-4)
        assert [t.token_id for t in lp.top] == torch.topk(row, 2).indices.tolist()
    assert all(not r.prompt_logprobs for r in rest)
