"""A simulation's results as plain frozen data, and their JSON form.

Goodput follows DistServe (splitserve.common.slo): a request counts only when it met both its
TTFT target and its TPOT target. TTFT = first token (sampled by the prefill worker, or by the
decode worker for a local prefill) - arrival; TPOT = (finish - first token) / (output - 1), met by
any request with a single output token.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from splitserve.planner.samples import nearest_rank


@dataclass(frozen=True)
class PoolCounts:
    """Replicas of one pool at an instant."""

    routable: int
    starting: int
    draining: int

    @property
    def devices(self) -> int:
        """Replicas holding a device (every state but gone)."""
        return self.routable + self.starting + self.draining


@dataclass(frozen=True)
class TimelinePoint:
    """One tick: the window (t_s - window, t_s], the pools at its end and the policy's targets."""

    t_s: float
    arrival_rate: float
    """Requests per second that arrived in the window."""
    prefill: PoolCounts
    decode: PoolCounts
    prefill_target: int
    """What the policy asked for at this tick (routable + starting)."""
    decode_target: int
    attainment: float | None
    """Fraction of the requests finished in the window that met both targets (None: none finished)."""
    goodput_rps: float
    """Requests per second finished in the window that met both targets."""


@dataclass(frozen=True)
class LatencySummary:
    """Quantiles (seconds) over every finished request."""

    p50_s: float
    p90_s: float
    p99_s: float


@dataclass(frozen=True)
class SimulationResult:
    """One run. Device time counts every replica from the moment it was asked for until it is
    gone, over [0, end_s]; end_s = max(trace duration, last completion)."""

    trace: str
    policy: str
    duration_s: float
    end_s: float
    requests: int
    finished: int
    good: int
    """Requests that met both targets."""
    ttft_met: int
    tpot_met: int
    device_s: float
    ttft: LatencySummary
    tpot: LatencySummary
    prefix_hit_rate: float
    """Prompt tokens served from a prefix cache / all prompt tokens."""
    local_prefill_share: float
    wall_s: float
    """Seconds of real time the simulation took."""
    events: int
    """Events processed (arrivals, steps, joins, completions, ticks, replicas ready)."""
    timeline: tuple[TimelinePoint, ...]

    @property
    def attainment(self) -> float:
        """Good requests / all requests of the trace (unfinished ones count as misses)."""
        return self.good / self.requests if self.requests else 1.0

    @property
    def device_hours(self) -> float:
        return self.device_s / 3600.0

    @property
    def mean_devices(self) -> float:
        return self.device_s / self.end_s if self.end_s else 0.0

    @property
    def goodput_rps(self) -> float:
        return self.good / self.end_s if self.end_s else 0.0

    @property
    def goodput_per_device(self) -> float:
        """Good requests per device-second (goodput / mean devices)."""
        return self.good / self.device_s if self.device_s else 0.0

    def summary(self) -> dict:
        """The headline numbers (no timeline), for tables and JSON."""
        per_request = 1 / self.requests if self.requests else 0.0
        return {"trace": self.trace, "policy": self.policy, "requests": self.requests, "finished": self.finished,
                "good": self.good, "attainment": self.attainment, "ttft_attainment": self.ttft_met * per_request,
                "tpot_attainment": self.tpot_met * per_request, "device_hours": self.device_hours,
                "mean_devices": self.mean_devices, "goodput_rps": self.goodput_rps,
                "goodput_per_device": self.goodput_per_device, "ttft": asdict(self.ttft), "tpot": asdict(self.tpot),
                "prefix_hit_rate": self.prefix_hit_rate, "local_prefill_share": self.local_prefill_share,
                "end_s": self.end_s, "wall_s": self.wall_s, "events": self.events}

    def to_json(self) -> dict:
        """summary() and the timeline, one list per field (timeline_columns)."""
        return {**self.summary(), "duration_s": self.duration_s, "timeline": timeline_columns(self.timeline)}


def timeline_columns(timeline: tuple[TimelinePoint, ...]) -> dict[str, list]:
    """The timeline as columns (compact JSON): t_s, arrival_rate, prefill / decode (devices held:
    routable + starting + draining), prefill_routable, decode_routable, prefill_target,
    decode_target, attainment (None where nothing finished; 4 decimals), goodput_rps."""
    return {"t_s": [p.t_s for p in timeline], "arrival_rate": [p.arrival_rate for p in timeline],
            "prefill": [p.prefill.devices for p in timeline], "decode": [p.decode.devices for p in timeline],
            "prefill_routable": [p.prefill.routable for p in timeline],
            "decode_routable": [p.decode.routable for p in timeline],
            "prefill_target": [p.prefill_target for p in timeline], "decode_target": [p.decode_target for p in timeline],
            "attainment": [None if p.attainment is None else round(p.attainment, 4) for p in timeline],
            "goodput_rps": [p.goodput_rps for p in timeline]}


def latency_summary(values: np.ndarray) -> LatencySummary:
    """Nearest-rank quantiles (NaN when empty)."""
    if len(values) == 0:
        return LatencySummary(math.nan, math.nan, math.nan)
    ordered = np.sort(values)
    return LatencySummary(*(float(nearest_rank(ordered, q)) for q in (0.5, 0.9, 0.99)))


def _finite(value):
    """JSON has no NaN: NaN becomes None (recursively)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def write_json(results: list[SimulationResult], path: Path) -> Path:
    """Write the results (with timelines) as one JSON document: {"runs": [...]}."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": [_finite(r.to_json()) for r in results]}, indent=1) + "\n")
    return path
