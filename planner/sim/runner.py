"""Running a simulation: in this process, or split over processes (shards) stepped in lockstep.

Sharding uses more than one core for one large cluster. Request i of the trace goes to shard
i mod k, so each shard sees the arrival process thinned by k (rates and burst structure scale
by 1/k), and each shard owns its share of every pool. Every tick each shard sends its window to
this process, which merges the windows into one Observation for the policy (control.Controller)
and sends each shard its share of the decision: of n replicas, shard i gets n // k + (i < n % k),
and at least 1 while n >= 1 (a pool the policy keeps non-empty is non-empty in every shard, so a
total below k is rounded up to k). Routing is per shard: a request only sees its shard's workers
(with the least-loaded router of pool.py, a negligible difference at hundreds of workers).
"""

from __future__ import annotations

import multiprocessing
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import numpy as np

from splitserve.planner.core.types import Decision
from splitserve.planner.sim.cluster import Run, Simulator, SimulatorOutput, assemble, run_local
from splitserve.planner.sim.config import SimulatedCluster
from splitserve.planner.sim.control import Controller, Policy
from splitserve.planner.sim.report import SimulationResult
from splitserve.planner.sim.traces import Trace
from splitserve.planner.sim.window import Window


def share(replicas: int, shard: int, shards: int) -> int:
    """Shard `shard`'s part of a pool of `replicas` (module docstring)."""
    if replicas == 0:
        return 0
    return max(1, replicas // shards + (1 if shard < replicas % shards else 0))


def shard_trace(trace: Trace, shard: int, shards: int) -> Trace:
    """Requests shard, shard + shards, ... of the trace (read-only views)."""
    part = slice(shard, None, shards)
    return Trace(trace.name, trace.duration_s, trace.arrival_s[part], trace.prompt_tokens[part],
                 trace.output_tokens[part], trace.prefix_group[part], trace.shared_tokens[part])


def shard_decision(decision: Decision, shard: int, shards: int) -> Decision:
    prefill, decode = decision.prefill, decision.decode
    return replace(decision, prefill=replace(prefill, replicas=share(prefill.replicas, shard, shards)),
                   decode=replace(decode, replicas=share(decode.replicas, shard, shards)))


@dataclass(frozen=True)
class ShardFailure:
    """A shard's exception, as text (sent instead of a window or an output)."""

    text: str


def _shard_main(config: SimulatedCluster, trace: Trace, connection: Connection) -> None:
    """A shard process: simulate, sending each window and receiving its share of the decision."""
    def control(window: Window) -> Decision | None:
        connection.send(window)
        return connection.recv()
    try:
        connection.send(Simulator(config, trace, control).run())
    except BaseException:  # the parent must hear of it, or it waits forever
        connection.send(ShardFailure(traceback.format_exc()))
    finally:
        connection.close()


def _receive(connection: Connection) -> Window | SimulatorOutput:
    message = connection.recv()
    if isinstance(message, ShardFailure):
        raise RuntimeError(f"a simulation shard failed:\n{message.text}")
    return message


def _lockstep(controller: Controller, connections: list[Connection]) -> list[SimulatorOutput]:
    """Every tick: all shards' windows -> one decision -> each shard's share; until they all end."""
    shards = len(connections)
    while True:
        messages = [_receive(c) for c in connections]
        if all(isinstance(m, SimulatorOutput) for m in messages):
            return messages
        decision = controller.decide(messages)
        for shard, connection in enumerate(connections):
            connection.send(None if decision is None else shard_decision(decision, shard, shards))


def run_sharded(config: SimulatedCluster, trace: Trace, policy: Policy, policy_name: str, shards: int) -> Run:
    started = time.perf_counter()
    # spawn, never fork: forking a process that runs other threads (torch's OpenMP pool, gRPC, Ray
    # clients in a test session) can leave a lock held forever in the child, which then never
    # sends its first window while this process waits for it.
    context = multiprocessing.get_context("spawn")
    controller = Controller(config, policy, trace.duration_s)
    pipes = [context.Pipe() for _ in range(shards)]
    processes = []
    for shard, (_, child) in enumerate(pipes):
        part = replace(config, initial_prefill=share(config.initial_prefill, shard, shards),
                       initial_decode=share(config.initial_decode, shard, shards))
        processes.append(context.Process(target=_shard_main, args=(part, shard_trace(trace, shard, shards), child),
                                         daemon=True))
        processes[-1].start()
        child.close()
    try:
        outputs = _lockstep(controller, [parent for parent, _ in pipes])
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
    ids = [np.arange(shard, len(trace), shards) for shard in range(shards)]
    return assemble(config, trace, policy_name, outputs, ids, controller.timeline, time.perf_counter() - started)


def simulate_run(config: SimulatedCluster, trace: Trace, policy: Policy, policy_name: str, shards: int = 1) -> Run:
    """Run `trace` through a fresh cluster under `policy` (policies keep state: pass a fresh one),
    in this process (shards = 1) or over `shards` processes."""
    if shards == 1:
        return run_local(config, trace, policy, policy_name)[1]
    return run_sharded(config, trace, policy, policy_name, shards)


def simulate(config: SimulatedCluster, trace: Trace, policy: Policy, policy_name: str,
             shards: int = 1) -> SimulationResult:
    return simulate_run(config, trace, policy, policy_name, shards).result
