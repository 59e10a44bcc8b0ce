"""Workers die under load on a real Ray cluster (KV over NIXL): a decode worker's process is
SIGKILLed, a prefill worker's gets SIGTERM. Every stream ends finished, moved requests included,
with greedy output equal to Hugging Face's; Ray restarts the dead worker, which rejoins the
router's pool with a new engine epoch; every worker ends idle."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import pytest
import ray

from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.proto.splitserve.v1 import generation_pb2_grpc
from splitserve.testing.local_cluster import running_cluster, tiny_cluster_config
from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy

pytestmark = pytest.mark.slow

NUM_REQUESTS = 16
ARRIVAL_GAP_S = 0.05
KILL_AFTER_REQUESTS = 6
"""The worker dies right after this many requests were sent (the rest arrive after its death)."""


@dataclass(frozen=True)
class WorkerDeathOutcome:
    """Counts of one run: requests sent, finished and failed, moves off the dead worker, and the
    longest a stream went without a response (the client-visible recovery time)."""

    scenario: str
    sent: int
    completed: int
    failed: int
    migrated: int
    max_stall_s: float
    rejoined_s: float
    """Kill -> the restarted worker reporting to the router again (routable)."""
    failures: tuple[str, ...]


def death_cases(seed: int = 11) -> list[GreedyCase]:
    rng = random.Random(seed)
    return [GreedyCase(tuple(rng.randrange(3, 512) for _ in range(rng.randrange(16, 120))), 40, True)
            for _ in range(NUM_REQUESTS)]


def _stream(port: int, index: int, case: GreedyCase) -> tuple[list[int], float, str | None]:
    """Tokens, the longest gap between responses, and the error code (None when it finished)."""
    request = pb.GenerateRequest(request_id=f"req-{index}", token_ids=pb.TokenIds(ids=case.prompt_token_ids),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=case.max_tokens,
                                                            ignore_eos=case.ignore_eos))
    tokens, stall, last = [], 0.0, time.monotonic()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            for response in generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120):
                now = time.monotonic()
                stall, last = max(stall, now - last), now
                tokens.extend(response.token_ids)
        except grpc.RpcError as error:
            return tokens, stall, f"{error.code().name}: {error.details()}"
    return tokens, stall, None


def _actor_pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda worker: os.getpid()), timeout=30)


def run_worker_death(model_dir, role: str, signum: int) -> tuple[WorkerDeathOutcome, list[list[int]]]:
    """Send NUM_REQUESTS greedy requests ARRIVAL_GAP_S apart to a 2P+2D cluster and deliver
    `signum` to the process of the `role` pool's first worker after KILL_AFTER_REQUESTS were sent."""
    cases = death_cases()
    config = tiny_cluster_config(model_dir, prefill=2, decode=2)
    with running_cluster(config) as (cluster, loop):
        actors = cluster.prefill_actors if role == "prefill" else cluster.decode_actors
        pid = _actor_pid(actors[0])
        worker_id = f"{role}-0"
        epoch = cluster.orchestrator.index.cursor(worker_id)[0]
        with ThreadPoolExecutor(NUM_REQUESTS) as pool:
            futures = []
            for index, case in enumerate(cases):
                futures.append(pool.submit(_stream, cluster.port, index, case))
                if index + 1 == KILL_AFTER_REQUESTS:
                    if role == "decode":  # the premise of the migration check: a stream is on it when it dies
                        _wait_for_a_request_on(cluster.orchestrator.decode_pool, worker_id)
                    os.kill(pid, signum)
                    killed_at = time.monotonic()
                time.sleep(ARRIVAL_GAP_S)
            results = [future.result() for future in futures]
        rejoined_s = loop.run(_rejoined(cluster.orchestrator, worker_id, epoch)) - killed_at
        loop.run(cluster.wait_idle(timeout_s=30))
        migrated = cluster.metrics.registry.get_sample_value("splitserve_request_migrations_total",
                                                             {"model_name": cluster.metrics.model_name})
    failures = tuple(error for _, _, error in results if error is not None)
    outcome = WorkerDeathOutcome(f"{signal.Signals(signum).name} {role}-0 under load", len(cases),
                                 len(cases) - len(failures), len(failures), int(migrated),
                                 round(max(stall for _, stall, _ in results), 3), round(rejoined_s, 2), failures)
    return outcome, [tokens for tokens, _, _ in results]


def _wait_for_a_request_on(pool, worker_id: str, timeout_s: float = 10.0) -> None:
    """Until the router holds a request on the worker. Which of the requests sent so far land on it, and
    whether they are still running when the kill comes, depends on routing and on how fast the engine is."""
    deadline = time.monotonic() + timeout_s
    while pool.num_requests(worker_id) == 0:
        assert time.monotonic() < deadline, f"no request reached {worker_id} within {timeout_s} s"
        time.sleep(0.005)


async def _rejoined(orchestrator, worker_id: str, old_epoch: str, timeout_s: float = 120.0) -> float:
    """time.monotonic() once the worker reports again with a new epoch (Ray restarted it)."""
    deadline = time.monotonic() + timeout_s
    while orchestrator.monitor.load(worker_id) is None or orchestrator.index.cursor(worker_id)[0] == old_epoch:
        assert time.monotonic() < deadline, f"{worker_id} did not rejoin within {timeout_s} s"
        await asyncio.sleep(0.05)
    return time.monotonic()


@pytest.mark.parametrize("role, signum", [("decode", signal.SIGKILL), ("prefill", signal.SIGTERM)])
def test_a_worker_dying_under_load_loses_no_request(tiny_llama_dir, role, signum):
    outcome, outputs = run_worker_death(tiny_llama_dir, role, signum)
    assert (outcome.sent, outcome.completed, outcome.failed, outcome.failures) == (NUM_REQUESTS, NUM_REQUESTS, 0, ())
    assert outputs == [hf_greedy(tiny_llama_dir, case) for case in death_cases()]
    if role == "decode":  # streams were running there when it died
        assert outcome.migrated >= 1
