"""planner/sim: traces, the cluster model's exact timings, routing, scaling, and the baselines.

Timings are worked out by hand from HAND_PROFILE (see each test's comments) and compared to 1e-9
relative; trace statistics against stated tolerances (a Poisson count of n has sd sqrt(n))."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from operator import attrgetter

import numpy as np
import pytest

from splitserve.planner.core.types import (Decision, LengthHistogram, Observation, PerformanceProfile, PlannerConfig,
                                           PoolBounds, PoolObservation, Role)
from splitserve.planner.sim.balance import LeastLoaded
from splitserve.planner.sim.cluster import Simulator, run_local
from splitserve.planner.sim.config import SimulatedCluster
from splitserve.planner.sim.device import steps_duration, steps_to_reach, steps_within
from splitserve.planner.samples import gap_cv2
from splitserve.planner.sim.observe import length_histogram
from splitserve.planner.sim.policies import DynamoLikePolicy, RayServeLikePolicy, StaticPolicy, decision, pool_target
from splitserve.planner.sim.report import write_json
from splitserve.planner.sim.runner import share
from splitserve.planner.sim.scenario import BENCH_WORKLOAD, Scale, run_simulation
from splitserve.planner.sim.traces import (NO_PREFIX, LengthDistribution, Trace, Workload, gamma_arrivals,
                                           make_trace, mmpp_arrivals, poisson_arrivals)
from splitserve.planner.sim.workers import PrefillWorker, WorkerState

HAND_PROFILE = PerformanceProfile(prefill_fixed_s=0.01, prefill_s_per_token=0.001, prefill_s_per_token2=0.0,
                                  decode_fixed_s=0.02, decode_s_per_request=0.005, decode_s_per_context_token=0.0001,
                                  max_batch_size=4, prefill_token_budget=512)
"""prefill step = 0.01 + 0.001 n; decode step = 0.02 + 0.005 batch + 0.0001 context."""
HAND = SimulatedCluster(profile=HAND_PROFILE, ttft_s=1.0, tpot_s=0.05, kv_bytes_per_token=1000,
                     transfer_bytes_per_s=1e6, transfer_latency_s=0.002, decode_kv_tokens=10_000,
                     prefix_cache_groups=1)
"""KV transfer = 0.002 + 0.001 s per prompt token."""


def exact(value: float):
    return pytest.approx(value, rel=1e-9, abs=1e-12)


def trace_of(rows: list[tuple], duration_s: float = 20.0) -> Trace:
    """rows: (arrival_s, prompt_tokens, output_tokens[, prefix_group, shared_tokens])."""
    full = [(*row, NO_PREFIX, 0) if len(row) == 3 else row for row in rows]
    columns = list(zip(*full))
    return Trace("hand", duration_s, np.array(columns[0], dtype=np.float64),
                 *(np.array(c, dtype=np.int64) for c in columns[1:]))


@dataclass
class Scripted:
    """Replica targets by tick time (held otherwise); records every observation it is given."""

    prefill: int
    decode: int
    changes: dict[float, tuple[int, int, int]] = field(default_factory=dict)
    """now_s -> (prefill, decode, local_prefill_threshold) from then on."""
    threshold: int = 0
    seen: list[Observation] = field(default_factory=list)

    def decide(self, observation: Observation) -> Decision:
        self.seen.append(observation)
        if observation.now_s in self.changes:
            self.prefill, self.decode, self.threshold = self.changes[observation.now_s]
        made = decision(observation, pool_target(Role.PREFILL, observation.prefill, self.prefill, "script"),
                        pool_target(Role.DECODE, observation.decode, self.decode, "script"))
        return replace(made, local_prefill_threshold=self.threshold)


@dataclass(frozen=True)
class HandRun:
    """A finished simulation: the simulator (its pools and request table) and the result."""

    simulator: Simulator
    result: object

    @property
    def requests(self):
        return self.simulator.requests

    @property
    def prefill(self):
        return self.simulator.prefill

    @property
    def decode(self):
        return self.simulator.decode


def simulate_hand(rows: list[tuple], policy: Scripted | None = None, config: SimulatedCluster = HAND,
                  duration_s: float = 20.0) -> HandRun:
    policy = policy or Scripted(config.initial_prefill, config.initial_decode)
    simulator, run = run_local(config, trace_of(rows, duration_s), policy, "scripted")
    return HandRun(simulator, run.result)


# ---- traces ---------------------------------------------------------------------------------------------

def test_same_seed_same_trace_and_another_seed_differs():
    a, b = make_trace("multitenant", 20.0, 300.0, 7), make_trace("multitenant", 20.0, 300.0, 7)
    for name in ("arrival_s", "prompt_tokens", "output_tokens", "prefix_group", "shared_tokens"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.arrival_s[:100], make_trace("multitenant", 20.0, 300.0, 8).arrival_s[:100])
    assert not a.arrival_s.flags.writeable


@pytest.mark.parametrize(("peak_rate", "duration_s", "seed", "message"), [
    (20.0, math.inf, 0, "duration_s must be a finite number > 0, got inf"),
    (20.0, math.nan, 0, "duration_s must be a finite number > 0, got nan"),
    (20.0, 0.0, 0, "duration_s must be a finite number > 0, got 0.0"),
    (math.inf, 60.0, 0, "peak_rate must be a finite number > 0, got inf"),
    (20.0, 60.0, -1, "seed must be >= 0, got -1"),
])
def test_a_trace_that_cannot_be_drawn_is_refused_naming_the_argument(peak_rate, duration_s, seed, message):
    """Before, `splitserve simulate --duration inf` drew arrivals forever, --duration nan blamed
    'peak_rate > 0 and duration_s > 0' together, and --seed -1 surfaced numpy's 'expected non-negative integer'."""
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make_trace("poisson", peak_rate, duration_s, seed)


