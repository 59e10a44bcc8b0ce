"""A bounded soak of a LocalCluster: mixed requests (shared prefixes, 1-200 prompt tokens, 1-64
output tokens) with random cancels from several client threads, while one worker's process is
SIGKILLed every `kill_every_s` (prefill and decode in turn; Ray restarts it). Afterwards every
worker must be idle (no leaked block, lease or transfer), no stream may have hung (each is bounded
by STREAM_TIMEOUT_S), and every failure must be a status the docs list for such faults.
bench/fault_matrix.py --soak-minutes runs it."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass

from splitserve.testing.workloads import GreedyCase, mixed_workload

STREAM_TIMEOUT_S = 60.0
"""A stream still open this long is hung (the tiny model's longest request takes well under a second)."""
CANCEL_FRACTION = 0.2
MAX_CANCEL_AFTER_S = 0.3
DOCUMENTED_FAILURES = frozenset({"UNAVAILABLE", "RESOURCE_EXHAUSTED"})
"""What a stream may end with under worker kills besides OK and the client's own CANCELLED
(docs/serving.md, status codes): UNAVAILABLE once a request moved routing.max_migrations times or no
worker answers, RESOURCE_EXHAUSTED when admission refuses it."""


@dataclass(frozen=True)
class SoakOutcome:
    seconds: float
    requests: int
    codes: tuple[tuple[str, int], ...]
    """How the streams ended: OK, CANCELLED (by the client), or a status code's name."""
    hung: int
    kills: tuple[str, ...]
    """The workers killed, in order ('-' where the worker was still restarting)."""
    workers_idle_after: bool

    @property
    def undocumented(self) -> tuple[str, ...]:
        return tuple(code for code, _ in self.codes if code not in {"OK", "CANCELLED", *DOCUMENTED_FAILURES})


def soak(cluster, loop, minutes: float, kill_every_s: float = 120.0, clients: int = 6, seed: int = 0) -> SoakOutcome:
    cases = mixed_workload(512, num_requests=400, seed=seed, max_prompt=200, max_output=64)
    stop = threading.Event()
    codes: Counter[str] = Counter()
    lock = threading.Lock()
    started = time.monotonic()

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        while not stop.is_set():
            code = _one_request(cluster.port, f"soak-{index}-{rng.random():.12f}", rng.choice(cases), rng)
            with lock:
                codes[code] += 1

    threads = [threading.Thread(target=client, args=(index,), daemon=True) for index in range(clients)]
    for thread in threads:
        thread.start()
    kills = _kill_workers(cluster, stop, started + minutes * 60, kill_every_s)
    stop.set()
    for thread in threads:
        thread.join(STREAM_TIMEOUT_S + 10)
    try:
        loop.run(cluster.wait_idle(timeout_s=60))
        idle = True
    except TimeoutError:
        idle = False
    hung = codes.pop("HUNG", 0)
    return SoakOutcome(round(time.monotonic() - started, 1), sum(codes.values()) + hung,
                       tuple(sorted(codes.items())), hung, kills, idle)


def _one_request(port: int, request_id: str, case: GreedyCase, rng: random.Random) -> str:
    """One streamed request on its own connection, cancelled by the client at a random time for
    CANCEL_FRACTION of them; returns how it ended (HUNG: still open after STREAM_TIMEOUT_S)."""
    import grpc

    from splitserve.proto.splitserve.v1 import generation_pb2 as pb
    from splitserve.proto.splitserve.v1 import generation_pb2_grpc

    request = pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=case.prompt_token_ids),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=case.max_tokens,
                                                            ignore_eos=case.ignore_eos))
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=STREAM_TIMEOUT_S)
        cancel = None
        if rng.random() < CANCEL_FRACTION:
            cancel = threading.Timer(rng.uniform(0, MAX_CANCEL_AFTER_S), call.cancel)
            cancel.start()
        try:
            for _ in call:
                pass
        except grpc.RpcError as error:
            return "HUNG" if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED else error.code().name
        finally:
            if cancel is not None:
                cancel.cancel()
    return "OK"


def _kill_workers(cluster, stop: threading.Event, until: float, kill_every_s: float) -> tuple[str, ...]:
    """SIGKILL prefill-0 and decode-0 in turn every kill_every_s until `until`."""
    import ray

    kills = []
    targets = [worker_id for worker_id in ("prefill-0", "decode-0") if worker_id in cluster.actors]
    while not stop.wait(max(0.0, min(kill_every_s, until - time.monotonic()))):
        if time.monotonic() >= until:
            break
        worker_id = targets[len(kills) % len(targets)]
        try:
            pid = ray.get(cluster.actors[worker_id].__ray_call__.remote(lambda worker: os.getpid()), timeout=10)
        except (ray.exceptions.RayError, TimeoutError):
            kills.append("-")  # still restarting from the last kill
            continue
        os.kill(pid, signal.SIGKILL)
        kills.append(worker_id)
    return tuple(kills)
