"""The simulated device's step times: `PerformanceProfile`'s formulas, used as ground truth.

A decode worker's batch only changes when a request joins or finishes; between two changes its
steps form an arithmetic progression (every step adds one token to each running request's
context), so any number of steps is summed, and the steps that fit in a span are counted, in
closed form. That is what lets the simulator advance a decode replica from one batch change to
the next in one operation instead of one event per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.planner.core.types import PerformanceProfile


@dataclass(frozen=True)
class DeviceModel:
    """Step times of one device. prefill: fixed + a*n + b*n^2 for a step of n prompt tokens;
    decode: fixed + p*batch + c*context for a step over `batch` requests whose contexts total
    `context` tokens (the profile's docstring)."""

    profile: PerformanceProfile

    def prefill_step_s(self, tokens: int) -> float:
        p = self.profile
        return p.prefill_fixed_s + p.prefill_s_per_token * tokens + p.prefill_s_per_token2 * tokens * tokens

    def prefill_extra_s(self, tokens: int) -> float:
        """What `tokens` prompt tokens add to a step that runs anyway (no second fixed cost)."""
        p = self.profile
        return p.prefill_s_per_token * tokens + p.prefill_s_per_token2 * tokens * tokens

    def decode_step_s(self, batch: int, context: int) -> float:
        p = self.profile
        return p.decode_fixed_s + p.decode_s_per_request * batch + p.decode_s_per_context_token * context

    def decode_growth_s(self, batch: int) -> float:
        """How much longer each decode step is than the one before, at a constant batch."""
        return self.profile.decode_s_per_context_token * batch


def steps_duration(first_s: float, growth_s: float, steps: int) -> float:
    """Seconds taken by `steps` consecutive steps, the first lasting first_s and each next one
    growth_s longer: steps*first + growth*steps*(steps-1)/2."""
    return steps * first_s + growth_s * steps * (steps - 1) * 0.5


def steps_within(first_s: float, growth_s: float, elapsed_s: float) -> int:
    """The largest m >= 0 with steps_duration(first_s, growth_s, m) <= elapsed_s (first_s > 0)."""
    if elapsed_s <= 0.0:
        return 0
    if growth_s == 0.0:
        m = int(elapsed_s / first_s)
    else:
        half = first_s - 0.5 * growth_s
        m = int((math.sqrt(half * half + 2.0 * growth_s * elapsed_s) - half) / growth_s)
    while (m + 1) * first_s + growth_s * (m + 1) * m * 0.5 <= elapsed_s:
        m += 1
    while m > 0 and m * first_s + growth_s * m * (m - 1) * 0.5 > elapsed_s:
        m -= 1
    return m


def steps_to_reach(first_s: float, growth_s: float, elapsed_s: float) -> tuple[int, float]:
    """The first step boundary at or after elapsed_s: (m, steps_duration(first_s, growth_s, m)),
    m the smallest >= 0 with steps_duration >= elapsed_s."""
    m = steps_within(first_s, growth_s, elapsed_s)
    done = steps_duration(first_s, growth_s, m)
    if done < elapsed_s:
        m += 1
        done = steps_duration(first_s, growth_s, m)
    return m, done
