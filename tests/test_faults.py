"""The fault matrix on in-process clusters (splitserve.testing.fault_scenarios): every scenario's streams end
as expected (codes, the cause named, outputs equal to the undisturbed greedy run), and afterwards
no worker holds a request, lease, transfer or KV block and the router counts nothing in flight.

docs/reliability.md holds the matrix's last run (bench/fault_matrix.py); a test here checks it
lists exactly these scenarios with their current expectations, without re-running them.
"""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.worker_messages import PrefillRequest
from splitserve.testing.fault_scenarios import (ALL_SCENARIOS, IN_PROCESS_SCENARIOS, LOAD_CANCELS, LOAD_CASES,
                                               LOAD_PLAN, LONG, RESULTS_JSON, SHORT, Reference, StepHold,
                                               load_results, render_results, results_block, run_in_process,
                                               unmet_expectations, unscheduled)
from splitserve.testing.in_process_cluster import InProcessCluster
from tests.factories import hf_greedy


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> Reference:
    return Reference(tiny_llama_dir)


@pytest.mark.parametrize("scenario", IN_PROCESS_SCENARIOS, ids=lambda scenario: scenario.name)
def test_scenario_ends_every_stream_as_expected_and_leaks_nothing(scenario, tiny_llama_dir, reference):
    outcome = asyncio.run(run_in_process(scenario, tiny_llama_dir, reference))
    assert unmet_expectations(scenario, outcome) == ()
    assert outcome.requests_sent == sum(count for _, count in scenario.expected.codes)
    assert all(residue.is_clean for residue in outcome.residue) and outcome.router_in_flight == 0


def test_the_undisturbed_run_is_hugging_face_greedy(tiny_llama_dir, reference):
    cases = [SHORT, LONG, *LOAD_CASES[:3]]
    reference.prepare(cases)
    assert [list(reference.tokens(case)) for case in cases] == [hf_greedy(tiny_llama_dir, case) for case in cases]


def test_the_load_plan_cancels_mid_stream_at_most():
    assert (len(LOAD_CASES), LOAD_CANCELS) == (100, 17)
    for case, cancel in zip(LOAD_CASES, LOAD_PLAN):
        if cancel is not None:  # a fixed-length stream cancelled before its last chunk: it cannot finish first
            assert case.ignore_eos and 1 <= cancel.after_chunks < case.max_tokens


def test_a_step_gate_holds_the_engine_while_calls_still_run(tiny_llama_dir):
    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            worker = cluster.prefill_workers[0]
            hold = StepHold(worker._loop, unscheduled)
            steps = (await worker.stats()).engine.num_steps
            call = asyncio.ensure_future(worker.prefill(PrefillRequest("p", SHORT.prompt_token_ids, SamplingParams())))
            await hold.reached()
            held = await worker.stats()  # a call, answered while the step is held
            hold.release()
            result = await call
            await worker.abort("p")
            return steps, held.engine.num_steps, held.engine.num_waiting, result.token_ids

    steps_before, steps_held, waiting, token_ids = asyncio.run(scenario())
    assert (steps_held, waiting, len(token_ids)) == (steps_before, 1, 1)


def test_reliability_doc_lists_every_scenario_with_its_last_results():
    results = load_results(RESULTS_JSON)
    assert list(results) == [scenario.name for scenario in ALL_SCENARIOS], (
        "bench/results/fault_matrix.json does not match the scenario list: run .venv/bin/python bench/fault_matrix.py")
    assert results_block() == render_results(ALL_SCENARIOS, results), (
        "docs/reliability.md is stale: run .venv/bin/python bench/fault_matrix.py")
