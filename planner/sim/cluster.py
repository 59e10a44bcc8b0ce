"""The whole simulated cluster: arrivals -> router -> prefill pool -> KV transfer -> decode pool,
with a policy (the planner's core, or a baseline) deciding the pools' sizes every tick.

One event loop over a heap (events.EventQueue) merged with the trace's sorted arrivals. At every
tick_s the simulator hands the window since the previous tick (window.Window) to its controller
and applies the Decision it gets back: pools are resized (pool.ReplicaPool) and prompts of at
most `local_prefill_threshold` tokens are prefilled on their decode worker from then on; no
decision (None) ends the run. run_local runs one simulator under a control.Controller;
runner.py also runs several in lockstep (shards); `assemble` makes the SimulationResult.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.planner.core.types import Decision
from splitserve.planner.sim.config import SimulatedCluster
from splitserve.planner.sim.control import Controller, Policy
from splitserve.planner.sim.decode import DecodePool
from splitserve.planner.sim.device import DeviceModel
from splitserve.planner.sim.events import EventQueue, RequestTable
from splitserve.planner.sim.prefill import PrefillPool
from splitserve.planner.sim.report import SimulationResult, TimelinePoint, latency_summary
from splitserve.planner.sim.traces import Trace
from splitserve.planner.sim.window import PoolState, Window, WindowStats

Control = Callable[[Window], Decision | None]


@dataclass(frozen=True, eq=False)
class SimulatorOutput:
    """What one simulator (one shard) hands back at the end of its run."""

    first_token_s: np.ndarray
    """float64 [n requests of its trace]; NaN: no first token."""
    finish_s: np.ndarray
    """float64 [n]; NaN: unfinished."""
    lifetimes: np.ndarray
    """float64 [workers, 2]: (asked_s, gone_s) of every replica it ever had; gone_s NaN: held to the end."""
    totals: tuple[int, int, int, int]
    """Over the run: requests routed, their prompt tokens, prefix-hit tokens, local prefills."""
    events: int


class Simulator:
    """One run of `trace` through the cluster, decided by `control` (single use: call run() once)."""

    def __init__(self, config: SimulatedCluster, trace: Trace, control: Control) -> None:
        self.config, self.trace, self.control = config, trace, control
        self.events = EventQueue()
        self.requests = RequestTable(trace)
        self.stats = WindowStats(config.step_samples)
        device = DeviceModel(config.profile)
        self.decode = DecodePool(self.events, self.requests, device, self.stats, config.scale_up_s,
                                 config.decode_kv_tokens, config.kv_bytes_per_token / config.transfer_bytes_per_s,
                                 config.transfer_latency_s, config.router_scan_limit, self._finish)
        self.prefill = PrefillPool(self.events, self.requests, device, self.stats, config.scale_up_s,
                                   config.prefix_cache_groups, config.router_scan_limit, self.decode.accept)
        self.local_threshold = 0
        self.finished = 0
        self.done = False
        self.totals = [0, 0, 0, 0]

    def run(self) -> SimulatorOutput:
        self.prefill.start(self.config.initial_prefill)
        self.decode.start(self.config.initial_decode)
        self.events.push(self.config.tick_s, self._on_tick)
        events = self._loop()
        lifetimes = [(w.asked_s, np.nan if w.gone_s is None else w.gone_s)
                     for pool in (self.prefill, self.decode) for w in (*pool.live, *pool.retired)]
        return SimulatorOutput(np.array(self.requests.first_token_s), np.array(self.requests.finish_s),
                               np.array(lifetimes, dtype=np.float64).reshape(-1, 2), tuple(self.totals), events)

    def _loop(self) -> int:
        """Process arrivals and events in time order (an event before an arrival at the same
        instant) until done; the number processed."""
        arrivals, heap = self.requests.arrival, self.events.heap
        n, i, count = len(arrivals), 0, 0
        while not self.done and (heap or i < n):
            if heap and (i == n or heap[0][0] <= arrivals[i]):
                at, _, handler, a, b = heapq.heappop(heap)
                handler(a, b, at)
            else:
                self._arrive(i, arrivals[i])
                i += 1
            count += 1
        return count

    def _arrive(self, r: int, now: float) -> None:
        prompt = self.requests.prompt[r]
        if prompt <= self.local_threshold and self.decode.prefill_locally(r, now):
            stats = self.stats
            stats.routed += 1
            stats.prompt_tokens += prompt
            stats.local += 1
            return
        self.prefill.route(r, now)

    def _finish(self, r: int, now: float) -> None:
        self.requests.finish_s[r] = now
        self.finished += 1
        self.stats.finished.append(r)

    def _on_tick(self, _: object, __: object, now: float) -> None:
        decision = self.control(self.window(now))
        stats, totals = self.stats, self.totals
        for k, value in enumerate((stats.routed, stats.prompt_tokens, stats.hit_tokens, stats.local)):
            totals[k] += value
        stats.reset()
        if decision is None:
            self.done = True
            return
        self.prefill.resize(decision.prefill.replicas, now)
        self.decode.resize(decision.decode.replicas, now)
        self.local_threshold = max(0, min(decision.local_prefill_threshold, self.config.profile.prefill_token_budget))
        self.events.push(now + self.config.tick_s, self._on_tick)

    def window(self, now: float) -> Window:
        """The window (now - tick_s, now] as recorded so far."""
        trace, stats, requests, ids = self.trace, self.stats, self.requests, self.stats.finished
        lo, hi = np.searchsorted(trace.arrival_s, [now - self.config.tick_s, now], side="right")
        first = np.array([requests.first_token_s[r] for r in ids], dtype=np.float64)
        finish = np.array([requests.finish_s[r] for r in ids], dtype=np.float64)
        output = np.array([requests.output[r] for r in ids], dtype=np.int64)
        arrival = np.array([requests.arrival[r] for r in ids], dtype=np.float64)
        return Window(
            now, trace.arrival_s[lo:hi], trace.prompt_tokens[lo:hi], first - arrival, tpot_of(first, finish, output),
            output, np.array(stats.prefill_queue_s), np.array(stats.decode_queue_s), np.array(stats.transfer_s),
            stats.routed, stats.prompt_tokens, stats.hit_tokens, stats.local, self._prefill_state(),
            self._decode_state(), tuple(stats.prefill_steps), tuple(stats.decode_steps),
            self.prefill.scaled_up or self.decode.scaled_up, len(requests) - self.finished)

    def _prefill_state(self) -> PoolState:
        pool = self.prefill
        waiting = pool.waiting + len(pool.backlog)
        return PoolState(len(pool.routable), pool.starting(), pool.draining(), waiting,
                         pool.queued_requests() - waiting)

    def _decode_state(self) -> PoolState:
        pool = self.decode
        return PoolState(len(pool.routable), pool.starting(), pool.draining(), len(pool.backlog),
                         pool.running_requests(), sum(w.kv_reserved for w in pool.routable))


def tpot_of(first: np.ndarray, finish: np.ndarray, output: np.ndarray) -> np.ndarray:
    """(finish - first token) / (output - 1); 0 for a single output token (meets any target)."""
    return np.where(output > 1, (finish - first) / np.maximum(output - 1, 1), 0.0)


@dataclass(frozen=True, eq=False)
class Run:
    """A simulation's result and its per-request outcomes (bool [n], in trace order)."""

    result: SimulationResult
    ttft_met: np.ndarray
    """Finished, and its TTFT met the target."""
    tpot_met: np.ndarray
    """Finished, and its TPOT met the target."""


