"""planner/core: the performance model's fit, the queueing formulas, and the planner replayed tick by tick.

Replays use PROFILE: a 100-token prompt prefills in 0.1 s (no fixed cost), so at a TTFT target of 1 s the
prefill pool needs exactly floor(rate / 10) + 1 replicas at the rates used here (utilisation < 1 is what
binds; the queueing tail then leaves attainment > 0.9999). Outputs are 1 token (no decode work) unless a
test says otherwise, so the decode pool sits at its minimum.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.planner.core.perf_model import (UNEXCITED_SHARE, FitConfig, LinearFit, PerformanceModel,
                                                nonnegative_quadratic, prefill_features)
from splitserve.planner.core.planner import (REASONS, Allocation, Planner, PlannerTuning, fewest_devices,
                                             local_prefill_threshold, planning_rate, rate_standard_error)
from splitserve.planner.core.queueing import (DecodePool, DecodeWorkload, PrefillPool, PrefillWorkload,
                                              PrefixScaledPrefillPool, allen_cunneen_wait_s, erlang_c)
from splitserve.planner.core.types import (Decision, DecodeStepSample, LengthHistogram, Observation,
                                           PerformanceProfile, PlannerConfig, PoolBounds, PoolObservation,
                                           PrefillStepSample)

PROFILE = PerformanceProfile(prefill_fixed_s=0.0, prefill_s_per_token=0.001, prefill_s_per_token2=0.0,
                             decode_fixed_s=0.01, decode_s_per_request=0.0, decode_s_per_context_token=0.0)
CONFIG = PlannerConfig(ttft_s=1.0, itl_s=0.05, attainment=0.95, prefill=PoolBounds(1, 10), decode=PoolBounds(1, 4),
                       tick_s=10.0, scale_up_cooldown_s=30.0, scale_down_cooldown_s=60.0, max_step=2,
                       scale_down_margin=0.02, scale_down_ticks=3, profile=PROFILE)
NO_TREND = PlannerTuning(trend_ticks=1, rate_confidence_z=0.0)
"""Policy replays size for the current rate only; the trend and the rate's sampling error have their own."""


def observe(now_s: float, rate: float, prefill: int, prefill_starting: int = 0, decode: int = 1,
            output_tokens: int = 1, scale_up_s: float | None = None, ttft_p99_s: float | None = None,
            arrival_cv2: float = 1.0, prefix_hit_rate: float = 0.0) -> Observation:
    return Observation(now_s=now_s, window_s=10.0, arrival_rate=rate, arrival_cv2=arrival_cv2,
                       prefix_hit_rate=prefix_hit_rate,
                       prompt_lengths=LengthHistogram.of([100]), output_lengths=LengthHistogram.of([output_tokens]),
                       prefill=PoolObservation(prefill, starting=prefill_starting),
                       decode=PoolObservation(decode), scale_up_s=scale_up_s, ttft_p99_s=ttft_p99_s)


def prefill_outcome(decision: Decision) -> tuple[int, int, str]:
    """(target, change, reason prefix) of the prefill pool."""
    target = decision.prefill
    return target.replicas, target.change, target.reason.split(":")[0]


def replay(planner: Planner, observations: list[Observation]) -> list[tuple[int, int, str]]:
    return [prefill_outcome(planner.decide(observation)) for observation in observations]


# ---- replays: exact decisions -------------------------------------------------------------------------


def test_scale_up_is_bounded_then_waits_for_cooldown_until_exactly_its_expiry():
    got = replay(Planner(CONFIG, NO_TREND), [
        observe(10.0, 45.0, prefill=1),                       # needs 5: +max_step
        observe(20.0, 45.0, prefill=1, prefill_starting=2),   # 10 s after the change
        observe(39.9, 45.0, prefill=3),                       # 29.9 s: still cooling
        observe(40.0, 45.0, prefill=3),                       # 30 s: expired
        observe(50.0, 45.0, prefill=3, prefill_starting=2)])  # 5 provisioned: nothing more
    assert got == [(3, 2, "bounded_step"), (3, 0, "cooldown"), (3, 0, "cooldown"), (5, 2, "scale_up"),
                   (5, 0, "hold")]


def test_reason_names_the_numbers():
    """At 3 replicas: P(wait) = C(3, 2.5) = 0.702, wait tail rate (30 - 25) / 0.5 = 10/s, so the TTFT p99 is
    0.1 + ln(0.702 / 0.01) / 10 = 0.525 s."""
    planner = Planner(dataclasses.replace(CONFIG, scale_up_cooldown_s=0.0), NO_TREND)
    decision = planner.decide(observe(10.0, 25.0, prefill=1))
    assert decision.prefill.reason == (
        "scale_up: prefill 1 -> 3 for attainment 0.95; "
        "at 1: TTFT attainment 0.000, p99 inf s vs 1 s, utilisation 2.50 at 25 req/s; "
        "at 3: TTFT attainment 1.000, p99 0.525 s vs 1 s, utilisation 0.83 at 25 req/s")
    assert decision.decode.reason.startswith("at_min: decode at min_replicas 1; ITL attainment 1.000")


