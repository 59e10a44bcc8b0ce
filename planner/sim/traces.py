"""Seeded, deterministic request traces for the simulator.

A trace is a set of requests sorted by arrival time, held as read-only numpy arrays (millions of
requests must be cheap to build and to index). Four shapes, as in issue 15:

- `poisson`: a steady Poisson process (exponential inter-arrivals, cv^2 = 1).
- `bursty`: a 2-state Markov-modulated process (MMPP): the rate switches between a low and a high
  level, each state lasting an exponential time; inside a state the inter-arrivals are gamma
  with cv^2 > 1, so it is bursty both within seconds and over minutes.
- `diurnal`: a non-homogeneous Poisson process whose rate ramps from a trough up to the peak and
  back down over the trace (one raised-cosine "day" compressed into the duration).
- `multitenant`: Poisson arrivals; every request belongs to a tenant (Zipf popularity) whose long
  system prompt is a shared prefix, followed by a fresh user message.

The same (spec, seed) always gives the same arrays, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from splitserve.common.validation import require

NO_PREFIX = -1
"""prefix_group of a request that shares no prefix with another."""

TRACE_NAMES = ("poisson", "bursty", "diurnal", "multitenant")


@dataclass(frozen=True)
class LengthDistribution:
    """Token lengths drawn from a lognormal(log(median), sigma), rounded and clipped to [minimum, maximum]."""

    median: float
    sigma: float
    minimum: int
    maximum: int

    def __post_init__(self) -> None:
        require(self.median > 0 and self.sigma >= 0, f"need median > 0 and sigma >= 0, got {self.median}, {self.sigma}")
        require(1 <= self.minimum <= self.maximum, f"need 1 <= minimum <= maximum, got {self.minimum}, {self.maximum}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """int64 [n], every value in [minimum, maximum]."""
        raw = rng.lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(raw), self.minimum, self.maximum).astype(np.int64)

    def mean(self) -> float:
        """The clipped distribution's mean, estimated once from a fixed-seed sample (deterministic)."""
        return float(self.sample(np.random.default_rng(12345), 200_000).mean())


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, as typed data (tests and examples; the simulator reads the arrays)."""

    arrival_s: float
    prompt_tokens: int
    """Total prompt length, shared prefix included."""
    output_tokens: int
    """Tokens generated, the first one by the prefill worker."""
    prefix_group: int
    """Tenant whose system prompt this prompt starts with; NO_PREFIX for none."""
    shared_tokens: int
    """Length of that shared prefix (0 for NO_PREFIX); always < prompt_tokens."""


def _read_only(values: np.ndarray) -> np.ndarray:
    values.setflags(write=False)
    return values


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests sorted by arrival. Invariants: every array has the same length n; arrival_s is
    non-decreasing in [0, duration_s); 1 <= output_tokens; 0 <= shared_tokens < prompt_tokens;
    shared_tokens == 0 exactly where prefix_group == NO_PREFIX. The arrays are read-only."""

    name: str
    duration_s: float
    arrival_s: np.ndarray
    """float64 [n]."""
    prompt_tokens: np.ndarray
    """int64 [n]."""
    output_tokens: np.ndarray
    """int64 [n]."""
    prefix_group: np.ndarray
    """int64 [n]."""
    shared_tokens: np.ndarray
    """int64 [n]."""

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        require(all(len(a) == n for a in (self.prompt_tokens, self.output_tokens, self.prefix_group,
                                          self.shared_tokens)), "every trace array must have the same length")
        require(n == 0 or (self.arrival_s[0] >= 0 and self.arrival_s[-1] < self.duration_s), "arrivals outside the trace")
        require(bool(np.all(np.diff(self.arrival_s) >= 0)), "arrival_s must be non-decreasing")
        require(bool(np.all(self.output_tokens >= 1)), "output_tokens must be >= 1")
        require(bool(np.all((self.shared_tokens >= 0) & (self.shared_tokens < self.prompt_tokens))),
                "need 0 <= shared_tokens < prompt_tokens")
        require(bool(np.all((self.prefix_group == NO_PREFIX) == (self.shared_tokens == 0))),
                "shared_tokens must be 0 exactly where prefix_group is NO_PREFIX")
        for values in (self.arrival_s, self.prompt_tokens, self.output_tokens, self.prefix_group, self.shared_tokens):
            _read_only(values)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def request(self, i: int) -> TraceRequest:
        return TraceRequest(float(self.arrival_s[i]), int(self.prompt_tokens[i]), int(self.output_tokens[i]),
                            int(self.prefix_group[i]), int(self.shared_tokens[i]))

    def mean_rate(self) -> float:
        return len(self) / self.duration_s


