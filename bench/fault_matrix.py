"""The fault matrix: runs every scenario of testing/fault_scenarios.py and regenerates the results
section of docs/reliability.md.

In-process scenarios run on a fresh InProcessCluster each (router + 1 prefill + 1 decode worker,
in-process KV transfer); the NIXL scenarios share one local Ray cluster (1 prefill + 1 decode
actor, NIXL over UCX), which takes most of the time. The model is the tests' tiny Llama
(testing/tiny_models.py TINY_SPECS["llama"]), built into a temporary directory.

Writes bench/results/fault_matrix.json (every scenario's outcome and the date it was measured)
and the generated block of docs/reliability.md (tests/test_faults.py checks the two agree with
the scenario list). Exits 1 if any scenario missed its expectation.

Run: .venv/bin/python bench/fault_matrix.py            (about 1 minute on 2 cores)
     .venv/bin/python bench/fault_matrix.py --skip-ray (in-process only; NIXL results kept from the last run)
     .venv/bin/python bench/fault_matrix.py --only cancel-pulling deadline-held
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import logging
import sys
import tempfile
from pathlib import Path

from splitserve.engine.tiny_model import build_tiny_model
from splitserve.testing.fault_scenarios import (ALL_SCENARIOS, IN_PROCESS_SCENARIOS, RAY_SCENARIOS, MatrixResult,
                                               Reference, Scenario, ScenarioOutcome, load_results,
                                               ray_cluster_config, render_results, run_in_process, run_on_ray,
                                               save_results, unmet_expectations, write_results_block)
from splitserve.testing.local_cluster import running_cluster
from splitserve.testing.tiny_models import TINY_SPECS


def run_in_process_scenarios(scenarios: list[Scenario], model_dir: Path, reference: Reference) -> list[ScenarioOutcome]:
    return [report(scenario, asyncio.run(run_in_process(scenario, model_dir, reference))) for scenario in scenarios]


def run_ray_scenarios(scenarios: list[Scenario], model_dir: Path, reference: Reference) -> list[ScenarioOutcome]:
    if not scenarios:
        return []
    with running_cluster(ray_cluster_config(model_dir)) as (cluster, loop):
        return [report(scenario, loop.run(run_on_ray(cluster, scenario, reference))) for scenario in scenarios]


def report(scenario: Scenario, outcome: ScenarioOutcome) -> ScenarioOutcome:
    problems = unmet_expectations(scenario, outcome)
    ends = ", ".join(f"{code} {count}" for code, count in outcome.codes)
    print(f"{scenario.name:44s} {ends:28s} {'as expected' if not problems else 'NOT AS EXPECTED'} "
          f"({outcome.seconds:.1f} s)", flush=True)
    for problem in problems:
        print(f"    {problem}", flush=True)
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip-ray", action="store_true", help="run only the in-process scenarios")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these scenarios")
    args = parser.parse_args()
    known = {scenario.name for scenario in ALL_SCENARIOS}
    unknown = sorted(set(args.only or ()) - known)
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {sorted(known)}")
    chosen = lambda scenarios: [s for s in scenarios if args.only is None or s.name in args.only]  # noqa: E731
    logging.basicConfig(level=logging.ERROR)  # the scenarios' faults make workers log warnings by design
    with tempfile.TemporaryDirectory(prefix="fault-matrix-") as tmp:
        model_dir = build_tiny_model(Path(tmp) / "llama", TINY_SPECS["llama"])
        reference = Reference(model_dir)
        outcomes = run_in_process_scenarios(chosen(IN_PROCESS_SCENARIOS), model_dir, reference)
        if not args.skip_ray:
            outcomes += run_ray_scenarios(chosen(RAY_SCENARIOS), model_dir, reference)
    today = datetime.date.today().isoformat()
    previous = load_results()
    fresh = {outcome.name: MatrixResult(today, outcome) for outcome in outcomes}
    results = {s.name: fresh.get(s.name) or previous[s.name] for s in ALL_SCENARIOS if s.name in fresh or s.name in previous}
    save_results(results)
    missing = [s.name for s in ALL_SCENARIOS if s.name not in results]
    if missing:
        print(f"docs/reliability.md not updated: no results yet for {missing}")
    else:
        write_results_block(render_results(ALL_SCENARIOS, results))
    by_name = {s.name: s for s in ALL_SCENARIOS}
    return 1 if any(unmet_expectations(by_name[o.name], o) for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
