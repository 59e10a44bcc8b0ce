"""vLLM's pooling endpoints besides /v1/embeddings on a runner pooling cluster: /score and /rerank over an embedding
model (cosine similarity of the embeddings, disaggregated: pooled on the prefill pool) and over a cross-encoder (its
sigmoid logit on the pair encoding, colocated), /classify on a classifier, /pooling on both; exact response shapes,
values equal to transformers' (fp32), usage as vLLM counts it, and the errors with their status codes."""

from __future__ import annotations

import base64
import math
import struct
from dataclasses import replace

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.common.pooling import read_model_pooling
from splitserve.deploy.cli import build_parser, serve_config
from splitserve.deploy.local import BoundPorts, serving_banner
from splitserve.deploy.preflight import PreflightError, check_pooling
from splitserve.testing.in_process_cluster import worker_engine_config
from tests.factories import hf_classifier_logits, hf_embedding, save_random_classifier, served_apis, stream_tokens
from tests.test_embeddings_api import Served

TOLERANCE = 1e-5
MODEL = "tiny-pool"
QUERY = "where does the river run"
DOCUMENTS = ["The river runs to the sea", "A quiet morning", "Rivers run downhill"]
LABELS = {"0": "negative", "1": "neutral", "2": "positive"}


def _served(model_dir, mode: str):
    engine = replace(worker_engine_config(max_model_len=64), runner="pooling", max_num_batched_tokens=16)
    return served_apis(model_dir, MODEL, served_class=Served, mode=mode, engine_config=engine,
                       pooling=read_model_pooling(model_dir))


@pytest.fixture(scope="module")
def embedder(tiny_llama_dir):
    with _served(tiny_llama_dir, "disaggregated") as served:
        yield served


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory):
    return save_random_classifier(tmp_path_factory.mktemp("ce") / "m", "qwen3", 1, seed=7)


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_dir):
    with _served(cross_encoder_dir, "colocated") as served:
        yield served


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    return save_random_classifier(tmp_path_factory.mktemp("cls") / "m", "llama", 3, seed=3, id2label=LABELS,
                                  label2id={v: int(k) for k, v in LABELS.items()})


def _cosine(model_dir, first: list[int], second: list[int]) -> float:
    u, v = (torch.tensor(hf_embedding(model_dir, ids, "LAST"), dtype=torch.float64) for ids in (first, second))
    return float(u @ v / (u.norm() * v.norm()))


