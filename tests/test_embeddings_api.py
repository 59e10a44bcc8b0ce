"""POST /v1/embeddings on a cluster of runner pooling (vLLM's `--runner pooling` server), in both modes: in the
disaggregated cluster each input is pooled on a prefill worker and nothing reaches the decode pool; in the colocated
one the decode worker pools it. Exact response shape and usage, embeddings equal to transformers' (fp32), base64 that
decodes to the same floats, the official SDK, and the errors with their status codes."""

from __future__ import annotations

import base64
import json
import struct
from dataclasses import replace

import grpc
import openai
import pytest
import torch

from splitserve.common.pooling import PoolerConfig, read_model_pooling
from splitserve.deploy.cli import build_parser, serve_config
from splitserve.deploy.cluster_config import ClusterConfigError
from splitserve.deploy.preflight import PreflightError, check_pooling
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.router.policy import RoutingConfig
from splitserve.testing.in_process_cluster import worker_engine_config
from tests.factories import (ServedApis, capture_access_log, hf_embedding, http_request, served_apis, stream_tokens,
                             with_sentence_transformers_files)
from tests.test_embeddings import TOLERANCE

MODEL = "tiny-embed"
MAX_MODEL_LEN = 64
TEXTS = ["The river runs", "A quiet morning over the hills and the sea"]
TOKEN_PROMPTS = [[5, 9, 200, 31], list(range(40, 80))]
"""The second is longer than the workers' 16-token budget: it is prefilled in three chunks."""
GENERATION_REFUSED = ("runner: this engine runs the model as a pooling model (runner 'pooling'), which embeds prompts and "
                      "generates nothing; start it with runner 'generate' to generate")
TOO_MANY = "the router has 1 requests in flight, its limit (router.routing.max_in_flight_requests); retry later"


class Served(ServedApis):
    def post(self, path: str, body: dict) -> tuple[int, dict]:
        status, _, raw = http_request(self.http_port, "POST", path, json.dumps(body).encode())
        return status, json.loads(raw)

    def tokens(self, text: str) -> list[int]:
        status, body = self.post("/tokenize", {"prompt": text})
        assert status == 200
        return body["tokens"]

    def prompt_tokens_on(self, role: str) -> int:
        workers = self.cluster.prefill_workers if role == "prefill" else self.cluster.decode_workers
        return sum(self.loop.run(w.stats()).engine.num_prompt_tokens for w in workers)


def _pooling_cluster(model_dir, mode: str):
    engine = replace(worker_engine_config(max_model_len=MAX_MODEL_LEN), runner="pooling", max_num_batched_tokens=16)
    return served_apis(model_dir, MODEL, served_class=Served, mode=mode, engine_config=engine,
                       pooling=read_model_pooling(model_dir))


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def served(request, tiny_llama_dir):
    with _pooling_cluster(tiny_llama_dir, request.param) as served:
        yield served


def _assert_embedding(got: list[float], model_dir, prompt: list[int]) -> None:
    want = torch.tensor(hf_embedding(model_dir, prompt, "LAST"))
    assert torch.allclose(torch.tensor(got), want, rtol=0, atol=TOLERANCE)


def test_one_string_input_response_shape_and_usage(served, tiny_llama_dir):
    tokens = served.tokens(TEXTS[0])
    status, body = served.post("/v1/embeddings", {"model": MODEL, "input": TEXTS[0], "user": "someone"})
    assert status == 200
    assert sorted(body) == ["created", "data", "id", "model", "object", "usage"]
    assert (body["object"], body["model"], body["usage"]) == (
        "list", MODEL, {"prompt_tokens": len(tokens), "total_tokens": len(tokens)})
    assert body["id"].startswith("embd-")
    (item,) = body["data"]
    assert (sorted(item), item["object"], item["index"], len(item["embedding"])) == (
        ["embedding", "index", "object"], "embedding", 0, 64)
    _assert_embedding(item["embedding"], tiny_llama_dir, tokens)
    served.loop.run(served.cluster.wait_idle())  # every block of both pools back


