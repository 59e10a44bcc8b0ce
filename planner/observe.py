"""What the planner sees of a live cluster: the records of the requests that ended and the
workers' latest reports, turned into one `Observation` per tick (pure: times come from the caller).

Arrivals are counted by conservation, not by a hook on the request path: the requests that
arrived in a window are those that ended in it plus the growth of the in-flight count over it.
Their burstiness (cv^2 of inter-arrival times) is measured on the arrival times of the requests
that ended in the window (arrival = end - e2e), a sample of the window's arrivals.

Step samples come from the workers' reports, which carry moving averages, not single steps: one
sample per worker and tick (a prefill worker's per-token cost at the window's mean uncached prompt;
a decode worker's decode-only step time at its running batch and the KV it holds).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve.common.stats import RequestRecord, WorkerSnapshot
from splitserve.planner.core.types import (DecodeStepSample, LengthHistogram, Observation, PoolObservation,
                                           PrefillStepSample, Role)
from splitserve.planner.samples import gap_cv2, nearest_rank


@dataclass(frozen=True)
class PoolMembers:
    """A pool's workers by state, as the adapter counts them."""

    routable: int
    starting: int = 0
    draining: int = 0


@dataclass(frozen=True)
class _Ended:
    arrival_s: float
    ended_s: float
    record: RequestRecord


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank q-quantile (q in [0, 1]); None for no values."""
    return nearest_rank(sorted(values), q) if values else None


class TrafficWindow:
    """Ended requests of the last `window_s` seconds and the in-flight count at the last tick.

    Invariant: `_ended` is in order of end time and holds nothing older than the last tick's window."""

    def __init__(self, ttft_s: float, itl_s: float, block_size: int) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.block_size = block_size
        self._ended: deque[_Ended] = deque()
        self._in_flight_at_last_tick = 0

    def record(self, now_s: float, record: RequestRecord) -> None:
        """A request ended at now_s (an internal step is not one: Orchestrator.num_in_flight leaves steps out
        too, so arrivals by conservation count its client's request once)."""
        if record.step_of is not None:
            return
        self._ended.append(_Ended(now_s - record.e2e_s, now_s, record))

    def observation(self, now_s: float, window_s: float, in_flight: int, snapshots: Sequence[WorkerSnapshot],
                    members: Mapping[Role, PoolMembers], scale_up_s: float | None) -> Observation:
        """The window (now_s - window_s, now_s]; advances the in-flight baseline to now."""
        while self._ended and self._ended[0].ended_s <= now_s - window_s:
            self._ended.popleft()
        records = [ended.record for ended in self._ended]
        arrivals = max(0, len(records) + in_flight - self._in_flight_at_last_tick)
        self._in_flight_at_last_tick = in_flight
        uncached = [r.num_prompt_tokens - r.num_cached_tokens for r in records]
        mean_uncached = sum(uncached) / len(uncached) if uncached else 0.0
        ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
        tpots = [r.tpot_s for r in records if r.tpot_s is not None]
        return Observation(
            now_s=now_s, window_s=window_s, arrival_rate=arrivals / window_s,
            arrival_cv2=gap_cv2(sorted(ended.arrival_s for ended in self._ended)),
            prompt_lengths=LengthHistogram.of([r.num_prompt_tokens for r in records]),
            output_lengths=LengthHistogram.of([r.num_output_tokens for r in records if r.finish_reason]),
            prefill=self._pool(Role.PREFILL, snapshots, members, records),
            decode=self._pool(Role.DECODE, snapshots, members, records),
            prefix_hit_rate=_ratio(sum(r.num_cached_tokens for r in records), sum(r.num_prompt_tokens for r in records)),
            transfer_s_p50=percentile([r.kv_transfer.seconds for r in records
                                       if r.kv_transfer is not None and not r.kv_transfer.failed], 0.5) or 0.0,
            ttft_attainment=self._attainment(records, self._ttft_met),
            itl_attainment=self._attainment(records, self._itl_met),
            ttft_p99_s=percentile(ttfts, 0.99), itl_p99_s=percentile(tpots, 0.99),
            local_prefill_share=_ratio(sum(r.routing_reason == "local_prefill" for r in records),
                                       sum(r.routing_reason is not None for r in records)),
            scale_up_s=scale_up_s,
            prefill_steps=self._prefill_steps(snapshots, mean_uncached),
            decode_steps=self._decode_steps(snapshots))

    def _pool(self, role: Role, snapshots: Sequence[WorkerSnapshot], members: Mapping[Role, PoolMembers],
              records: Sequence[RequestRecord]) -> PoolObservation:
        loads = [s.load for s in snapshots if s.role == role.value and s.load is not None]
        remote = role is Role.PREFILL
        queue_times = [r.queue_s for r in records
                       if r.queue_s is not None and (r.prefill_worker is not None) == remote]
        pool = members.get(role, PoolMembers(0))
        return PoolObservation(
            replicas=pool.routable, starting=pool.starting, draining=pool.draining,
            queue_depth=sum(load.num_waiting for load in loads),
            queue_time_p50_s=percentile(queue_times, 0.5) or 0.0, queue_time_p99_s=percentile(queue_times, 0.99) or 0.0,
            running_requests=sum(load.num_running for load in loads),
            kv_usage=sum(load.kv_usage for load in loads) / len(loads) if loads else 0.0,
            kv_capacity_tokens=min((load.num_kv_blocks for load in loads), default=0) * self.block_size)

    def _attainment(self, records: Sequence[RequestRecord], met) -> float | None:
        counted = [r for r in records if r.slo is not None]
        return sum(met(r) for r in counted) / len(counted) if counted else None

    def _ttft_met(self, record: RequestRecord) -> bool:
        return record.ttft_s is not None and record.ttft_s <= self.ttft_s

    def _itl_met(self, record: RequestRecord) -> bool:
        return record.ttft_s is not None and (record.tpot_s is None or record.tpot_s <= self.itl_s)

    def _prefill_steps(self, snapshots: Sequence[WorkerSnapshot], mean_uncached: float) -> tuple[PrefillStepSample, ...]:
        tokens = max(1, round(mean_uncached))
        return tuple(PrefillStepSample(tokens, s.load.prefill_s_per_token * tokens) for s in snapshots
                     if s.role == Role.PREFILL.value and s.load is not None and s.load.prefill_s_per_token is not None)

    def _decode_steps(self, snapshots: Sequence[WorkerSnapshot]) -> tuple[DecodeStepSample, ...]:
        return tuple(DecodeStepSample(s.load.num_running, (s.load.num_kv_blocks - s.load.num_free_kv_blocks)
                                      * self.block_size, s.load.decode_step_s) for s in snapshots
                     if s.role == Role.DECODE.value and s.load is not None and s.load.decode_step_s is not None
                     and s.load.num_running > 0)


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0
