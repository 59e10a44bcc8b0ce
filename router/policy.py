"""Routing and admission policy: a pure function of what the router observes.

`route()` takes one request's needs and a typed view of every candidate worker (prefix-cache
overlap from the prefix index, load from the workers' reports plus the router's own unreported
assignments) and returns where to run it, or why to reject it at once. No I/O, no clock: the
caller builds the observations, passes a `turn` counter for tie-breaking, and counts decisions.

Cost model (docs/routing.md): a worker's predicted TTFT is
    (num_prompt_tokens - num_cached_tokens + num_queued_prefill_tokens) * s_per_token
with num_cached_tokens clamped to num_prompt_tokens - 1 (an engine always computes >= 1 prompt
token to sample the first output). Only `prefix_aware` reads cache overlap when *deciding*;
every policy's reported `predicted_ttft_s` (which admission checks) counts the cache hit the
chosen worker will actually get. A remote prefill's TTFT excludes the KV transfer: the first
token streams from the prefill worker, and the transfer delays the second token instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from splitserve.common.validation import require

ROUTING_POLICIES = ("prefix_aware", "least_loaded", "round_robin")
DISAGGREGATION_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class RoutingConfig:
    """How the router picks workers and when it rejects a request up front."""

    policy: str = "prefix_aware"
    """prefix_aware: least predicted TTFT (cache overlap + queued work); least_loaded: fewest
    requests in flight from this router; round_robin: in turn. The last two ignore caches."""
    disaggregation: str = "auto"
    """auto: decide per request; always: prefill on a prefill worker; never: prefill on the
    decode worker (no KV moves)."""
    max_local_prefill_tokens: int = 256
    """auto: the longest uncached prompt a decode worker prefills itself (a local prefill
    stalls that worker's running decodes for its duration)."""
    default_prefill_s_per_token: float = 1e-3
    """Prefill cost of one prompt token, used until a worker has measured its own."""
    transfer_s_per_token: float = 5e-6
    """Predicted KV pull cost per prompt token; auto mode charges it to remote prefill."""
    admission_ttft_factor: float = 4.0
    """Reject a request when its best predicted TTFT exceeds this factor x its TTFT SLO (the
    request's own, else router.slo.ttft_s)."""
    max_queued_prefill_tokens: int | None = None
    """A worker with this many queued prompt tokens takes no new prefill; reject a request
    when no candidate is below it. None: no limit."""
    max_in_flight_requests: int | None = 1024
    """Reject a request at once (RESOURCE_EXHAUSTED, reason too_many_requests) while this
    router has this many in flight, instead of queueing without bound. None: no limit."""
    max_migrations: int = 2
    """How many times one request may move off a lost worker (re-prefilling prompt + tokens
    streamed so far elsewhere) before it fails with UNAVAILABLE; 0: never move."""

    def __post_init__(self) -> None:
        require(self.policy in ROUTING_POLICIES, f"policy must be one of {ROUTING_POLICIES}, got {self.policy!r}")
        require(self.disaggregation in DISAGGREGATION_MODES,
                 f"disaggregation must be one of {DISAGGREGATION_MODES}, got {self.disaggregation!r}")
        require(self.max_local_prefill_tokens >= 0,
                 f"max_local_prefill_tokens must be >= 0, got {self.max_local_prefill_tokens}")
        require(self.default_prefill_s_per_token > 0,
                 f"default_prefill_s_per_token must be > 0, got {self.default_prefill_s_per_token}")
        require(self.transfer_s_per_token >= 0, f"transfer_s_per_token must be >= 0, got {self.transfer_s_per_token}")
        require(self.admission_ttft_factor > 0,
                 f"admission_ttft_factor must be > 0, got {self.admission_ttft_factor}")
        require(self.max_queued_prefill_tokens is None or self.max_queued_prefill_tokens >= 1,
                 f"max_queued_prefill_tokens must be >= 1, got {self.max_queued_prefill_tokens}")
        require(self.max_in_flight_requests is None or self.max_in_flight_requests >= 1,
                 f"max_in_flight_requests must be >= 1, got {self.max_in_flight_requests}")
        require(self.max_migrations >= 0, f"max_migrations must be >= 0, got {self.max_migrations}")


@dataclass(frozen=True)
class RoutingRequest:
    """What routing needs to know about one request."""

    num_prompt_tokens: int
    num_blocks_needed: int
    """KV blocks the request needs on the decode worker (prompt + max output)."""
    ttft_slo_s: float | None
    """This request's TTFT SLO (the caller applies the config default); None: no TTFT check."""

    def __post_init__(self) -> None:
        require(self.num_prompt_tokens >= 1, f"num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        require(self.num_blocks_needed >= 1, f"num_blocks_needed must be >= 1, got {self.num_blocks_needed}")
        require(self.ttft_slo_s is None or self.ttft_slo_s > 0, f"ttft_slo_s must be > 0, got {self.ttft_slo_s}")


@dataclass(frozen=True)
class PrefillCandidate:
    """A prefill worker as the router sees it for one request."""

    worker_id: str
    num_cached_tokens: int
    """Leading prompt tokens its prefix cache holds (index overlap * block_size)."""
    num_queued_prefill_tokens: int
    """Prompt tokens queued there: max(reported, this router's unfinished assignments)."""
    prefill_s_per_token: float | None
    """Measured cost of one prompt token; None: the config default."""
    num_in_flight: int
    """Requests this router has assigned there and not seen finish (least_loaded)."""


@dataclass(frozen=True)
class DecodeCandidate:
    """A decode worker as the router sees it for one request."""

    worker_id: str
    num_cached_tokens: int
    """Leading prompt tokens its prefix cache holds (counts for a local prefill)."""
    num_queued_prefill_tokens: int
    """Prompt tokens of local prefills queued there."""
    prefill_s_per_token: float | None
    """Measured cost of one prompt token; None: the config default."""
    num_running: int
    """Running requests, this router's unreported assignments included."""
    max_num_seqs: int
    num_free_kv_blocks: int
    num_kv_blocks: int
    num_in_flight: int
    """Requests this router has assigned there and not seen finish (least_loaded)."""

    def __post_init__(self) -> None:
        require(self.max_num_seqs >= 1, f"{self.worker_id}: max_num_seqs must be >= 1, got {self.max_num_seqs}")
        require(0 <= self.num_free_kv_blocks <= self.num_kv_blocks,
                 f"{self.worker_id}: need 0 <= num_free_kv_blocks <= num_kv_blocks, "
                 f"got {self.num_free_kv_blocks} and {self.num_kv_blocks}")


Candidate = PrefillCandidate | DecodeCandidate
C = TypeVar("C", PrefillCandidate, DecodeCandidate)


@dataclass(frozen=True)
class RouteDecision:
    decode_worker_id: str | None
    """None: a pooling request that runs on its prefill worker alone (route_prefill_only)."""
    prefill_worker_id: str | None
    """None: the decode worker prefills locally (no KV moves)."""
    predicted_ttft_s: float
    """Predicted TTFT of the chosen prefill (remote: excluding the KV transfer)."""
    reason: str
    """For metrics: "cache_hit" | "load" | "local_prefill" | "round_robin"."""


@dataclass(frozen=True)
class Rejection:
    reason: str
    """For metrics: "ttft_slo" | "queue_full" | "no_kv_capacity"."""
    message: str
    """For the client, with the numbers (predicted vs allowed)."""


def route(request: RoutingRequest, prefill: Sequence[PrefillCandidate], decode: Sequence[DecodeCandidate],
          config: RoutingConfig, turn: int) -> RouteDecision | Rejection:
    """Pick a decode worker and where to prefill, or reject the request at once.

    `turn` (the caller's request counter) breaks exact ties round-robin, so a burst at an idle
    pool spreads. Raises ValueError only for a caller bug: no decode candidates.
    """
    if not decode:
        raise ValueError("route() needs at least one decode candidate")
    # Workers with room now; when none has, every worker whose pool can ever hold the request
    # (its engine queues it until blocks free up): a busy pool queues, it does not reject.
    fitting = ([c for c in decode if _fits(request, c)]
               or [c for c in decode if c.num_kv_blocks >= request.num_blocks_needed])
    if not fitting:
        return _no_kv_capacity(request, decode)
    if not prefill or config.disaggregation == "never":
        return _route_local_only(request, fitting, config, turn)
    open_prefill = [c for c in prefill if not _queue_full(c, config)]
    if not open_prefill:
        short_local = [c for c in fitting if _short_enough_for_local(request, c, config)]
        if config.disaggregation == "auto" and short_local:
            return _route_local_only(request, short_local, config, turn)  # auto may still prefill locally
        return _queue_full_rejection(prefill, config, "prefill")
    decode_worker = _pick_decode(request, fitting, config, turn)
    prefill_worker = _pick_prefill(request, open_prefill, config, turn)
    if config.disaggregation == "auto" and _local_wins(request, prefill_worker, decode_worker, config):
        return _admit(request, _local_decision(request, decode_worker, config), config)
    return _admit(request, _remote_decision(request, prefill_worker, decode_worker, config), config)


def route_prefill_only(request: RoutingRequest, prefill: Sequence[PrefillCandidate], config: RoutingConfig,
                       turn: int) -> RouteDecision | Rejection:
    """Pick a prefill worker for a request that needs nothing else (a pooling request: its vector comes back with
    the prefill's result), or reject it at once: no decode worker is picked, so none's queue or KV pool counts.
    Raises ValueError only for a caller bug: no prefill candidates."""
    if not prefill:
        raise ValueError("route_prefill_only() needs at least one prefill candidate")
    open_prefill = [c for c in prefill if not _queue_full(c, config)]
    if not open_prefill:
        return _queue_full_rejection(prefill, config, "prefill")
    worker = _pick_prefill(request, open_prefill, config, turn)
    reason = "round_robin" if config.policy == "round_robin" else "cache_hit" if worker.num_cached_tokens else "load"
    return _admit(request, RouteDecision(None, worker.worker_id, predicted_ttft_s(request, worker, config), reason),
                  config)


def predicted_ttft_s(request: RoutingRequest, candidate: Candidate, config: RoutingConfig,
                     num_cached_tokens: int | None = None) -> float:
    """(uncached prompt tokens + queued prefill tokens) x the worker's per-token prefill cost.

    `num_cached_tokens` overrides the candidate's overlap (0 for a cache-blind decision).
    """
    cached = candidate.num_cached_tokens if num_cached_tokens is None else num_cached_tokens
    return (_uncached_tokens(request, cached) + candidate.num_queued_prefill_tokens) * _s_per_token(candidate, config)


def decode_score(request: RoutingRequest, candidate: DecodeCandidate) -> float:
    """Lower is better: batch occupancy + KV usage after admitting the request, each in [0, 1].

        num_running / max_num_seqs + 1 - (num_free_kv_blocks - num_blocks_needed) / num_kv_blocks
    """
    headroom = (candidate.num_free_kv_blocks - request.num_blocks_needed) / candidate.num_kv_blocks
    return candidate.num_running / candidate.max_num_seqs + 1.0 - headroom


def _route_local_only(request: RoutingRequest, fitting: Sequence[DecodeCandidate], config: RoutingConfig,
                      turn: int) -> RouteDecision | Rejection:
    """No prefill pool to use (none, or disaggregation "never"): the decode worker prefills."""
    open_decode = [c for c in fitting if not _queue_full(c, config)]
    if not open_decode:
        return _queue_full_rejection(fitting, config, "decode")
    decode_worker = _pick_decode(request, open_decode, config, turn)
    return _admit(request, _local_decision(request, decode_worker, config), config)


def _pick_prefill(request: RoutingRequest, candidates: Sequence[PrefillCandidate], config: RoutingConfig,
                  turn: int) -> PrefillCandidate:
    if config.policy == "prefix_aware":
        return _argmin(candidates, lambda c: predicted_ttft_s(request, c, config), turn)
    if config.policy == "least_loaded":
        return _argmin(candidates, lambda c: c.num_in_flight, turn)
    return _argmin(candidates, lambda c: 0, turn)  # round_robin: everyone ties


def _pick_decode(request: RoutingRequest, candidates: Sequence[DecodeCandidate], config: RoutingConfig,
                 turn: int) -> DecodeCandidate:
    if config.policy == "prefix_aware":
        return _argmin(candidates, lambda c: decode_score(request, c), turn)
    if config.policy == "least_loaded":
        return _argmin(candidates, lambda c: c.num_in_flight, turn)
    return _argmin(candidates, lambda c: 0, turn)  # round_robin: everyone ties


def _argmin(candidates: Sequence[C], key: Callable[[C], float], turn: int) -> C:
    """The candidate with the least key; exact ties go round-robin by `turn` (in candidate order)."""
    best = min(key(c) for c in candidates)
    tied = [c for c in candidates if key(c) == best]
    return tied[turn % len(tied)]


def _local_wins(request: RoutingRequest, prefill_worker: PrefillCandidate, decode_worker: DecodeCandidate,
                config: RoutingConfig) -> bool:
    """auto mode: prefill on the decode worker iff its uncached part is short and it is no slower
    than the remote prefill plus the KV transfer. Only prefix_aware counts cache overlap here."""
    if _queue_full(decode_worker, config):
        return False
    aware = config.policy == "prefix_aware"
    local_cached = decode_worker.num_cached_tokens if aware else 0
    if not _short_enough_for_local(request, decode_worker, config):
        return False
    local = predicted_ttft_s(request, decode_worker, config, local_cached)
    remote = predicted_ttft_s(request, prefill_worker, config, None if aware else 0)
    return local <= remote + request.num_prompt_tokens * config.transfer_s_per_token


def _short_enough_for_local(request: RoutingRequest, decode_worker: DecodeCandidate, config: RoutingConfig) -> bool:
    """The uncached part a decode worker would prefill is within max_local_prefill_tokens (only
    prefix_aware counts the decode worker's cache)."""
    cached = decode_worker.num_cached_tokens if config.policy == "prefix_aware" else 0
    return _uncached_tokens(request, cached) <= config.max_local_prefill_tokens


def _local_decision(request: RoutingRequest, decode_worker: DecodeCandidate, config: RoutingConfig) -> RouteDecision:
    return RouteDecision(decode_worker.worker_id, None, predicted_ttft_s(request, decode_worker, config),
                         "local_prefill")


def _remote_decision(request: RoutingRequest, prefill_worker: PrefillCandidate, decode_worker: DecodeCandidate,
                     config: RoutingConfig) -> RouteDecision:
    if config.policy == "round_robin":
        reason = "round_robin"
    else:
        reason = "cache_hit" if prefill_worker.num_cached_tokens > 0 else "load"
    return RouteDecision(decode_worker.worker_id, prefill_worker.worker_id,
                         predicted_ttft_s(request, prefill_worker, config), reason)


def _admit(request: RoutingRequest, decision: RouteDecision, config: RoutingConfig) -> RouteDecision | Rejection:
    """Reject when the chosen option's predicted TTFT exceeds admission_ttft_factor x the SLO."""
    if request.ttft_slo_s is None:
        return decision
    allowed_s = config.admission_ttft_factor * request.ttft_slo_s
    if decision.predicted_ttft_s <= allowed_s:
        return decision
    return Rejection("ttft_slo", f"predicted TTFT {decision.predicted_ttft_s:.3f} s exceeds the allowed "
                                 f"{allowed_s:.3f} s ({config.admission_ttft_factor:g} x the "
                                 f"{request.ttft_slo_s:.3f} s TTFT SLO) at the current load")


def _fits(request: RoutingRequest, candidate: DecodeCandidate) -> bool:
    return (candidate.num_free_kv_blocks >= request.num_blocks_needed
            and candidate.num_running < candidate.max_num_seqs)


def _no_kv_capacity(request: RoutingRequest, decode: Sequence[DecodeCandidate]) -> Rejection:
    largest = max(c.num_kv_blocks for c in decode)
    return Rejection("no_kv_capacity", f"the request needs {request.num_blocks_needed} KV blocks (prompt + "
                                       f"max_tokens) and the largest decode KV pool has {largest}")


def _queue_full(candidate: Candidate, config: RoutingConfig) -> bool:
    limit = config.max_queued_prefill_tokens
    return limit is not None and candidate.num_queued_prefill_tokens >= limit


def _queue_full_rejection(candidates: Sequence[Candidate], config: RoutingConfig, pool: str) -> Rejection:
    least = min(c.num_queued_prefill_tokens for c in candidates)
    return Rejection("queue_full", f"every {pool} worker already has >= {config.max_queued_prefill_tokens} "
                                   f"prompt tokens queued (least: {least})")


def _uncached_tokens(request: RoutingRequest, num_cached_tokens: int) -> int:
    """Prompt tokens left to compute; >= 1, since the engine always computes the last one."""
    return request.num_prompt_tokens - max(0, min(num_cached_tokens, request.num_prompt_tokens - 1))


def _s_per_token(candidate: Candidate, config: RoutingConfig) -> float:
    measured = candidate.prefill_s_per_token
    return config.default_prefill_s_per_token if measured is None else measured