def test_a_simulation_whose_trace_drew_no_request_is_refused():
    """Before, `splitserve simulate --devices 2 --duration 0.01` printed attainment 1.000 and TTFT p99 'nans'."""
    with pytest.raises(ValueError, match=r"^the poisson trace drew no request in 0\.01 s at up to 1\.62 req/s; "
                                         r"simulate a longer duration$"):
        run_simulation("poisson", 2, "planner", 0, 0.01)


def test_poisson_rate_and_cv2_within_tolerance():
    """100,000 expected arrivals: the count's sd is 316 (0.3%); we allow 1%. The sample cv^2 of
    100,000 exponential gaps has sd ~0.009; we allow 0.03."""
    arrivals = poisson_arrivals(np.random.default_rng(1), 50.0, 2000.0)
    assert abs(len(arrivals) / 2000.0 - 50.0) < 0.5
    assert abs(gap_cv2(arrivals) - 1.0) < 0.03
    assert arrivals[0] >= 0 and arrivals[-1] < 2000.0 and np.all(np.diff(arrivals) >= 0)


def test_gamma_arrivals_are_bursty_at_the_asked_rate():
    """Gamma gaps of shape 1/4: cv^2 4 (heavier-tailed sample variance: allow 10%), rate within 2%."""
    arrivals = gamma_arrivals(np.random.default_rng(2), 50.0, 4.0, 2000.0)
    assert abs(len(arrivals) / 2000.0 - 50.0) < 1.0
    assert 3.6 < gap_cv2(arrivals) < 4.4