def test_where_it_runs(served):
    """Disaggregated: the prefill pool pools, the decode pool sees nothing; colocated: the decode worker pools."""
    before = {role: served.prompt_tokens_on(role) for role in ("prefill", "decode")}
    status, _ = served.post("/v1/embeddings", {"input": TOKEN_PROMPTS[1]})
    assert status == 200
    grew = {role: served.prompt_tokens_on(role) - before[role] for role in ("prefill", "decode")}
    if served.cluster.mode == "disaggregated":
        assert grew == {"prefill": 40, "decode": 0}
    else:
        assert grew == {"prefill": 0, "decode": 40}


@pytest.mark.parametrize("form", ["strings", "token_ids", "token_id_lists"])
def test_batched_inputs_come_back_in_order(form, served, tiny_llama_dir):
    inputs = {"strings": TEXTS, "token_ids": TOKEN_PROMPTS[0], "token_id_lists": TOKEN_PROMPTS}[form]
    prompts = ([served.tokens(text) for text in TEXTS] if form == "strings"
               else [TOKEN_PROMPTS[0]] if form == "token_ids" else TOKEN_PROMPTS)
    status, body = served.post("/v1/embeddings", {"input": inputs})
    assert status == 200
    assert [item["index"] for item in body["data"]] == list(range(len(prompts)))
    for item, prompt in zip(body["data"], prompts):
        _assert_embedding(item["embedding"], tiny_llama_dir, prompt)
    total = sum(len(prompt) for prompt in prompts)
    assert body["usage"] == {"prompt_tokens": total, "total_tokens": total}


def test_base64_decodes_to_the_same_floats(served):
    _, floats = served.post("/v1/embeddings", {"input": TOKEN_PROMPTS})
    status, encoded = served.post("/v1/embeddings", {"input": TOKEN_PROMPTS, "encoding_format": "base64"})
    assert status == 200
    for as_floats, as_base64 in zip(floats["data"], encoded["data"]):
        raw = base64.b64decode(as_base64["embedding"])
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == as_floats["embedding"]


def test_the_openai_sdk(served):
    """The SDK asks for base64 and decodes it itself; the vectors are the float response's."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="none", max_retries=0)
    result = client.embeddings.create(model=MODEL, input=TEXTS)
    _, floats = served.post("/v1/embeddings", {"input": TEXTS})
    assert [item.embedding for item in result.data] == [item["embedding"] for item in floats["data"]]
    assert (result.usage.prompt_tokens, result.model) == (floats["usage"]["prompt_tokens"], MODEL)


def test_chat_messages_are_one_input_rendered_by_the_chat_template(served, tiny_llama_dir):
    """vLLM's chat form: no generation prompt unless asked (then the template's assistant header is pooled too)."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[0]}]
    for add_generation_prompt in (False, True):
        status, tokenized = served.post("/tokenize", {"messages": messages,
                                                      "add_generation_prompt": add_generation_prompt})
        assert status == 200
        body = {"messages": messages, **({"add_generation_prompt": True} if add_generation_prompt else {})}
        status, response = served.post("/v1/embeddings", body)
        assert status == 200
        (item,) = response["data"]
        _assert_embedding(item["embedding"], tiny_llama_dir, tokenized["tokens"])
        assert response["usage"]["prompt_tokens"] == tokenized["count"]
    status, error = served.post("/v1/embeddings", {"messages": messages, "add_generation_prompt": True,
                                                   "continue_final_message": True})
    assert (status, error["error"]["param"]) == (400, "continue_final_message")


def test_truncate_prompt_tokens_and_a_prompt_that_fills_the_context(served, tiny_llama_dir):
    long = list(range(100, 100 + MAX_MODEL_LEN))
    status, body = served.post("/v1/embeddings", {"input": long})
    assert (status, body["usage"]["prompt_tokens"]) == (200, MAX_MODEL_LEN)  # nothing is generated after it
    _assert_embedding(body["data"][0]["embedding"], tiny_llama_dir, long)
    status, body = served.post("/v1/embeddings", {"input": long, "truncate_prompt_tokens": 10})
    assert (status, body["usage"]["prompt_tokens"]) == (200, 10)
    _assert_embedding(body["data"][0]["embedding"], tiny_llama_dir, long[-10:])
    # vLLM's -1 keeps max_model_len tokens of a pooled prompt (a completion's keeps one fewer: room for an output)
    status, body = served.post("/v1/embeddings", {"input": [7, 8, 9] + long, "truncate_prompt_tokens": -1})
    assert (status, body["usage"]["prompt_tokens"]) == (200, MAX_MODEL_LEN)
    _assert_embedding(body["data"][0]["embedding"], tiny_llama_dir, long)


