"""Stats dataclasses returned by cores; servers turn them into metrics."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.kv_events import LoadReport, WorkerCounters
from splitserve.common.kv_transfer_types import KVLayout
from splitserve.common.metrics import TTFT_PHASES
from splitserve.common.slo import SloOutcome, tpot_s


@dataclass(frozen=True)
class SpecDecodeStats:
    """Speculative decoding of one engine since start, with vLLM's semantics (cumulative counts)."""

    num_drafts: int
    """Verifications: one per speculating request per step."""
    num_draft_tokens: int
    """Draft tokens verified."""
    num_accepted_tokens: int
    """Draft tokens accepted (each verification also emits one token of the target's, not counted)."""
    num_accepted_tokens_per_pos: tuple[int, ...]
    """Entry j: verifications that accepted draft j + 1 (so it is at most entry j - 1)."""

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification (accepted drafts + the target's token); 0 before any."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's scheduler and KV pool (cumulative counters since start)."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    """Blocks with no owner, including cached-free ones that still hold a reusable prefix."""
    num_cached_free_kv_blocks: int
    """Free blocks that still carry a block hash (evictable prefix cache)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int
    """Prompt tokens found in the prefix cache."""
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    """Prompt tokens of the requests this engine prefilled (cached ones included; a prompt whose
    KV was pulled from a producer does not count unless it was recomputed here)."""
    num_generation_tokens: int
    """Tokens sampled (a producer samples each request's first token)."""
    quantization: str
    """How the decoder's linear weights are stored: none, int8, int4, gptq or awq (docs/quantization.md)."""
    weight_bits: int | None
    """Bits per quantized weight; None when not quantized."""
    quantization_group_size: int | None
    """Input channels sharing one scale; None when not quantized or one scale per output channel (int8)."""
    kv_cache_dtype: str
    """What the KV pool stores: the model's dtype ('float32', 'bfloat16') or 'int8' / 'fp8_e4m3' codes."""
    kv_bytes_per_token: int
    """Pool bytes of one token's keys and values across all layers (a quantized pool's scales included)."""
    spec_decode: SpecDecodeStats | None = None
    """Speculative decoding counters; None when the engine does not speculate."""

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks owned by requests, in [0, 1]."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class RoutingStats:
    """A router's routing outcomes since start (cumulative counts, sorted by name)."""

    decisions: tuple[tuple[str, int], ...]
    """(reason, requests): cache_hit, load, local_prefill, round_robin."""
    rejections: tuple[tuple[str, int], ...]
    """(reason, requests) rejected by admission control: ttft_slo, queue_full, no_kv_capacity,
    too_many_requests, tokenizer_busy."""


@dataclass(frozen=True)
class LoopLagStats:
    """How late the router's event-loop heartbeat ran, since start (one value per beat).

    Invariant: len(bucket_counts) == len(buckets) and bucket_counts[-1] <= count."""

    buckets: tuple[float, ...]
    """Upper bounds in seconds (common.metrics.LOOP_LAG_BUCKETS); +Inf is implicit."""
    bucket_counts: tuple[int, ...]
    """Cumulative: beats whose lag was at most each bound."""
    count: int
    """Beats measured."""
    sum_s: float
    """Their lag, summed."""


@dataclass(frozen=True)
class WorkerSnapshot:
    """The router's latest view of one worker (what its metrics are exported from).

    Invariant: load and counters are both set (the worker answers its report polls) or both None."""

    worker_id: str
    role: str
    """'prefill' or 'decode'."""
    load: LoadReport | None
    counters: WorkerCounters | None
    layout: KVLayout | None = None
    """The worker's KV pool layout from its info (KV dtype, bytes per token); None when not known."""


@dataclass(frozen=True)
class KVTransferRecord:
    """How one request's KV pull from its prefill worker to its decode worker ended."""

    prefill_worker: str
    decode_worker: str
    seconds: float | None
    """Pull time measured on the decode worker; None when the pull failed."""
    num_bytes: int
    """KV bytes pulled (TransferParams.num_bytes); 0 when the pull failed."""

    @property
    def failed(self) -> bool:
        return self.seconds is None


FINISH_REASONS = ("stop", "length")
"""The finish reasons of a request that finished; anything else ends it with an error code."""


@dataclass(frozen=True)
class RequestParamsRecord:
    """A finished client request's parameters and longest output, observed once however many sequences it ran
    (vLLM's request_params_n, request_params_max_tokens and request_max_num_generation_tokens, which vLLM observes
    once per parent request of n sequences). A lone request's is its own (n 1); a fan-out's is every sequence's."""

    n: int
    """The sequences the client asked for (its `n`)."""
    max_tokens: int | None
    """Each sequence's max_tokens as the router ran it (the client's, or the API's default); None only from a
    library caller that left it unset (not observed, as vLLM skips an unset one)."""
    max_num_generation_tokens: int
    """The most output tokens any of its sequences generated (best_of's dropped ones included)."""


@dataclass(frozen=True)
class RequestRecord:
    """One request's life at the router, built once when it ends, on any path after validation.

    Invariant: exactly one of finish_reason and error_code is set. Times are seconds, measured on
    the router's clock except the worker-side phases (durations on the worker's own clock)."""

    request_id: str
    finish_reason: str | None
    """'stop' or 'length' when the request finished; None when it did not."""
    error_code: str | None
    """gRPC status code name when it did not finish: RESOURCE_EXHAUSTED (admission control),
    UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, INVALID_ARGUMENT, ABORTED (a worker ended it),
    CANCELLED (the client went away)."""
    routing_reason: str | None
    """RouteDecision.reason (cache_hit, load, local_prefill, round_robin); None when not routed."""
    rejection_reason: str | None
    """Rejection.reason (ttft_slo, queue_full, no_kv_capacity), or too_many_requests (the router's
    in-flight limit), when admission control rejected it."""
    prefill_worker: str | None
    """The prefill worker it was routed to; None when not routed or prefilled on its decode worker."""
    decode_worker: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from a prefix cache."""
    num_output_tokens: int
    """Tokens streamed to the client."""
    ttft_s: float | None
    """Router arrival -> first token streamed; None when no token was."""
    inter_token_latencies: tuple[float, ...]
    """One per output token after the first (num_output_tokens - 1 values, none without tokens):
    a chunk of k tokens arriving g seconds after the previous chunk counts k gaps of g / k, tokens
    that came with the first token count 0; so they sum to last token - first token."""
    e2e_s: float
    """Router arrival -> the final chunk (or the request's end, when it did not finish)."""
    queue_s: float | None
    """Router arrival -> the prompt's first scheduled prefill step; None when no prefill ended."""
    prefill_s: float | None
    """Prefill compute: first scheduled step -> first token (on the worker that prefilled)."""
    decode_s: float | None
    """First token -> the final chunk (e2e_s - ttft_s); None without a first token."""
    ttft_breakdown: tuple[tuple[str, float], ...]
    """(phase, seconds) for each phase of common.metrics.TTFT_PHASES the request went through, in
    that order."""
    kv_transfer: KVTransferRecord | None
    """None when no KV moved (local prefill, finished on the prefill worker) or the request ended
    before the decode worker reported its pull."""
    slo: SloOutcome | None
    """Which targets it met; None when it does not count (see common.slo.request_slo_outcome)."""
    num_migrations: int = 0
    """Times it moved off a lost worker to another one."""
    step_of: str | None = None
    """Set on an internal step the router ran for a client's request (a beam of a beam search step), to
    that request's id: not a request any client sent. Observers count it apart (RouterMetrics keeps
    its KV transfer and counts it in internal_step_requests; the access log and the planner leave
    it out); the client's request has a record of its own. None: a client's request."""
    client_request_id: str | None = None
    """The id the client gave the request when the router knows it by another (request_id: that id was in
    flight, so this request's is it with a ` #<k>` suffix, router/request_ids.py; a sequence's or step's is
    derived from that); None when request_id is, or is derived from, the client's own."""

    def __post_init__(self) -> None:
        if (self.finish_reason is None) == (self.error_code is None):
            raise ValueError(f"exactly one of finish_reason ({self.finish_reason!r}) and error_code "
                             f"({self.error_code!r}) must be set")
        unknown = [phase for phase, _ in self.ttft_breakdown if phase not in TTFT_PHASES]
        if unknown:
            raise ValueError(f"unknown TTFT phases {unknown}; known: {TTFT_PHASES}")

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None with fewer than two output tokens."""
        return None if self.ttft_s is None else tpot_s(self.ttft_s, self.e2e_s, self.num_output_tokens)


@dataclass(frozen=True)
class PlannerStats:
    """The autoscaling planner's state for metrics: pool sizes, its targets and forecasts, and
    what it decided (cumulative since start)."""

    replicas: tuple[tuple[str, str, int], ...]
    """(pool, state, workers): state is routable, starting or draining."""
    targets: tuple[tuple[str, int], ...]
    """(pool, target replicas) of the last decision; empty before the first."""
    predicted_ttft_p99_s: float | None
    predicted_itl_p99_s: float | None
    """The last decision's forecast for its targets (None before the first)."""
    decisions: tuple[tuple[str, str, int], ...]
    """(pool, reason kind, decisions): scale_up, scale_down, hold, cooldown, at_max, at_min, bounded_step."""
    failed_starts: int
    """Workers the planner asked for that did not start."""
    device_seconds: float
    """Workers (any state) x seconds, summed over the ticks: the cost side of goodput per device."""
