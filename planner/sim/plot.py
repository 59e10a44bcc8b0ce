"""Simulations as a PNG: per trace, replicas over time against the load, and attainment over time.

matplotlib is imported when a plot is drawn (it is the `bench` extra, not a product dependency).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from splitserve.planner.sim.report import SimulationResult

TARGET_LINE = 0.95
"""The attainment target drawn on every attainment panel."""


def write_png(results: Sequence[SimulationResult], path: Path, title: str = "") -> Path:
    """plot_runs over the results' JSON form."""
    return plot_runs([r.to_json() for r in results], path, title)


def plot_runs(runs: Sequence[dict], path: Path, title: str = "") -> Path:
    """One row per trace among `runs` (SimulationResult.to_json() dicts, one per policy and trace):
    devices held per policy with the arrival rate (grey, right axis), and each policy's fraction of
    the requests finished in each window that met both targets; the time axis ends just after the
    trace's arrivals (a run that overran them is cut)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(run["trace"] for run in runs))
    fig, axes = plt.subplots(len(traces), 2, figsize=(14, 3.2 * len(traces)), squeeze=False)
    for row, trace in enumerate(traces):
        timelines = {run["policy"]: run["timeline"] for run in runs if run["trace"] == trace}
        _replicas(axes[row][0], f"{title}{trace}", timelines)
        _attainment(axes[row][1], trace, timelines)
        minutes = max(run["duration_s"] for run in runs if run["trace"] == trace) / 60
        for ax in axes[row]:
            ax.set_xlim(0, 1.05 * minutes)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _minutes(timeline: dict[str, list]) -> list[float]:
    return [t / 60 for t in timeline["t_s"]]


def _replicas(ax, title: str, timelines: dict[str, dict[str, list]]) -> None:
    for policy, timeline in timelines.items():
        held = [p + d for p, d in zip(timeline["prefill"], timeline["decode"])]
        ax.plot(_minutes(timeline), held, label=policy, linewidth=1)
    load = ax.twinx()
    first = next(iter(timelines.values()))
    load.plot(_minutes(first), first["arrival_rate"], color="grey", alpha=0.4, linewidth=0.8)
    load.set_ylabel("arrivals / s (grey)")
    ax.set(title=f"{title}: replicas (prefill + decode) vs load", xlabel="minutes", ylabel="devices held")
    ax.legend(fontsize=7, loc="upper left")


def _attainment(ax, trace: str, timelines: dict[str, dict[str, list]]) -> None:
    for policy, timeline in timelines.items():
        values = [math.nan if v is None else v for v in timeline["attainment"]]
        ax.plot(_minutes(timeline), values, label=policy, linewidth=1)
    ax.axhline(TARGET_LINE, color="black", linestyle=":", linewidth=0.8)
    ax.set(title=f"{trace}: SLO attainment per window", xlabel="minutes", ylabel="attainment", ylim=(0, 1.02))
    ax.legend(fontsize=7, loc="lower left")
