"""SLO targets and the DistServe rule: which requests count, and which targets each one met."""

from __future__ import annotations

import pytest

from splitserve.common.slo import SloConfig, SloOutcome, evaluate_slo, request_slo_outcome, tpot_s

BOTH = SloConfig(ttft_s=0.5, tpot_s=0.1)


def test_tpot_is_the_mean_gap_after_the_first_token():
    assert tpot_s(ttft_s=0.5, e2e_s=1.5, num_output_tokens=11) == pytest.approx(0.1)
    assert tpot_s(ttft_s=0.25, e2e_s=0.75, num_output_tokens=2) == 0.5
    assert tpot_s(ttft_s=0.5, e2e_s=0.5, num_output_tokens=1) is None
    assert tpot_s(ttft_s=0.5, e2e_s=0.5, num_output_tokens=0) is None


@pytest.mark.parametrize("ttft, e2e, tokens, expected", [
    (0.5, 0.5 + 4 * 0.1, 5, (True, True)),       # both exactly on target: met (<=)
    (0.5000001, 0.9, 5, (False, True)),
    (0.5, 0.5 + 4 * 0.1000001, 5, (True, False)),
    (0.75, 10.0, 1, (False, True)),              # one output token: no TPOT, meets any TPOT target
    (None, 3.0, 0, (False, True)),               # no token at all misses a TTFT target
])
def test_targets_are_met_up_to_and_including_the_boundary(ttft, e2e, tokens, expected):
    assert evaluate_slo(BOTH, ttft, e2e, tokens) == SloOutcome(*expected)


def test_a_missing_target_is_always_met():
    assert evaluate_slo(SloConfig(), None, 100.0, 50) == SloOutcome(True, True)
    assert evaluate_slo(SloConfig(ttft_s=0.1), 0.2, 100.0, 50) == SloOutcome(False, True)
    assert evaluate_slo(SloConfig(tpot_s=0.1), 50.0, 100.0, 2) == SloOutcome(True, False)
    assert SloOutcome(True, False).both_met is False and SloOutcome(True, True).both_met is True


@pytest.mark.parametrize("error_code, expected", [
    (None, SloOutcome(True, True)),
    ("RESOURCE_EXHAUSTED", SloOutcome(False, False)),  # rejected: counts, meets nothing
    ("DEADLINE_EXCEEDED", SloOutcome(False, False)),
    ("UNAVAILABLE", SloOutcome(False, False)),
    ("INTERNAL", SloOutcome(False, False)),
    ("ABORTED", SloOutcome(False, False)),
    ("CANCELLED", None),                               # the client withdrew: not counted
    ("INVALID_ARGUMENT", None),
])
def test_which_requests_count_toward_attainment(error_code, expected):
    # The same (fast) timings for every row: only the way the request ended decides.
    assert request_slo_outcome(BOTH, error_code, 0.1, 0.2, 3) == expected


@pytest.mark.parametrize("field, value", [("ttft_s", 0.0), ("ttft_s", -1.0), ("tpot_s", float("inf")),
                                          ("tpot_s", float("nan"))])
def test_targets_must_be_finite_and_positive(field, value):
    with pytest.raises(ValueError, match=f"{field} must be a finite number > 0"):
        SloConfig(**{field: value})


def test_a_request_brings_its_own_targets_and_falls_back_to_the_routers():
    from splitserve.common.errors import InvalidRequestError
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.proto.splitserve.v1 import generation_pb2 as pb
    from splitserve.router.api_types import GenerationInput
    from splitserve.router.orchestrator import Orchestrator
    from splitserve.router.server import slo_target
    from types import SimpleNamespace

    request = pb.GenerateRequest(ttft_slo_s=2.0, tpot_slo_s=0.05)
    assert (slo_target(request, "ttft_slo_s"), slo_target(request, "tpot_slo_s")) == (2.0, 0.05)
    assert slo_target(pb.GenerateRequest(), "tpot_slo_s") is None
    with pytest.raises(InvalidRequestError, match=r"^tpot_slo_s: must be a finite number > 0, got 0.0$"):
        slo_target(pb.GenerateRequest(tpot_slo_s=0.0), "tpot_slo_s")

    router = Orchestrator("r", (), [SimpleNamespace(worker_id="decode-0")], None, "colocated",
                          slo=SloConfig(ttft_s=1.0, tpot_s=0.2))
    own_tpot = GenerationInput("a", (5,), SamplingParams(), tpot_slo_s=0.05)
    assert router.slo_targets(own_tpot) == SloConfig(ttft_s=1.0, tpot_s=0.05)
    assert router.slo_targets(GenerationInput("b", (5,), SamplingParams(), ttft_slo_s=3.0)) == SloConfig(3.0, 0.2)