def test_starting_replicas_count_as_provisioned():
    planner = Planner(dataclasses.replace(CONFIG, scale_up_cooldown_s=0.0), NO_TREND)
    got = replay(planner, [
        observe(10.0, 45.0, prefill=1),
        observe(20.0, 45.0, prefill=1, prefill_starting=2),   # 3 provisioned: +2 more, not +4
        observe(30.0, 45.0, prefill=3, prefill_starting=2),   # 5 provisioned: hold, not +2
        observe(40.0, 45.0, prefill=5)])
    assert got == [(3, 2, "bounded_step"), (5, 2, "scale_up"), (5, 0, "hold"), (5, 0, "hold")]


def test_idle_pool_scales_to_min_after_hysteresis_and_one_bad_tick_resets_the_count():
    got = replay(Planner(CONFIG, NO_TREND), [
        observe(100.0, 0.0, prefill=5),    # held 1/3
        observe(110.0, 0.0, prefill=5),    # held 2/3
        observe(120.0, 45.0, prefill=5),   # 5 needed again: count resets
        observe(130.0, 0.0, prefill=5),    # 1/3
        observe(140.0, 0.0, prefill=5),    # 2/3
        observe(150.0, 0.0, prefill=5),    # 3/3, never changed: -max_step
        observe(160.0, 0.0, prefill=3),    # a change resets the count: 1/3
        observe(170.0, 0.0, prefill=3),    # 2/3
        observe(180.0, 0.0, prefill=3),    # 3/3 but 30 s < scale_down_cooldown_s 60
        observe(209.9, 0.0, prefill=3),    # 59.9 s
        observe(210.0, 0.0, prefill=3),    # 60 s: to min
        observe(220.0, 0.0, prefill=1)])
    assert got == [(5, 0, "hold"), (5, 0, "hold"), (5, 0, "hold"), (5, 0, "hold"), (5, 0, "hold"),
                   (3, -2, "bounded_step"), (3, 0, "hold"), (3, 0, "hold"), (3, 0, "cooldown"), (3, 0, "cooldown"),
                   (1, -2, "at_min"), (1, 0, "at_min")]


def test_margin_band_holds_a_pool_that_meets_the_target_but_not_target_plus_margin():
    """Bursty arrivals (cv^2 40) at 25 req/s: 5 replicas predict 0.958 (meets 0.95, not 0.97), 6 predict
    0.990. From 6 the pool holds however long it waits; from 5 it does not scale up either."""
    planner = Planner(CONFIG, NO_TREND)
    got = replay(planner, [observe(10.0 * tick, 25.0, prefill=6, arrival_cv2=40.0) for tick in range(1, 6)])
    assert got == [(6, 0, "hold")] * 5
    assert planner.decide(observe(60.0, 25.0, prefill=6, arrival_cv2=40.0)).prefill.reason.startswith(
        "hold: prefill 6: 5 meet 0.95, 6 meet 0.97; TTFT attainment 0.990")
    assert prefill_outcome(planner.decide(observe(70.0, 25.0, prefill=5, arrival_cv2=40.0))) == (5, 0, "hold")


def test_overload_beyond_max_replicas_steps_up_by_max_step_with_at_max():
    planner = Planner(CONFIG, NO_TREND)
    first = planner.decide(observe(10.0, 200.0, prefill=4))   # utilisation 2.0 even at max 10
    got = [prefill_outcome(first)] + replay(planner, [
        observe(20.0, 200.0, prefill=4, prefill_starting=2),
        observe(40.0, 200.0, prefill=6),
        observe(70.0, 200.0, prefill=8),
        observe(100.0, 200.0, prefill=10)])
    assert got == [(6, 2, "at_max"), (6, 0, "cooldown"), (8, 2, "at_max"), (10, 2, "at_max"), (10, 0, "at_max")]
    assert first.predicted.attainment == 0.0 and first.predicted.goodput_rps == 0.0
    assert first.predicted.ttft_p99_s == math.inf
    assert "nan" not in first.prefill.reason


def test_bounds_are_hard_past_cooldown_and_max_step():
    planner = Planner(dataclasses.replace(CONFIG, prefill=PoolBounds(2, 6)), NO_TREND)
    got = replay(planner, [
        observe(10.0, 5.0, prefill=9),    # above max (bounds changed): down to 6 at once
        observe(20.0, 5.0, prefill=1)])   # lost replicas below min while cooling: up to 2 at once
    assert got == [(6, -3, "at_max"), (2, 1, "at_min")]


def test_prefill_scale_down_keeps_the_prefix_hit_rate_that_carries_the_load():
    """Hit rate 0.5 seen on 5 replicas at 45 req/s: a 100-token prompt costs 0.05 s, so 3 replicas would do
    (utilisation 0.75) if the hit rate stayed; at 3 it is 0.5 * 3/5 = 0.3 (0.07 s: utilisation 1.05,
    overloaded) and at 4 it is 0.4 (0.06 s: utilisation 0.675). The pool steps down to 4, not 3."""
    got = replay(Planner(CONFIG, NO_TREND), [observe(10.0 * t, 45.0, prefill=5, prefix_hit_rate=0.5)
                                             for t in range(1, 4)])
    assert got == [(5, 0, "hold"), (5, 0, "hold"), (4, -1, "scale_down")]


