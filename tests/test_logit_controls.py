"""logit_bias, allowed_token_ids, bad_words and include_stop_str_in_output on every API: the OpenAI
HTTP API, gRPC Generate, Triton, the offline LLM, and the disaggregated path (the first token is
sampled on the prefill worker, the rest on the decode worker). The sampler's arithmetic is tested
against the per-row oracle in tests/test_sampler.py."""

from __future__ import annotations

import asyncio
import functools
import json

import grpc
import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.router.policy import RoutingConfig
from tests.factories import ServedApis, http_request, make_request_limits, served_apis, stream_tokens

MODEL = "tiny-llama"
PROMPT = "The river runs by the old mill"
VOCAB_SIZE = 512
"""The tiny models' vocabulary."""


class Served(ServedApis):
    def post(self, path: str, body: dict) -> tuple[int, dict]:
        status, _, raw = http_request(self.http_port, "POST", path, json.dumps(body).encode())
        return status, json.loads(raw)

    def completion_ids(self, **fields) -> list[int]:
        """Token ids of a greedy completion of PROMPT (ignore_eos) with these fields."""
        body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                "return_tokens_as_token_ids": True, **fields}
        status, reply = self.post("/v1/completions", body)
        assert status == 200, reply
        return [int(token.removeprefix("token_id:")) for token in reply["choices"][0]["logprobs"]["tokens"]]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served) as served:
        yield served


def printable_token(tokenizer, avoid: list[int]) -> int:
    """A token id with visible text that is not in `avoid`."""
    return next(t for t in range(VOCAB_SIZE) if t not in avoid and tokenizer.decode([t]).strip().isalpha())


def two_token_word(tokenizer, tokens: list[int]) -> tuple[str, int, set[tuple[int, ...]]]:
    """(word, k, its banned sequences): a word of more than one character that `tokens` hold as
    tokens[k:k + 2], one of the sequences vLLM's rule bans for it (bare or after a space)."""
    encode = functools.partial(tokenizer.encode, add_special_tokens=False)
    for k in range(len(tokens) - 1):
        word = tokenizer.decode(tokens[k:k + 2])
        forms = set(SamplingParams(bad_words=[word]).with_bad_words_tokenized(encode).bad_words_token_ids)
        if tuple(tokens[k:k + 2]) in forms and len(word.strip()) > 1:
            return word, k, forms
    raise AssertionError(f"no two-token word in {tokens}")


def contains(tokens: list[int], sequence: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i:i + len(sequence)]) == sequence for i in range(len(tokens) - len(sequence) + 1))


# ---- OpenAI HTTP API ----------------------------------------------------------------------------

def test_a_large_logit_bias_forces_its_token_on_completions_and_chat(served):
    plain = served.completion_ids(max_tokens=6)
    forced = printable_token(served.cluster.tokenizer, plain)
    assert served.completion_ids(max_tokens=6, logit_bias={str(forced): 100}) == [forced] * 6
    # a bias against the greedy token moves the choice off it, at every position
    assert plain[0] not in served.completion_ids(max_tokens=6, logit_bias={str(plain[0]): -100})
    status, reply = served.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "max_tokens": 4,
        "ignore_eos": True, "logit_bias": {str(forced): 100}})
    assert status == 200
    assert reply["choices"][0]["message"]["content"] == served.cluster.tokenizer.decode([forced] * 4)


def test_sampled_tokens_stay_in_allowed_token_ids(served):
    allowed = [5, 77, 130, 301]
    for seed in range(3):
        tokens = served.completion_ids(max_tokens=12, temperature=1.5, seed=seed, allowed_token_ids=allowed)
        assert len(tokens) == 12 and set(tokens) <= set(allowed)