@pytest.mark.parametrize(("body", "status", "param", "message"), [
    ({"input": []}, 400, "input", "input: must be a string or a non-empty list of token ids"),
    ({"input": ["ok", 7]}, 400, "input", "input: must be a string or a non-empty list of token ids"),
    ({"input": ["ok", []]}, 400, "input[1]", "input[1]: must be a string or a non-empty list of token ids"),
    ({}, 400, "input", "input: is required: a string, a list of strings, a list of token ids or a list of token-id "
                       "lists (or send messages)"),
    ({"input": "x", "encoding_format": "bytes"}, 400, "encoding_format",
     "encoding_format: must be 'float' or 'base64', got 'bytes'"),
    ({"input": "x", "dimensions": 16}, 400, "dimensions",
     "dimensions: Model 'tiny-embed' does not support Matryoshka embeddings; dimensions must be unset (received "
     "dimensions=16)."),
    ({"input": list(range(MAX_MODEL_LEN + 1))}, 400, "input",
     "This model's maximum context length is 64 tokens. However, input has 65 tokens. Please reduce the length of the "
     "input."),
    ({"input": [[1, 2], list(range(MAX_MODEL_LEN + 1))]}, 400, "input[1]",
     "This model's maximum context length is 64 tokens. However, input[1] has 65 tokens. Please reduce the length of "
     "the input."),
    ({"input": [1, 100000]}, 400, "input", "input: token ids out of vocabulary [0, 512): [100000]"),
    ({"input": "ok \ud800"}, 400, "input", "input: is not valid Unicode (lone surrogate '\\ud800' at index 3)"),
    ({"input": ["ok", "\udfff"]}, 400, "input[1]",
     "input[1]: is not valid Unicode (lone surrogate '\\udfff' at index 0)"),
    ({"input": ["a"] * 129}, 400, "input", "input: 129 inputs exceed 128 inputs per request"),
    ({"input": "x", "model": "other"}, 404, "model",
     "The model `other` does not exist; this server serves `tiny-embed`."),
])
def test_errors(body, status, param, message, served):
    got_status, got = served.post("/v1/embeddings", body)
    assert (got_status, got["error"]["param"], got["error"]["message"]) == (status, param, message)
    served.loop.run(served.cluster.wait_idle())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_generation_endpoints_are_not_served(path, served):
    status, body = served.post(path, {"model": MODEL, "prompt": "x", "messages": [{"role": "user", "content": "x"}]})
    assert (status, body["error"]["code"], body["error"]["message"]) == (
        404, "unknown_url", f"Invalid URL (POST {path}): this server runs its model as a pooling model "
                            "(--runner pooling), which serves /v1/embeddings, /score, /rerank and /pooling")


def test_a_generating_server_does_not_serve_embeddings(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served) as generating:
        status, body = generating.post("/v1/embeddings", {"input": "x"})
    assert (status, body["error"]["code"], body["error"]["message"]) == (
        404, "unknown_url", "Invalid URL (POST /v1/embeddings): this server generates (--runner generate); start it "
                            "with --runner pooling to serve pooling endpoints")


def test_one_access_log_line_per_input(served, monkeypatch, caplog):
    access_log = capture_access_log(served, monkeypatch, caplog)
    status, _ = served.post("/v1/embeddings", {"input": TOKEN_PROMPTS, "request_id": "emb-1"})
    assert status == 200
    served.loop.run(served.cluster.wait_idle())
    lines = sorted(access_log(), key=lambda fields: fields["request_id"])
    disaggregated = served.cluster.mode == "disaggregated"
    assert [(f["request_id"], f["status"], f["finish_reason"], f["prompt_tokens"], f["output_tokens"],
             f["prefill_worker"], f["decode_worker"], f["migrations"]) for f in lines] == [
        (f"emb-1-{index}", "OK", "stop", len(prompt), 0, "prefill-0" if disaggregated else None,
         None if disaggregated else "decode-0", 0) for index, prompt in enumerate(TOKEN_PROMPTS)]


