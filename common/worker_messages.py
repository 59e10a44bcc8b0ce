"""Typed messages between the router and the workers (Ray actor calls pickle these)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.kv_transfer_types import AgentMetadata, KVLayout, LayerAnnouncement, TransferParams
from splitserve.common.lora import LoRARequest
from splitserve.common.pooling import PoolingParams
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.stats import EngineStats
from splitserve.common.token_logprobs import TokenLogprobs


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    """Stop strings are the router's business: workers get params without them."""
    router_id: str = ""
    """The router that sent it: the worker ends the request when that router is gone
    (`abort_router`). '': sent by no router (tests calling a worker directly)."""
    cache_salt: str | None = None
    """The request's prefix-cache salt (None: unsalted): its block hashes, and so the KV events the
    worker publishes for it, start from the salted root the router hashed the prompt with."""
    priority: int = 0
    """vLLM's request priority (lower first) under the workers' priority scheduling policy; 0 under fcfs."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter the prompt runs with (the OpenAI `model` field named it), None for the base model; like
    the salt it roots the block hashes (common/block_hash.py), so the router's hashes stay the worker's."""
    pooling_params: PoolingParams | None = None
    """An embedding request (a worker of runner 'pooling'): the prompt is pooled, nothing is sampled or held, and
    the result carries the embedding (sampling_params is then SamplingParams() and unused)."""


@dataclass(frozen=True)
class PrefillResult:
    """The first token of a request and where its prompt KV waits."""

    request_id: str
    token_ids: tuple[int, ...]
    """The first sampled token (empty if the request was aborted first)."""
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    """None: continue on a decode worker with `transfer`; else the request ended here."""
    stop_reason: int | str | None
    num_cached_tokens: int
    transfer: TransferParams | None
    generator_state: bytes | None
    """Seeded requests: RNG state after the first sample, for the decode worker."""
    compute_s: float
    """Seconds from the prompt's first scheduled engine step to its first token (prefill compute)."""
    queue_s: float = 0.0
    """Seconds from admission to the prefill worker to the prompt's first scheduled engine step."""
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """With sampling_params.prompt_logprobs, where the prompt was computed (with the first token): one
    entry per prompt token, None for the first; None otherwise."""
    error: str | None = None
    """Set with invalid_field on an 'abort' the engine decided for the request's own fault (its grammar
    refused the sampled token): the InvalidRequestError's text (the router answers INVALID_ARGUMENT)."""
    invalid_field: str | None = None
    """The field that error names."""
    embedding: tuple[float, ...] | None = None
    """An embedding request's pooled vector (finish_reason 'stop', nothing held); None otherwise."""


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    router_id: str
    """Which router's output stream carries this request's tokens."""
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    """Tokens already generated elsewhere: the prefill worker's first token, or (transfer None)
    what a lost worker streamed before the request moved here, recomputed with the prompt."""
    sampling_params: SamplingParams
    num_cached_tokens: int
    transfer: TransferParams | None
    """None: prefill locally (colocated mode) unless first_token_pending, else pull this KV first."""
    generator_state: bytes | None
    first_token_pending: bool = False
    """Layer-wise transfer: a prefill worker is computing the prompt now (output_token_ids is empty,
    transfer and generator_state None). The worker admits the request and allocates its blocks at
    once; its LayerwiseProgress (TransferParams, then LayerAnnouncements) and then its
    PrefillFirstToken follow on the same stream, and it decodes once both its pull and its first
    token are in."""
    cache_salt: str | None = None
    """The request's prefix-cache salt (None: unsalted), as on its PrefillRequest: a prompt prefilled
    or pulled here is cached under the same hashes as on the prefill worker."""
    priority: int = 0
    """As on its PrefillRequest: its place in the decode worker's queues (waiting for blocks, for a
    step) under the priority scheduling policy."""
    lora_request: LoRARequest | None = None
    """The request's LoRA adapter, as on its PrefillRequest: the decode steps run it, and the pulled blocks are
    cached under the adapter's hashes, as on the prefill worker."""
    pooling_params: PoolingParams | None = None
    """An embedding request pooled here (colocated mode, transfer None): as on a PrefillRequest; its one final
    TokenDelta carries the embedding."""