def assemble(config: SimulatedCluster, trace: Trace, policy_name: str, outputs: Sequence[SimulatorOutput],
             shards: Sequence[np.ndarray], timeline: Sequence[TimelinePoint], wall_s: float) -> Run:
    """outputs[i] ran the requests trace[shards[i]]; device time counts to end_s = max(duration,
    last finish)."""
    first, finish = np.full(len(trace), np.nan), np.full(len(trace), np.nan)
    for output, ids in zip(outputs, shards):
        first[ids], finish[ids] = output.first_token_s, output.finish_s
    done = ~np.isnan(finish)
    ttft, tpot = first - trace.arrival_s, tpot_of(first, finish, trace.output_tokens)
    ttft_met, tpot_met = done & (ttft <= config.ttft_s), done & (tpot <= config.tpot_s)
    end = max(trace.duration_s, float(finish[done].max()) if done.any() else 0.0)
    lifetimes = np.concatenate([o.lifetimes for o in outputs])
    device_s = float(np.sum(np.minimum(np.nan_to_num(lifetimes[:, 1], nan=end), end) - lifetimes[:, 0]))
    routed, prompt_tokens, hit_tokens, local = (sum(o.totals[k] for o in outputs) for k in range(4))
    result = SimulationResult(
        trace=trace.name, policy=policy_name, duration_s=trace.duration_s, end_s=end, requests=len(trace),
        finished=int(done.sum()), good=int(np.count_nonzero(ttft_met & tpot_met)), ttft_met=int(ttft_met.sum()),
        tpot_met=int(tpot_met.sum()), device_s=device_s, ttft=latency_summary(ttft[done]),
        tpot=latency_summary(tpot[done]), prefix_hit_rate=hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        local_prefill_share=local / routed if routed else 0.0, wall_s=wall_s,
        events=sum(o.events for o in outputs), timeline=tuple(timeline))
    return Run(result, ttft_met, tpot_met)


def run_local(config: SimulatedCluster, trace: Trace, policy: Policy, policy_name: str) -> tuple[Simulator, Run]:
    """One simulator in this process (the simulator is returned for inspection)."""
    started = time.perf_counter()
    controller = Controller(config, policy, trace.duration_s)
    simulator = Simulator(config, trace, lambda window: controller.decide([window]))
    output = simulator.run()
    return simulator, assemble(config, trace, policy_name, [output], [np.arange(len(trace))], controller.timeline,
                               time.perf_counter() - started)
