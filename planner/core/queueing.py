"""Predicted TTFT and ITL for a replica count at an observed load, with queueing.

A planner that sizes pools from mean service times alone (NVIDIA Dynamo's does) underestimates TTFT under
bursts: the wait in the prefill queue, not the prefill itself, is what grows. The approximations:

- Prefill pool = one G/G/c queue (c = prefill replicas; the router's least-loaded choice behaves like a
  central queue). Service time of a request = `PerformanceModel.prompt_seconds` of its uncached tokens,
  prompt * (1 - prefix_hit_rate) and at least 1, alone on a worker (batching several short prompts into
  one step would amortise the fixed cost: ignored, so the estimate errs high).
- P(wait > 0) = Erlang C (M/M/c, exact), the mean wait scaled by the Allen-Cunneen factor
  (arrival cv^2 + service cv^2) / 2, and, given a wait, an exponential tail with that conditional mean:
  P(W > t) = C * exp(-t * 2 (c mu - lambda) / (ca^2 + cs^2)). Exact for M/M/c, Kingman-like otherwise.
- TTFT = wait + the request's own prefill (the first token streams from the prefill worker; the KV
  transfer delays the second token, so it is charged to TPOT). P(TTFT ok) averages over the prompt-length
  histogram, and the p99 is the 0.99 quantile of that same mixture.
- Decode pool: each replica runs one continuous batch whose step takes t(k) = f + g k at k requests
  (f, g from the model at the mean context of a running request: prompt + half the output, weighted by
  residence). Concurrency per replica by Little's law: b = (lambda E[steps] / d) * t(b), a fixed point
  solved in closed form b = u f / (1 - u g) with u = lambda E[steps] / d.
- A running request sees 1 + Poisson(b) requests in its step (M/G/infinity Palm view), capped at the batch
  limit = min(max_batch_size, KV capacity / mean context). P(TPOT ok) of a request with o >= 2 output
  tokens is P(t(batch) <= itl - transfer / (o - 1)) (a per-step bound on its mean step time: errs
  high); a request with fewer than two tokens has no TPOT and always meets it.
- attainment = P(TTFT ok) * P(TPOT ok) (independence). Utilisation >= 1 in either pool (or a batch that
  would outgrow its limit) gives attainment 0 and infinite latency, never an exception or a NaN.

`latency_scale` (>= 0) multiplies every predicted latency (the planner's feedback correction); the
targets are compared against the scaled latencies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from splitserve.common.validation import require
from splitserve.planner.core.perf_model import PerformanceModel
from splitserve.planner.core.types import LengthHistogram

P99 = 0.99
_BISECTION_STEPS = 60
"""Halvings of the TTFT quantile's bracket: 2^-60 of it, below float precision of any latency here."""


def log_factorials(count: int) -> np.ndarray:
    """[count] log(k!) for k = 0..count-1."""
    logs = np.log(np.arange(1, max(count, 1), dtype=float))
    return np.concatenate([[0.0], np.cumsum(logs)])[:count]


def erlang_c(servers: int, offered_load: float) -> float:
    """P(an arrival waits) in M/M/c with `servers` servers and `offered_load` = lambda / mu Erlangs.

    0 without load, 1 when offered_load >= servers (unstable). Computed in log space, so it stays exact
    at thousands of servers where a^c / c! overflows."""
    if offered_load <= 0:
        return 0.0
    if offered_load >= servers:
        return 1.0
    ks = np.arange(servers, dtype=float)
    log_terms = ks * math.log(offered_load) - log_factorials(servers)  # a^k / k!, k < c
    log_last = (servers * math.log(offered_load) - math.lgamma(servers + 1)
                + math.log(servers / (servers - offered_load)))  # a^c / c! * c / (c - a)
    top = max(float(log_terms.max()), log_last)
    last = math.exp(log_last - top)
    return last / (float(np.exp(log_terms - top).sum()) + last)


