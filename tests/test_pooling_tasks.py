"""Sequence-classification models (LlamaForSequenceClassification, Qwen2/Qwen3ForSequenceClassification) under
runner pooling, and LLM.classify / LLM.score: fp32 logits equal transformers' AutoModelForSequenceClassification
within TOLERANCE under chunked prefill; scores equal a cross-encoder's activated logit on the tokenizer's pair
encoding, or the cosine similarity of transformers' embeddings; the activations vLLM reads from config.json."""

from __future__ import annotations

import math
import random

import pytest
import torch

from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.pooling import PoolerConfig, PoolingParams, read_model_pooling, score_pairs
from splitserve.engine import LLM
from tests.factories import (assert_pool_idle, copy_with_config_fields, hf_classifier_logits, hf_embedding,
                             save_random_classifier)

TOLERANCE = 1e-5
"""Largest difference allowed per logit (logits ~1) or probability."""
LABELS = {"0": "negative", "1": "neutral", "2": "positive"}
QUERY = "where does the river run"
DOCUMENTS = ["The river runs to the sea", "A quiet morning", "Rivers run downhill"]


def _prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(length)] for length in (1, 6, 40)]


PROMPTS = _prompts()
"""The 40-token prompt is prefilled over three steps (max_num_batched_tokens 16)."""


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("classifiers")
    models = {arch: save_random_classifier(root / arch, arch, 3, seed=i, id2label=LABELS,
                                           label2id={v: int(k) for k, v in LABELS.items()})
              for i, arch in enumerate(("llama", "qwen2", "qwen3"))}
    models["cross-encoder"] = save_random_classifier(root / "cross-encoder", "qwen3", 1, seed=7)
    return models


@pytest.fixture(scope="module")
def pooling_llm():
    """One pooling LLM per model directory for the module (each test leaves its pool idle)."""
    llms: dict[object, LLM] = {}

    def get(model_dir) -> LLM:
        if model_dir not in llms:
            llms[model_dir] = LLM(model_dir, runner="pooling", block_size=4, max_num_batched_tokens=16)
        return llms[model_dir]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_classify_equals_transformers(arch, classifiers, pooling_llm):
    llm = pooling_llm(classifiers[arch])
    logits = llm.classify(PROMPTS, pooling_params=PoolingParams(use_activation=False))
    probs = llm.classify(PROMPTS)
    for prompt, raw, activated in zip(PROMPTS, logits, probs, strict=True):
        want = torch.tensor(hf_classifier_logits(classifiers[arch], prompt))
        assert torch.allclose(torch.tensor(raw.outputs.probs), want, rtol=0, atol=TOLERANCE)
        assert torch.allclose(torch.tensor(activated.outputs.probs), want.double().softmax(0).float(), rtol=0,
                              atol=TOLERANCE)
        assert (activated.prompt_token_ids, activated.outputs.num_classes, activated.finished) == (prompt, 3, True)
    assert_pool_idle(llm.engine.block_manager)


def test_score_by_a_cross_encoder_is_its_sigmoid_logit_on_the_pair_encoding(classifiers, pooling_llm):
    model_dir = classifiers["cross-encoder"]
    llm = pooling_llm(model_dir)
    outputs = llm.score(QUERY, DOCUMENTS)
    raw = llm.score(QUERY, DOCUMENTS, pooling_params=PoolingParams(use_activation=False))
    for document, output, logit in zip(DOCUMENTS, outputs, raw, strict=True):
        pair = llm.get_tokenizer()(text=QUERY, text_pair=document)["input_ids"]
        (want,) = hf_classifier_logits(model_dir, pair)
        assert output.prompt_token_ids == pair
        assert abs(logit.outputs.score - want) <= TOLERANCE
        assert abs(output.outputs.score - 1 / (1 + math.exp(-want))) <= TOLERANCE
    with pytest.raises(InvalidRequestError, match="^model: scores need a cross-encoder of one label"):
        pooling_llm(classifiers["qwen3"]).score(QUERY, DOCUMENTS)


