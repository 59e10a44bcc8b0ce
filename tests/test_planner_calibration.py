"""bench/planner_calibration.py's pure pieces: the profile fit (exact recovery, non-negativity),
the trace and its requests, the quantile cells, reading the router's records, and the simulated
latencies of a hand-computed request. No timing is asserted here (that is the bench's result)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from splitserve.common.stats import RequestRecord
from splitserve.planner.core.perf_model import prefill_features
from splitserve.planner.core.types import PerformanceProfile
from splitserve.planner.sim.traces import NO_PREFIX, Trace
from tests.factories import make_request_record

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from planner_calibration import (QUICK, Cell, DecodeSample, PrefillSample, ReplayRequest, Samples,  # noqa: E402
                                 Stream, calibration_trace, cells, decode_gap_samples, fit_profile, fit_transfer,
                                 gap_breakdown, loaded_prefill_samples, mean_by_length, mean_by_shape,
                                 measure_loaded, prefill_overlap, tpot_by_overlap, phase_medians, record_latencies,
                                 relative_nnls, replay_requests, sim_config, simulated_latencies, steady_gap_s)

HAND_PROFILE = PerformanceProfile(prefill_fixed_s=0.002, prefill_s_per_token=1e-4, prefill_s_per_token2=3e-8,
                                  decode_fixed_s=0.0015, decode_s_per_request=2e-4, decode_s_per_context_token=4e-7,
                                  max_batch_size=256, prefill_token_budget=8192)


def exact(value: float):
    return pytest.approx(value, rel=1e-9, abs=1e-15)


def hand_samples(profile: PerformanceProfile) -> tuple[list[PrefillSample], list[DecodeSample]]:
    """Noiseless samples of the profile's formulas."""
    p = profile
    prefill = [PrefillSample(n, p.prefill_fixed_s + p.prefill_s_per_token * n + p.prefill_s_per_token2 * n * n)
               for n in (32, 64, 128, 256, 512, 768)]
    decode = [DecodeSample(b, c, p.decode_fixed_s + p.decode_s_per_request * b + p.decode_s_per_context_token * c)
              for b, c in ((1, 100), (1, 500), (4, 300), (4, 2000), (16, 1500))]
    return prefill, decode


def record(request_id: str, ttft_s: float, e2e_s: float, output: int, finish_reason: str | None = "length",
           gaps: tuple[float, ...] = (), phases: tuple[tuple[str, float], ...] = (), prompt: int = 64,
           prefill_s: float | None = None) -> RequestRecord:
    return make_request_record(
        request_id, finish_reason=finish_reason, error_code=None if finish_reason else "UNAVAILABLE",
        num_prompt_tokens=prompt, num_output_tokens=output, ttft_s=ttft_s, inter_token_latencies=gaps, e2e_s=e2e_s,
        prefill_s=prefill_s, ttft_breakdown=phases)


def test_the_fit_recovers_a_profile_exactly_from_noiseless_samples():
    prefill, decode = hand_samples(HAND_PROFILE)
    fitted = fit_profile(prefill, decode, max_batch_size=256, prefill_token_budget=8192)
    for name in ("prefill_fixed_s", "prefill_s_per_token", "prefill_s_per_token2", "decode_fixed_s",
                 "decode_s_per_request", "decode_s_per_context_token"):
        assert getattr(fitted, name) == exact(getattr(HAND_PROFILE, name)), name
    assert (fitted.max_batch_size, fitted.prefill_token_budget) == (256, 8192)


def test_a_zero_coefficient_is_recovered_as_zero():
    """A profile with no quadratic prefill term and no context cost: the fit finds 0 for both."""
    profile = PerformanceProfile(0.003, 2e-4, 0.0, 0.002, 1e-4, 0.0, 16, 512)
    fitted = fit_profile(*hand_samples(profile), max_batch_size=16, prefill_token_budget=512)
    assert fitted.prefill_s_per_token2 == exact(0.0)
    assert fitted.decode_s_per_context_token == exact(0.0)
    assert (fitted.prefill_fixed_s, fitted.decode_fixed_s) == (exact(0.003), exact(0.002))