def allen_cunneen_wait_s(servers: int, arrival_rate: float, mean_service_s: float, arrival_cv2: float,
                         service_cv2: float) -> float:
    """Mean queueing delay of G/G/c: Erlang C / (c mu - lambda) * (ca^2 + cs^2) / 2 (inf when unstable)."""
    capacity = servers / mean_service_s if mean_service_s > 0 else math.inf
    if arrival_rate >= capacity:
        return math.inf
    wait_probability = erlang_c(servers, arrival_rate * mean_service_s)
    return wait_probability / (capacity - arrival_rate) * (arrival_cv2 + service_cv2) / 2


def _weights(histogram: LengthHistogram) -> np.ndarray:
    counts = np.asarray(histogram.counts, dtype=float)
    return counts / counts.sum() if len(counts) else counts


@dataclass(frozen=True, eq=False)
class PrefillWorkload:
    """The prefill pool's load. Invariant: service_s and weights have one entry per prompt-length bin,
    weights sum to 1 (both empty when no prompt was seen)."""

    arrival_rate: float
    arrival_cv2: float
    service_s: np.ndarray
    """[bins] seconds one worker spends on a prompt of each bin's uncached length."""
    weights: np.ndarray
    """[bins] fraction of requests in each bin."""

    @classmethod
    def build(cls, arrival_rate: float, arrival_cv2: float, prompt_lengths: LengthHistogram,
              prefix_hit_rate: float, model: PerformanceModel) -> PrefillWorkload:
        uncached = np.maximum(1.0, np.asarray(prompt_lengths.lengths, dtype=float) * (1.0 - prefix_hit_rate))
        return cls(arrival_rate, arrival_cv2, model.prompt_seconds(uncached), _weights(prompt_lengths))

    @property
    def mean_service_s(self) -> float:
        return float(self.weights @ self.service_s)

    @property
    def service_cv2(self) -> float:
        mean = self.mean_service_s
        return float(self.weights @ (self.service_s - mean) ** 2) / (mean * mean) if mean > 0 else 0.0


@dataclass(frozen=True)
class PrefillForecast:
    replicas: int
    utilisation: float
    """lambda E[S] / c; >= 1 (or inf) means unstable."""
    mean_wait_s: float
    ttft_attainment: float
    ttft_p99_s: float

    def summary(self, ttft_target_s: float) -> str:
        return (f"TTFT attainment {self.ttft_attainment:.3f}, p99 {self.ttft_p99_s:.3g} s vs {ttft_target_s:.3g} s, "
                f"utilisation {self.utilisation:.2f}")