def test_scale_down_needs_room_beyond_the_window_rate_sampling_error():
    """35 req/s over 10 s windows: 4 replicas carry the estimate (utilisation 0.875, P(wait > 0.9 s) ~ 1%),
    but not 2 standard errors above it (35 + 2 sqrt(3.5) = 38.7 req/s: utilisation 0.97); the default
    tuning keeps 5. Four times burstier than Poisson doubles the error: 35 + 4 sqrt(3.5) = 42.5 req/s."""
    observations = [observe(10.0 * t, 35.0, prefill=5) for t in range(1, 4)]
    assert replay(Planner(CONFIG, NO_TREND), observations)[-1] == (4, -1, "scale_down")
    assert replay(Planner(CONFIG, PlannerTuning(trend_ticks=1)), observations) == [(5, 0, "hold")] * 3
    bursty = [observe(10.0, 35.0, prefill=4, arrival_cv2=4.0)]
    assert replay(Planner(dataclasses.replace(CONFIG, scale_up_cooldown_s=0.0), PlannerTuning(trend_ticks=1)),
                  bursty) == [(5, 1, "scale_up")]
    assert rate_standard_error(35.0, 0.25, 10.0) == rate_standard_error(35.0, 1.0, 10.0) == math.sqrt(3.5)


def test_trend_plans_for_the_rate_when_the_next_scale_up_could_serve():
    """Rates 5 then 15 (window midpoints 5 s and 15 s), slope 1 req/s per s. At 20 s with scale_up_s 5 and a
    30 s cooldown, capacity asked for at the next chance serves from 55 s: the line says 55 req/s there,
    clamped to twice the current rate (30), plus 2 standard errors (2 sqrt(3) = 3.46): 4 replicas wanted,
    3 reached within max_step. Without the trend and the error margin: 15 req/s, 2 replicas."""
    windows = [observe(10.0, 5.0, prefill=1), observe(20.0, 15.0, prefill=1, scale_up_s=5.0)]
    assert replay(Planner(CONFIG), windows) == [(1, 0, "at_min"), (3, 2, "bounded_step")]
    planner = Planner(CONFIG)
    planner.decide(windows[0])
    assert planner.decide(windows[1]).prefill.reason.startswith(
        "bounded_step: prefill 1 -> 3 toward 4 (max_step 2); at 1: TTFT attainment 0.000, p99 inf s vs 1 s, "
        "utilisation 3.35 at 33.5 req/s")
    assert replay(Planner(CONFIG, NO_TREND), windows) == [(1, 0, "at_min"), (2, 1, "scale_up")]
    assert planning_rate(((5.0, 5.0), (15.0, 15.0)), 55.0, max_factor=2.0) == 30.0
    assert planning_rate(((5.0, 5.0), (15.0, 15.0)), 25.0, max_factor=2.0) == 25.0


def test_decode_pool_sized_by_batch_capacity():
    """Decode steps cost 10 ms + 0.1 ms per request (batch limit 256: 7191 request-steps/s per replica);
    100 steps per request at 100 req/s need 10,000/s: 2 replicas."""
    profile = dataclasses.replace(PROFILE, prefill_s_per_token=1e-5, decode_s_per_request=1e-4)
    planner = Planner(dataclasses.replace(CONFIG, profile=profile, decode=PoolBounds(1, 8)), NO_TREND)
    decision = planner.decide(observe(10.0, 100.0, prefill=1, output_tokens=101))
    assert (decision.prefill.replicas, decision.decode.replicas, decision.decode.change) == (1, 2, 1)
    assert decision.decode.reason.startswith("scale_up: decode 1 -> 2 for attainment 0.95; at 1: ITL attainment 0.000")
    assert decision.predicted.decode_replicas == 2 and decision.predicted.itl_p99_s < CONFIG.itl_s


def test_feedback_correction_moves_a_bounded_step_toward_observed_latency():
    planner = Planner(CONFIG, NO_TREND)
    model = PerformanceModel.from_profile(PROFILE)
    predicted = PrefillPool(PrefillWorkload.build(45.0, 1.0, LengthHistogram.of([100]), 0.0, model),
                            1.0).ttft_quantile_s(5)
    decision = planner.decide(observe(10.0, 45.0, prefill=5, ttft_p99_s=2 * predicted))
    assert planner.state.correction.ttft == pytest.approx(2 ** 0.3, rel=1e-9)
    assert decision.predicted.ttft_p99_s == pytest.approx(predicted * 2 ** 0.3, rel=1e-9)
    for tick in range(2, 30):
        planner.decide(observe(10.0 * tick, 45.0, prefill=5, ttft_p99_s=10 * predicted))
    assert planner.state.correction.ttft == pytest.approx(2.0, rel=1e-12)  # max_correction
    assert planner.state.correction.itl == 1.0  # nothing observed