def test_score_by_embeddings_one_to_many(embedder, tiny_llama_dir):
    query, documents = embedder.tokens(QUERY), [embedder.tokens(d) for d in DOCUMENTS]
    before = {role: embedder.prompt_tokens_on(role) for role in ("prefill", "decode")}
    status, body = embedder.post("/v1/score", {"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200
    assert sorted(body) == ["created", "data", "id", "model", "object", "usage"]
    assert (body["object"], body["model"], body["id"][:6]) == ("list", MODEL, "score-")
    assert [(item["index"], item["object"]) for item in body["data"]] == [(0, "score"), (1, "score"), (2, "score")]
    for item, document in zip(body["data"], documents):
        assert abs(item["score"] - _cosine(tiny_llama_dir, query, document)) <= TOLERANCE
    # vLLM's count: per pair the query, the pad token (the tiny tokenizer's id 0) and the document
    pairs = sum(len(query) + 1 + len(document) for document in documents)
    assert body["usage"] == {"prompt_tokens": pairs, "total_tokens": pairs, "completion_tokens": 0}
    # the query is embedded once, each document once, all on the prefill pool (no decode worker is involved)
    grew = {role: embedder.prompt_tokens_on(role) - before[role] for role in ("prefill", "decode")}
    assert grew == {"prefill": len(query) + sum(map(len, documents)), "decode": 0}


def test_score_n_to_n_and_the_unversioned_path(embedder, tiny_llama_dir):
    status, body = embedder.post("/score", {"text_1": ["a b", "c d"], "text_2": ["e f", "g h"]})
    assert status == 200
    for item, (first, second) in zip(body["data"], [("a b", "e f"), ("c d", "g h")], strict=True):
        assert abs(item["score"] - _cosine(tiny_llama_dir, embedder.tokens(first), embedder.tokens(second))) \
            <= TOLERANCE


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_by_embeddings_sorts_and_cuts_to_top_n(path, embedder, tiny_llama_dir):
    query = embedder.tokens(QUERY)
    scores = [_cosine(tiny_llama_dir, query, embedder.tokens(d)) for d in DOCUMENTS]
    best = sorted(range(3), key=lambda i: -scores[i])
    status, body = embedder.post(path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert status == 200
    assert (sorted(body), body["id"][:7], body["model"]) == (["id", "model", "results", "usage"], "rerank-", MODEL)
    assert [(r["index"], r["document"]) for r in body["results"]] == [(i, {"text": DOCUMENTS[i]}) for i in best[:2]]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([scores[i] for i in best[:2]],
                                                                            abs=TOLERANCE)
    tokens = sum(len(query) + 1 + len(embedder.tokens(d)) for d in DOCUMENTS)  # every document ran
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    status, body = embedder.post(path, {"query": QUERY, "documents": DOCUMENTS, "return_documents": False})
    assert [sorted(r) for r in body["results"]] == [["index", "relevance_score"]] * 3


def test_pooling_task_embed(embedder, tiny_llama_dir):
    prompt = embedder.tokens(QUERY)
    status, body = embedder.post("/pooling", {"task": "embed", "input": QUERY, "encoding_format": "base64"})
    assert status == 200
    assert (sorted(body), body["id"][:5], body["object"]) == (
        ["created", "data", "id", "model", "object", "usage"], "pool-", "list")
    (item,) = body["data"]
    assert (item["index"], item["object"]) == (0, "pooling")
    vector = struct.unpack(f"<{64}f", base64.b64decode(item["data"]))
    assert torch.allclose(torch.tensor(vector), torch.tensor(hf_embedding(tiny_llama_dir, prompt, "LAST")), rtol=0,
                          atol=TOLERANCE)
    assert body["usage"] == {"prompt_tokens": len(prompt), "total_tokens": len(prompt), "completion_tokens": 0}


def test_score_and_rerank_by_a_cross_encoder(cross_encoder, cross_encoder_dir):
    tokenizer = AutoTokenizer.from_pretrained(cross_encoder_dir)  # vLLM's cross-encoder prompt: the pair encoding
    pairs = [tokenizer(text=QUERY, text_pair=document)["input_ids"] for document in DOCUMENTS]
    logits = [hf_classifier_logits(cross_encoder_dir, pair)[0] for pair in pairs]
    status, body = cross_encoder.post("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200
    assert [item["score"] for item in body["data"]] == pytest.approx([1 / (1 + math.exp(-x)) for x in logits],
                                                                     abs=TOLERANCE)
    assert body["usage"]["prompt_tokens"] == sum(map(len, pairs))
    status, body = cross_encoder.post("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS, "use_activation": False})
    assert [item["score"] for item in body["data"]] == pytest.approx(logits, abs=TOLERANCE)
    status, body = cross_encoder.post("/rerank", {"query": QUERY, "documents": DOCUMENTS})
    assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -logits[i])
    status, body = cross_encoder.post("/rerank", {"query": "x " * 80, "documents": DOCUMENTS})
    assert (status, body["error"]["param"], body["error"]["message"]) == (
        400, "query + documents[0]", "This model's maximum context length is 64 tokens. However, query + documents[0] "
        "has 177 tokens. Please reduce the length of the input.")


def test_classify(classifier_dir):
    with _served(classifier_dir, "colocated") as served:
        prompts = [served.tokens(text) for text in DOCUMENTS[:2]]
        status, body = served.post("/classify", {"model": MODEL, "input": DOCUMENTS[:2]})
        status_raw, raw = served.post("/classify", {"input": DOCUMENTS[:2], "use_activation": False})
        status_pooled, pooled = served.post("/pooling", {"task": "classify", "input": DOCUMENTS[:2]})
        chat = [{"role": "user", "content": DOCUMENTS[0]}]
        chat_prompt = served.post("/tokenize", {"messages": chat, "add_generation_prompt": False})[1]["tokens"]
        status_chat, chat_body = served.post("/classify", {"messages": chat, "use_activation": False})
        refusals = {path: served.post(path, body) for path, body in [
            ("/v1/score", {"text_1": "a", "text_2": "b"}), ("/v1/embeddings", {"input": "a"}),
            ("/v1/completions", {"prompt": "a"}), ("/classify", {"input": "a\ud800"})]}
        with pytest.raises(grpc.RpcError) as generating:
            stream_tokens(served.grpc_port, pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=prompts[0]),
                                                               sampling=pb.SamplingParams(max_tokens=2)))
    assert (status, status_raw, status_pooled, status_chat) == (200, 200, 200, 200)
    assert chat_body["data"][0]["probs"] == pytest.approx(hf_classifier_logits(classifier_dir, chat_prompt),
                                                          abs=TOLERANCE)  # vLLM's chat form: the rendered chat
    for pooled_item, item in zip(pooled["data"], body["data"], strict=True):  # the second ran after prefix-cache hits
        assert pooled_item["data"] == pytest.approx(item["probs"], abs=TOLERANCE)
    assert (sorted(body), body["object"], body["id"][:9]) == (
        ["created", "data", "id", "model", "object", "usage"], "list", "classify-")
    for item, raw_item, prompt, index in zip(body["data"], raw["data"], prompts, range(2)):
        logits = torch.tensor(hf_classifier_logits(classifier_dir, prompt))
        probs = logits.double().softmax(0)
        assert (item["index"], item["num_classes"], item["label"]) == (index, 3, LABELS[str(int(probs.argmax()))])
        assert item["probs"] == pytest.approx(probs.tolist(), abs=TOLERANCE)
        assert raw_item["probs"] == pytest.approx(logits.tolist(), abs=TOLERANCE)
    tokens = sum(map(len, prompts))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    assert {path: (status, body["error"]["param"], body["error"]["message"])
            for path, (status, body) in refusals.items()} == {
        "/v1/score": (400, "model", "model: scores need a cross-encoder of one label (num_labels 1); this model "
                                    "classifies into 3 labels: classify instead (/classify)"),
        "/v1/embeddings": (404, None, "Invalid URL (POST /v1/embeddings): this server runs its model as a pooling "
                                      "model (--runner pooling), which serves /classify, /score, /rerank and /pooling "
                                      "(a sequence-classification model)"),
        "/v1/completions": (404, None, "Invalid URL (POST /v1/completions): this server runs its model as a pooling "
                                       "model (--runner pooling), which serves /classify, /score, /rerank and /pooling "
                                       "(a sequence-classification model)"),
        "/classify": (400, "input", "input: is not valid Unicode (lone surrogate '\\ud800' at index 1)")}
    assert (generating.value.code(), generating.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT, "runner: this engine runs the model as a pooling model (runner 'pooling'), "
                                          "which classifies prompts and generates nothing; start it with runner "
                                          "'generate' to generate")


@pytest.mark.parametrize(("path", "body", "status", "param", "message"), [
    ("/v1/rerank", {"query": QUERY, "documents": []}, 400, "documents",
     "documents: At least one text_pair element must be given"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "text_2",
     "text_2: Input lengths must be either 1:1, 1:N or N:N; got 2:3"),
    ("/v1/score", {"text_1": "a"}, 400, "text_2", "text_2: is required: a string or a list of strings"),
    ("/v1/rerank", {"documents": ["a"]}, 400, "query", "query: is required: a string"),
    ("/v1/rerank", {"query": ["a"], "documents": ["a"]}, 400, "query", "query: must be a string, got [\"a\"]"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, 400, "top_n",
     "top_n: must be an integer >= 0, got -1"),
    ("/v1/score", {"text_1": "a", "text_2": ["b"] * 129}, 400, "text_2",
     "text_2: 129 pairs exceed 128 pairs per request"),
    ("/v1/score", {"text_1": ["a", "b\ud800"], "text_2": ["c", "d"]}, 400, "text_1[1]",
     "text_1[1]: is not valid Unicode (lone surrogate '\\ud800' at index 1)"),
    ("/v1/rerank", {"query": "a", "documents": ["b", "x " * 80]}, 400, "documents[1]",
     "This model's maximum context length is 64 tokens. However, documents[1] has 160 tokens. Please reduce the "
     "length of the input."),
    ("/v1/score", {"text_1": "a", "text_2": "b", "model": "other"}, 404, "model",
     "The model `other` does not exist; this server serves `tiny-pool`."),
    ("/pooling", {"input": "a"}, 400, "task", "task: must be one of embed, classify (a whole sequence's vector; "
                                              "per-token tasks are not served), got null"),
    ("/pooling", {"input": ["a", "b\ud800"], "task": "embed"}, 400, "input[1]",
     "input[1]: is not valid Unicode (lone surrogate '\\ud800' at index 1)"),
    ("/pooling", {"input": "a", "task": "classify"}, 400, "task",
     "task: this model pools for 'embed' only, got 'classify'"),
    ("/classify", {"input": "a"}, 404, None, "Invalid URL (POST /classify): this server runs its model as a pooling "
                                             "model (--runner pooling), which serves /v1/embeddings, /score, "
                                             "/rerank and /pooling"),
])
def test_errors(path, body, status, param, message, embedder):
    got_status, got = embedder.post(path, body)
    assert (got_status, got["error"]["param"], got["error"]["message"]) == (status, param, message)


def test_a_generating_server_does_not_serve_scores(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served) as generating:
        answers = [generating.post(path, {"text_1": "a", "text_2": "b", "query": "a", "documents": ["b"],
                                          "input": "a"}) for path in ("/v1/score", "/rerank", "/classify", "/pooling")]
    assert [(status, body["error"]["code"], body["error"]["message"]) for status, body in answers] == [
        (404, "unknown_url", f"Invalid URL (POST {path}): this server generates (--runner generate); start it with "
                             "--runner pooling to serve pooling endpoints") for path in ("/v1/score", "/rerank",
                                                                                         "/classify", "/pooling")]


def test_a_classification_model_is_refused_before_ray_starts_without_runner_pooling(classifier_dir):
    config = serve_config(build_parser().parse_args(["serve", str(classifier_dir)]))
    with pytest.raises(PreflightError) as error:
        check_pooling(config)
    assert str(error.value) == (f"{classifier_dir}: a LlamaForSequenceClassification (a sequence-classification "
                                "head, no LM head) runs with --runner pooling only")


def test_a_classification_servers_banner_scores_a_pair(classifier_dir):
    """It serves no /v1/embeddings: the banner's curl is a /v1/score that works as printed."""
    config = serve_config(build_parser().parse_args(["serve", str(classifier_dir), "--served-model-name", "tiny",
                                                     "--runner", "pooling"]))
    banner = serving_banner(config, BoundPorts(50051, 8000, None), "splitserve", needs_key=False)
    assert banner.splitlines()[2] == (
        "  try: curl http://127.0.0.1:8000/v1/score -H 'Content-Type: application/json' -d '{\"model\": \"tiny\", "
        "\"text_1\": \"Where does the river run?\", \"text_2\": \"The river runs to the sea.\"}'")
