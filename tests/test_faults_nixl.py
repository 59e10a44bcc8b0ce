"""The fault matrix's NIXL scenarios (splitserve.testing.fault_scenarios RAY_SCENARIOS) on one local Ray
cluster: 1 prefill + 1 decode actor, KV pulled over NIXL, short leases. A lost notification
leaves the producer's blocks to its lease; a prefill actor killed between its first token and
the pull ends nothing but its own process: the request still finishes with the undisturbed run's
tokens, within a bounded time, and the decode worker ends idle."""

from __future__ import annotations

import pytest

from splitserve.testing.fault_scenarios import (RAY_SCENARIOS, Reference, ray_cluster_config, run_on_ray,
                                               unmet_expectations)
from splitserve.kv_transfer import nixl_module
from splitserve.testing.local_cluster import running_cluster
from tests.factories import NIXL_MISSING

if nixl_module() is None:
    pytest.skip(NIXL_MISSING, allow_module_level=True)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster(tiny_llama_dir):
    with running_cluster(ray_cluster_config(tiny_llama_dir)) as running:
        yield running


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> Reference:
    return Reference(tiny_llama_dir)


@pytest.mark.parametrize("scenario", RAY_SCENARIOS, ids=lambda scenario: scenario.name)
def test_nixl_scenario_ends_every_stream_as_expected_and_leaks_nothing(scenario, ray_cluster, reference):
    cluster, loop = ray_cluster
    outcome = loop.run(run_on_ray(cluster, scenario, reference))
    assert unmet_expectations(scenario, outcome) == ()
    killed = ("prefill-0",) if scenario.name == "nixl-prefill-killed-before-pull" else ()
    assert outcome.dead_workers == killed
    assert [residue.worker_id for residue in outcome.residue] == ["decode-0", *(() if killed else ("prefill-0",))]