def test_every_reason_starts_with_a_known_word():
    planner = Planner(CONFIG)
    for tick, rate in enumerate([0.0, 45.0, 200.0, 5.0, 0.0, 0.0, 0.0, 0.0], start=1):
        decision = planner.decide(observe(10.0 * tick, rate, prefill=3))
        for target in (decision.prefill, decision.decode):
            assert target.reason.split(":")[0] in REASONS, target.reason


def test_a_thousand_replica_pool_steps_by_max_step_toward_its_target():
    """(How long decide() takes at this size is measured by bench/planner.py, not asserted here.)"""
    rng = random.Random(7)
    profile = PerformanceProfile(0.01, 2e-4, 0.0, 0.01, 2e-4, 1e-7)
    config = dataclasses.replace(CONFIG, prefill=PoolBounds(1, 1000), decode=PoolBounds(1, 1000), profile=profile)
    observation = Observation(
        now_s=10.0, window_s=10.0, arrival_rate=2000.0, arrival_cv2=100.0,
        prompt_lengths=LengthHistogram.of([rng.randint(10, 4000) for _ in range(5000)]),
        output_lengths=LengthHistogram.of([rng.randint(1, 500) for _ in range(5000)]),
        prefill=PoolObservation(500), decode=PoolObservation(500, kv_capacity_tokens=2_000_000),
        prefix_hit_rate=0.3, transfer_s_p50=0.01)
    decision = Planner(config).decide(observation)
    assert prefill_outcome(decision) == (502, 2, "bounded_step")


_TICK = st.tuples(st.sampled_from([0.0, 0.5, 5.0, 45.0, 300.0, 1e6]), st.sampled_from([0.0, 1.0, 30.0]),
                  st.integers(0, 14), st.integers(0, 3), st.integers(0, 6), st.sampled_from([1, 2, 50, 4000]),
                  st.sampled_from([0, 1000, 10**6]))


@settings(max_examples=150, deadline=None)
@given(st.lists(_TICK, min_size=1, max_size=10), st.integers(0, 2), st.integers(2, 12))
def test_any_replay_keeps_bounds_steps_cooldowns_and_finite_numbers(ticks, low, high):
    """Whatever the traffic and whatever the pools report: targets within bounds, steps within max_step
    and no change inside its cooldown (for pools inside their bounds), no NaN anywhere."""
    config = dataclasses.replace(CONFIG, prefill=PoolBounds(low, high), decode=PoolBounds(low, high),
                                 profile=dataclasses.replace(PROFILE, decode_s_per_request=1e-4))
    planner, last_change = Planner(config), {"prefill": -math.inf, "decode": -math.inf}
    for index, (rate, cv2, prefill, starting, decode, output, kv) in enumerate(ticks):
        now = 10.0 * (index + 1)
        observation = dataclasses.replace(
            observe(now, rate, prefill, starting, decode, output_tokens=output, arrival_cv2=cv2),
            decode=PoolObservation(decode, kv_capacity_tokens=kv))
        decision = planner.decide(observation)
        predicted = decision.predicted
        assert 0.0 <= predicted.attainment <= 1.0 and predicted.goodput_rps >= 0.0
        assert not math.isnan(predicted.ttft_p99_s) and not math.isnan(predicted.itl_p99_s)
        assert 0 <= decision.local_prefill_threshold <= PROFILE.prefill_token_budget
        for target, current in ((decision.prefill, prefill + starting), (decision.decode, decode)):
            assert low <= target.replicas <= high and target.change == target.replicas - current
            assert target.reason.split(":")[0] in REASONS and "nan" not in target.reason
            if low <= current <= high and target.change:
                cooldown = config.scale_up_cooldown_s if target.change > 0 else config.scale_down_cooldown_s
                assert abs(target.change) <= config.max_step
                assert now - last_change[target.role.value] >= cooldown
            if target.change:
                last_change[target.role.value] = now


# ---- search, trend, threshold ---------------------------------------------------------------------------


def _monotone(rng: random.Random, size: int) -> list[float]:
    values = sorted(rng.choice([0.0, 1.0, rng.random()]) for _ in range(size))
    return values


@pytest.mark.parametrize("seed", range(40))
def test_fewest_devices_matches_brute_force(seed):
    rng = random.Random(seed)
    prefill, decode = _monotone(rng, 13), _monotone(rng, 11)
    bounds = (PoolBounds(rng.randint(0, 3), 12), PoolBounds(rng.randint(0, 3), 10))
    target, current = rng.choice([0.3, 0.5, 0.9]), Allocation(rng.randint(0, 12), rng.randint(0, 10))
    feasible = [(p + d, abs(p - current.prefill) + abs(d - current.decode), p, d)
                for p in range(bounds[0].min_replicas, 13) for d in range(bounds[1].min_replicas, 11)
                if prefill[p] * decode[d] >= target]
    expected = Allocation(*min(feasible)[2:]) if feasible else None
    assert fewest_devices(prefill.__getitem__, decode.__getitem__, bounds, target, current) == expected


