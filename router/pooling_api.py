"""vLLM's pooling endpoints besides /v1/embeddings (router/embeddings.py): /classify, /score (and /v1/score), /rerank
(and /v1/rerank, /v2/rerank), /pooling: their requests, and their responses from each input's final chunk (whose
`embedding` is the pooled vector: an embedding, or a sequence-classification model's logits, common/pooling.py).

A score is either the cosine similarity of two embeddings (an embedding model: each text is an input of its own) or a
cross-encoder's activated logit (a classification model of one label: each pair is one input, the tokenizer's pair
encoding), as vLLM's ServingScores computes them; usage counts what vLLM counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.common.errors import InvalidRequestError, json_excerpt
from splitserve.common.pooling import Classifier, cosine_similarity, score_pairs
from splitserve.common.prompt_truncation import PromptTruncation
from splitserve.router.api_types import StreamChunk, Usage
from splitserve.router.embeddings import encoded
from splitserve.router.lax_values import with_lax_values
from splitserve.router.openai_protocol import (ChatInput, EmbeddingRequest, _chat_input, _flag, _model, _priority,
                                               _prompts, _request_id, _truncation, _typed, parse_embedding_request)
from splitserve.router.request_limits import MAX_SEQUENCES, RequestLimits, utf8_length
from splitserve.router.tokenizer import check_unicode


@dataclass(frozen=True)
class ClassifyRequest:
    model: str | None
    inputs: tuple[str | tuple[int, ...], ...]
    """`input`: a string, a list of strings, a list of token ids, or a list of token-id lists (as /v1/embeddings')."""
    use_activation: bool | None
    """vLLM's: false returns the logits as `probs`; None or true the model's activation (Classifier)."""
    truncation: PromptTruncation | None
    add_special_tokens: bool
    request_id: str
    priority: int
    chat: ChatInput | None
    """`messages` instead of `input` (vLLM's ClassificationChatRequest): one input, the rendered chat."""


@dataclass(frozen=True)
class ScoreRequest:
    """A /score or /rerank request: the first texts (one query, or N) against the second (documents)."""

    model: str | None
    firsts: tuple[str, ...]
    seconds: tuple[str, ...]
    pairs: tuple[tuple[str, str], ...]
    """(first, second) per score, in the order of `seconds` (common.pooling.score_pairs: 1:1, 1:N, N:N)."""
    use_activation: bool | None
    truncation: PromptTruncation | None
    request_id: str
    priority: int
    top_n: int
    """/rerank: the best top_n results (0, or more than the documents: all of them)."""
    return_documents: bool
    """/rerank: each result carries its `document` (vLLM always does; Jina's and Cohere's clients may ask not to)."""
    first_fields: tuple[str, ...]
    """What an error about each of `firsts` names: `text_1` (or `query`) for a string, `text_1[i]` in a list."""
    second_fields: tuple[str, ...]

    def input_fields(self, pairs: bool) -> list[str]:
        """What each input's errors name: pair i's two texts (`query + documents[i]`: a cross-encoder's inputs are the
        pairs), else each first text and then each second one."""
        if pairs:
            return [f"{self.first_fields[self.first_index(pair)]} + {second}"
                    for pair, second in enumerate(self.second_fields)]
        return [*self.first_fields, *self.second_fields]

    def first_index(self, pair: int) -> int:
        """Which of `firsts` pair `pair` scores (1:N: the one query)."""
        return 0 if len(self.firsts) == 1 else pair


def parse_classify_request(body: Mapping[str, Any], limits: RequestLimits) -> ClassifyRequest:
    """vLLM's ClassificationRequest: `input` as /v1/embeddings reads it (at most MAX_SEQUENCES), or its chat form
    (`messages`)."""
    body = with_lax_values(body, logprobs_is_boolean=False)
    chat = _chat_input(body, limits) if "messages" in body and "input" not in body else None
    if "input" not in body and chat is None:
        raise InvalidRequestError("input", "is required: a string, a list of strings, a list of token ids or a list "
                                           "of token-id lists (or send messages)")
    return ClassifyRequest(_model(body), () if chat else _prompts(body, limits, 1, True, "input"),
                           _use_activation(body), _truncation(body, limits, pools=True),
                           bool(_flag(body, "add_special_tokens", True)), _request_id(body, limits), _priority(body),
                           chat)


def parse_score_request(body: Mapping[str, Any], limits: RequestLimits) -> ScoreRequest:
    """vLLM's ScoreRequest: text_1 and text_2, each a string or a list of strings (its newer queries / documents
    spelling too)."""
    body = with_lax_values(body, logprobs_is_boolean=False)
    first, second = ("queries", "documents") if "text_1" not in body and "queries" in body else ("text_1", "text_2")
    for name in (first, second):
        if name not in body:
            raise InvalidRequestError(name, "is required: a string or a list of strings")
    return _score_request(body, limits, first, second, 0, True)


def parse_rerank_request(body: Mapping[str, Any], limits: RequestLimits) -> ScoreRequest:
    """vLLM's RerankRequest (Jina's and Cohere's shape): a `query` string, `documents` (strings), top_n and Jina's
    return_documents."""
    body = with_lax_values(body, logprobs_is_boolean=False)
    if body.get("query") is None:
        raise InvalidRequestError("query", "is required: a string")
    if not isinstance(body["query"], str):
        raise InvalidRequestError("query", f"must be a string, got {json_excerpt(body['query'])}")
    if "documents" not in body:
        raise InvalidRequestError("documents", "is required: a list of strings")
    top_n = _typed(body, "top_n", int, "an integer >= 0", 0)
    if top_n < 0:
        raise InvalidRequestError("top_n", f"must be an integer >= 0, got {top_n}")
    return _score_request(body, limits, "query", "documents", top_n, bool(_flag(body, "return_documents", True)))


def _score_request(body: Mapping[str, Any], limits: RequestLimits, first: str, second: str, top_n: int,
                   return_documents: bool) -> ScoreRequest:
    pairs = score_pairs(body[first], body[second], first, second)
    if len(pairs) > MAX_SEQUENCES:
        raise InvalidRequestError(second, f"{len(pairs)} pairs exceed {MAX_SEQUENCES} pairs per request")
    firsts, first_fields = _texts_and_fields(body, first, limits)
    seconds, second_fields = _texts_and_fields(body, second, limits)
    return ScoreRequest(_model(body), firsts, seconds, tuple(pairs), _use_activation(body),
                        _truncation(body, limits, pools=True), _request_id(body, limits), _priority(body), top_n,
                        return_documents, first_fields, second_fields)


def _texts_and_fields(body: Mapping[str, Any], field: str, limits: RequestLimits
                      ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """One side's texts (score_pairs checked their types) and what each one's errors name; each text's Unicode and
    size checked."""
    texts = (body[field],) if isinstance(body[field], str) else tuple(body[field])
    fields = (field,) if isinstance(body[field], str) else tuple(f"{field}[{index}]" for index in range(len(texts)))
    for text, name in zip(texts, fields):
        check_unicode(text, name)
        limits.check_prompt_bytes(utf8_length(text), name)
    return texts, fields


POOLING_TASKS = ("embed", "classify")
"""The /pooling tasks served: a whole sequence's vector (vLLM's per-token tasks, its default, are not)."""


@dataclass(frozen=True)
class PoolingRequest:
    """vLLM's /pooling request: /v1/embeddings' fields and the task the model pools for."""

    task: str
    embedding: EmbeddingRequest
    """input, encoding_format, dimensions, use_activation and the rest, read as /v1/embeddings reads them."""


def parse_pooling_request(body: Mapping[str, Any], limits: RequestLimits) -> PoolingRequest:
    """`task` is required (vLLM's default is a per-token task, not served here): embed or classify."""
    task = _typed(body, "task", str, f"one of {', '.join(POOLING_TASKS)}")
    if task not in POOLING_TASKS:
        raise InvalidRequestError("task", f"must be one of {', '.join(POOLING_TASKS)} (a whole sequence's vector; "
                                          f"per-token tasks are not served), got {json_excerpt(task)}")
    return PoolingRequest(task, parse_embedding_request(body, limits))


@dataclass(frozen=True)
class PoolingRenderer:
    """vLLM's PoolingResponse: per input its pooled `data`: the embedding (task embed), or the classifier's
    activated logits (task classify; the logits with use_activation false)."""

    request_id: str
    created: int
    model: str
    encoding_format: str
    classifier: Classifier | None
    use_activation: bool | None

    def response(self, choices: Sequence[Sequence[StreamChunk]], usage: Usage) -> dict:
        data = [{"index": index, "object": "pooling", "data": encoded(self._data(chunks[-1].embedding),
                                                                        self.encoding_format)}
                for index, chunks in enumerate(choices)]
        return {"id": f"pool-{self.request_id}", "object": "list", "created": self.created, "model": self.model,
                "data": data, "usage": _usage(usage.prompt_tokens)}

    def _data(self, vector: tuple[float, ...]) -> Sequence[float]:
        return vector if self.classifier is None else self.classifier.classified(vector, self.use_activation)


def _use_activation(body: Mapping[str, Any]) -> bool | None:
    """vLLM's use_activation, or its deprecated spellings `activation` and `softmax`."""
    for name in ("use_activation", "activation", "softmax"):
        value = _typed(body, name, bool, "a boolean")
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class ClassifyRenderer:
    """vLLM's ClassificationResponse: per input its label (id2label of the largest output), `probs` (the activated
    logits, or the logits with use_activation false) and num_classes."""

    request_id: str
    created: int
    model: str
    classifier: Classifier
    use_activation: bool | None

    def response(self, choices: Sequence[Sequence[StreamChunk]], usage: Usage) -> dict:
        data = []
        for index, chunks in enumerate(choices):
            probs = self.classifier.classified(chunks[-1].embedding, self.use_activation)
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": index, "label": self.classifier.labels[best], "probs": list(probs),
                         "num_classes": len(probs)})
        return {"id": f"classify-{self.request_id}", "object": "list", "created": self.created, "model": self.model,
                "data": data, "usage": _usage(usage.prompt_tokens)}