def test_a_batch_takes_an_admission_slot_per_input(tiny_llama_dir):
    """Each input is a request of the router's: a batch the router cannot hold whole is refused at once (429), as a
    completion's batched prompts are, and a lone input is served."""
    engine = replace(worker_engine_config(max_model_len=MAX_MODEL_LEN), runner="pooling")
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, engine_config=engine,
                     routing=RoutingConfig(disaggregation="always", max_in_flight_requests=1),
                     pooling=read_model_pooling(tiny_llama_dir)) as served:
        status, body = served.post("/v1/embeddings", {"input": TOKEN_PROMPTS})
        assert (status, body["error"]["message"]) == (429, TOO_MANY)
        assert served.post("/v1/embeddings", {"input": TOKEN_PROMPTS[0]})[0] == 200
        served.loop.run(served.cluster.wait_idle())


def _serve_config(*argv: str):
    return serve_config(build_parser().parse_args(["serve", "/models/m", *argv]))


def test_the_runner_flags_set_both_pools():
    config = _serve_config("--runner", "pooling", "--pooler-config", '{"pooling_type": "MEAN"}')
    assert (config.prefill.engine.runner, config.decode.engine.runner, config.runner) == ("pooling",) * 3
    assert config.prefill.engine.pooler_config == config.decode.engine.pooler_config == PoolerConfig("MEAN")
    assert [_serve_config(*task).runner for task in (["--task", "embed"], ["--task", "classify"], ["--task", "score"],
                                                      [])] == ["pooling", "pooling", "pooling", "generate"]
    with pytest.raises(ClusterConfigError, match=r"^decode.engine.runner: must equal prefill.engine.runner "
                                                 r"\('generate'\) in disaggregated mode, got 'pooling'$"):
        _serve_config("--set", "decode.engine.runner=pooling")
    with pytest.raises(ClusterConfigError, match=r"^prefill.engine.pooler_config: is for runner 'pooling' "
                                                 r"\(an engine that embeds\); set runner='pooling'$"):
        _serve_config("--pooler-config", '{"pooling_type": "MEAN"}')
    for bad in (["--pooler-config", '{"pooling": "MEAN"}'], ["--task", "embed", "--runner", "generate"]):
        with pytest.raises(SystemExit):
            _serve_config(*bad)


def test_the_grpc_generate_api_of_a_pooling_server_refuses(served):
    """The workers refuse a generation request (the runner is pooling); nothing stays allocated."""
    request = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=TOKEN_PROMPTS[0]),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=2))
    with pytest.raises(grpc.RpcError) as error:
        stream_tokens(served.grpc_port, request)
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, GENERATION_REFUSED)
    served.loop.run(served.cluster.wait_idle())


def test_serve_preflight_refuses_a_pooling_the_engines_would_refuse(tiny_llama_dir, tmp_path):
    """Before Ray starts: a sentence-transformers pooling the engines do not run (max)."""
    model_dir = with_sentence_transformers_files(tiny_llama_dir, tmp_path / "st", "max", True)
    config = _serve_config("--runner", "pooling")
    check_pooling(replace(config, model=str(tiny_llama_dir)))  # no modules.json: LAST, normalized
    with pytest.raises(PreflightError, match=r"^--runner pooling: .*1_Pooling/config.json: pooling "
                                             r"'pooling_mode_max_tokens' is not supported; supported: lasttoken, "
                                             r"mean, cls$"):
        check_pooling(replace(config, model=str(model_dir)))


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_the_messages_endpoints_are_not_served_either(path, served):
    status, body = served.post(path, {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
    assert (status, body["type"], body["error"]["message"]) == (
        404, "error", f"Invalid URL (POST {path}): this server runs its model as a pooling model (--runner pooling), "
                      "which serves /v1/embeddings, /score, /rerank and /pooling")