def test_planning_rate_follows_the_line_within_its_clamps():
    assert planning_rate(((5.0, 10.0), (15.0, 20.0)), 30.0, 2.0) == 35.0      # 15 + 1/s * 20 s
    assert planning_rate(((5.0, 10.0), (15.0, 20.0)), 60.0, 2.0) == 40.0      # capped at 2 x 20
    assert planning_rate(((5.0, 20.0), (15.0, 10.0)), 30.0, 2.0) == 10.0      # falling: never below now
    assert planning_rate(((15.0, 12.0),), 30.0, 2.0) == 12.0                  # one point: no trend


def test_planning_rate_ignores_a_slope_within_the_windows_noise():
    """Six windows around 13 req/s (variance 1.3 each over 10 s): least-squares slope 0.06/s, whose standard
    error is sqrt(1.3 / 1750) = 0.027/s (2.2 of them). At z = 2 the slope counts (13 + 0.06 * 70 = 17.2 at
    100 s); at z = 3 the line is flat at the mean, 13, and the plan is the current rate, 14.5."""
    history = tuple((5.0 + 10 * i, rate) for i, rate in enumerate((11.5, 12.0, 13.0, 13.0, 14.0, 14.5)))
    assert planning_rate(history, 100.0, 2.0, 1.3, significance_z=2.0) == pytest.approx(17.2)
    assert planning_rate(history, 100.0, 2.0, 1.3, significance_z=3.0) == 14.5
    assert planning_rate(history, 100.0, 2.0, 1.3) == planning_rate(history, 100.0, 2.0)


def test_local_prefill_threshold_keeps_the_step_within_the_itl_target():
    """Idle decode pool: p99 step = 10 ms + 0.1 ms; 50 ms target leaves 39.9 ms = 39 tokens at 1 ms each."""
    model = PerformanceModel.from_profile(dataclasses.replace(PROFILE, decode_s_per_request=1e-4))
    workload = DecodeWorkload.build(0.0, LengthHistogram.of([50]), LengthHistogram.of([100]), 0.0, 0, model)
    pool = DecodePool(workload, 0.05)
    assert local_prefill_threshold(model, pool, 1, 0.05, 1.0) == 39
    assert local_prefill_threshold(model, pool, 1, 0.05, 2.0) == 19       # latencies corrected x2: 79.8 ms
    assert local_prefill_threshold(model, pool, 1, 0.0101, 1.0) == 0      # no slack
    assert local_prefill_threshold(model, pool, 1, 10.0, 1.0) == 2048     # everything fits: the token budget


# ---- queueing formulas ---------------------------------------------------------------------------------


def _erlang_c_by_recurrence(servers: int, load: float) -> float:
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = load * blocking / (k + load * blocking)
    return blocking / (1 - load / servers * (1 - blocking))


def test_erlang_c_hand_values_and_large_pools():
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3, rel=1e-12)              # (1/2 * 2) / (1 + 1 + 1)
    assert erlang_c(3, 2.5) == pytest.approx(15.625 / 22.25, rel=1e-12)     # 2.5^3/3! * 3/0.5 over 6.625 + that
    assert erlang_c(1, 0.8) == pytest.approx(0.8, rel=1e-12)                # M/M/1: P(wait) = rho
    assert erlang_c(1000, 950.0) == pytest.approx(_erlang_c_by_recurrence(1000, 950.0), rel=1e-9)
    assert (erlang_c(4, 0.0), erlang_c(4, 4.0), erlang_c(4, 9.0), erlang_c(0, 1.0)) == (0.0, 1.0, 1.0, 1.0)


def test_mean_waits():
    assert allen_cunneen_wait_s(1, 8.0, 0.1, 1.0, 1.0) == pytest.approx(0.8 / (10 - 8), rel=1e-12)  # M/M/1
    assert allen_cunneen_wait_s(2, 1.0, 1.0, 1.0, 1.0) == pytest.approx(1 / 3, rel=1e-12)           # C / (c mu - l)
    assert allen_cunneen_wait_s(1, 8.0, 0.1, 1.0, 0.0) == pytest.approx(0.2, rel=1e-12)             # M/D/1: half
    assert allen_cunneen_wait_s(1, 10.0, 0.1, 1.0, 1.0) == math.inf


def _prefill_pool(rate: float, lengths: list[int], target_s: float = 1.0, cv2: float = 1.0) -> PrefillPool:
    model = PerformanceModel.from_profile(PROFILE)
    return PrefillPool(PrefillWorkload.build(rate, cv2, LengthHistogram.of(lengths), 0.0, model), target_s)


def test_prefill_ttft_tail_by_hand():
    """One 0.1 s prompt, Poisson arrivals at 5/s, 1 replica: P(wait) = 0.5, conditional wait rate
    (10 - 5) / ((1 + 0) / 2) = 10/s, so P(TTFT > t) = 0.5 exp(-10 (t - 0.1))."""
    pool = _prefill_pool(5.0, [100])
    assert pool.attainment(1) == pytest.approx(1 - 0.5 * math.exp(-9.0), rel=1e-12)
    assert pool.ttft_quantile_s(1) == pytest.approx(0.1 + math.log(50) / 10, rel=1e-9)
    assert pool.forecast(1).mean_wait_s == pytest.approx(0.5 / 5 * 0.5, rel=1e-12)