@dataclass(frozen=True)
class ScoreRenderer:
    """A /score or /rerank response from its inputs' final chunks: with `classifier` (a cross-encoder) input i is
    pair i and its score the activated logit; without, inputs are the request's firsts then its seconds, embedded,
    and pair i scores the cosine similarity of its two."""

    request: ScoreRequest
    request_id: str
    created: int
    model: str
    classifier: Classifier | None
    prompt_lengths: tuple[int, ...]
    """Each input's prompt tokens."""
    pad_tokens: int
    """An embedding pair's usage counts its two prompts and the tokenizer's pad token between them (vLLM's count:
    1 when the tokenizer has one, else 0)."""
    rerank: bool

    def response(self, choices: Sequence[Sequence[StreamChunk]], usage: Usage) -> dict:
        scores = self._scores([chunks[-1].embedding for chunks in choices])
        tokens = self._pair_tokens()
        if self.rerank:
            return self._rerank_response(scores, sum(tokens))
        return {"id": f"score-{self.request_id}", "object": "list", "created": self.created, "model": self.model,
                "data": [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)],
                "usage": _usage(sum(tokens))}

    def _scores(self, vectors: list[tuple[float, ...]]) -> list[float]:
        if self.classifier is not None:
            return [self.classifier.scored(vector, self.request.use_activation) for vector in vectors]
        num_firsts = len(self.request.firsts)
        return [cosine_similarity(vectors[self.request.first_index(pair)], vectors[num_firsts + pair])
                for pair in range(len(self.request.pairs))]

    def _pair_tokens(self) -> list[int]:
        if self.classifier is not None:
            return list(self.prompt_lengths)
        num_firsts = len(self.request.firsts)
        return [self.prompt_lengths[self.request.first_index(pair)] + self.pad_tokens
                + self.prompt_lengths[num_firsts + pair] for pair in range(len(self.request.pairs))]

    def _rerank_response(self, scores: list[float], num_tokens: int) -> dict:
        """vLLM's RerankResponse: results by relevance_score, best first (ties keep document order), the best top_n."""
        order = sorted(range(len(scores)), key=lambda index: -scores[index])
        if 0 < self.request.top_n < len(order):
            order = order[:self.request.top_n]
        results = [{"index": index, **({"document": {"text": self.request.seconds[index]}}
                                       if self.request.return_documents else {}),
                    "relevance_score": scores[index]} for index in order]
        return {"id": f"rerank-{self.request_id}", "model": self.model,
                "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}, "results": results}


def _usage(prompt_tokens: int) -> dict:
    """vLLM's UsageInfo of a pooling response: nothing generated."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}