def test_bad_words_never_appear_as_either_tokenization(served):
    """A word the greedy output holds as two tokens is banned: neither its bare nor its spaced
    tokenization (vLLM's two forms) appears in the output any more, and the output changed there."""
    plain = served.completion_ids(max_tokens=16)
    word, at, forms = two_token_word(served.cluster.tokenizer, plain)
    banned = served.completion_ids(max_tokens=16, bad_words=[word])
    assert banned[:at + 1] == plain[:at + 1] and banned[at + 1] != plain[at + 1]
    assert not any(contains(banned, form) for form in forms)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_stop_string(served, stream):
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 16, "ignore_eos": True}
    status, reply = served.post("/v1/completions", body)
    full = reply["choices"][0]["text"]
    stop = full[3:6]
    index = full.index(stop)
    body |= {"stop": [stop], "include_stop_str_in_output": True, "stream": stream}
    status, raw_headers, raw = http_request(served.http_port, "POST", "/v1/completions", json.dumps(body).encode())
    assert status == 200
    if stream:
        events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                  if line.startswith("data: {")]
        text = "".join(event["choices"][0]["text"] for event in events if event["choices"])
    else:
        text = json.loads(raw)["choices"][0]["text"]
    assert text == full[:index + len(stop)]
    body["include_stop_str_in_output"] = False
    _, _, raw = http_request(served.http_port, "POST", "/v1/completions", json.dumps(body | {"stream": False}).encode())
    assert json.loads(raw)["choices"][0]["text"] == full[:index]


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"logit_bias": {"abc": 1}}, "logit_bias",
     "contains key(s) that cannot be converted to integer token IDs: ['abc']"),
    ({"logit_bias": {"512": 1}}, "logit_bias",
     "token_id(s) [512] in logit_bias contain out-of-vocab token ids. Vocabulary size: 512"),
    ({"logit_bias": {"-1": 1}}, "logit_bias",
     "token_id(s) [-1] in logit_bias contain out-of-vocab token ids. Vocabulary size: 512"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias", "biases must be numbers in [-100, 100], got [100.5]"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "biases must be numbers in [-100, 100], got ['x']"),
    ({"logit_bias": [5]}, "logit_bias", "must be an object mapping token ids to biases, got [5]"),
    ({"logit_bias": {str(t): 1 for t in range(1025)}}, "logit_bias", "must hold at most 1024 entries, got 1025"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "must not be empty (leave it out to allow every token)"),
    ({"allowed_token_ids": [3, 900]}, "allowed_token_ids",
     "token_id(s) [900] in allowed_token_ids contain out-of-vocab token ids. Vocabulary size: 512"),
    ({"allowed_token_ids": ["3"]}, "allowed_token_ids", "must be integers"),
    ({"bad_words": [""]}, "bad_words", "must be non-empty strings"),
    ({"bad_words": "river"}, "bad_words", "must be a list of strings, got 'river'"),
    ({"bad_words": [f"w{i}" for i in range(129)]}, "bad_words", "must hold at most 128 entries, got 129"),
    ({"include_stop_str_in_output": 2}, "include_stop_str_in_output", "must be a boolean, got 2"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_logit_controls_are_400_naming_the_field(served, path, fields, param, message):
    body = {"model": MODEL, "max_tokens": 2, **fields}
    body |= {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    status, reply = served.post(path, body)
    assert (status, reply["error"]["param"], reply["error"]["message"]) == (400, param, f"{param}: {message}")


# ---- gRPC Generate and Triton -----------------------------------------------------------------

def test_grpc_takes_the_same_logit_controls(served):
    tokenizer = served.cluster.tokenizer
    plain = served.completion_ids(max_tokens=6)
    forced = printable_token(tokenizer, plain)
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    token_ids, text, _ = stream_tokens(served.grpc_port, pb.GenerateRequest(
        text=PROMPT.encode(), sampling=pb.SamplingParams(**greedy, logit_bias={forced: 100.0})))
    assert (token_ids, text) == ([forced] * 6, tokenizer.decode([forced] * 6))
    allowed = [5, 77, 130]
    token_ids, _, _ = stream_tokens(served.grpc_port, pb.GenerateRequest(
        text=PROMPT.encode(), sampling=pb.SamplingParams(temperature=1.5, seed=1, max_tokens=8, ignore_eos=True,
                                                         allowed_token_ids=allowed)))
    assert set(token_ids) <= set(allowed)
    word = tokenizer.decode(plain[1:3])
    assert stream_tokens(served.grpc_port, pb.GenerateRequest(
        text=PROMPT.encode(), sampling=pb.SamplingParams(**greedy, bad_words=[word])))[0] == served.completion_ids(
        max_tokens=6, bad_words=[word])


def test_grpc_and_triton_keep_the_stop_string_with_include_stop_str_in_output(served):
    from splitserve.proto.inference import grpc_service_pb2 as ipb
    from splitserve.proto.inference import grpc_service_pb2_grpc as ipb_grpc

    greedy = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
    _, full, _ = stream_tokens(served.grpc_port, pb.GenerateRequest(text=PROMPT.encode(),
                                                                   sampling=pb.SamplingParams(**greedy)))
    stop = full[3:6]
    expected = full[:full.index(stop) + len(stop)]
    kept = pb.SamplingParams(**greedy, stop=[stop], include_stop_str_in_output=True)
    _, text, responses = stream_tokens(served.grpc_port, pb.GenerateRequest(text=PROMPT.encode(), sampling=kept))
    assert (text, responses[-1].stop_string) == (expected, stop)
    # bad_words too: the Triton path must tokenize them before the engine (which refuses them untokenized)
    sampling = json.dumps({**greedy, "stop": [stop], "include_stop_str_in_output": True, "bad_words": ["zz"]})
    request = ipb.ModelInferRequest(model_name=MODEL, inputs=[
        ipb.ModelInferRequest.InferInputTensor(name=name, datatype="BYTES", shape=[1],
                                               contents=ipb.InferTensorContents(bytes_contents=[value]))
        for name, value in (("text_input", PROMPT.encode()), ("sampling_parameters", sampling.encode()))])
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        reply = ipb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    outputs = {tensor.name: index for index, tensor in enumerate(reply.outputs)}
    assert reply.raw_output_contents[outputs["text_output"]][4:].decode() == PROMPT + expected


@pytest.mark.parametrize(("sampling", "message"), [
    (pb.SamplingParams(logit_bias={512: 1.0}),
     "logit_bias: token_id(s) [512] in logit_bias contain out-of-vocab token ids. Vocabulary size: 512"),
    (pb.SamplingParams(logit_bias={3: -101.0}), "logit_bias: biases must be numbers in [-100, 100], got [-101.0]"),
    (pb.SamplingParams(allowed_token_ids=[-4]),
     "allowed_token_ids: token_id(s) [-4] in allowed_token_ids contain out-of-vocab token ids. Vocabulary size: 512"),
    (pb.SamplingParams(bad_words=["ok", ""]), "bad_words: must be non-empty strings"),
])
def test_grpc_refuses_bad_logit_controls_with_invalid_argument(served, sampling, message):
    with pytest.raises(grpc.RpcError) as error:
        stream_tokens(served.grpc_port, pb.GenerateRequest(text=PROMPT.encode(), sampling=sampling))
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_triton_sampling_parameters_take_the_logit_controls():
    from splitserve.proto.inference import grpc_service_pb2 as ipb
    from splitserve.router.triton_protocol import parse_infer_request

    def request(sampling: dict) -> ipb.ModelInferRequest:
        return ipb.ModelInferRequest(model_name=MODEL, inputs=[
            ipb.ModelInferRequest.InferInputTensor(name=name, datatype="BYTES", shape=[1],
                                                   contents=ipb.InferTensorContents(bytes_contents=[value]))
            for name, value in (("text_input", b"a"), ("sampling_parameters", json.dumps(sampling).encode()))])

    parsed = parse_infer_request(request({"logit_bias": {"7": 2.5}, "allowed_token_ids": [7, 9],
                                          "bad_words": ["mill"], "include_stop_str_in_output": True}),
                                 make_request_limits())
    assert parsed.sampling == SamplingParams(logit_bias=((7, 2.5),), allowed_token_ids=(7, 9), bad_words=("mill",),
                                             include_stop_str_in_output=True)
    for sampling, message in (
            ({"logit_bias": [1]}, "logit_bias: must be an object mapping token ids to biases, got [1]"),
            ({"logit_bias": {"600": 1}}, "logit_bias: token_id(s) [600] in logit_bias contain out-of-vocab token ids. "
                                         "Vocabulary size: 512")):
        with pytest.raises(InvalidRequestError) as error:
            parse_infer_request(request(sampling), make_request_limits())
        assert str(error.value) == message


# ---- the disaggregated path and the offline LLM ------------------------------------------------

def test_logit_controls_apply_on_the_prefill_worker_and_the_decode_worker(tiny_llama_dir):
    """The first token is sampled on the prefill worker, the others on the decode worker: a bias
    forcing one token gives it at every position, and a bad word that spans the two (its first
    token the prefill worker's, its second the decode worker's first) is banned there."""
    from splitserve.testing.in_process_cluster import InProcessCluster

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = (1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52)

    async def run(params_list):
        async with InProcessCluster(tiny_llama_dir, routing=RoutingConfig(disaggregation="always")) as cluster:
            outputs = []
            for i, params in enumerate(params_list):
                chunks = await cluster.generate(f"r{i}", prompt, params)
                outputs.append([t for chunk in chunks for t in chunk.token_ids])
            prefill = await cluster.clients["prefill-0"].stats()
            return outputs, prefill.engine.num_prompt_tokens

    (plain,), _ = asyncio.run(run([greedy]))
    forced = next(t for t in range(3, VOCAB_SIZE) if t not in plain)
    outputs, prefilled = asyncio.run(run([
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={forced: 100.0}),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, bad_words_token_ids=((plain[0], plain[1]),)),
    ]))
    assert prefilled == 2 * len(prompt)  # both prompts prefilled on the prefill worker
    assert outputs[0] == [forced] * 6
    assert outputs[1][0] == plain[0] and outputs[1][1] != plain[1]


def test_the_offline_llm_tokenizes_bad_words_and_applies_every_control(tiny_llama_dir):
    from splitserve.engine.llm import LLM

    llm = LLM(tiny_llama_dir, block_size=16, max_model_len=256, num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = llm.generate(PROMPT, greedy)[0].token_ids
    word = llm.tokenizer.decode(plain[2:4])
    banned = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, bad_words=[word]))[0]
    forms = [tuple(llm.tokenizer.encode(w, add_special_tokens=False)) for w in (word.lstrip(), " " + word.lstrip())]
    assert not any(contains(banned.token_ids, form) for form in forms)
    allowed = llm.generate(PROMPT, SamplingParams(max_tokens=8, seed=3, ignore_eos=True,
                                                  allowed_token_ids=[9, 10, 11]))[0]
    assert set(allowed.token_ids) <= {9, 10, 11}
    full = llm.generate(PROMPT, greedy)[0].text
    stop = full[2:5]
    kept = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True))[0]
    assert (kept.text, kept.finish_reason) == (full[:full.index(stop) + len(stop)], "stop")
    with pytest.raises(InvalidRequestError, match=r"^logit_bias: token_id\(s\) \[600\] in logit_bias contain "):
        llm.generate(PROMPT, SamplingParams(logit_bias={600: 1.0}))
    with pytest.raises(InvalidRequestError, match="^bad_words: must be tokenized"):
        llm.engine.add_request("raw", [1, 2, 3], SamplingParams(bad_words=["x"]))
