"""Ready-made simulations: the reference device, workload and targets, sized to a device count.

The device is the project's 88M bench model in bf16 on one 2-core CPU of the development machine,
fitted to bench/results/engine_throughput.json: prefill 974 tokens/s on 2047-token prompts
(~2.1 s per full 2048-token step), batch-1 decode 12.4 ms, a 64-request batch of ~190-token
contexts 95 ms per step. The KV transfer is NIXL over UCX shared memory (bench/nixl_bandwidth.py:
3.7-5.0 GB/s) of that model's 12 KiB per token. Targets: TTFT 3 s, TPOT 0.1 s.

"`devices` devices" fixes a trace's peak rate: the rate that many devices serve at
NOMINAL_UTILISATION when split in proportion to the work (Scale.split), from the mean lengths
of the workload (a multitenant prompt costs its user message plus MULTITENANT_MISS_SHARE of its
system prompt).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from splitserve.common.validation import require
from splitserve.planner.core.planner import Planner
from splitserve.planner.core.types import PerformanceProfile, PlannerConfig, PoolBounds
from splitserve.planner.sim.config import SimulatedCluster
from splitserve.planner.sim.control import Policy
from splitserve.planner.sim.policies import DynamoLikePolicy, RayServeLikePolicy, StaticPolicy, decode_tokens_per_s
from splitserve.planner.sim.report import SimulationResult
from splitserve.planner.sim.runner import simulate
from splitserve.planner.sim.traces import LengthDistribution, Workload, diurnal_rate, make_trace

BENCH_PROFILE = PerformanceProfile(
    prefill_fixed_s=0.010, prefill_s_per_token=0.00085, prefill_s_per_token2=1.0e-7,
    decode_fixed_s=0.0115, decode_s_per_request=0.0012, decode_s_per_context_token=6.0e-7,
    max_batch_size=256, prefill_token_budget=2048)
BENCH_WORKLOAD = Workload(
    prompt=LengthDistribution(512.0, 0.6, 32, 2048), output=LengthDistribution(192.0, 0.6, 2, 1024),
    system_prompt=LengthDistribution(1024.0, 0.3, 512, 1536), user_message=LengthDistribution(128.0, 0.8, 8, 512))
TTFT_S, TPOT_S = 3.0, 0.1
NOMINAL_UTILISATION = 0.8
MULTITENANT_MISS_SHARE = 0.1
POLICY_NAMES = ("static", "dynamo", "rayserve", "planner")
SHARD_FROM_DEVICES = 256
"""Clusters this large are simulated over 2 processes by default (runner.py)."""


@dataclass(frozen=True)
class Scale:
    """A trace sized to a device count: its peak rate and the nominal split at a rate."""

    trace: str
    devices: int
    prefill_s: float
    """Nominal prefill device-seconds per request."""
    decode_s: float
    """Nominal decode device-seconds per request."""

    @classmethod
    def of(cls, trace: str, devices: int) -> Scale:
        require(devices >= 2, f"need at least 2 devices, got {devices}")
        workload, profile = BENCH_WORKLOAD, BENCH_PROFILE
        if trace == "multitenant":
            prompt = workload.user_message.mean() + MULTITENANT_MISS_SHARE * workload.system_prompt.mean()
            context = workload.user_message.mean() + workload.system_prompt.mean()
        else:
            prompt = context = workload.prompt.mean()
        output = workload.output.mean()
        prefill_s = profile.prefill_fixed_s + profile.prefill_s_per_token * prompt + profile.prefill_s_per_token2 * prompt ** 2
        decode_s = output / decode_tokens_per_s(profile, context + output / 2, TPOT_S)
        return cls(trace, devices, prefill_s, decode_s)

    @property
    def peak_rate(self) -> float:
        return self.devices * NOMINAL_UTILISATION / (self.prefill_s + self.decode_s)

    def split(self, rate: float) -> tuple[int, int]:
        """Nominal (prefill, decode) replicas for `rate` requests/s, each >= 1."""
        return (max(1, math.ceil(rate * self.prefill_s / NOMINAL_UTILISATION)),
                max(1, math.ceil(rate * self.decode_s / NOMINAL_UTILISATION)))

    def initial_rate(self, duration_s: float) -> float:
        """The trace's rate at time 0: bursty starts in its low state, diurnal at its trough."""
        if self.trace == "bursty":
            return BENCH_WORKLOAD.bursty_low_fraction * self.peak_rate
        if self.trace == "diurnal":
            return float(diurnal_rate(0.0, self.peak_rate, BENCH_WORKLOAD.diurnal_trough_fraction, duration_s))
        return self.peak_rate


def cluster_config(scale: Scale, duration_s: float, initial: tuple[int, int] | None = None) -> SimulatedCluster:
    """The reference cluster; `initial` pools default to the nominal split at the trace's initial rate."""
    prefill, decode = initial or scale.split(scale.initial_rate(duration_s))
    return SimulatedCluster(profile=BENCH_PROFILE, ttft_s=TTFT_S, tpot_s=TPOT_S, initial_prefill=prefill,
                         initial_decode=decode)


def planner_config(scale: Scale) -> PlannerConfig:
    """The planner's config for the reference cluster: each pool within [1, devices]; up to a
    quarter of the devices per step (at least 4); the other fields are PlannerConfig's defaults."""
    bounds = PoolBounds(1, scale.devices)
    return PlannerConfig(enabled=True, ttft_s=TTFT_S, itl_s=TPOT_S, prefill=bounds, decode=bounds,
                         max_step=max(4, scale.devices // 4), profile=BENCH_PROFILE)


def make_policy(name: str, scale: Scale) -> Policy:
    """A fresh policy: `static` is the nominal split at the peak rate; `planner` is the planner's core."""
    require(name in POLICY_NAMES, f"policy must be one of {POLICY_NAMES}, got {name!r}")
    config = planner_config(scale)
    if name == "static":
        return StaticPolicy(*scale.split(scale.peak_rate))
    if name == "dynamo":
        return DynamoLikePolicy(config)
    if name == "rayserve":
        return RayServeLikePolicy(config)
    return Planner(config)


def default_shards(devices: int) -> int:
    """Processes for one simulation: 2 from SHARD_FROM_DEVICES devices on when there are 2 cores."""
    return 2 if devices >= SHARD_FROM_DEVICES and (os.cpu_count() or 1) >= 2 else 1


def run_simulation(trace_name: str, devices: int, policy_name: str, seed: int, duration_s: float,
                   shards: int | None = None) -> SimulationResult:
    """One simulation of the reference cluster: trace `trace_name` sized to `devices` devices,
    `duration_s` seconds of arrivals, under policy `policy_name` (one of POLICY_NAMES), over
    `shards` processes (None: default_shards)."""
    scale = Scale.of(trace_name, devices)
    trace = make_trace(trace_name, scale.peak_rate, duration_s, seed, BENCH_WORKLOAD)
    # With no request every latency is NaN and attainment a vacuous 1.0: nothing to report.
    require(len(trace) > 0, f"the {trace_name} trace drew no request in {duration_s:g} s at up to "
                            f"{scale.peak_rate:.2f} req/s; simulate a longer duration")
    initial = scale.split(scale.peak_rate) if policy_name == "static" else None
    return simulate(cluster_config(scale, duration_s, initial), trace, make_policy(policy_name, scale), policy_name,
                    default_shards(devices) if shards is None else shards)