def test_mmpp_alternates_rates_and_is_bursty():
    arrivals = mmpp_arrivals(np.random.default_rng(3), (10.0, 40.0), (100.0, 100.0), 1.0, 4000.0)
    per_window = np.bincount((arrivals // 50).astype(int), minlength=80)
    assert per_window.min() < 50 * 15 and per_window.max() > 50 * 35
    assert gap_cv2(arrivals) > 1.3
    assert 15.0 < len(arrivals) / 4000.0 < 35.0


def test_diurnal_trough_at_the_ends_and_peak_in_the_middle():
    """Peak 40/s, trough 25%: the first and last 5% of the trace average ~10.3/s, the middle 5% ~40/s."""
    trace = make_trace("diurnal", 40.0, 2000.0, 4)
    counts = np.histogram(trace.arrival_s, bins=20, range=(0.0, 2000.0))[0] / 100.0
    assert counts[0] < 13 and counts[-1] < 13
    assert 36 < counts[9] < 44 and 36 < counts[10] < 44


def test_multitenant_prompts_start_with_their_tenants_shared_prefix():
    trace = make_trace("multitenant", 30.0, 600.0, 5)
    assert np.all(trace.prefix_group >= 0) and np.all(trace.shared_tokens < trace.prompt_tokens)
    for group in np.unique(trace.prefix_group):
        assert len(np.unique(trace.shared_tokens[trace.prefix_group == group])) == 1
    counts = np.bincount(trace.prefix_group)
    assert counts[0] == counts.max()  # Zipf: tenant 0 is the most popular
    assert trace.request(0).prefix_group == int(trace.prefix_group[0])


def test_lengths_are_clipped_to_their_range():
    lengths = LengthDistribution(100.0, 2.0, 10, 300).sample(np.random.default_rng(6), 10_000)
    assert lengths.min() == 10 and lengths.max() == 300


def test_trace_rejects_a_shared_prefix_as_long_as_the_prompt():
    with pytest.raises(ValueError, match="shared_tokens"):
        trace_of([(0.0, 100, 2, 3, 100)])


# ---- the device model's closed forms ---------------------------------------------------------------------

@pytest.mark.parametrize("first, growth, elapsed", [(0.01, 0.0, 0.1), (0.0351, 0.0002, 1.0), (0.02, 0.001, 0.0199),
                                                    (0.02, 0.001, 0.02), (0.5, 0.25, 10.0)])
def test_closed_form_step_counts_match_a_step_by_step_count(first, growth, elapsed):
    """Steps first, first + growth, first + 2 growth, ...: summed one by one (to 1e-12, float sums)."""
    t, m = 0.0, 0
    while t + first + growth * m <= elapsed + 1e-12:
        t += first + growth * m
        m += 1
    assert steps_within(first, growth, elapsed) == m
    assert steps_duration(first, growth, m) == exact(t)
    reach, seconds = steps_to_reach(first, growth, elapsed)
    assert reach == (m if steps_duration(first, growth, m) == elapsed else m + 1)
    assert seconds == steps_duration(first, growth, reach) >= elapsed


# ---- exact timings ---------------------------------------------------------------------------------------

def test_one_request_on_an_idle_cluster():
    """prefill 0.01 + 0.1 = 0.11 -> first token 1.11; transfer 0.002 + 0.1 -> joins at 1.212;
    2 decode steps: 0.02 + 0.005 + 0.0101 = 0.0351 (context 101), then 0.0352 (context 102)."""
    sim = simulate_hand([(1.0, 100, 3)])
    assert sim.requests.first_token_s[0] == exact(1.11)
    assert sim.requests.finish_s[0] == exact(1.212 + 0.0351 + 0.0352)
    result = sim.result
    assert result.ttft.p50_s == exact(0.11)
    assert result.tpot.p50_s == exact((1.2823 - 1.11) / 2)
    assert (result.good, result.ttft_met, result.tpot_met) == (0, 1, 0)  # TPOT 86 ms > 50 ms target
    assert result.events == 5  # arrival, prefill step, completion, ticks at 10 and 20 (a join is no event)


def test_a_single_output_token_finishes_at_prefill():
    sim = simulate_hand([(0.5, 40, 1)])
    assert sim.requests.finish_s[0] == sim.requests.first_token_s[0] == exact(0.55)
    assert sim.result.good == 1


def test_chunked_prefill_under_the_token_budget():
    """Budget 512: step 1 takes 512 of A's 700 (0.522 s); step 2 takes A's last 188 + B's 100 +
    C's 100 = 388 tokens (0.398 s): all three first tokens at 0.92."""
    sim = simulate_hand([(0.0, 700, 1), (0.1, 100, 1), (0.2, 100, 1)])
    assert sim.requests.first_token_s == [exact(0.92)] * 3
    assert [tokens for tokens, _ in sim.prefill.stats.prefill_steps] == [512, 388]


def test_continuous_batching_joins_at_a_step_boundary():
    """A (prompt 100, 4 tokens) first token 0.11, joins 0.212, step 0.0351 -> 0.2471.
    B (prompt 50, 2 tokens) prefills 0.11-0.17, KV arrives 0.222 mid-step: joins at 0.2471.
    Batch of 2, context 102 + 51: step 0.02 + 0.01 + 0.0153 -> 0.2924, B's only decode step: B done.
    A alone, context 103: 0.0353 -> 0.3277, A's third decode step: A done."""
    sim = simulate_hand([(0.0, 100, 4), (0.05, 50, 2)])
    assert sim.requests.first_token_s == [exact(0.11), exact(0.17)]
    assert sim.requests.finish_s == [exact(0.3277), exact(0.2924)]


def test_decode_kv_capacity_makes_a_request_wait_for_room():
    """KV for 250 tokens: A (100 + 100) holds 200, so B (40 + 10) waits until A finishes."""
    sim = simulate_hand([(0.0, 100, 100), (0.0, 40, 10)], config=replace(HAND, decode_kv_tokens=249))
    first_a, first_b = sim.requests.first_token_s
    assert (first_a, first_b) == (exact(0.11), exact(0.16))
    assert sim.requests.finish_s[1] > sim.requests.finish_s[0]
    a_done = sim.requests.finish_s[0]
    # B admitted when A finishes: transfer 0.002 + 0.04, then 9 steps of 0.02 + 0.005 + 0.0001 * (41..49)
    assert sim.requests.finish_s[1] == exact(a_done + 0.042 + sum(0.025 + 0.0001 * c for c in range(41, 50)))


# ---- routing and the prefix cache ------------------------------------------------------------------------

def test_a_prefix_hit_skips_the_shared_tokens():
    """Same tenant twice on one prefill worker: 400 tokens (0.41 s), then only 350 - 300 = 50 (0.06 s)."""
    sim = simulate_hand([(0.0, 400, 1, 5, 300), (1.0, 350, 1, 5, 300)])
    assert sim.requests.first_token_s == [exact(0.41), exact(1.06)]
    assert sim.requests.uncached == [400, 50]
    assert sim.result.prefix_hit_rate == exact(300 / 750)


def test_prefix_lru_evicts_the_least_recently_used_group():
    """One group fits: tenants 5, 6, 5 -> the second 5 misses."""
    sim = simulate_hand([(0.0, 400, 1, 5, 300), (1.0, 400, 1, 6, 300), (2.0, 400, 1, 5, 300)])
    assert sim.requests.uncached == [400, 400, 400]


@pytest.mark.parametrize("scan_limit", [8, 0])  # 0: even 2 workers go through balance.LeastLoaded
def test_prefix_aware_routing_prefers_the_cached_worker_over_an_idle_one(scan_limit):
    """Two workers. A (tenant 5, 310 tokens) prefills on worker 0 (tie) by 0.32. C (100 tokens, no
    tenant) takes worker 0 at 0.5 (tie) until 0.61. B (tenant 5, 400 tokens) at 0.501: worker 0 costs
    100 queued + 100 uncached < idle worker 1's 400, so B waits for C and takes 0.01 + 0.1 -> 0.72.
    Were B of tenant 6, worker 0 would cost 500: B goes to worker 1, 0.501 + 0.41 = 0.911."""
    config = replace(HAND, initial_prefill=2, router_scan_limit=scan_limit)
    rows = [(0.0, 310, 1, 5, 300), (0.5, 100, 1), (0.501, 400, 1, 5, 300)]
    sim = simulate_hand(rows, Scripted(2, 1), config)
    assert sim.requests.first_token_s == [exact(0.32), exact(0.61), exact(0.72)]
    rows[2] = (0.501, 400, 1, 6, 300)
    sim = simulate_hand(rows, Scripted(2, 1), config)
    assert sim.requests.first_token_s == [exact(0.32), exact(0.61), exact(0.911)]


def test_least_loaded_stays_exact_when_increases_are_not_pushed():
    workers = [PrefillWorker(i, 0.0) for i in range(3)]
    for w in workers:
        w.state = WorkerState.ROUTABLE
    balance = LeastLoaded(attrgetter("queued_tokens"), lambda w: w.state == WorkerState.ROUTABLE, lambda: workers)
    for w, load in zip(workers, (5, 3, 9)):
        w.queued_tokens = load
        balance.update(w, load)
    assert balance.least() is workers[1]
    workers[1].queued_tokens = 7  # grew, not pushed: re-pushed as it surfaces
    assert balance.least() is workers[0]
    workers[0].queued_tokens = 9
    balance.update(workers[0], 9)  # an increase: no push
    workers[0].queued_tokens = 6
    balance.update(workers[0], 6)  # a decrease above its floor (5): no push either, still exact
    assert balance.least() is workers[0]
    workers[0].queued_tokens = 8
    assert balance.least() is workers[1]
    workers[2].queued_tokens = 1
    balance.update(workers[2], 1)
    workers[1].state = WorkerState.DRAINING
    assert balance.least() is workers[2]
    workers[2].state = WorkerState.DRAINING
    assert balance.least() is workers[0]
    workers[0].state = WorkerState.GONE
    assert balance.least() is None


def test_large_pools_route_to_the_least_loaded_decode_worker():
    """Three decode workers through LeastLoaded: A, B, C land on a different worker each (fewest
    KV tokens reserved; ties to the oldest entry), so each decodes alone."""
    config = replace(HAND, initial_decode=3, router_scan_limit=0)
    sim = simulate_hand([(0.0, 100, 30), (0.2, 100, 30), (0.4, 100, 30), (3.0, 100, 2)], Scripted(1, 3), config)
    assert [w.wid for w in sim.decode.live] == [0, 1, 2]
    first, finish = sim.requests.first_token_s, sim.requests.finish_s
    solo = sum(0.025 + 0.0001 * c for c in range(101, 130))  # 29 steps alone, contexts 101..129
    assert [finish[r] - first[r] for r in range(3)] == [exact(0.102 + solo)] * 3


# ---- scaling ---------------------------------------------------------------------------------------------

def test_a_new_replica_becomes_routable_scale_up_s_after_it_was_asked_for():
    policy = Scripted(1, 1, {10.0: (2, 1, 0)})
    sim = simulate_hand([(0.5, 100, 2), (55.0, 100, 2)], policy, replace(HAND, scale_up_s=30.0), duration_s=60.0)
    pools = [(o.now_s, o.prefill.replicas, o.prefill.starting) for o in policy.seen]
    assert pools[:5] == [(10.0, 1, 0), (20.0, 1, 1), (30.0, 1, 1), (40.0, 2, 0), (50.0, 2, 0)]
    added = sim.prefill.live[1]
    assert (added.asked_s, added.ready_s) == (10.0, 40.0)
    assert policy.seen[4].scale_up_s == 30.0 and policy.seen[1].scale_up_s is None
    assert sim.result.device_s == exact(60.0 + 50.0 + 60.0)


def test_shrinking_cancels_a_starting_replica_first():
    policy = Scripted(1, 1, {10.0: (2, 1, 0), 20.0: (1, 1, 0)})
    sim = simulate_hand([(0.5, 100, 2)], policy, replace(HAND, scale_up_s=30.0), duration_s=40.0)
    cancelled = sim.prefill.retired[0]
    assert (cancelled.asked_s, cancelled.gone_s, cancelled.ready_s) == (10.0, 20.0, None)
    assert sim.result.device_s == exact(40.0 + 10.0 + 40.0)


def test_draining_finishes_running_requests_takes_no_new_ones_and_loses_nothing():
    """At 10 s both pools go 2 -> 1. Prefill worker 0 is idle: gone at once. Decode worker 0 still
    runs A (200 tokens): it drains, is gone when A finishes, and C (arriving later) goes to worker 1."""
    policy = Scripted(2, 2, {10.0: (1, 1, 0)})
    config = replace(HAND, initial_prefill=2, initial_decode=2, decode_kv_tokens=100_000)
    sim = simulate_hand([(9.0, 500, 200), (9.0, 500, 200), (11.0, 100, 50)], policy, config, duration_s=30.0)
    assert sim.result.finished == 3 and all(not math.isnan(t) for t in sim.requests.finish_s)
    gone_prefill = next(w for w in sim.prefill.retired)
    assert (gone_prefill.wid, gone_prefill.gone_s) == (0, 10.0)
    drained = next(w for w in sim.decode.retired)
    assert drained.wid == 0 and drained.state == WorkerState.GONE
    assert drained.gone_s == sim.requests.finish_s[0] and drained.gone_s > 10.0
    kept = sim.decode.live[0]
    assert kept.wid == 1 and kept.slots == 0
    assert policy.seen[1].decode.draining == 1 and policy.seen[1].decode.replicas == 1


def test_local_prefill_on_the_decode_worker():
    """Threshold 200 from t=10: a 150-token prompt prefills on the idle decode worker in
    0.01 + 0.15 s, no transfer, then decodes 2 steps (context 151, 152)."""
    policy = Scripted(1, 1, {10.0: (1, 1, 200)})
    sim = simulate_hand([(12.0, 150, 3), (13.0, 300, 1)], policy, duration_s=20.0)
    assert sim.requests.first_token_s[0] == exact(12.16)
    assert sim.requests.finish_s[0] == exact(12.16 + 0.0401 + 0.0402)
    assert sim.requests.uncached == [150, 300]
    assert sim.requests.first_token_s[1] == exact(13.31)  # above the threshold: the prefill pool
    assert sim.result.local_prefill_share == 0.5


# ---- observations ----------------------------------------------------------------------------------------

def test_the_observation_describes_the_window():
    """Window (0, 10]: 3 arrivals at 1, 2, 4 (gaps 1, 2: cv^2 = 0.25 / 2.25); two finish in it."""
    policy = Scripted(1, 1)
    simulate_hand([(1.0, 100, 3), (2.0, 20, 1), (4.0, 40, 2)], policy, replace(HAND, histogram_bin_tokens=16),
                  duration_s=30.0)
    seen = policy.seen[0]
    assert (seen.now_s, seen.window_s, seen.arrival_rate) == (10.0, 10.0, 0.3)
    assert seen.arrival_cv2 == exact(0.25 / 2.25)
    assert seen.prompt_lengths == LengthHistogram((32, 48, 112), (1, 1, 1))
    assert seen.output_lengths.total == 3
    assert seen.ttft_attainment == 1.0 and seen.ttft_p99_s == exact(0.11)
    assert seen.transfer_s_p50 == exact(0.042)
    assert (seen.prefill.replicas, seen.decode.replicas, seen.decode.kv_capacity_tokens) == (1, 1, 10_000)
    assert seen.prefill.queue_depth == 0 and seen.prefill.queue_time_p99_s == 0.0
    assert [(s.num_tokens, s.seconds) for s in seen.prefill_steps] == [(100, exact(0.11)), (20, exact(0.03)),
                                                                       (40, exact(0.05))]
    assert policy.seen[1].arrival_rate == 0.0 and policy.seen[1].ttft_attainment is None


def test_length_histogram_bins_round_up():
    assert length_histogram(np.array([1, 16, 17, 40]), 16) == LengthHistogram((16, 32, 48), (2, 1, 1))
    assert length_histogram(np.array([], dtype=np.int64), 16) == LengthHistogram()


# ---- determinism and the entry point ---------------------------------------------------------------------

def _without_wall(result) -> dict:
    return {**result.to_json(), "wall_s": None}


def test_same_seed_gives_identical_results_and_the_json_round_trips(tmp_path):
    first = run_simulation("bursty", 16, "rayserve", 3, 600.0)
    second = run_simulation("bursty", 16, "rayserve", 3, 600.0)
    assert _without_wall(first) == _without_wall(second)
    assert first.timeline == second.timeline
    assert _without_wall(run_simulation("bursty", 16, "rayserve", 4, 600.0)) != _without_wall(first)
    path = write_json([first], tmp_path / "sim.json")
    assert path.read_text().count('"trace": "bursty"') == 1


def test_shares_of_a_pool_across_shards():
    assert [share(7, i, 3) for i in range(3)] == [3, 2, 2]
    assert [share(2, i, 3) for i in range(3)] == [1, 1, 1]  # a non-empty pool stays non-empty everywhere
    assert [share(0, i, 3) for i in range(3)] == [0, 0, 0]


def test_two_shards_are_deterministic_and_cover_every_request_once():
    two = run_simulation("diurnal", 64, "planner", 1, 600.0, shards=2)
    again = run_simulation("diurnal", 64, "planner", 1, 600.0, shards=2)
    assert _without_wall(two) == _without_wall(again)
    assert two.requests == two.finished == len(make_trace("diurnal", Scale.of("diurnal", 64).peak_rate, 600.0, 1,
                                                         BENCH_WORKLOAD))
    assert [p.t_s for p in two.timeline] == [10.0 * (k + 1) for k in range(len(two.timeline))]


def test_two_shards_match_one_process_on_a_static_cluster():
    """Same pools split in two halves, each routing its half of the requests: the same cluster."""
    one = run_simulation("poisson", 64, "static", 2, 600.0, shards=1)
    two = run_simulation("poisson", 64, "static", 2, 600.0, shards=2)
    assert two.requests == two.finished == one.requests
    assert abs(two.attainment - one.attainment) < 0.02
    assert abs(two.device_s / one.device_s - 1) < 0.01
    assert {(p.prefill.routable, p.decode.routable) for p in two.timeline} == {
        (p.prefill.routable, p.decode.routable) for p in one.timeline}


def test_static_run_holds_its_pools_and_counts_device_time():
    result = run_simulation("poisson", 16, "static", 0, 300.0)
    prefill, decode = Scale.of("poisson", 16).split(Scale.of("poisson", 16).peak_rate)
    assert {(p.prefill.routable, p.decode.routable) for p in result.timeline} == {(prefill, decode)}
    assert result.device_s == exact((prefill + decode) * result.end_s)
    assert result.finished == result.requests


# ---- the baselines ---------------------------------------------------------------------------------------

def crafted(now_s: float = 100.0, rate: float = 10.0, prompt: int = 1000, output: int = 150, hit: float = 0.5,
            prefill: tuple[int, int] = (5, 0), decode: tuple[int, int] = (200, 0), ttft_p99: float | None = None,
            itl_p99: float | None = None) -> Observation:
    return Observation(now_s, 10.0, rate, 1.0, LengthHistogram((prompt,), (50,)), LengthHistogram((output,), (40,)),
                       PoolObservation(*prefill), PoolObservation(*decode), prefix_hit_rate=hit,
                       ttft_p99_s=ttft_p99, itl_p99_s=itl_p99)


BASELINE = PlannerConfig(ttft_s=1.0, itl_s=0.5, prefill=PoolBounds(1, 500), decode=PoolBounds(1, 500),
                         profile=HAND_PROFILE, scale_up_cooldown_s=30.0, scale_down_cooldown_s=120.0)


def test_static_policy_targets_and_changes():
    made = StaticPolicy(3, 4).decide(crafted(prefill=(2, 0), decode=(4, 1)))
    assert (made.prefill.replicas, made.prefill.change, made.decode.replicas, made.decode.change) == (3, 1, 4, -1)
    assert made.local_prefill_threshold == 0


def test_dynamo_like_sizes_from_averages():
    """prefill: 500 uncached tokens (hit 0.5) = 0.51 s; 10 req/s * 0.51 / 0.8 = 6.375 -> 7.
    decode: contexts 1000 + 75; step(b) = 0.02 + 0.005 b + 0.1075 b <= 0.5 -> b = 4 (0.47 s),
    8.51 tokens/s; 10 * 150 / 8.51 / 0.8 = 220.3 -> 221."""
    made = DynamoLikePolicy(BASELINE).decide(crafted())
    assert (made.prefill.replicas, made.decode.replicas) == (7, 221)
    assert DynamoLikePolicy(BASELINE).decide(crafted(rate=0.0)).prefill.replicas == 1  # min_replicas
    assert DynamoLikePolicy(replace(BASELINE, decode=PoolBounds(1, 100))).decide(crafted()).decode.replicas == 100


def test_ray_serve_like_steps_one_replica_with_cooldowns():
    policy = RayServeLikePolicy(BASELINE)
    up = policy.decide(crafted(now_s=10.0, ttft_p99=1.5, itl_p99=0.2))  # TTFT over: +1; ITL < half: -1
    assert (up.prefill.replicas, up.decode.replicas) == (6, 199)
    held = policy.decide(crafted(now_s=30.0, prefill=(6, 0), decode=(199, 0), ttft_p99=2.0, itl_p99=0.2))
    assert (held.prefill.replicas, held.decode.replicas) == (6, 199)  # 20 s < 30 s up, < 120 s down cooldown
    again = policy.decide(crafted(now_s=40.0, prefill=(6, 0), decode=(199, 0), ttft_p99=2.0, itl_p99=0.4))
    assert (again.prefill.replicas, again.decode.replicas) == (7, 199)  # ITL 0.4: between half and target
    down = policy.decide(crafted(now_s=130.0, prefill=(7, 0), decode=(199, 0), ttft_p99=0.2, itl_p99=None))
    assert (down.prefill.replicas, down.decode.replicas) == (7, 199)  # 90 s since the up: down cooldown
    down = policy.decide(crafted(now_s=160.0, prefill=(7, 0), decode=(199, 0), ttft_p99=0.2, itl_p99=None))
    assert (down.prefill.replicas, down.decode.replicas) == (6, 199)  # nothing finished: decode holds


def test_a_policy_asking_for_negative_replicas_is_refused():
    policy = Scripted(1, 1, {10.0: (-1, 1, 0)})
    with pytest.raises(ValueError, match="negative replicas"):
        simulate_hand([(0.5, 10, 1)], policy)


def test_workload_validates_its_shapes():
    with pytest.raises(ValueError, match="bursty_low_fraction"):
        Workload(bursty_low_fraction=0.0)
