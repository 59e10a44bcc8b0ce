"""Routing policy: pure functions of what the router observes (replaced by the prefix-aware
policy later). Least load = fewest requests this router has in flight on a worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    in_flight: int
    """Requests this router has assigned to the worker and not yet seen finish."""


def pick_least_loaded(loads: Sequence[WorkerLoad], turn: int) -> str:
    """The worker with the fewest requests in flight; ties go round-robin by `turn`, so a
    burst arriving at an idle pool spreads over every worker instead of piling on the first."""
    if not loads:
        raise ValueError("no workers to choose from")
    least = min(load.in_flight for load in loads)
    tied = [load.worker_id for load in loads if load.in_flight == least]
    return tied[turn % len(tied)]