class PrefillPool:
    """The prefill pool's G/G/c model at one load against one TTFT target. Immutable after construction."""

    def __init__(self, workload: PrefillWorkload, ttft_target_s: float, latency_scale: float = 1.0) -> None:
        require(ttft_target_s > 0 and latency_scale > 0, "ttft_target_s and latency_scale must be > 0")
        self.workload = workload
        self._scale = latency_scale
        self._target_s = ttft_target_s / latency_scale  # in unscaled model seconds
        self._mean_service_s = workload.mean_service_s
        self._variability = (workload.arrival_cv2 + workload.service_cv2) / 2

    def utilisation(self, replicas: int) -> float:
        """lambda E[S] / c: 0 with nothing to serve, inf with requests and no replica."""
        if self.workload.arrival_rate == 0 or len(self.workload.weights) == 0:
            return 0.0
        return self.workload.arrival_rate * self._mean_service_s / replicas if replicas > 0 else math.inf

    def _wait_tail(self, replicas: int) -> tuple[float, float]:
        """(P(wait > 0), decay per second) with P(wait > t) = p * exp(-decay * t). Requires utilisation < 1."""
        rate = self.workload.arrival_rate
        probability = erlang_c(replicas, rate * self._mean_service_s)
        if probability == 0.0 or self._variability == 0.0:
            return 0.0, math.inf  # no load, or deterministic arrivals and service below saturation: no queue
        return probability, (replicas / self._mean_service_s - rate) / self._variability

    def attainment(self, replicas: int) -> float:
        """P(TTFT <= target), in [0, 1]; 0 when utilisation >= 1; 1 with nothing to serve."""
        if len(self.workload.weights) == 0 or self.workload.arrival_rate == 0:
            return 1.0
        if self.utilisation(replicas) >= 1:
            return 0.0
        return self._share_within(self._target_s, *self._wait_tail(replicas))

    def _share_within(self, seconds: float, wait_probability: float, decay: float) -> float:
        """P(wait + service <= seconds) over the prompt-length mixture."""
        slack = seconds - self.workload.service_s
        late = wait_probability * np.exp(-decay * np.maximum(slack, 0.0)) if wait_probability else 0.0
        return float(self.workload.weights @ np.where(slack >= 0, 1.0 - late, 0.0))

    def ttft_quantile_s(self, replicas: int, quantile: float = P99) -> float:
        """The smallest t with P(TTFT <= t) >= quantile (scaled seconds; inf when unstable, 0 when idle)."""
        if len(self.workload.weights) == 0:
            return 0.0
        if self.utilisation(replicas) >= 1:
            return math.inf
        wait_probability, decay = self._wait_tail(replicas)
        excess = math.log(wait_probability / (1 - quantile)) / decay if wait_probability > 1 - quantile else 0.0
        low, high = 0.0, float(self.workload.service_s.max()) + excess  # every bin's tail <= 1 - q at `high`
        for _ in range(_BISECTION_STEPS):
            middle = (low + high) / 2
            if self._share_within(middle, wait_probability, decay) >= quantile:
                high = middle
            else:
                low = middle
        return high * self._scale

    def forecast(self, replicas: int) -> PrefillForecast:
        utilisation = self.utilisation(replicas)
        mean_wait = (0.0 if utilisation == 0 else allen_cunneen_wait_s(
            replicas, self.workload.arrival_rate, self._mean_service_s, self.workload.arrival_cv2,
            self.workload.service_cv2) * self._scale)
        return PrefillForecast(replicas, utilisation, mean_wait, self.attainment(replicas),
                               self.ttft_quantile_s(replicas))


class PrefixScaledPrefillPool:
    """The prefill pool at each replica count when its prefix hit rate depends on that count.

    The prefix caches of the pool's workers hold its tenants' shared prefixes; fewer workers hold fewer
    of them, so shrinking the pool raises every remaining worker's uncached work (a multi-tenant load
    sized from the hit rate its larger pool enjoyed collapses into cache thrashing). The model, from
    what one window shows (the hit rate at the replicas that served it): at n replicas the hit rate is
    observed * min(1, n / observed_replicas), proportional to the caches' total capacity below the
    observed count (pessimistic when the working set fits in fewer workers: the planner then steps
    down as each smaller pool shows its own hit rate), and the observed one at or above it (no credit
    for a hit rate a larger pool has not shown).
    """

    def __init__(self, pool_at_hit_rate: Callable[[float], PrefillPool], observed_hit_rate: float,
                 observed_replicas: int) -> None:
        self._pool_at_hit_rate = pool_at_hit_rate
        self._observed_hit_rate = observed_hit_rate
        self._observed_replicas = observed_replicas
        self._pools: dict[float, PrefillPool] = {}

    def hit_rate(self, replicas: int) -> float:
        if self._observed_replicas <= 0 or replicas >= self._observed_replicas:
            return self._observed_hit_rate
        return self._observed_hit_rate * replicas / self._observed_replicas

    def at(self, replicas: int) -> PrefillPool:
        """The G/G/c model for `replicas` workers (one per distinct hit rate, built on first use)."""
        hit_rate = self.hit_rate(replicas)
        pool = self._pools.get(hit_rate)
        if pool is None:
            pool = self._pools[hit_rate] = self._pool_at_hit_rate(hit_rate)
        return pool

    @property
    def workload(self) -> PrefillWorkload:
        """The load at the observed replica count (its arrival rate is every count's)."""
        return self.at(max(self._observed_replicas, 1)).workload

    def utilisation(self, replicas: int) -> float:
        return self.at(replicas).utilisation(replicas)

    def attainment(self, replicas: int) -> float:
        return self.at(replicas).attainment(replicas)

    def ttft_quantile_s(self, replicas: int, quantile: float = P99) -> float:
        return self.at(replicas).ttft_quantile_s(replicas, quantile)

    def forecast(self, replicas: int) -> PrefillForecast:
        return self.at(replicas).forecast(replicas)