def test_score_by_an_embedding_model_is_the_cosine_of_the_embeddings(tiny_llama_dir, pooling_llm):
    llm = pooling_llm(tiny_llama_dir)
    outputs = llm.score(["a b c", "d e"], ["d e", "x y z"])  # N:N, "d e" embedded once
    tokenizer = llm.get_tokenizer()
    for (first, second), output in zip([("a b c", "d e"), ("d e", "x y z")], outputs, strict=True):
        ids = [tokenizer.encode(text) for text in (first, second)]
        u, v = (torch.tensor(hf_embedding(tiny_llama_dir, i, "LAST"), dtype=torch.float64) for i in ids)
        assert abs(output.outputs.score - float(u @ v / (u.norm() * v.norm()))) <= TOLERANCE
        assert output.prompt_token_ids == ids[0] + [0] + ids[1]  # vLLM's: the pad token (0) between them
    with pytest.raises(InvalidRequestError, match=r"^data_2: Input lengths must be either 1:1, 1:N or N:N; got 2:1$"):
        llm.score(["a", "b"], ["c"])
    assert_pool_idle(llm.engine.block_manager)


def test_score_pairing_rules():
    assert score_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert score_pairs(["q", "r"], ["a", "b"]) == [("q", "a"), ("r", "b")]
    assert score_pairs("q", "a") == [("q", "a")]
    for first, second, message in [(["q", "r"], ["a", "b", "c"], "text_2: Input lengths must be either 1:1, 1:N or "
                                                                  "N:N; got 2:3"),
                                   ([], ["a"], "text_1: At least one text element must be given"),
                                   ("q", [], "text_2: At least one text_pair element must be given"),
                                   ("q", [1], "text_2: must be a string or a list of strings")]:
        with pytest.raises(InvalidRequestError) as error:
            score_pairs(first, second)
        assert str(error.value) == message


def test_each_model_kind_serves_its_own_apis(classifiers, tiny_llama_dir, pooling_llm):
    with pytest.raises(ValueError, match="^Embedding API is not supported by this model"):
        pooling_llm(classifiers["qwen3"]).embed(PROMPTS)
    with pytest.raises(ValueError, match="^Classification API is not supported by this model"):
        pooling_llm(tiny_llama_dir).classify(PROMPTS)
    with pytest.raises(UnsupportedModelError, match="a Qwen3ForSequenceClassification .* runs with runner 'pooling'"):
        LLM(classifiers["qwen3"])


@pytest.mark.parametrize(("fields", "classify", "score"), [
    ({}, "softmax", "softmax"),
    ({"problem_type": "multi_label_classification"}, "sigmoid", "softmax"),
    ({"problem_type": "regression"}, "identity", "softmax"),
    ({"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, "softmax", "identity"),
])
def test_activations_as_vllm_reads_config_json(fields, classify, score, classifiers, tmp_path):
    pooling = read_model_pooling(copy_with_config_fields(classifiers["qwen3"], tmp_path / "m", **fields))
    assert (pooling.pooling_type, pooling.normalize, pooling.classifier.labels) == (
        "LAST", False, ("negative", "neutral", "positive"))
    assert (pooling.classifier.classify_activation, pooling.classifier.score_activation) == (classify, score)
    one_label = read_model_pooling(classifiers["cross-encoder"]).classifier
    assert (one_label.labels, one_label.classify_activation, one_label.score_activation) == (
        ("LABEL_0",), "sigmoid", "sigmoid")
    overridden = read_model_pooling(classifiers["qwen3"], PoolerConfig(pooling_type="MEAN", use_activation=False))
    assert (overridden.pooling_type, overridden.classifier.activates) == ("MEAN", False)
    # --pooler-config's use_activation false: logits unless the request asks for the activation
    assert overridden.classifier.classified([0.0, 0.0], None) == (0.0, 0.0)
    assert overridden.classifier.classified([0.0, 0.0], True) == (0.5, 0.5)
    assert one_label.scored([0.0], None) == 0.5 and one_label.scored([2.0], False) == 2.0