def test_the_fit_minimises_relative_error_with_non_negative_coefficients():
    """Points (1, 1) and (2, 4) lie on 3n - 2; with the intercept held at 0 the relative error
    (c - 1)^2 + (2c / 4 - 1)^2 is least at c = 1.2 (2.5c = 3), beating the intercept-only fit."""
    solution = relative_nnls(np.array([[1.0, 1.0], [1.0, 2.0]]), np.array([1.0, 4.0]))
    assert solution.tolist() == [exact(0.0), exact(1.2)]


def test_the_fit_needs_positive_times_and_enough_samples():
    with pytest.raises(ValueError, match="need >= k samples"):
        relative_nnls(prefill_features([1, 2]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="need >= k samples"):
        relative_nnls(prefill_features([1, 2, 3]), np.array([1.0, 0.0, 2.0]))


def test_the_transfer_line_is_recovered_from_bandwidth_rows():
    rows = [{"num_bytes": b, "nixl_s": 0.0005 + b / 4e9} for b in (1 << 20, 16 << 20, 256 << 20)]
    latency_s, bytes_per_s = fit_transfer(rows)
    assert (latency_s, bytes_per_s) == (exact(0.0005), exact(4e9))


def test_the_trace_is_seeded_and_within_the_workload():
    trace = calibration_trace(QUICK, seed=3)
    again = calibration_trace(QUICK, seed=3)
    assert np.array_equal(trace.arrival_s, again.arrival_s)
    assert np.array_equal(trace.prompt_tokens, again.prompt_tokens)
    assert (trace.prompt_tokens.min() >= 64, trace.prompt_tokens.max() <= 512) == (True, True)
    assert (trace.output_tokens.min() >= 32, trace.output_tokens.max() <= 128) == (True, True)
    assert not trace.shared_tokens.any() and bool(np.all(trace.prefix_group == NO_PREFIX))
    assert trace.duration_s == QUICK.duration_s and len(trace) > 0


def hand_trace() -> Trace:
    return Trace("hand", 10.0, np.array([0.5, 1.25, 4.0]), np.array([3, 5, 2]), np.array([7, 1, 2]),
                 np.full(3, NO_PREFIX), np.zeros(3, dtype=np.int64))


def test_each_trace_request_becomes_a_request_of_its_length_and_output():
    requests = replay_requests(hand_trace(), vocab_size=10, seed=0)
    assert [(r.request_id, r.arrival_s, len(r.token_ids), r.max_tokens) for r in requests] == [
        ("cal-0-0000", 0.5, 3, 7), ("cal-0-0001", 1.25, 5, 1), ("cal-0-0002", 4.0, 2, 2)]
    assert all(3 <= token < 10 for r in requests for token in r.token_ids)
    assert replay_requests(hand_trace(), 10, seed=0) == requests
    assert replay_requests(hand_trace(), 2048, seed=1) != replay_requests(hand_trace(), 2048, seed=0)
    retry = replay_requests(hand_trace(), 2048, seed=0, prefix="fit", attempt=1)
    assert [r.request_id for r in retry] == ["fit-1-0000", "fit-1-0001", "fit-1-0002"]
    assert [(r.arrival_s, len(r.token_ids), r.max_tokens) for r in retry] == [(0.5, 3, 7), (1.25, 5, 1), (4.0, 2, 2)]
    assert [r.token_ids for r in retry] != [r.token_ids for r in replay_requests(hand_trace(), 2048, seed=0)]


def test_a_trace_with_shared_prefixes_is_refused():
    trace = Trace("shared", 10.0, np.array([0.5]), np.array([8]), np.array([2]), np.array([0]), np.array([4]))
    with pytest.raises(ValueError, match="no shared prefixes"):
        replay_requests(trace, 10, seed=0)


def test_cells_take_nearest_rank_quantiles_and_judge_within_20_percent():
    real = np.arange(100, 0, -1) / 1000  # 0.001 .. 0.100, unsorted
    rows = cells("ttft", real, 1.2 * real)
    assert [(c.metric, c.quantile, c.real_s, c.simulated_s) for c in rows] == [
        ("ttft", 0.5, 0.05, exact(0.06)), ("ttft", 0.99, 0.099, exact(0.1188))]
    assert [(c.ratio, c.within) for c in rows] == [(exact(1.2), True), (exact(1.2), True)]
    assert Cell("tpot", 0.5, 0.004, 0.0032).within  # ratio 0.8: on the edge, within
    assert not Cell("tpot", 0.5, 0.004, 0.00319).within
    assert not Cell("tpot", 0.99, 0.004, 0.00484).within  # ratio 1.21
    assert Cell("ttft", 0.5, 0.02, 0.03).to_json() == {"metric": "ttft", "quantile": 0.5, "real_s": 0.02,
                                                       "simulated_s": 0.03, "ratio": exact(1.5), "within": False}


def test_latencies_are_read_from_records_in_trace_order():
    requests = [ReplayRequest("a", 0.0, (5,), 3), ReplayRequest("b", 1.0, (6,), 2)]
    records = {"b": record("b", 0.02, 0.05, 2), "a": record("a", 0.01, 0.03, 3)}
    ttft, tpot = record_latencies(records, requests)
    assert ttft.tolist() == [0.01, 0.02]
    assert tpot.tolist() == [exact(0.01), exact(0.03)]  # (e2e - ttft) / (output - 1)


def test_a_request_that_did_not_produce_all_its_tokens_fails_the_run():
    requests = [ReplayRequest("a", 0.0, (5,), 3)]
    with pytest.raises(ValueError, match="a ended length after 2 of 3 tokens"):
        record_latencies({"a": record("a", 0.01, 0.03, 2)}, requests)
    with pytest.raises(ValueError, match="a ended UNAVAILABLE"):
        record_latencies({"a": record("a", 0.01, 0.03, 3, finish_reason=None)}, requests)


def test_the_steady_gap_is_the_median_of_the_middle_half_of_each_stream():
    """8 gaps -> gaps 2..5 of each record; the pooled median of (3, 3, 3, 3) and (5, 5, 5, 5) is 4."""
    first = record("a", 0.0, 1.0, 9, gaps=(0.0, 9.0, 3.0, 3.0, 3.0, 3.0, 9.0, 9.0))
    second = record("b", 0.0, 1.0, 9, gaps=(0.0, 1.0, 5.0, 5.0, 5.0, 5.0, 1.0, 1.0))
    assert steady_gap_s([first, second]) == 4.0


def test_phase_medians_are_per_phase():
    records = [record(str(i), 0.0, 1.0, 2, phases=(("router_queue", q), ("prefill_compute", c)))
               for i, (q, c) in enumerate(((0.001, 0.02), (0.003, 0.01), (0.002, 0.05)))]
    assert phase_medians(records) == {"router_queue": 0.002, "prefill_compute": 0.02}


def test_simulated_latencies_of_a_hand_worked_request():
    """Profile: prefill 0.01 + 0.001 n; decode 0.02 + 0.005 batch + 0.0001 context; KV transfer
    0.002 + 100 tokens x 1000 B / 1e6 B/s = 0.102 s. One request at t = 1.0, prompt 100, output 3:
    first token at 1.11 (TTFT 0.11); it joins at 1.212 and decodes 2 steps at contexts 101 and
    102 (0.0351 + 0.0352 s), finishing at 1.2823: TPOT (1.2823 - 1.11) / 2 = 0.08615."""
    profile = PerformanceProfile(0.01, 0.001, 0.0, 0.02, 0.005, 0.0001, 4, 512)
    trace = Trace("one", 5.0, np.array([1.0]), np.array([100]), np.array([3]), np.array([NO_PREFIX]),
                  np.array([0]))
    ttft, tpot = simulated_latencies(sim_config(profile, 10_000, 1000, (0.002, 1e6)), trace)
    assert ttft.tolist() == [exact(0.11)]
    assert tpot.tolist() == [exact(0.08615)]


def test_the_sim_config_carries_the_measured_cluster():
    config = sim_config(HAND_PROFILE, 16_384, 4096, (0.0007, 4.5e9))
    assert (config.profile, config.initial_prefill, config.initial_decode, config.decode_kv_tokens,
            config.kv_bytes_per_token, config.transfer_latency_s, config.transfer_bytes_per_s, config.scale_up_s) == (
        HAND_PROFILE, 1, 1, 16_384, 4096, 0.0007, 4.5e9, 0.0)


def test_lone_prompts_give_prefill_samples_of_their_ttft_less_their_wait():
    """Only prompts the worker started within 2 ms count (the others may have shared a step)."""
    records = [record("a", 0.030, 0.1, 2, prompt=100, phases=(("router_queue", 0.004), ("prefill_queue", 0.001),
                                                              ("prefill_compute", 0.025))),
               record("b", 0.080, 0.2, 2, prompt=300, phases=(("router_queue", 0.004), ("prefill_queue", 0.030),
                                                              ("prefill_compute", 0.046))),
               record("c", 0.012, 0.1, 2, prompt=64)]  # no phases: never prefilled on a prefill worker
    assert loaded_prefill_samples(records) == [PrefillSample(100, exact(0.029))]


def test_decode_gaps_are_sampled_only_while_the_batch_holds_still():
    """A (prompt 10) streams at 0, 1, 2, 3, 4: in the batch over [1, 4]; B (prompt 20) at 1.5, 2.5,
    3, 3.5: over [2.5, 3.5]. A's gap (1, 2]: batch {A}, context 10 + 2 tokens out by t = 1. A's
    gaps (2, 3] and (3, 4] see B join and leave: skipped. B's gaps (2.5, 3] and (3, 3.5]: batch
    {A, B}, context (10 + 3) + (20 + 2) = 35, then (10 + 4) + (20 + 3) = 37. C, with 2 tokens,
    never decodes a step of its own after the handoff: no samples, no span."""
    streams = [Stream(10, np.array([0.0, 1.0, 2.0, 3.0, 4.0])), Stream(20, np.array([1.5, 2.5, 3.0, 3.5])),
               Stream(30, np.array([1.2, 2.2]))]
    assert decode_gap_samples(streams) == [DecodeSample(1, 12, 1.0), DecodeSample(2, 35, 0.5),
                                           DecodeSample(2, 37, 0.5)]


def test_decode_gaps_are_averaged_per_batch_and_context_bin():
    """Bins of 256 context tokens; a bin needs 20 gaps. Batch 1 in bin 0: contexts 100 and 200,
    0.002 s and 0.004 s, 10 each -> (1, 150, 0.003). Batch 2 in bin 1: 20 gaps at 300 -> kept.
    Batch 2 in bin 0: 19 gaps -> left out."""
    samples = ([DecodeSample(1, 100, 0.002)] * 10 + [DecodeSample(1, 200, 0.004)] * 10
               + [DecodeSample(2, 300, 0.005)] * 20 + [DecodeSample(2, 255, 0.001)] * 19)
    assert mean_by_shape(samples) == [DecodeSample(1, 150, exact(0.003)), DecodeSample(2, 300, exact(0.005))]


def test_lone_prompts_are_averaged_per_length_bin():
    """Bins of 64 tokens; a bin needs 5 prompts. 64..127: 100 x 3 at 0.02 s and 110 x 2 at 0.03 s ->
    (104, 0.024). 128..191: 4 prompts -> left out."""
    samples = [PrefillSample(100, 0.02)] * 3 + [PrefillSample(110, 0.03)] * 2 + [PrefillSample(150, 0.05)] * 4
    assert mean_by_length(samples) == [PrefillSample(104, exact(0.024))]


def test_decode_time_is_split_into_handoff_steady_and_changing_gaps():
    """The streams of the gap-sampling test: handoffs 1.0 each (3 s); steady gaps A (1, 2], B (2.5, 3],
    B (3, 3.5] (2 s); changing A (2, 3], A (3, 4] (2 s); 7 s in all."""
    streams = [Stream(10, np.array([0.0, 1.0, 2.0, 3.0, 4.0])), Stream(20, np.array([1.5, 2.5, 3.0, 3.5])),
               Stream(30, np.array([1.2, 2.2]))]
    assert gap_breakdown(streams) == {
        "handoff_mean_s": 1.0, "steady_mean_s": exact(2 / 3), "changing_mean_s": 1.0, "steady_gaps": 3,
        "changing_gaps": 2, "handoff_share": exact(3 / 7), "steady_share": exact(2 / 7), "changing_share": exact(2 / 7)}


def test_a_loaded_replay_is_read_on_the_replay_clock():
    """Request a entered the router 0.25 s after its arrival at 1.0: its 22 tokens at 1.75 + k;
    gaps 2..21 each 1.0 s, at contexts 10 + 2 .. 10 + 21: one shape, mean context 21.5 -> 22. Its
    lone prompt alone is too few for a prefill sample."""
    requests = [ReplayRequest("a", 1.0, (5,) * 10, 22)]
    records = {"a": record("a", 0.5, 21.5, 22, gaps=(1.0,) * 21, prompt=10,
                           phases=(("router_queue", 0.1), ("prefill_queue", 0.0), ("prefill_compute", 0.4)))}
    assert measure_loaded(records, requests, [0.25]) == Samples((), (DecodeSample(1, 22, 1.0),))


def test_prefill_overlap_is_the_share_of_a_decode_spent_beside_a_prefill():
    """Prefill busy: A (-0.5, 0), B (2, 4), C (6, 7); D was prefilled on its decode worker (none).
    A decodes over [0, 10]: 2 + 1 s of prefill -> 0.3; B over [4, 6.5]: 0.5 s of C's -> 0.2; C over
    [7, 8] and D over [0, 1]: none; E has one token (no decode): 0."""
    spans = {"A": (0.5, [0.0, 10.0]), "B": (2.0, [4.0, 6.5]), "C": (1.0, [7.0, 8.0]), "D": (None, [0.0, 1.0]),
             "E": (None, [3.0])}
    records = [record(name, 0.1, 1.0, len(tokens), prefill_s=busy) for name, (busy, tokens) in spans.items()]
    streams = [Stream(64, np.array(tokens)) for _, tokens in spans.values()]
    assert prefill_overlap(records, streams).tolist() == [exact(0.3), exact(0.2), 0.0, 0.0, 0.0]


def test_tpot_is_tabled_per_prefill_overlap_bucket():
    overlap = np.array([0.05, 0.2, 0.3, 1.0, 0.0])
    rows = tpot_by_overlap(overlap, np.array([1.0, 2.0, 3.0, 4.0, 5.0]), np.array([10.0, 20.0, 30.0, 40.0, 50.0]))
    assert rows == [{"overlap": [0.0, 0.1], "requests": 2, "real_median_s": 3.0, "simulated_median_s": 30.0},
                    {"overlap": [0.1, 0.3], "requests": 1, "real_median_s": 2.0, "simulated_median_s": 20.0},
                    {"overlap": [0.3, 1.0], "requests": 2, "real_median_s": 3.5, "simulated_median_s": 35.0}]