def test_prefill_mixture_and_bursts():
    """Prompts of 100 and 2000 tokens (0.1 s and 2.0 s of prefill): the long half misses a 1 s target
    whatever the pool; burstier arrivals lower attainment at the same utilisation."""
    mixed = _prefill_pool(1.0, [100, 2000])
    assert mixed.attainment(100) == pytest.approx(0.5, rel=1e-9)
    assert mixed.workload.service_cv2 == pytest.approx((0.95 ** 2) / (1.05 ** 2), rel=1e-12)
    assert _prefill_pool(25.0, [100], cv2=8.0).attainment(3) < _prefill_pool(25.0, [100], cv2=1.0).attainment(3)


def test_prefill_overload_is_zero_and_infinite_never_nan():
    pool = _prefill_pool(10.0, [100])   # utilisation exactly 1 on one replica
    forecast = pool.forecast(1)
    assert (forecast.utilisation, forecast.ttft_attainment, forecast.ttft_p99_s, forecast.mean_wait_s) == (
        1.0, 0.0, math.inf, math.inf)
    assert (pool.attainment(0), pool.utilisation(0)) == (0.0, math.inf)
    idle = _prefill_pool(0.0, [100])
    assert (idle.attainment(0), idle.forecast(2).mean_wait_s, idle.ttft_quantile_s(2)) == (1.0, 0.0, 0.1)


def _decode_pool(rate: float, itl_target_s: float, kv_capacity_tokens: int = 0, transfer_s: float = 0.0,
                 outputs: tuple[int, ...] = (101,)) -> DecodePool:
    model = PerformanceModel.from_profile(dataclasses.replace(PROFILE, decode_s_per_request=1e-4))
    workload = DecodeWorkload.build(rate, LengthHistogram.of(list(outputs)), LengthHistogram.of([100]), transfer_s,
                                    kv_capacity_tokens, model)
    return DecodePool(workload, itl_target_s)


def _poisson_cdf(mean: float, upto: int) -> float:
    return sum(math.exp(-mean) * mean ** k / math.factorial(k) for k in range(upto + 1))


def test_prefix_hit_rate_scales_with_replicas_below_the_observed_count_only():
    model = PerformanceModel.from_profile(PROFILE)

    def pool_at(hit_rate: float) -> PrefillPool:
        return PrefillPool(PrefillWorkload.build(45.0, 1.0, LengthHistogram.of([100]), hit_rate, model), 1.0)

    pools = PrefixScaledPrefillPool(pool_at, observed_hit_rate=0.5, observed_replicas=5)
    assert [pools.hit_rate(n) for n in range(8)] == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.5, 0.5]
    assert pools.utilisation(3) == pytest.approx(45 * 0.07 / 3) and pools.attainment(3) == 0.0
    assert pools.attainment(4) == pool_at(0.4).attainment(4)
    assert pools.forecast(6) == pool_at(0.5).forecast(6)
    assert pools.workload.arrival_rate == 45.0
    assert PrefixScaledPrefillPool(pool_at, 0.5, observed_replicas=0).hit_rate(3) == 0.5  # nothing observed


def test_decode_batch_fixed_point_and_poisson_tail_by_hand():
    """10 req/s x 100 steps on 1 replica: u = 1000/s, b = u 0.01 / (1 - u 0.0001) = 11.11.
    Target 11.25 ms allows a batch of 12 = 1 + Poisson(b) <= 12."""
    pool = _decode_pool(10.0, 0.01125)
    assert pool.mean_batch(1) == pytest.approx(10 / 0.9, rel=1e-12)
    assert pool.utilisation(1) == pytest.approx(1000 * 0.0356 / 256, rel=1e-12)
    assert pool.attainment(1) == pytest.approx(_poisson_cdf(10 / 0.9, 11), rel=1e-9)
    p99_batch = next(k for k in range(1, 257) if _poisson_cdf(10 / 0.9, k - 1) >= 0.99)
    assert pool.itl_quantile_s(1) == pytest.approx(0.01 + 1e-4 * p99_batch, rel=1e-12)


def test_decode_transfer_short_outputs_and_kv_limit():
    """A 0.2 s transfer spread over 4 later tokens adds 50 ms to TPOT: with 10 ms steps a 55 ms target is
    missed at any batch, while the 1-token half has no TPOT. A KV pool of 1000 tokens holds 6 running
    contexts of 100 + 50.5 tokens."""
    pool = _decode_pool(0.001, 0.055, transfer_s=0.2, outputs=(1, 5))
    assert pool.workload.tpot_weights.tolist() == [0.5]
    assert pool.attainment(1) == pytest.approx(0.5, rel=1e-12)
    assert _decode_pool(10.0, 0.05, kv_capacity_tokens=1000).workload.batch_limit == 6   # 1000 // (100 + 50.5)