@dataclass(frozen=True, eq=False)
class DecodeWorkload:
    """The decode pool's load. Invariant: transfer_per_token_s and tpot_weights have one entry per
    output-length bin with >= 2 tokens; tpot_weights sum to the share of such requests (<= 1)."""

    arrival_rate: float
    steps_per_request: float
    """E[max(output - 1, 0)]: decode steps one request spends in a batch."""
    step_fixed_s: float
    step_per_request_s: float
    """Step time t(k) = step_fixed_s + step_per_request_s * k at the mean running context."""
    batch_limit: int
    """Most requests one replica runs at once: min(max_batch_size, KV capacity / mean context)."""
    transfer_per_token_s: np.ndarray
    """[bins] the KV transfer's share of TPOT: transfer_s / (output - 1)."""
    tpot_weights: np.ndarray
    """[bins] fraction of all requests in each bin."""

    @classmethod
    def build(cls, arrival_rate: float, output_lengths: LengthHistogram, prompt_lengths: LengthHistogram,
              transfer_s: float, kv_capacity_tokens: int, model: PerformanceModel) -> DecodeWorkload:
        outputs, weights = np.asarray(output_lengths.lengths, dtype=float), _weights(output_lengths)
        steps = np.maximum(outputs - 1.0, 0.0)
        mean_steps = float(weights @ steps)
        # Context of a running request, averaged over its steps (prompt + (steps + 1) / 2) and weighted by
        # how many steps it runs (residence).
        growth = float(weights @ (steps * (steps + 1) / 2)) / mean_steps if mean_steps > 0 else 0.0
        context = prompt_lengths.mean() + growth
        fixed = model.decode_step_seconds(0, 0)
        per_request = model.decode_step_seconds(1, context) - fixed
        limit = model.max_batch_size
        if kv_capacity_tokens > 0:
            limit = min(limit, int(kv_capacity_tokens // max(context, 1.0)))
        has_tpot = outputs >= 2
        return cls(arrival_rate, mean_steps, fixed, per_request, limit,
                   transfer_s / (outputs[has_tpot] - 1.0), weights[has_tpot])


@dataclass(frozen=True)
class DecodeForecast:
    replicas: int
    utilisation: float
    """Request-steps per second per replica over the most one replica sustains (a full batch)."""
    mean_batch: float
    itl_attainment: float
    itl_p99_s: float
    """Step time at the 0.99 quantile of the batch a running request sees."""

    def summary(self, itl_target_s: float) -> str:
        return (f"ITL attainment {self.itl_attainment:.3f}, p99 {self.itl_p99_s * 1e3:.3g} ms vs "
                f"{itl_target_s * 1e3:.3g} ms, batch {self.mean_batch:.1f}, utilisation {self.utilisation:.2f}")


class DecodePool:
    """The decode pool's continuous-batching model at one load against one ITL (TPOT) target."""

    def __init__(self, workload: DecodeWorkload, itl_target_s: float, latency_scale: float = 1.0) -> None:
        require(itl_target_s > 0 and latency_scale > 0, "itl_target_s and latency_scale must be > 0")
        self.workload = workload
        self._scale = latency_scale
        self._target_s = itl_target_s / latency_scale
        self._log_factorials = log_factorials(max(workload.batch_limit, 1))

    def step_seconds(self, batch: float) -> float:
        """Model (unscaled) seconds of one step over `batch` requests."""
        return self.workload.step_fixed_s + self.workload.step_per_request_s * batch

    def _per_replica_rate(self, replicas: int) -> float:
        """Request-steps per second each replica must run (inf with no replica and some load)."""
        demand = self.workload.arrival_rate * self.workload.steps_per_request
        if demand == 0:
            return 0.0
        return demand / replicas if replicas > 0 else math.inf

    def utilisation(self, replicas: int) -> float:
        """Per-replica request-steps/s over a full batch's: 0 with nothing to decode, inf with decoding
        requests and no replica (or no room for one context)."""
        rate = self._per_replica_rate(replicas)
        limit = self.workload.batch_limit
        if rate == 0:
            return 0.0
        if rate == math.inf or limit == 0:
            return math.inf
        return rate * self.step_seconds(limit) / limit

    def mean_batch(self, replicas: int) -> float:
        """Little's law fixed point b = u t(b); inf when utilisation >= 1 (then b would outgrow the limit)."""
        rate = self._per_replica_rate(replicas)
        if self.utilisation(replicas) >= 1:
            return math.inf
        return rate * self.workload.step_fixed_s / (1 - rate * self.workload.step_per_request_s)

    def _seen_batch_cdf(self, mean_batch: float) -> np.ndarray:
        """[limit] P(batch seen by a running request <= k) for k = 1..limit; the batch is
        min(1 + Poisson(mean_batch), limit), so the last entry is 1."""
        limit = self.workload.batch_limit
        if mean_batch == 0:
            return np.ones(limit)
        others = np.arange(limit, dtype=float)
        pmf = np.exp(others * math.log(mean_batch) - mean_batch - self._log_factorials)
        return np.concatenate([np.minimum(np.cumsum(pmf[:-1]), 1.0), [1.0]])

    def _largest_batch_within(self, seconds: np.ndarray) -> np.ndarray:
        """[bins] the largest batch whose step fits in `seconds` (0 if none), clipped to the limit."""
        fixed, slope, limit = self.workload.step_fixed_s, self.workload.step_per_request_s, self.workload.batch_limit
        if slope == 0:
            return np.where(seconds >= fixed, limit, 0)
        return np.clip(np.floor((seconds - fixed) / slope), 0, limit).astype(int)

    def attainment(self, replicas: int) -> float:
        """P(TPOT <= target), in [0, 1]; 0 when utilisation >= 1; 1 with nothing to decode."""
        if self._per_replica_rate(replicas) == 0:
            return 1.0
        if self.utilisation(replicas) >= 1:
            return 0.0
        cdf = self._seen_batch_cdf(self.mean_batch(replicas))
        allowed = self._largest_batch_within(self._target_s - self.workload.transfer_per_token_s)
        within = np.where(allowed >= 1, cdf[np.maximum(allowed, 1) - 1], 0.0)
        no_tpot = 1.0 - float(self.workload.tpot_weights.sum())
        return min(1.0, no_tpot + float(self.workload.tpot_weights @ within))

    def itl_quantile_s(self, replicas: int, quantile: float = P99) -> float:
        """Scaled step time at the quantile of the batch a running request sees (inf when unstable)."""
        if self.utilisation(replicas) >= 1:
            return math.inf
        cdf = self._seen_batch_cdf(self.mean_batch(replicas))
        batch = int(np.searchsorted(cdf, quantile)) + 1  # first k with P(batch <= k) >= quantile
        return self.step_seconds(min(batch, self.workload.batch_limit)) * self._scale

    def forecast(self, replicas: int) -> DecodeForecast:
        return DecodeForecast(replicas, self.utilisation(replicas), self.mean_batch(replicas),
                              self.attainment(replicas), self.itl_quantile_s(replicas))
