"""Statistics of observed samples, shared by the live observer (planner/observe.py) and the
simulator's (planner/sim/observe.py, planner/sim/report.py), so both describe traffic alike."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def nearest_rank(ordered: Sequence[float] | np.ndarray, q: float) -> float:
    """The smallest sample with at least a fraction q of the samples at or below it (ordered ascending, non-empty)."""
    return float(ordered[max(0, math.ceil(q * len(ordered)) - 1)])


def gap_cv2(times: Sequence[float] | np.ndarray) -> float:
    """Squared coefficient of variation of the gaps between sorted event times; 1.0 (the Poisson
    value, no evidence either way) with fewer than two gaps or a zero mean gap."""
    gaps = np.diff(np.asarray(times, dtype=float))
    mean = float(gaps.mean()) if len(gaps) >= 2 else 0.0
    return float(gaps.var()) / (mean * mean) if mean > 0 else 1.0