@dataclass(frozen=True)
class LayerwiseProgress:
    """Prefill worker -> router -> decode worker, layer-wise transfer: what the producer sent for
    one request since the last progress, in order (its TransferParams first, then its layers;
    announcements that queued up while the previous item was delivered travel together)."""

    request_id: str
    messages: tuple[TransferParams | LayerAnnouncement, ...]


@dataclass(frozen=True)
class PrefillFirstToken:
    """Router -> decode worker, layer-wise transfer: the prefill of a first_token_pending request
    returned and the request goes on here (a prefill that ended the request is sent as a
    StreamAbort instead)."""

    request_id: str
    token_ids: tuple[int, ...]
    num_cached_tokens: int
    generator_state: bytes | None
    """Seeded requests: RNG state after the first sample."""


@dataclass(frozen=True)
class TokenDelta:
    """What one request gained in one decode-worker step."""

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    transfer_s: float | None = None
    """Set on the first delta after a KV pull: seconds the pull took."""
    error: str | None = None
    """Why the request was ended by a fault (finish_reason 'abort'), or refused."""
    invalid_field: str | None = None
    """Set with `error` when the worker refused the request as one it can never serve: the field
    the error names (the router answers INVALID_ARGUMENT)."""
    kv_transfer_failed: bool = False
    """Set on the first delta after a failed pull: either the request goes on by recomputing the
    prompt (the producer may still hold the lease, so the router releases it), or (transfer
    failure policy 'fail') it is the error delta that ends the request."""
    queue_s: float | None = None
    """Set on a request's first delta with tokens: seconds from its admission to this worker to
    its first scheduled engine step, minus the KV pull (waiting for blocks, for the pull to start,
    for a batch slot)."""
    compute_s: float | None = None
    """Set with queue_s: seconds from the first scheduled engine step to this delta (the prefill
    of a prompt this worker computed itself, else the first decode step)."""
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """With sampling_params.prompt_logprobs, where the prompt was computed (with the first token): one
    entry per prompt token, None for the first; None otherwise."""
    embedding: tuple[float, ...] | None = None
    """An embedding request's pooled vector, on its final ('stop') delta; None otherwise."""


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str
    """'prefill' or 'decode' (a decode worker also prefills locally)."""
    max_model_len: int
    vocab_size: int
    layout: KVLayout
    agent: AgentMetadata
    """Transfer-agent metadata for the handshake (new on every worker start)."""
    max_num_seqs: int
    """The most requests the worker's engine runs in one batch."""
    layerwise: bool = False
    """Prefill: it announces each layer's KV as the forward writes it (kv_transfer_layerwise), so
    the router hands the decode worker its request when the prefill starts (prefill_layerwise)."""
    scheduling_policy: str = "fcfs"
    """The engine's scheduling_policy: the router takes requests with a priority other than 0 only
    when every worker's is "priority"."""


@dataclass(frozen=True)
class WorkerStats:
    engine: EngineStats
    num_held_leases: int
    """Prefill: requests whose KV waits for a pull."""
    num_transfers: int
    """Decode: requests waiting for blocks or pulling KV."""
    routers: frozenset[str]
    """The routers that have requests here (queued, running, holding KV or pulling it): a gone
    router's are ended at once (`abort_router`)."""
    num_layerwise_pulls: int = 0
    """Decode: layer-wise pulls completed (DONE) since the worker started."""

    @property
    def is_idle(self) -> bool:
        """No request, lease or transfer in flight and every KV block free."""
        engine = self.engine
        return (engine.num_running == engine.num_waiting == self.num_held_leases == self.num_transfers == 0
                and engine.num_free_kv_blocks == engine.num_kv_blocks)