@dataclass(frozen=True)
class Workload:
    """Length distributions and the shapes' parameters (every rate is relative to peak_rate)."""

    prompt: LengthDistribution = field(default_factory=lambda: LengthDistribution(768.0, 0.6, 32, 3072))
    output: LengthDistribution = field(default_factory=lambda: LengthDistribution(192.0, 0.7, 2, 1024))
    bursty_low_fraction: float = 0.45
    """bursty: the low state's rate as a fraction of the peak (the high state runs at the peak)."""
    bursty_dwell_s: tuple[float, float] = (240.0, 120.0)
    """bursty: mean seconds in the low state and in the high state."""
    bursty_cv2: float = 3.0
    """bursty: cv^2 of the gamma inter-arrivals inside a state (> 1)."""
    diurnal_trough_fraction: float = 0.25
    """diurnal: the rate at the start and the end of the trace, as a fraction of the peak (mid-trace)."""
    tenants: int = 16
    tenant_zipf_s: float = 1.0
    """multitenant: tenant k (1-based) is picked with probability proportional to k^-s."""
    system_prompt: LengthDistribution = field(default_factory=lambda: LengthDistribution(1536.0, 0.4, 512, 3072))
    """multitenant: each tenant's shared system prompt length (drawn once per tenant)."""
    user_message: LengthDistribution = field(default_factory=lambda: LengthDistribution(192.0, 0.8, 8, 1024))
    """multitenant: the fresh part of each prompt."""

    def __post_init__(self) -> None:
        require(0 < self.bursty_low_fraction <= 1, "bursty_low_fraction must be in (0, 1]")
        require(min(self.bursty_dwell_s) > 0, "bursty_dwell_s must be > 0")
        require(self.bursty_cv2 > 0, "bursty_cv2 must be > 0")
        require(0 < self.diurnal_trough_fraction <= 1, "diurnal_trough_fraction must be in (0, 1]")
        require(self.tenants >= 1 and self.tenant_zipf_s >= 0, "need tenants >= 1 and tenant_zipf_s >= 0")


def poisson_arrivals(rng: np.random.Generator, rate: float, duration_s: float) -> np.ndarray:
    """Sorted arrival times in [0, duration_s) of a Poisson process of `rate` per second."""
    return gamma_arrivals(rng, rate, 1.0, duration_s)


def gamma_arrivals(rng: np.random.Generator, rate: float, cv2: float, duration_s: float) -> np.ndarray:
    """A renewal process with gamma inter-arrivals of mean 1/rate and squared coefficient of
    variation cv2 (shape 1/cv2; cv2 = 1 is Poisson), in [0, duration_s)."""
    require(rate >= 0 and cv2 > 0 and duration_s > 0, "need rate >= 0, cv2 > 0, duration_s > 0")
    if rate == 0:
        return np.zeros(0)
    expected = rate * duration_s
    chunk = int(expected + 6 * math.sqrt(expected * max(cv2, 1.0)) + 16)
    gaps = rng.gamma(1.0 / cv2, cv2 / rate, chunk)
    times = np.cumsum(gaps)
    while times[-1] < duration_s:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.gamma(1.0 / cv2, cv2 / rate, chunk))])
    return times[times < duration_s]


