"""What the router's APIs (gRPC Generation, Triton, OpenAI HTTP) hand the orchestrator and get
back: a request's input, its streamed chunks, and the error that ends a stream."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.lora import LoRARequest
from splitserve.common.pooling import PoolingParams
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.token_logprobs import TokenLogprobs


class RouterError(Exception):
    """Ends a stream with a gRPC status code name and a message for the client."""

    def __init__(self, code: str, message: str, rejection_reason: str | None = None) -> None:
        """`rejection_reason`: why admission control refused the request (RESOURCE_EXHAUSTED), for its record."""
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.rejection_reason = rejection_reason


@dataclass(frozen=True)
class GenerationInput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    deadline: float | None = None
    """time.monotonic() after which the request ends with DEADLINE_EXCEEDED."""
    ttft_slo_s: float | None = None
    """The request's TTFT target (admission control, SLO accounting); None takes the router's default."""
    tpot_slo_s: float | None = None
    """The request's TPOT target (SLO accounting); None takes the router's default."""
    kv_cached_on: tuple[str, ...] = ()
    """Workers known to hold the prompt's full blocks in their prefix cache before their reports
    say so (a parallel-sampling sibling was just prefilled there): routing counts those blocks as
    cached on them, so the siblings of `n > 1` share the prompt's KV."""
    cache_salt: str | None = None
    """Salts the prefix cache (vLLM's cache_salt, a non-empty string): the prompt's block hashes, at the
    router and on the workers, start from the salted root, so it hits only blocks of requests with the
    same salt. None: unsalted."""
    step_of: str | None = None
    """The client's request this one is an internal step of (each live beam at each step of a beam search
    runs as a request of its own): it runs like any request, but it is not one the client sent, so it is
    recorded as a step (RequestRecord.step_of), never as a request; the client's request has its own
    record (Orchestrator.stepwise). None: a request the client sent (or one sequence of it)."""
    priority: int = 0
    """vLLM's request priority: under the workers' priority scheduling policy, lower values are
    scheduled first and preempted last; anything but 0 is refused under fcfs."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the request runs with (the OpenAI `model` field selected it by name), None for the base
    model: the workers run it, and the prompt's block hashes start from its root (common/block_hash.py)."""
    client_request_id: str | None = None
    """The id the client gave the request when the router knows it by another (request_id: the client's was in
    flight, router/request_ids.py), for its record; None when request_id is (or is derived from) the client's."""
    pooling_params: PoolingParams | None = None
    """An embedding request (a cluster of runner 'pooling'): its prompt is pooled where it is prefilled (a prefill
    worker, or in colocated mode a decode worker), no KV moves, and its one chunk carries the embedding;
    sampling_params is SamplingParams(max_tokens=1) and unused."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Timing:
    queue_s: float
    prefill_s: float
    transfer_s: float
    first_token_s: float
    total_s: float


@dataclass(frozen=True)
class StreamChunk:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    kv_holder: str | None = None
    """On a request's first chunk: the worker whose prefix cache now holds the prompt's KV (its
    prefill worker, or the decode worker that prefilled it); None on every other chunk."""
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """With sampling_params.prompt_logprobs, on the chunk with the request's first token: one entry per
    prompt token, None for the first; None on every other chunk."""
    embedding: tuple[float, ...] | None = None
    """An embedding request's (GenerationInput.pooling_params) vector, on its one (final) chunk."""