def test_decode_overload_is_zero_and_infinite_never_nan():
    pool = _decode_pool(100.0, 0.05)   # 10,000 request-steps/s > 7191 per replica
    forecast = pool.forecast(1)
    assert (forecast.itl_attainment, forecast.itl_p99_s, forecast.mean_batch) == (0.0, math.inf, math.inf)
    assert forecast.utilisation == pytest.approx(10_000 * 0.0356 / 256, rel=1e-12)
    assert (pool.attainment(0), pool.utilisation(0)) == (0.0, math.inf)
    no_kv = _decode_pool(1.0, 0.05, kv_capacity_tokens=100)   # one context does not fit
    assert (no_kv.workload.batch_limit, no_kv.attainment(5), no_kv.itl_quantile_s(5)) == (0, 0.0, math.inf)
    assert _decode_pool(0.0, 0.05).attainment(0) == 1.0


# ---- performance model ---------------------------------------------------------------------------------

TRUE_PREFILL = (0.003, 0.00025, 1e-8)


def _prefill_samples(count: int, coefficients: tuple[float, float, float], seed: int = 0) -> list[PrefillStepSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        tokens = rng.randint(1, 2048)
        samples.append(PrefillStepSample(tokens, coefficients[0] + coefficients[1] * tokens
                                         + coefficients[2] * tokens * tokens))
    return samples


def test_fit_recovers_known_coefficients():
    nearly_no_prior = PerformanceModel.from_profile(PROFILE, FitConfig(prior_weight=1e-9))
    fitted = nearly_no_prior.update(_prefill_samples(500, TRUE_PREFILL), ())
    assert fitted.prefill.coefficients == pytest.approx(TRUE_PREFILL, rel=1e-6)
    with_prior = PerformanceModel.from_profile(PROFILE).update(_prefill_samples(5000, TRUE_PREFILL), ())
    assert with_prior.prefill.coefficients == pytest.approx(TRUE_PREFILL, rel=0.02)   # the prior weighs 20 of 5000
    decode_truth = (0.008, 3e-4, 2e-7)
    rng = random.Random(1)
    batches = [rng.randint(1, 256) for _ in range(400)]
    steps = [DecodeStepSample(b, b * rng.randint(10, 4000), 0.0) for b in batches]
    steps = [dataclasses.replace(s, seconds=decode_truth[0] + decode_truth[1] * s.batch_size
                                 + decode_truth[2] * s.context_tokens) for s in steps]
    assert nearly_no_prior.update((), steps).decode.coefficients == pytest.approx(decode_truth, rel=1e-6)


def test_fit_is_the_map_estimate_and_the_prior_dominates_few_samples():
    """Three samples 10x slower than the profile: the fit is exactly the documented least squares (sample
    rows, the same rows weighted W/N toward the profile, a small ridge), and the predicted full-budget step
    moves N / (N + W) = 3/23 of the way (to 1e-3: the ridge holds a little more)."""
    model = PerformanceModel.from_profile(dataclasses.replace(PROFILE, prefill_fixed_s=0.002))
    samples = _prefill_samples(3, (0.02, 0.01, 0.0))
    fitted = model.update(samples, ())
    scales, prior = np.array(model.prefill.scales), np.array(model.prefill.prior) * np.array(model.prefill.scales)
    rows = prefill_features([s.num_tokens for s in samples]) / scales
    weight = model.fit.prior_weight
    ridge = math.sqrt(UNEXCITED_SHARE * weight)
    design = np.vstack([rows, math.sqrt(weight / 3) * rows, ridge * np.eye(3)])
    target = np.concatenate([[s.seconds for s in samples], math.sqrt(weight / 3) * rows @ prior, ridge * prior])
    expected = np.linalg.lstsq(design, target, rcond=None)[0] / scales
    assert fitted.prefill.coefficients == pytest.approx(expected.tolist(), rel=1e-9)
    prior_s, sample_s = 0.002 + 0.001 * 2048, 0.02 + 0.01 * 2048
    moved = (fitted.prompt_seconds(np.array([2048.0]))[0] - prior_s) / (sample_s - prior_s)
    assert moved == pytest.approx(3 / 23, abs=1e-3)


def test_fit_keeps_coefficients_nonnegative():
    """Steps that get faster with more tokens: the per-token terms pin at exactly 0, not below."""
    samples = [PrefillStepSample(n, 0.05 - 1e-5 * n) for n in range(10, 2000, 10)]
    fitted = PerformanceModel.from_profile(PROFILE, FitConfig(prior_weight=1e-6)).update(samples, ())
    assert fitted.prefill.coefficients[1:] == (0.0, 0.0)
    assert fitted.prefill.coefficients[0] == pytest.approx(np.mean([s.seconds for s in samples]), rel=1e-6)


def test_nonnegative_quadratic_picks_the_constrained_optimum():
    """Unconstrained optimum (1, -1): c1 pins at 0, then 3 c0 = 1 on that face."""
    hessian = np.array([[3.0, 1.0], [1.0, 3.0]])
    assert nonnegative_quadratic(hessian, hessian @ np.array([1.0, -1.0])).tolist() == pytest.approx([2 / 3, 0.0])


def test_forgetting_follows_a_drifting_worker_and_an_empty_window_changes_nothing():
    model = PerformanceModel.from_profile(PROFILE, FitConfig(prior_weight=1e-6, forgetting=0.5))
    model = model.update(_prefill_samples(200, (0.01, 0.001, 0.0)), ())
    for seed in range(30):
        model = model.update(_prefill_samples(200, TRUE_PREFILL, seed), ())
    assert model.prefill.coefficients == pytest.approx(TRUE_PREFILL, rel=1e-3)
    assert model.update((), ()) == model
    again = PerformanceModel.from_profile(PROFILE).update(_prefill_samples(50, TRUE_PREFILL), ())
    assert again == PerformanceModel.from_profile(PROFILE).update(_prefill_samples(50, TRUE_PREFILL), ())


def test_seeded_fit_is_the_profile():
    model = PerformanceModel.from_profile(PROFILE)
    assert model.as_profile() == PROFILE
    assert model.prompt_seconds(np.array([100.0, 4096.0])).tolist() == pytest.approx([0.1, 4.096])
    assert LinearFit.seeded((1.0, 2.0), (1.0, 1.0)).seconds(np.array([1.0, 3.0])) == 7.0


# ---- impossible observations are refused by name ---------------------------------------------------------

@pytest.mark.parametrize(("change", "message"), [
    ({"arrival_rate": math.inf}, "arrival_rate must be a finite number >= 0, got inf"),
    ({"arrival_cv2": math.inf}, "arrival_cv2 must be a finite number >= 0, got inf"),
    ({"arrival_cv2": math.nan}, "arrival_cv2 must be a finite number >= 0, got nan"),
    ({"now_s": math.nan}, "now_s must be finite, got nan"),
    ({"window_s": math.inf}, "window_s must be a finite number > 0, got inf"),
    ({"transfer_s_p50": -1.0}, "transfer_s_p50 must be a finite number >= 0, got -1.0"),
    ({"local_prefill_share": 2.0}, "local_prefill_share must be in [0, 1], got 2.0"),
    ({"ttft_attainment": 1.5}, "ttft_attainment must be in [0, 1], got 1.5"),
    ({"itl_attainment": -0.1}, "itl_attainment must be in [0, 1], got -0.1"),
    ({"ttft_p99_s": math.nan}, "ttft_p99_s must be a finite number >= 0, got nan"),
    ({"itl_p99_s": -1.0}, "itl_p99_s must be a finite number >= 0, got -1.0"),
    ({"scale_up_s": -5.0}, "scale_up_s must be a finite number >= 0, got -5.0"),
])
def test_an_impossible_observation_is_refused_naming_the_field(change, message):
    """Before, infinities, NaNs and out-of-range fractions reached decide(): cv² = inf raised ZeroDivisionError,
    a NaN TTFT p99 blamed 'ttft_target_s and latency_scale', the rest silently produced decisions."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        dataclasses.replace(observe(100.0, rate=5.0, prefill=1), **change)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: PoolObservation(-1), "a pool's replicas must be >= 0, got -1"),
    (lambda: PoolObservation(1, starting=-2), "a pool's starting must be >= 0, got -2"),
    (lambda: PoolObservation(1, queue_depth=-3), "a pool's queue_depth must be >= 0, got -3"),
    (lambda: PoolObservation(1, kv_capacity_tokens=-1), "a pool's kv_capacity_tokens must be >= 0, got -1"),
    (lambda: PoolObservation(1, queue_time_p99_s=math.inf), "a pool's queue_time_p99_s must be a finite number >= 0, got inf"),
    (lambda: PoolObservation(1, kv_usage=2.0), "a pool's kv_usage must be in [0, 1], got 2.0"),
    (lambda: PrefillStepSample(0, 0.1), "a prefill step sample needs num_tokens >= 1, got 0"),
    (lambda: PrefillStepSample(100, -0.1), "a prefill step sample's seconds must be a finite number >= 0, got -0.1"),
    (lambda: DecodeStepSample(-1, 100, 0.01),
     "a decode step sample needs batch_size and context_tokens >= 0, got -1, 100"),
    (lambda: DecodeStepSample(4, 100, math.nan), "a decode step sample's seconds must be a finite number >= 0, got nan"),
])
def test_an_impossible_pool_or_step_sample_is_refused_naming_the_field(build, message):
    """Before, a pool of -1 replicas was planned for ('scale_up: prefill -1 -> 1') and negative step times fed the fit."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        build()


def test_an_observation_earlier_than_the_previous_one_is_refused():
    """Before, a tick at 50 s after one at 100 s was decided with 'changed -50 s ago' cooldowns."""
    planner = Planner(CONFIG, NO_TREND)
    assert prefill_outcome(planner.decide(observe(100.0, rate=25.0, prefill=1))) == (3, 2, "scale_up")
    assert prefill_outcome(planner.decide(observe(100.0, rate=25.0, prefill=3))) == (3, 0, "hold")  # same time: fine
    with pytest.raises(ValueError, match=r"^now_s 50\.0 is before the previous observation's 100\.0 "
                                         r"\(observations must come in time order\)$"):
        planner.decide(observe(50.0, rate=25.0, prefill=3))
