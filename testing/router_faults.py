"""Faults of several routers, and of a worker under them, on a LocalCluster (Ray on loopback):
one router killed under load, one worker's process killed. tests/test_routers.py asserts on these
outcomes; bench/fault_matrix.py records them (docs/reliability.md)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from splitserve.testing.workloads import GreedyCase

REAP_WITHIN_S = 1.0
"""The issue's bound: a dead router's requests are gone from every worker this soon after the kill."""
GIVE_UP_S = 10.0
"""Waits for an outcome end here (a hung cluster fails instead of blocking)."""


def router_cluster_config(model_dir, **overrides):
    """1 prefill + 1 decode worker and 2 routers. Decode's KV pool holds about two of
    `load_cases()`'s requests at once, so the others wait for blocks while the prefill worker holds
    their KV under a lease (30 s): a router killed then has KV held for it."""
    from splitserve.testing.local_cluster import tiny_cluster_config

    return tiny_cluster_config(model_dir, **{"router.replicas": 2, "router.resources.num_cpus": 0.25,
                                             "decode.engine.num_kv_blocks": 64, "decode.engine.max_model_len": 256,
                                             "prefill.engine.max_model_len": 256, **overrides})


def load_cases(num_streams: int = 16, seed: int = 20) -> list[GreedyCase]:
    rng = random.Random(seed)
    return [GreedyCase(tuple(rng.randrange(3, 512) for _ in range(rng.randrange(24, 64))), 160, True)
            for _ in range(num_streams)]


@dataclass(frozen=True)
class StreamResult:
    tokens: tuple[int, ...]
    code: str | None
    """The gRPC status code's name when the stream did not finish."""
    finish_reason: str | None = None
    """The last response's finish_reason ('length', 'stop', or 'abort': a worker ended the request)."""


def stream_on_own_connection(port: int, request_id: str, case: GreedyCase,
                             started: threading.Event | None = None) -> StreamResult:
    """One greedy gRPC stream over a connection of its own (so the kernel's SO_REUSEPORT spread
    places each stream on some router); `started` is set at its first response or its end."""
    import grpc

    from splitserve.proto.splitserve.v1 import generation_pb2 as pb
    from splitserve.proto.splitserve.v1 import generation_pb2_grpc

    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=case.prompt_token_ids),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=case.max_tokens,
                                                            ignore_eos=case.ignore_eos))
    tokens: list[int] = []
    finish_reason = None
    options = [("grpc.use_local_subchannel_pool", 1)]  # no connection shared with another channel
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        try:
            for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
                tokens.extend(response.token_ids)
                finish_reason = response.finish_reason or finish_reason
                if started is not None:
                    started.set()
        except grpc.RpcError as error:
            return StreamResult(tuple(tokens), error.code().name, finish_reason)
        finally:
            if started is not None:
                started.set()
    return StreamResult(tuple(tokens), None, finish_reason)


def worker_routers(cluster) -> dict[str, frozenset[str]]:
    """worker id -> the routers with requests on it (WorkerStats.routers)."""
    import ray

    stats = ray.get([actor.stats.remote() for actor in cluster.actors.values()], timeout=30)
    return {worker_id: s.routers for worker_id, s in zip(cluster.actors, stats)}


def index_is_exact(cluster, router, timeout_s: float = GIVE_UP_S) -> bool:
    """Whether the router's prefix index holds exactly each worker's cached blocks, once its
    report polls caught up (they answer within router.worker_link.report_wait_s of a change)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        snapshots = ray.get([actor.report.remote(None, 0, 0.0) for actor in cluster.actors.values()], timeout=30)
        truth = {worker_id: report.snapshot.block_hashes for worker_id, report in zip(cluster.actors, snapshots)}
        if ray.get(router.index_hashes.remote(), timeout=30) == truth:
            return any(truth.values())
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


@dataclass(frozen=True)
class RouterDeath:
    """One of two routers killed under load."""

    in_flight: tuple[tuple[str, int], ...]
    """Each router's requests in flight just before the kill."""
    victim: str
    held_on_prefill: bool
    """The prefill worker held requests of the victim at the kill (the lease would keep them 30 s)."""
    results: tuple[StreamResult, ...]
    reaped_s: float
    """Kill -> no worker lists the victim (its queued prompts and held KV included)."""

    @property
    def cut(self) -> tuple[StreamResult, ...]:
        return tuple(result for result in self.results if result.code is not None)


