"""Issue 15: the planner against three baselines, in simulation (planner/sim), at 16, 128 and 1,000 devices.

Cluster, device and workload: splitserve.planner.sim.scenario (the 88M bench model in bf16 on one
2-core CPU per device; TTFT target 3 s, TPOT 0.1 s; scale-up delay 30 s; a decision every 10 s).
"N devices" sizes each trace's peak rate to what N devices serve at 80% utilisation (Scale).
Traces (splitserve.planner.sim.traces, seed --seed): poisson (steady at the peak), bursty (2-state
MMPP, low state at 45% of the peak, gamma inter-arrivals with cv^2 3), diurnal (25% -> 100% -> 25%
of the peak over the run), multitenant (16 tenants' shared system prompts, Zipf popularity).

Arrivals: 1 hour at 16 and 128 devices, 15 minutes at 1,000 (DURATION_S: so that the whole bench
runs in minutes on 2 cores; the diurnal ramp is then 4x steeper at 1,000 devices than below).

Policies, each on the same trace:
(a) static: the best fixed (prefill, decode) split found with hindsight, by a coarse-to-fine search
    (StaticSearch). TTFT depends only on the prefill pool, so the least prefill count whose TTFT
    attainment reaches 95% is searched first (any decode count will do: 1.5x nominal), then the
    least decode count whose TPOT attainment does with a quarter more prefill replicas than that.
    Each search: from the nominal split, strides of 5% doubling until the target is bracketed,
    then bisection down to the grid step max(1, devices // 50) (20 devices at 1,000). Every probe
    is a full simulation whose per-request outcomes are kept, so the joint attainment of any
    probed (prefill, decode) pair is estimated from two probes (TTFT met at that prefill count,
    TPOT met at that decode count); the pairs with the fewest devices are then simulated for
    real, a grid step going to the weaker pool while one misses. The answer is the cheapest
    simulated pair that met 95% (the best attainment if none did).
(b) dynamo: DynamoLikePolicy, (c) rayserve: RayServeLikePolicy, (d) planner: the planner's core,
all configured by scenario.planner_config (pools within [1, devices], max_step devices // 4,
PlannerConfig's default cooldowns). Dynamic policies start from the nominal split at the trace's
initial rate.

Per run: SLO attainment (both targets, DistServe goodput), goodput per device (good requests per
device-second; the table shows it per device-hour), device-hours (every replica from being asked
for until gone). Targets: (d) >= 95% attainment with device-hours <= (a)'s, and goodput per device
> (b)'s and (c)'s on bursty and diurnal (checked and reported on every trace).

Writes bench/results/planner.json (every run's summary and timeline, the static search's probes,
the targets, wall times) and planner.png (per trace at the largest scale: replicas over time
against the load, and windowed attainment over time). Runs on --workers processes (default 2).
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from serving_common import bench_parser, positive_int, report_header, write_report

from splitserve.planner.sim.plot import plot_runs
from splitserve.planner.sim.policies import StaticPolicy
from splitserve.planner.sim.report import SimulationResult
from splitserve.planner.sim.runner import simulate_run
from splitserve.planner.sim.scenario import BENCH_WORKLOAD, Scale, cluster_config, make_policy
from splitserve.planner.sim.traces import TRACE_NAMES, make_trace

RESULTS = Path(__file__).parent / "results"
SCALES = (16, 128, 1000)
DURATION_S = {16: 3600.0, 128: 3600.0, 1000: 900.0}
"""Seconds of arrivals per scale (the largest is shorter to keep the whole bench within minutes)."""
QUICK_DURATION_S = {16: 900.0, 128: 600.0, 1000: 300.0}
TARGET = 0.95
DYNAMIC = ("dynamo", "rayserve", "planner")
POLICIES = ("static", *DYNAMIC)
GOAL_TRACES = ("bursty", "diurnal")


@dataclass(frozen=True)
class Probe:
    """One static pair simulated during the search."""

    prefill: int
    decode: int
    attainment: float
    ttft_attainment: float
    tpot_attainment: float
    device_hours: float
    wall_s: float


class StaticSearch:
    """The best static split with hindsight for one (trace, scale) (module docstring, (a))."""

    def __init__(self, trace_name: str, devices: int, duration_s: float, seed: int) -> None:
        self.scale = Scale.of(trace_name, devices)
        self.duration_s, self.seed = duration_s, seed
        self.trace = make_trace(trace_name, self.scale.peak_rate, duration_s, seed, BENCH_WORKLOAD)
        self.step = max(1, devices // 50)
        self.probes: dict[tuple[int, int], tuple[SimulationResult, np.ndarray, np.ndarray]] = {}

    def evaluate(self, prefill: int, decode: int) -> SimulationResult:
        if (prefill, decode) not in self.probes:
            config = cluster_config(self.scale, self.duration_s, (prefill, decode))
            run = simulate_run(config, self.trace, StaticPolicy(prefill, decode), "static")
            self.probes[prefill, decode] = (run.result, run.ttft_met, run.tpot_met)
        return self.probes[prefill, decode][0]

    def least(self, attainment, start: int) -> int:
        """The least count on the grid (multiples of step, >= step) with attainment(count) >= TARGET,
        for a non-decreasing attainment: from `start`, strides of 5% doubling while the target stays
        on the same side (a bracket), then bisection down to one step."""
        stride = max(self.step, round(0.05 * start / self.step) * self.step)
        low, high = None, max(self.step, round(start / self.step) * self.step)
        while attainment(high) < TARGET:
            if high > 8 * self.scale.devices:
                return high
            low, high, stride = high, high + stride, 2 * stride
        while low is None:
            below = high - stride
            if below < self.step:
                low = 0
            elif attainment(below) >= TARGET:
                high, stride = below, 2 * stride
            else:
                low = below
        while high - low > self.step:
            middle = low + (high - low) // (2 * self.step) * self.step
            low, high = (low, middle) if attainment(middle) >= TARGET else (middle, high)
        return high

    def estimated(self, prefill: int, decode: int, p_wide: int, d_wide: int) -> float:
        """Joint attainment from the probes (prefill, d_wide) and (p_wide, decode)."""
        ttft_ok = self.probes[prefill, d_wide][1]
        tpot_ok = self.probes[p_wide, decode][2]
        return float(np.count_nonzero(ttft_ok & tpot_ok)) / len(ttft_ok)

    def run(self) -> tuple[SimulationResult, list[Probe]]:
        """TTFT depends on the prefill pool only, so any decode count serves the prefill search;
        the decode search runs with a quarter more prefill replicas than the prefill search found."""
        nominal = self.scale.split(self.scale.peak_rate)
        d_wide = math.ceil(1.5 * nominal[1])
        p_low = self.least(lambda p: self._ttft(p, d_wide), nominal[0])
        p_wide = max(p_low + self.step, math.ceil(1.25 * p_low))
        d_low = self.least(lambda d: self._tpot(p_wide, d), nominal[1])
        prefills = sorted(p for p, d in self.probes if d == d_wide and p >= p_low)
        decodes = sorted(d for p, d in self.probes if p == p_wide and d >= d_low)
        pairs = sorted(((p + d, -self.estimated(p, d, p_wide, d_wide), p, d) for p in prefills for d in decodes))
        for _, estimate, prefill, decode in pairs:
            if -estimate >= TARGET:
                self._confirm(prefill, decode)
                break
        return self._best(), self._log()

    def _ttft(self, prefill: int, decode: int) -> float:
        result = self.evaluate(prefill, decode)
        return result.ttft_met / result.requests

    def _tpot(self, prefill: int, decode: int) -> float:
        result = self.evaluate(prefill, decode)
        return result.tpot_met / result.requests

    def _confirm(self, prefill: int, decode: int) -> None:
        """Simulate the pair; while it misses, add a grid step to the weaker pool (at most 6 times)."""
        for _ in range(6):
            result = self.evaluate(prefill, decode)
            if result.attainment >= TARGET:
                return
            if result.ttft_met <= result.tpot_met:
                prefill += self.step
            else:
                decode += self.step

    def _best(self) -> SimulationResult:
        results = [result for result, _, _ in self.probes.values()]
        meeting = [r for r in results if r.attainment >= TARGET]
        if meeting:
            return min(meeting, key=lambda r: (r.device_s, -r.attainment))
        return max(results, key=lambda r: r.attainment)

    def _log(self) -> list[Probe]:
        return [Probe(p, d, r.attainment, r.ttft_met / r.requests, r.tpot_met / r.requests, r.device_hours, r.wall_s)
                for (p, d), (r, _, _) in self.probes.items()]


def run_dynamic(trace_name: str, devices: int, policy_name: str, duration_s: float, seed: int) -> dict:
    started = time.perf_counter()
    scale = Scale.of(trace_name, devices)
    trace = make_trace(trace_name, scale.peak_rate, duration_s, seed, BENCH_WORKLOAD)
    result = simulate_run(cluster_config(scale, duration_s), trace, make_policy(policy_name, scale), policy_name).result
    return {"trace": trace_name, "devices": devices, "policy": policy_name, "result": result.to_json(),
            "job_wall_s": time.perf_counter() - started}


def run_static(trace_name: str, devices: int, duration_s: float, seed: int) -> dict:
    started = time.perf_counter()
    search = StaticSearch(trace_name, devices, duration_s, seed)
    best, probes = search.run()
    split = next(pair for pair, (result, _, _) in search.probes.items() if result is best)
    return {"trace": trace_name, "devices": devices, "policy": "static", "split": split, "result": best.to_json(),
            "probes": [asdict(p) for p in probes], "job_wall_s": time.perf_counter() - started}


def jobs(scales: tuple[int, ...], durations: dict[int, float], seed: int) -> list[tuple]:
    """Every (function, arguments), the costliest first (static searches, then by simulated work)."""
    work = []
    for devices in scales:
        for trace in TRACE_NAMES:
            weight = devices * durations[devices]
            work.append((12 * weight, run_static, (trace, devices, durations[devices], seed)))
            work.extend((weight, run_dynamic, (trace, devices, policy, durations[devices], seed)) for policy in DYNAMIC)
    return [(function, arguments) for _, function, arguments in sorted(work, key=lambda w: -w[0])]


def run_all(scales: tuple[int, ...], durations: dict[int, float], seed: int, workers: int) -> list[dict]:
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(function, *arguments) for function, arguments in jobs(scales, durations, seed)]
        return [future.result() for future in futures]


def by_cell(runs: list[dict]) -> dict[tuple[int, str], dict[str, dict]]:
    cells: dict[tuple[int, str], dict[str, dict]] = {}
    for run in runs:
        cells.setdefault((run["devices"], run["trace"]), {})[run["policy"]] = run
    return cells


def targets(cells: dict[tuple[int, str], dict[str, dict]]) -> list[dict]:
    """Per (scale, trace): the planner's attainment, device-hours against static, goodput per device against
    dynamo and rayserve (a goal on bursty and diurnal, reported everywhere)."""
    rows = []
    for (devices, trace), runs in sorted(cells.items()):
        ours, static = runs["planner"]["result"], runs["static"]["result"]
        rows.append({"devices": devices, "trace": trace, "goal_trace": trace in GOAL_TRACES,
                     "attainment_met": ours["attainment"] >= TARGET,
                     "device_hours_vs_static": ours["device_hours"] / static["device_hours"],
                     "device_hours_met": ours["device_hours"] <= static["device_hours"],
                     "goodput_per_device_vs_dynamo": _ratio(ours, runs["dynamo"]["result"]),
                     "goodput_per_device_vs_rayserve": _ratio(ours, runs["rayserve"]["result"])})
    return rows


def _ratio(ours: dict, other: dict) -> float | None:
    return ours["goodput_per_device"] / other["goodput_per_device"] if other["goodput_per_device"] else None


def table(cells: dict[tuple[int, str], dict[str, dict]]) -> str:
    header = (f"{'devices':>7} {'trace':<11} {'policy':<13} {'attain':>7} {'good/dev-h':>10} {'dev-hours':>9} "
              f"{'mean dev':>8} {'TTFT p99':>8} {'TPOT p99':>8} {'wall s':>7}")
    lines = [header, "-" * len(header)]
    for (devices, trace), runs in sorted(cells.items()):
        for policy in POLICIES:
            r = runs[policy]["result"]
            name = f"{policy} {runs[policy]['split'][0]}:{runs[policy]['split'][1]}" if policy == "static" else policy
            lines.append(f"{devices:>7} {trace:<11} {name:<13} {r['attainment']:>7.4f} {3600 * r['goodput_per_device']:>10.1f} "
                         f"{r['device_hours']:>9.2f} {r['mean_devices']:>8.1f} {_num(r['ttft']['p99_s']):>8} "
                         f"{_num(r['tpot']['p99_s']):>8} {runs[policy]['job_wall_s']:>7.1f}")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def plot(report: dict, path: Path) -> None:
    """Per trace at the largest scale: replicas over time against the load, attainment over time."""
    devices = max(run["devices"] for run in report["runs"])
    runs = sorted((run for run in report["runs"] if run["devices"] == devices),
                  key=lambda run: (TRACE_NAMES.index(run["trace"]), POLICIES.index(run["policy"])))
    plot_runs([run["result"] for run in runs], path, f"{devices} devices, ")


def main() -> None:
    parser = bench_parser(__doc__, "shorter traces (16: 15 min, 128: 10 min, 1000: 5 min)", RESULTS)
    parser.add_argument("--workers", type=positive_int, default=2, help="simulation processes (default 2)")
    parser.add_argument("--scales", type=int, nargs="+", choices=SCALES, default=list(SCALES),
                        help="device counts to run (the traces' durations are set per scale; default: all)")
    args = parser.parse_args()
    started = time.perf_counter()
    durations = QUICK_DURATION_S if args.quick else DURATION_S
    scales = tuple(args.scales)
    runs = run_all(scales, durations, args.seed, args.workers)
    cells = by_cell(runs)
    report = {**report_header("bench/planner.py", args), "scales": scales,
              "duration_s": {str(n): durations[n] for n in scales}, "target_attainment": TARGET,
              "targets": targets(cells), "runs": runs, "wall_s": time.perf_counter() - started}
    out_dir = write_report(report, "planner", args, RESULTS, plot)
    print(table(cells))
    for row in report["targets"]:
        print(row)
    print(f"wall {report['wall_s']:.0f} s on {args.workers} workers; results in {out_dir}")


if __name__ == "__main__":
    main()
