"""The oversized-prompt attack of issue 20 against a LocalCluster whose router runs in this
process: streams run undisturbed, then the same streams run while one 16 MB prompt and then 20
concurrent 4 MB prompts arrive on the OpenAI API. Measured: each refusal's status and latency, the
streams' inter-token gaps (ITL) in both phases, whether any worker stopped counting as answering
(sampled every 10 ms), and this process's RSS. bench/fault_matrix.py --attack runs it.

The streams' reader and the attacker are each a spawned process (standard library only), as they
would be other machines: in the router's process their own work (building and sending 96 MB of
JSON, reading the streams) would hold the router's GIL and count as the router's stall."""

from __future__ import annotations

import http.client
import json
import multiprocessing
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event

STREAMS = 4
STREAM_TOKENS = 300
FOUR_MB_PROMPTS = 20
SAMPLE_S = 0.01
PHASE_TIMEOUT_S = 240.0
"""Bound of one phase (its processes are killed past it); a phase takes a few seconds."""


class SseStream(threading.Thread):
    """A streamed /v1/completions read event by event; `gaps` are the seconds between events."""

    def __init__(self, port: int, model: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.port, self.model, self.prompt = port, model, prompt
        self.gaps: list[float] = []
        self.first = threading.Event()
        self.done = False

    def run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": STREAM_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            connection.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                               headers={"Content-Type": "application/json"})
            last = None
            for line in connection.getresponse():
                if not line.strip():
                    continue
                now = time.monotonic()
                if last is not None:
                    self.gaps.append(now - last)
                last = now
                self.first.set()
                self.done = line.strip() == b"data: [DONE]"
        finally:
            self.first.set()
            connection.close()


def post_seconds(port: int, body: bytes) -> tuple[int, float]:
    """(HTTP status, seconds from send to the answer) of one POST /v1/completions."""
    started = time.monotonic()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status, time.monotonic() - started
    finally:
        connection.close()


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


# ---- the client processes (spawned; only the standard library) ------------------------------

def streams_main(port: int, model: str, prompt: list[int], running: Event, out: Connection) -> None:
    """STREAMS streams; sets `running` once each has its first event; sends (every gap of every
    stream, how many ended with [DONE])."""
    streams = [SseStream(port, model, prompt) for _ in range(STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.first.wait(120)
    running.set()
    for stream in streams:
        stream.join(180)
    out.send(([gap for stream in streams for gap in stream.gaps], sum(stream.done for stream in streams)))


def strike_main(port: int, model: str, running: Event, out: Connection) -> None:
    """Once `running` is set: one 16 MB prompt, then FOUR_MB_PROMPTS 4 MB prompts at once. The bodies
    are built before the streams run. Sends ((status, seconds) of the 16 MB one, those of each 4 MB one)."""
    big = json.dumps({"model": model, "prompt": "the river runs by the old mill " * 516_129, "max_tokens": 4})
    four_mb = json.dumps({"model": model, "prompt": "a" * (4 << 20), "max_tokens": 4}).encode()
    running.wait(120)
    first = post_seconds(port, big.encode())
    answers: list = [None] * FOUR_MB_PROMPTS
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, post_seconds(port, four_mb)))
               for i in range(FOUR_MB_PROMPTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    out.send((first, tuple(answers)))


# ---- the attack, from the router's process ---------------------------------------------------

@dataclass(frozen=True)
class AttackOutcome:
    big_status: int
    big_s: float
    concurrent: tuple[tuple[int, float], ...]
    """(status, seconds) of each 4 MB prompt."""
    itl_p99_undisturbed_s: float
    itl_p99_attacked_s: float
    streams_finished: int
    workers_ever_unanswering: tuple[str, ...]
    rss_before: int
    rss_peak: int
    rss_after: int


def attack(cluster, model: str) -> AttackOutcome:
    """Needs cluster.orchestrator (router.replicas 1: the router is in this process)."""
    port = cluster.http.port
    prompt = list(range(5, 69))
    undisturbed, _, _ = _phase(port, model, prompt, with_strike=False)
    unanswering: set[str] = set()
    rss = [rss_bytes()]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(SAMPLE_S):
            orchestrator = cluster.orchestrator
            unanswering.update(w for w in orchestrator.infos if orchestrator.monitor.load(w) is None)
            rss.append(rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        attacked, finished, strike = _phase(port, model, prompt, with_strike=True)
    finally:
        stop.set()
        sampler.join()
    (big_status, big_s), concurrent = strike
    return AttackOutcome(big_status, big_s, concurrent, _p99(undisturbed), _p99(attacked), finished,
                         tuple(sorted(unanswering)), rss[0], max(rss), rss_bytes())


def _phase(port: int, model: str, prompt: list[int], with_strike: bool) -> tuple[list[float], int, tuple | None]:
    """The streams' process, and with_strike the attacker's, each joined (killed past
    PHASE_TIMEOUT_S). Returns the streams' gaps, how many finished, and the strike's answers."""
    context = multiprocessing.get_context("spawn")
    running = context.Event()
    streams_out, streams_in = context.Pipe(duplex=False)
    strike_out, strike_in = context.Pipe(duplex=False)
    processes = [context.Process(target=streams_main, args=(port, model, prompt, running, streams_in))]
    if with_strike:
        processes.append(context.Process(target=strike_main, args=(port, model, running, strike_in)))
    deadline = time.monotonic() + PHASE_TIMEOUT_S
    try:
        for process in processes:
            process.start()
        gaps, finished = _receive(streams_out, deadline)
        strike = _receive(strike_out, deadline) if with_strike else None
    finally:
        for process in processes:
            if process.pid is None:
                continue
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
    return gaps, finished, strike


def _receive(connection: Connection, deadline: float):
    if not connection.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"an attack client sent nothing within {PHASE_TIMEOUT_S:.0f} s")
    return connection.recv()


def _p99(values: list[float]) -> float:
    from splitserve.planner.samples import nearest_rank

    return nearest_rank(sorted(values), 0.99)
