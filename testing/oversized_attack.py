"""The oversized-prompt attack of issue 20 against a LocalCluster whose router runs in this
process: streams run undisturbed, then the same streams run while one 16 MB prompt and then 20
concurrent 4 MB prompts arrive on the OpenAI API. Measured: each refusal's status and latency, the
streams' inter-token gaps (ITL) in both phases, whether any worker stopped counting as answering
(sampled every 10 ms), and this process's RSS. bench/fault_matrix.py --attack runs it."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass

STREAMS = 4
STREAM_TOKENS = 300
FOUR_MB_PROMPTS = 20
SAMPLE_S = 0.01


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
    undisturbed = _run_streams(port, model, prompt, lambda: None)
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
    results: dict[str, object] = {}

    def strike() -> None:
        big = json.dumps({"model": model, "prompt": "the river runs by the old mill " * 516_129, "max_tokens": 4})
        results["big"] = post_seconds(port, big.encode())
        four_mb = json.dumps({"model": model, "prompt": "a" * (4 << 20), "max_tokens": 4}).encode()
        answers: list = [None] * FOUR_MB_PROMPTS
        threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, post_seconds(port, four_mb)))
                   for i in range(FOUR_MB_PROMPTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        results["concurrent"] = tuple(answers)

    attacked = _run_streams(port, model, prompt, strike)
    stop.set()
    sampler.join()
    return AttackOutcome(*results["big"], results["concurrent"], _p99(undisturbed[0]), _p99(attacked[0]),
                         attacked[1], tuple(sorted(unanswering)), rss[0], max(rss), rss_bytes())


def _run_streams(port: int, model: str, prompt: list[int], during) -> tuple[list[float], int]:
    """STREAMS streams; `during()` runs once every stream has its first event. Returns every gap
    of every stream and how many ended with [DONE]."""
    streams = [SseStream(port, model, prompt) for _ in range(STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.first.wait(120)
    during()
    for stream in streams:
        stream.join(180)
    return [gap for stream in streams for gap in stream.gaps], sum(stream.done for stream in streams)


def _p99(values: list[float]) -> float:
    from splitserve.planner.samples import nearest_rank

    return nearest_rank(sorted(values), 0.99)
