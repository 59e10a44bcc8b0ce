"""What the engine hands back: per-step deltas and whole-request results."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from splitserve.common.errors import InvalidRequestError
from splitserve.common.token_logprobs import TokenLogprobs


@dataclass(frozen=True)
class CompletionDelta:
    """What one request gained in one step; the last delta of a request has finish_reason set."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...]
    text_delta: str
    finish_reason: str | None
    """None while running; 'stop', 'length' or 'abort' on the final delta."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended the request, if any."""
    num_prompt_tokens: int
    num_cached_tokens: int
    first_scheduled_at: float | None = None
    """time.monotonic() of the request's first scheduled step (Request.first_scheduled_at)."""
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """With SamplingParams.prompt_logprobs, on the delta that carries the first output token: one entry per
    prompt token, None for the first (nothing precedes it); None on every other delta."""
    error: InvalidRequestError | None = None
    """On an 'abort' the engine decided itself (Request.error): the request error to answer with."""
    embedding: tuple[float, ...] | None = None
    """A pooling request's (EngineCore.add_pooling_request) on its final 'stop' delta: the pooled, cut and normalized
    vector; None on every other delta (and on a pooling request's abort)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def queue_and_compute_s(self, admitted_at: float, now: float) -> tuple[float, float]:
        """(admitted_at -> first scheduled step, first scheduled step -> now), time.monotonic()
        seconds; a request never scheduled spent it all queued."""
        scheduled = now if self.first_scheduled_at is None else self.first_scheduled_at
        return max(scheduled - admitted_at, 0.0), now - scheduled


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request, vLLM's `CompletionOutput` (`out.outputs[0].text`)."""

    index: int
    """Position in RequestOutput.outputs."""
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    """Sum of the sampled tokens' logprobs (in output order) when SamplingParams.logprobs was set, else None
    (vLLM's rule)."""
    logprobs: list[TokenLogprobs] | None
    """With SamplingParams.logprobs: one entry per output token."""
    finish_reason: str
    """'stop', 'length' or 'abort'."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended the completion, if any."""

    def finished(self) -> bool:
        """vLLM's CompletionOutput.finished(): whether the completion has ended (it has a finish_reason)."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """A finished request, vLLM's `RequestOutput`: the prompt, and its completions in `outputs`.

    `text`, `token_ids`, `finish_reason`, `stop_reason` and `logprobs` are shorthands for those of
    `outputs[0]`, the only completion unless SamplingParams.n > 1."""

    request_id: str
    prompt: str | None
    """The prompt's text: the str prompt, or a dict prompt's "prompt"; None for token ids alone."""
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprobs | None] | None
    """With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first."""
    outputs: list[CompletionOutput]
    """SamplingParams.n completions, outputs[i].index == i."""
    finished: bool
    num_cached_tokens: int

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs


@dataclass(frozen=True)
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: one prompt's embedding."""

    embedding: list[float]
    """The pooled vector: hidden_size floats, or the request's `dimensions`."""

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(frozen=True)
class ClassificationOutput:
    """vLLM's ClassificationOutput: one prompt's class probabilities (or logits, use_activation=False)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(frozen=True)
class ScoringOutput:
    """vLLM's ScoringOutput: one pair's score."""

    score: float


PoolingOutput = TypeVar("PoolingOutput", EmbeddingOutput, ClassificationOutput, ScoringOutput)
"""What a pooling request returns: an embedding, class probabilities, or a score."""


@dataclass(frozen=True)
class PoolingRequestOutput(Generic[PoolingOutput]):
    """vLLM's PoolingRequestOutput: what a prompt (a score: a pair) pooled to, `outputs`; LLM.embed, classify and
    score return the subclass vLLM names for theirs."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    """The prompt as run; a score's pair: a cross-encoder's pair encoding, an embedding model's two prompts (with the
    pad token between them when the tokenizer has one, as vLLM counts them)."""
    num_cached_tokens: int
    finished: bool


@dataclass(frozen=True)
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """vLLM's EmbeddingRequestOutput (LLM.embed): `out.outputs.embedding`."""


@dataclass(frozen=True)
class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    """vLLM's ClassificationRequestOutput (LLM.classify): `out.outputs.probs`."""


@dataclass(frozen=True)
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """vLLM's ScoringRequestOutput (LLM.score): `out.outputs.score`."""


@dataclass(frozen=True)
class BeamSearchSequence:
    """One beam LLM.beam_search returns, vLLM's `BeamSearchSequence`."""

    tokens: list[int]
    """The prompt's tokens and the beam's, with the EOS that completed it (vLLM's offline form)."""
    cum_logprob: float
    text: str
    """tokens decoded, the prompt's included, special tokens kept (vLLM's tokenizer.decode(tokens))."""
    finish_reason: str
    """'stop' (EOS completed it) or 'length'."""
    stop_reason: int | None
    """The EOS id that completed it."""


@dataclass(frozen=True)
class BeamSearchOutput:
    """One prompt's best beams, best first (vLLM's `BeamSearchOutput`)."""

    sequences: list[BeamSearchSequence]