def kill_a_router_under_load(cluster, cases: Sequence[GreedyCase], told_before_s: float = 0.0) -> RouterDeath:
    """Send every case on its own connection, kill (ray.kill: its process ends) the router with
    the most requests among those whose KV the prefill worker holds once every stream started,
    and wait for the streams to end.

    `told_before_s` > 0: every worker is first told the router is gone (abort_router, what
    RouterReaper calls on Ray's DEAD) and the kill follows that much later. Ray publishes DEAD a
    few ms before the killed process has exited (4-8 ms measured on loopback); this widens that
    window, in which the router still serves its clients, so a test meets it every time."""
    import ray

    started = [threading.Event() for _ in cases]
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(stream_on_own_connection, cluster.port, f"req-{index}", case, started[index])
                   for index, case in enumerate(cases)]
        if not all(event.wait(120) for event in started):
            raise TimeoutError("streams did not start within 120 s")
        in_flight = {router_id: ray.get(router.num_in_flight.remote()) for router_id, router in cluster.routers.items()}
        held = worker_routers(cluster)["prefill-0"] & set(in_flight)
        victim = max(held or in_flight, key=in_flight.get)
        if told_before_s > 0:
            ray.get([actor.abort_router.remote(victim) for actor in cluster.actors.values()], timeout=30)
            time.sleep(told_before_s)
        ray.kill(cluster.routers.pop(victim))
        killed_at = time.monotonic()
        while any(victim in routers for routers in worker_routers(cluster).values()):
            if time.monotonic() - killed_at > GIVE_UP_S:
                raise TimeoutError(f"the workers kept router {victim}'s requests for {GIVE_UP_S} s")
            time.sleep(0.01)
        reaped_s = time.monotonic() - killed_at
        results = tuple(future.result(timeout=180) for future in futures)
    return RouterDeath(tuple(sorted(in_flight.items())), victim, victim in held, results, reaped_s)


@dataclass(frozen=True)
class WorkerKill:
    """A worker's process SIGKILLed under routers that watch Ray's actor states."""

    worker_id: str
    states: tuple[str, ...]
    """What Ray's actor-state channel reported for it (deploy/actor_states.py)."""
    unroutable_s: float
    """Kill -> no router routes to it."""
    rejoined_s: float
    """Kill -> every router routes to it again (Ray restarted it; its new epoch is in)."""


def kill_a_worker(cluster, loop, worker_id: str, poll_s: float = 0.005) -> WorkerKill:
    import ray

    from splitserve.deploy.actor_states import ActorStateWatch, actor_id_of

    actor = cluster.actors[worker_id]
    pid = ray.get(actor.__ray_call__.remote(lambda worker: os.getpid()), timeout=30)
    states: list[str] = []
    watch = ActorStateWatch()
    loop.run(watch.start())
    watch.watch(actor_id_of(actor), states.append)
    routers = list(cluster.routers.values())

    def routed_by() -> list[bool]:
        return [worker_id in routable for routable in ray.get([r.routable_workers.remote() for r in routers])]

    try:
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        unroutable_s = _wait(lambda: not any(routed_by()), killed_at, GIVE_UP_S, poll_s)
        rejoined_s = _wait(lambda: all(routed_by()), killed_at, 120.0, 0.05)
    finally:
        loop.run(watch.stop())
    return WorkerKill(worker_id, tuple(states), unroutable_s, rejoined_s)


def _wait(condition: Callable[[], bool], since: float, timeout_s: float, poll_s: float) -> float:
    """Seconds from `since` until condition() holds; TimeoutError after timeout_s."""
    while not condition():
        if time.monotonic() - since > timeout_s:
            raise TimeoutError(f"not reached within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic() - since
