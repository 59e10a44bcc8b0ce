"""The planner's contract: what it observes each tick, how it is configured, what it decides.

Everything here is plain frozen data; the core never reads a clock, a socket or Ray. The Ray
adapter and the simulator both build `Observation`s and apply `Decision`s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from splitserve.common.validation import require


class Role(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class LengthHistogram:
    """An empirical distribution of token lengths over the observation window.

    Invariant: `lengths` strictly ascending, every count > 0, both the same length (may be empty:
    nothing was seen)."""

    lengths: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require(len(self.lengths) == len(self.counts), "lengths and counts must have the same length")
        require(all(a < b for a, b in zip(self.lengths, self.lengths[1:])), "lengths must be strictly ascending")
        require(all(c > 0 for c in self.counts), "every count must be > 0")
        require(all(n >= 0 for n in self.lengths), "lengths must be >= 0")

    @classmethod
    def of(cls, samples: list[int] | tuple[int, ...]) -> LengthHistogram:
        counts: dict[int, int] = {}
        for n in samples:
            counts[n] = counts.get(n, 0) + 1
        keys = tuple(sorted(counts))
        return cls(keys, tuple(counts[k] for k in keys))

    @property
    def total(self) -> int:
        return sum(self.counts)

    def mean(self) -> float:
        return sum(n * c for n, c in zip(self.lengths, self.counts)) / self.total if self.total else 0.0

    def quantile(self, q: float) -> int:
        """The smallest length with at least a fraction q of the samples at or below it (0 when empty)."""
        require(0.0 <= q <= 1.0, f"q must be in [0, 1], got {q}")
        need, seen = q * self.total, 0
        for n, c in zip(self.lengths, self.counts):
            seen += c
            if seen >= need:
                return n
        return 0


@dataclass(frozen=True)
class PrefillStepSample:
    """One prefill-worker engine step: `num_tokens` prompt tokens computed in `seconds`."""

    num_tokens: int
    seconds: float

    def __post_init__(self) -> None:
        require(self.num_tokens >= 1, f"a prefill step sample needs num_tokens >= 1, got {self.num_tokens}")
        _require_finite_nonnegative("a prefill step sample's seconds", self.seconds)


@dataclass(frozen=True)
class DecodeStepSample:
    """One decode-only engine step over `batch_size` requests whose contexts total `context_tokens`."""

    batch_size: int
    context_tokens: int
    seconds: float

    def __post_init__(self) -> None:
        require(self.batch_size >= 0 and self.context_tokens >= 0,
                f"a decode step sample needs batch_size and context_tokens >= 0, got {self.batch_size}, "
                f"{self.context_tokens}")
        _require_finite_nonnegative("a decode step sample's seconds", self.seconds)


@dataclass(frozen=True)
class PoolObservation:
    """One pool at the end of the window."""

    replicas: int
    """Workers that take new requests now."""
    starting: int = 0
    """Workers asked for and not routable yet."""
    draining: int = 0
    """Workers that take no new request and still finish their running ones."""
    queue_depth: int = 0
    """Requests waiting for this pool (not yet scheduled on a worker)."""
    queue_time_p50_s: float = 0.0
    queue_time_p99_s: float = 0.0
    running_requests: int = 0
    kv_usage: float = 0.0
    """Mean fraction of KV blocks in use over the routable workers, [0, 1]."""
    kv_capacity_tokens: int = 0
    """KV tokens one worker of this pool can hold (0 = unknown)."""

    def __post_init__(self) -> None:
        for name in ("replicas", "starting", "draining", "queue_depth", "running_requests", "kv_capacity_tokens"):
            require(getattr(self, name) >= 0, f"a pool's {name} must be >= 0, got {getattr(self, name)}")
        for name in ("queue_time_p50_s", "queue_time_p99_s"):
            _require_finite_nonnegative(f"a pool's {name}", getattr(self, name))
        _require_fraction("a pool's kv_usage", self.kv_usage)


@dataclass(frozen=True)
class Observation:
    """What the planner sees at one tick: the last `window_s` seconds of traffic and the pools now."""

    now_s: float
    window_s: float
    arrival_rate: float
    """Requests per second that arrived in the window."""
    arrival_cv2: float
    """Squared coefficient of variation of inter-arrival times in the window (1 = Poisson, > 1 bursty)."""
    prompt_lengths: LengthHistogram
    output_lengths: LengthHistogram
    prefill: PoolObservation
    decode: PoolObservation
    prefix_hit_rate: float = 0.0
    """Fraction of prompt tokens served from a prefix cache."""
    transfer_s_p50: float = 0.0
    """Median KV transfer time prefill -> decode."""
    ttft_attainment: float | None = None
    """Fraction of requests finished in the window that met the TTFT target (None: none finished)."""
    itl_attainment: float | None = None
    """Same for the TPOT/ITL target."""
    ttft_p99_s: float | None = None
    itl_p99_s: float | None = None
    local_prefill_share: float = 0.0
    """Fraction of requests prefilled on their decode worker (conditional disaggregation)."""
    scale_up_s: float | None = None
    """Measured seconds from asking for a worker to it being routable (None: not measured yet)."""
    prefill_steps: tuple[PrefillStepSample, ...] = ()
    decode_steps: tuple[DecodeStepSample, ...] = ()

    def __post_init__(self) -> None:
        require(math.isfinite(self.now_s), f"now_s must be finite, got {self.now_s}")
        require(0 < self.window_s < math.inf, f"window_s must be a finite number > 0, got {self.window_s}")
        for name in ("arrival_rate", "arrival_cv2", "transfer_s_p50"):
            _require_finite_nonnegative(name, getattr(self, name))
        for name in ("prefix_hit_rate", "local_prefill_share"):
            _require_fraction(name, getattr(self, name))
        for name in ("ttft_attainment", "itl_attainment"):
            if getattr(self, name) is not None:
                _require_fraction(name, getattr(self, name))
        for name in ("ttft_p99_s", "itl_p99_s", "scale_up_s"):
            if getattr(self, name) is not None:
                _require_finite_nonnegative(name, getattr(self, name))


@dataclass(frozen=True)
class PoolBounds:
    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        require(0 <= self.min_replicas <= self.max_replicas,
                f"need 0 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")


@dataclass(frozen=True)
class PerformanceProfile:
    """Offline seed of the per-role performance model (refined online from step samples).

    prefill step seconds = prefill_fixed_s + prefill_s_per_token * n + prefill_s_per_token2 * n^2
    decode step seconds  = decode_fixed_s + decode_s_per_request * batch + decode_s_per_context_token * context_tokens
    """

    prefill_fixed_s: float = 0.002
    prefill_s_per_token: float = 0.0002
    prefill_s_per_token2: float = 0.0
    decode_fixed_s: float = 0.004
    decode_s_per_request: float = 0.0002
    decode_s_per_context_token: float = 0.0
    max_batch_size: int = 256
    """Decode batch limit of one worker (the engine's max_num_seqs)."""
    prefill_token_budget: int = 2048
    """Tokens one prefill step computes at most (the engine's max_num_batched_tokens)."""

    def __post_init__(self) -> None:
        for name in ("prefill_fixed_s", "prefill_s_per_token", "prefill_s_per_token2", "decode_fixed_s",
                     "decode_s_per_request", "decode_s_per_context_token"):
            _require_finite_nonnegative(name, getattr(self, name))
        for name in ("max_batch_size", "prefill_token_budget"):
            require(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class PlannerConfig:
    """The `planner:` section of the cluster config."""

    enabled: bool = False
    """Run the planner with `splitserve serve` (false: the pools keep their configured sizes)."""
    ttft_s: float = 1.0
    """TTFT target of goodput (seconds)."""
    itl_s: float = 0.05
    """TPOT/ITL target of goodput (seconds per output token after the first)."""
    attainment: float = 0.95
    """Fraction of requests that must meet both targets."""
    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    tick_s: float = 10.0
    """Seconds between decisions (and the observation window)."""
    scale_up_cooldown_s: float = 30.0
    """After any change to a pool, no further scale-up of that pool for this long."""
    scale_down_cooldown_s: float = 120.0
    """After any change to a pool, no scale-down of that pool for this long."""
    max_step: int = 4
    """Most replicas added or removed in one pool per decision."""
    scale_down_margin: float = 0.02
    """Scale down only when the smaller pool is predicted to meet attainment + this margin
    (hysteresis against flapping)."""
    scale_down_ticks: int = 3
    """...and only after that prediction held for this many consecutive ticks."""
    profile: PerformanceProfile = field(default_factory=PerformanceProfile)

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s", "tick_s"):
            require(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        require(0 < self.attainment < 1, f"attainment must be in (0, 1), got {self.attainment}")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s"):
            require(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        require(self.max_step >= 1, f"max_step must be >= 1, got {self.max_step}")
        require(0 <= self.scale_down_margin < 1, f"scale_down_margin must be in [0, 1), got {self.scale_down_margin}")
        require(self.scale_down_ticks >= 1, f"scale_down_ticks must be >= 1, got {self.scale_down_ticks}")


@dataclass(frozen=True)
class Prediction:
    """The performance model's forecast for one (prefill, decode) replica pair at the observed load."""

    prefill_replicas: int
    decode_replicas: int
    ttft_p99_s: float
    itl_p99_s: float
    attainment: float
    """Predicted fraction of requests meeting both targets."""
    goodput_rps: float
    """Predicted requests per second that meet both targets."""

    @property
    def devices(self) -> int:
        return self.prefill_replicas + self.decode_replicas

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.devices if self.devices else 0.0


@dataclass(frozen=True)
class PoolTarget:
    role: Role
    replicas: int
    """Target replica count (routable + starting, draining ones excluded)."""
    change: int
    """replicas minus the current count; 0 = hold."""
    reason: str
    """Why, in words, e.g. 'scale_up: prefill 1 -> 3 for attainment 0.95; at 1: TTFT attainment 0.000, p99 inf s
    vs 1 s, utilisation 2.50 at 25 req/s; at 3: TTFT attainment 1.000, p99 0.525 s vs 1 s, utilisation 0.83 at 25 req/s'."""


@dataclass(frozen=True)
class Decision:
    now_s: float
    prefill: PoolTarget
    decode: PoolTarget
    local_prefill_threshold: int
    """Prompts with at most this many uncached tokens prefill on their decode worker (0: never)."""
    predicted: Prediction
    """The forecast for the chosen targets."""


def _require_finite_nonnegative(name: str, value: float) -> None:
    """A duration, rate or cv²: finite and >= 0 (NaN fails the comparison too)."""
    require(0 <= value < math.inf, f"{name} must be a finite number >= 0, got {value}")


def _require_fraction(name: str, value: float) -> None:
    require(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value}")
