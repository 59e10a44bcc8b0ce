"""The policy's side of a simulation: windows in, decisions out, and the run's timeline."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from splitserve.common.validation import require
from splitserve.planner.core.types import Decision, Observation
from splitserve.planner.sim.config import SimulatedCluster
from splitserve.planner.sim.observe import observation_of, timeline_point
from splitserve.planner.sim.report import TimelinePoint
from splitserve.planner.sim.window import Window


class Policy(Protocol):
    """Observations in, decisions out (may keep state between ticks). The planner's core
    (splitserve.planner.core.planner.Planner) and the baselines (policies.py) are policies."""

    def decide(self, observation: Observation) -> Decision:
        ...


class Controller:
    """Each tick: the windows of every shard -> one Observation -> the policy's Decision, or None
    once the run is over: the trace's duration has passed and every request finished, or
    overtime_s more have passed (then unfinished requests count as misses)."""

    def __init__(self, config: SimulatedCluster, policy: Policy, duration_s: float) -> None:
        self.config, self.policy, self.duration_s = config, policy, duration_s
        self.timeline: list[TimelinePoint] = []

    def decide(self, windows: Sequence[Window]) -> Decision | None:
        now = windows[0].now_s
        finished = all(w.unfinished == 0 for w in windows)
        if now >= self.duration_s + self.config.overtime_s or (now >= self.duration_s and finished):
            return None
        observation = observation_of(windows, self.config)
        decision = self.policy.decide(observation)
        targets = (decision.prefill.replicas, decision.decode.replicas)
        require(min(targets) >= 0, f"the policy asked for negative replicas: {targets}")
        self.timeline.append(timeline_point(windows, observation, decision, self.config))
        return decision
