"""The baselines issue 15 compares the planner's core with, behind the same `control.Policy`
protocol (`decide(Observation) -> Decision`):

- `StaticPolicy(prefill, decode)`: fixed pool sizes (the bench searches the best pair with hindsight).
- `DynamoLikePolicy`: sizes both pools from the window's averages with no queueing model, like
  NVIDIA Dynamo's SLA planner: prefill = ceil(arrival rate x mean prefill seconds / target
  utilisation), decode = ceil(arrival rate x mean output tokens / (one replica's tokens/s at the
  largest batch whose step meets the ITL target) / target utilisation).
- `RayServeLikePolicy`: latency feedback, one replica at a time: observed TTFT p99 above target ->
  prefill + 1, below `downscale_fraction` of it -> prefill - 1; the same with the TPOT p99 for
  decode; each pool waits a cooldown after its own last change (up: scale_up_cooldown_s, down:
  scale_down_cooldown_s).

Baselines predict nothing: the `Prediction` they return restates the window (observed p99s, the
lower of the two observed attainments, 1.0 when nothing finished, and arrival rate x that).
DynamoLikePolicy and RayServeLikePolicy clamp their targets to the config's pool bounds; no baseline
uses local prefill (threshold 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitserve.common.validation import require
from splitserve.planner.core.types import (Decision, Observation, PerformanceProfile, PlannerConfig, PoolBounds,
                                           PoolObservation, PoolTarget, Prediction, Role)


def provisioned(pool: PoolObservation) -> int:
    """Replicas a target is compared with: routable + starting (draining ones are leaving)."""
    return pool.replicas + pool.starting


def bounded(replicas: int, bounds: PoolBounds) -> int:
    return min(max(replicas, bounds.min_replicas), bounds.max_replicas)


def pool_target(role: Role, pool: PoolObservation, replicas: int, reason: str) -> PoolTarget:
    return PoolTarget(role, replicas, replicas - provisioned(pool), reason)


def restated(observation: Observation, prefill: int, decode: int) -> Prediction:
    """The window restated as a 'prediction' (see the module docstring)."""
    attainments = [a for a in (observation.ttft_attainment, observation.itl_attainment) if a is not None]
    attainment = min(attainments) if attainments else 1.0
    return Prediction(prefill, decode, observation.ttft_p99_s or 0.0, observation.itl_p99_s or 0.0, attainment,
                      observation.arrival_rate * attainment)


def decision(observation: Observation, prefill: PoolTarget, decode: PoolTarget) -> Decision:
    return Decision(observation.now_s, prefill, decode, 0, restated(observation, prefill.replicas, decode.replicas))


@dataclass(frozen=True)
class StaticPolicy:
    """Always the same pool sizes."""

    prefill: int
    decode: int

    def __post_init__(self) -> None:
        require(self.prefill >= 0 and self.decode >= 0, "replica counts must be >= 0")

    def decide(self, observation: Observation) -> Decision:
        return decision(observation,
                        pool_target(Role.PREFILL, observation.prefill, self.prefill, f"static: {self.prefill}"),
                        pool_target(Role.DECODE, observation.decode, self.decode, f"static: {self.decode}"))


def decode_tokens_per_s(profile: PerformanceProfile, context_tokens: float, itl_s: float) -> float:
    """One decode replica's output tokens/s at the largest batch (<= max_batch_size, >= 1) whose
    step over contexts of `context_tokens` each lasts at most itl_s."""
    def step_s(batch: int) -> float:
        return (profile.decode_fixed_s + profile.decode_s_per_request * batch
                + profile.decode_s_per_context_token * context_tokens * batch)
    batch = 1
    while batch < profile.max_batch_size and step_s(batch + 1) <= itl_s:
        batch += 1
    return batch / step_s(batch)


@dataclass(frozen=True)
class DynamoLikePolicy:
    """Averages, no queueing (module docstring). Mean lengths come from the window's histograms
    (prompt: arrivals; output: finished requests), `default_output_tokens` when none finished."""

    config: PlannerConfig
    target_utilisation: float = 0.8
    default_output_tokens: int = 128

    def __post_init__(self) -> None:
        require(0 < self.target_utilisation <= 1, "target_utilisation must be in (0, 1]")

    def prefill_replicas(self, observation: Observation) -> int:
        profile = self.config.profile
        tokens = observation.prompt_lengths.mean() * (1.0 - observation.prefix_hit_rate)
        seconds = profile.prefill_fixed_s + profile.prefill_s_per_token * tokens + profile.prefill_s_per_token2 * tokens ** 2
        return math.ceil(observation.arrival_rate * seconds / self.target_utilisation)

    def decode_replicas(self, observation: Observation) -> int:
        output = observation.output_lengths.mean() or self.default_output_tokens
        context = observation.prompt_lengths.mean() + output / 2
        tokens_per_s = decode_tokens_per_s(self.config.profile, context, self.config.itl_s)
        return math.ceil(observation.arrival_rate * output / tokens_per_s / self.target_utilisation)

    def decide(self, observation: Observation) -> Decision:
        prefill = bounded(self.prefill_replicas(observation), self.config.prefill)
        decode = bounded(self.decode_replicas(observation), self.config.decode)
        load = f"at {observation.arrival_rate:.3g} req/s"
        return decision(observation, pool_target(Role.PREFILL, observation.prefill, prefill, f"dynamo-like: {load}"),
                        pool_target(Role.DECODE, observation.decode, decode, f"dynamo-like: {load}"))


@dataclass
class RayServeLikePolicy:
    """p99 feedback, +/- 1 replica per pool per decision, with cooldowns (module docstring).
    Mutable: it remembers each pool's last change time."""

    config: PlannerConfig
    downscale_fraction: float = 0.5
    last_change_s: dict[Role, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(0 <= self.downscale_fraction < 1, "downscale_fraction must be in [0, 1)")

    def step(self, role: Role, p99_s: float | None, target_s: float, now_s: float) -> int:
        """+1, -1 or 0 for one pool."""
        since = now_s - self.last_change_s.get(role, -math.inf)
        if p99_s is None:
            return 0
        if p99_s > target_s and since >= self.config.scale_up_cooldown_s:
            return 1
        if p99_s < self.downscale_fraction * target_s and since >= self.config.scale_down_cooldown_s:
            return -1
        return 0

    def target(self, role: Role, pool: PoolObservation, p99_s: float | None, target_s: float, bounds: PoolBounds,
               now_s: float) -> PoolTarget:
        current = provisioned(pool)
        replicas = bounded(current + self.step(role, p99_s, target_s, now_s), bounds)
        if replicas != current:
            self.last_change_s[role] = now_s
        seen = "none finished" if p99_s is None else f"p99 {p99_s:.3g} s"
        return pool_target(role, pool, replicas, f"ray-serve-like: {seen}, target {target_s:g} s")

    def decide(self, observation: Observation) -> Decision:
        config, now = self.config, observation.now_s
        prefill = self.target(Role.PREFILL, observation.prefill, observation.ttft_p99_s, config.ttft_s,
                              config.prefill, now)
        decode = self.target(Role.DECODE, observation.decode, observation.itl_p99_s, config.itl_s, config.decode, now)
        return decision(observation, prefill, decode)
