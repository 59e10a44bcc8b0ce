"""From the windows of one tick (one per shard) to the planner's `Observation` and a timeline point.

Quantiles are nearest-rank over the merged samples; counts add up; the arrival cv^2 is taken over
all shards' arrivals merged in time order. prompt_lengths are the window's arrivals,
output_lengths its finished requests (a router learns output lengths only at the end), both
rounded up to histogram_bin_tokens. itl_attainment / itl_p99_s are per-request TPOT.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splitserve.planner.core.types import (Decision, DecodeStepSample, LengthHistogram, Observation,
                                           PoolObservation, PrefillStepSample)
from splitserve.planner.sim.config import SimulatedCluster
from splitserve.planner.samples import gap_cv2, nearest_rank
from splitserve.planner.sim.report import PoolCounts, TimelinePoint
from splitserve.planner.sim.window import PoolState, Window


def length_histogram(lengths: np.ndarray, bin_tokens: int) -> LengthHistogram:
    """Lengths rounded up to a multiple of bin_tokens (1: exact), counted per distinct value."""
    if len(lengths) == 0:
        return LengthHistogram()
    binned = -(-lengths // bin_tokens) * bin_tokens
    values, counts = np.unique(binned, return_counts=True)
    return LengthHistogram(tuple(values.tolist()), tuple(counts.tolist()))


def quantile(values: np.ndarray, q: float) -> float:
    """Nearest-rank quantile; 0.0 when empty."""
    return nearest_rank(np.sort(values), q) if len(values) else 0.0


def met_fraction(values: np.ndarray, target: float) -> float | None:
    """Fraction of values <= target (None when empty)."""
    return float(np.count_nonzero(values <= target)) / len(values) if len(values) else None


def p99(values: np.ndarray) -> float | None:
    return nearest_rank(np.sort(values), 0.99) if len(values) else None


def merged(windows: Sequence[Window], name: str) -> np.ndarray:
    return np.concatenate([getattr(w, name) for w in windows])


def _pool(states: Sequence[PoolState], queue_s: np.ndarray, kv_capacity: int) -> PoolObservation:
    routable = sum(s.routable for s in states)
    kv_usage = sum(s.kv_reserved for s in states) / (routable * kv_capacity) if routable and kv_capacity else 0.0
    return PoolObservation(
        replicas=routable, starting=sum(s.starting for s in states), draining=sum(s.draining for s in states),
        queue_depth=sum(s.queue_depth for s in states), queue_time_p50_s=quantile(queue_s, 0.5),
        queue_time_p99_s=quantile(queue_s, 0.99), running_requests=sum(s.running for s in states),
        kv_usage=kv_usage, kv_capacity_tokens=kv_capacity)


def _steps(windows: Sequence[Window], keep: int) -> tuple[tuple, tuple]:
    """The last `keep` step samples of each role (shard by shard)."""
    prefill = [s for w in windows for s in w.prefill_steps][-keep:] if keep else []
    decode = [s for w in windows for s in w.decode_steps][-keep:] if keep else []
    return (tuple(PrefillStepSample(n, s) for n, s in prefill),
            tuple(DecodeStepSample(b, c, s) for b, c, s in decode))


def observation_of(windows: Sequence[Window], config: SimulatedCluster) -> Observation:
    """One Observation of the whole cluster from its shards' windows (all at the same tick)."""
    window_s, bins = config.tick_s, config.histogram_bin_tokens
    arrivals, ttft, tpot = np.sort(merged(windows, "arrival_s")), merged(windows, "ttft_s"), merged(windows, "tpot_s")
    routed, prompt_tokens = sum(w.routed for w in windows), sum(w.routed_prompt_tokens for w in windows)
    prefill_steps, decode_steps = _steps(windows, config.step_samples)
    return Observation(
        now_s=windows[0].now_s, window_s=window_s, arrival_rate=len(arrivals) / window_s,
        arrival_cv2=gap_cv2(arrivals), prompt_lengths=length_histogram(merged(windows, "prompt_tokens"), bins),
        output_lengths=length_histogram(merged(windows, "output_tokens"), bins),
        prefill=_pool([w.prefill for w in windows], merged(windows, "prefill_queue_s"), 0),
        decode=_pool([w.decode for w in windows], merged(windows, "decode_queue_s"), config.decode_kv_tokens),
        prefix_hit_rate=sum(w.hit_tokens for w in windows) / prompt_tokens if prompt_tokens else 0.0,
        transfer_s_p50=quantile(merged(windows, "transfer_s"), 0.5),
        ttft_attainment=met_fraction(ttft, config.ttft_s), itl_attainment=met_fraction(tpot, config.tpot_s),
        ttft_p99_s=p99(ttft), itl_p99_s=p99(tpot),
        local_prefill_share=sum(w.local for w in windows) / routed if routed else 0.0,
        scale_up_s=config.scale_up_s if any(w.scaled_up for w in windows) else None,
        prefill_steps=prefill_steps, decode_steps=decode_steps)


def _counts(states: Sequence[PoolState]) -> PoolCounts:
    return PoolCounts(sum(s.routable for s in states), sum(s.starting for s in states),
                      sum(s.draining for s in states))


def timeline_point(windows: Sequence[Window], observation: Observation, decision: Decision,
                   config: SimulatedCluster) -> TimelinePoint:
    ttft, tpot = merged(windows, "ttft_s"), merged(windows, "tpot_s")
    good = int(np.count_nonzero((ttft <= config.ttft_s) & (tpot <= config.tpot_s)))
    return TimelinePoint(observation.now_s, observation.arrival_rate, _counts([w.prefill for w in windows]),
                         _counts([w.decode for w in windows]), decision.prefill.replicas, decision.decode.replicas,
                         good / len(ttft) if len(ttft) else None, good / observation.window_s)