def mmpp_arrivals(rng: np.random.Generator, rates: tuple[float, float], dwell_s: tuple[float, float], cv2: float,
                  duration_s: float) -> np.ndarray:
    """Two-state Markov-modulated arrivals: the state starts low (index 0), stays an exponential
    time of mean dwell_s[state], then flips; inside a state, gamma_arrivals at that state's rate."""
    pieces, start, state = [], 0.0, 0
    while start < duration_s:
        length = min(rng.exponential(dwell_s[state]), duration_s - start)
        if length > 0:
            pieces.append(start + gamma_arrivals(rng, rates[state], cv2, length))
        start, state = start + length, 1 - state
    return np.concatenate(pieces) if pieces else np.zeros(0)


def diurnal_rate(t: np.ndarray, peak_rate: float, trough_fraction: float, duration_s: float) -> np.ndarray:
    """Raised cosine: trough at t = 0 and t = duration_s, peak at duration_s / 2."""
    trough = trough_fraction * peak_rate
    return trough + (peak_rate - trough) * 0.5 * (1.0 - np.cos(2.0 * np.pi * t / duration_s))


def diurnal_arrivals(rng: np.random.Generator, peak_rate: float, trough_fraction: float,
                     duration_s: float) -> np.ndarray:
    """A non-homogeneous Poisson process with rate diurnal_rate, by time rescaling: unit-rate
    Poisson points mapped through the inverse of the cumulative rate (linear on a 1-s grid)."""
    grid = np.linspace(0.0, duration_s, int(duration_s) + 2)
    rate = diurnal_rate(grid, peak_rate, trough_fraction, duration_s)
    cumulative = np.concatenate([[0.0], np.cumsum(0.5 * (rate[1:] + rate[:-1]) * np.diff(grid))])
    unit = poisson_arrivals(rng, 1.0, float(cumulative[-1]))
    return np.minimum(np.interp(unit, cumulative, grid), np.nextafter(duration_s, 0.0))


def _plain(name: str, arrivals: np.ndarray, workload: Workload, rng: np.random.Generator,
           duration_s: float) -> Trace:
    n = len(arrivals)
    zeros = np.zeros(n, dtype=np.int64)
    return Trace(name, duration_s, arrivals, workload.prompt.sample(rng, n), workload.output.sample(rng, n),
                 zeros + NO_PREFIX, zeros)


def _multitenant(arrivals: np.ndarray, workload: Workload, rng: np.random.Generator, duration_s: float) -> Trace:
    n = len(arrivals)
    weights = np.arange(1, workload.tenants + 1, dtype=np.float64) ** -workload.tenant_zipf_s
    system = workload.system_prompt.sample(rng, workload.tenants)
    group = rng.choice(workload.tenants, size=n, p=weights / weights.sum()).astype(np.int64)
    shared = system[group]
    prompt = shared + workload.user_message.sample(rng, n)
    return Trace("multitenant", duration_s, arrivals, prompt, workload.output.sample(rng, n), group, shared)


def make_trace(name: str, peak_rate: float, duration_s: float, seed: int, workload: Workload = Workload()) -> Trace:
    """The trace `name` (one of TRACE_NAMES) whose highest sustained rate is peak_rate requests/s.
    poisson and multitenant run at peak_rate throughout; bursty alternates between the peak and
    bursty_low_fraction of it; diurnal ramps from diurnal_trough_fraction of it to it and back."""
    require(name in TRACE_NAMES, f"trace must be one of {TRACE_NAMES}, got {name!r}")
    for argument, value in (("peak_rate", peak_rate), ("duration_s", duration_s)):
        require(0 < value < math.inf, f"{argument} must be a finite number > 0, got {value}")
    require(seed >= 0, f"seed must be >= 0, got {seed}")
    rng = np.random.default_rng([seed, TRACE_NAMES.index(name)])
    if name == "bursty":
        rates = (workload.bursty_low_fraction * peak_rate, peak_rate)
        arrivals = mmpp_arrivals(rng, rates, workload.bursty_dwell_s, workload.bursty_cv2, duration_s)
    elif name == "diurnal":
        arrivals = diurnal_arrivals(rng, peak_rate, workload.diurnal_trough_fraction, duration_s)
    else:
        arrivals = poisson_arrivals(rng, peak_rate, duration_s)
    if name == "multitenant":
        return _multitenant(arrivals, workload, rng, duration_s)
    return _plain(name, arrivals, workload, rng, duration_s)
