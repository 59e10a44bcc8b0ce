"""What metrics cost: throughput of the same workload with the router's metrics on and off.

Metrics live at the router (a RequestRecord per request, turned into Prometheus samples by
RouterMetrics.observe, and the scrape) and in the workers' reports (cumulative counters the
router already polls for routing). So the bench runs what a user runs, router + prefill worker
+ decode worker, in one process (InProcessCluster: in-process KV transfer, so the router's work
competes with the engines for the same GIL and cores: a pessimistic setting), on the random
serving model (RANDOM_SERVING_SPEC, the embedded default when these results were recorded; a
small model makes the router's share of the work large, so the ratio is a worst case). "On" = the orchestrator's observer is RouterMetrics.observe
and a client scrapes /metrics over HTTP once a second (Prometheus' default is every 15 s);
"off" = no observer, no scrape. One cluster serves every round; rounds alternate off/on in an
ABBA order so drift hits both alike; the ratio is median(on) / median(off) of output tokens/s.

What cannot be switched off, because routing needs it or it is one clock read per request,
is measured on its own: building a worker's WorkerCounters (every report poll), the router's
per-chunk timeline bookkeeping, and RouterMetrics.observe for one finished request.

Writes bench/results/metrics_overhead.json and .png. Run: .venv/bin/python bench/metrics_overhead.py
(about 70 s; --quick: 4 rounds, written to the temp directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import timeit
import urllib.request
from pathlib import Path

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.slo import SloConfig
from splitserve.testing.tiny_models import RANDOM_SERVING_SPEC, cached_tiny_model
from splitserve.engine.worker_report import worker_counters
from splitserve.router.metrics_server import RouterMetrics
from splitserve.router.records import RequestTimeline
from splitserve.testing.in_process_cluster import InProcessCluster

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SLO = SloConfig(ttft_s=1.0, tpot_s=0.05)
MODEL_NAME = "tiny-llama"
"""The model_name label of every sample (any served name)."""
SCRAPE_INTERVAL_S = 1.0
CONCURRENCY, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 96, 64
"""8 x (96 + 64) tokens = 160 KV blocks: fits the in-process workers' 256-block pools at once."""
WAVES_PER_ROUND = 4
"""A round runs this many waves of CONCURRENCY requests one after another (about a second)."""


class Scraper:
    """GETs /metrics every SCRAPE_INTERVAL_S while enabled (a Prometheus stand-in), on its own thread."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.enabled = threading.Event()
        self.durations_s: list[float] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopped.wait(SCRAPE_INTERVAL_S):
            if self.enabled.is_set():
                started = time.perf_counter()
                with urllib.request.urlopen(self.url, timeout=10) as response:
                    response.read()
                self.durations_s.append(time.perf_counter() - started)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()


async def run_round(cluster: InProcessCluster, rng: random.Random, vocab_size: int, tag: str) -> dict:
    """WAVES_PER_ROUND waves of CONCURRENCY requests at once (fresh random prompts: nothing is
    found in a prefix cache)."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    tokens, started = 0, time.perf_counter()
    for wave in range(WAVES_PER_ROUND):
        prompts = [[rng.randrange(3, vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(CONCURRENCY)]
        outputs = await asyncio.gather(*(cluster.generate(f"{tag}-{wave}-{i}", p, params)
                                         for i, p in enumerate(prompts)))
        tokens += sum(len(c.token_ids) for chunks in outputs for c in chunks)
    seconds = time.perf_counter() - started
    assert tokens == WAVES_PER_ROUND * CONCURRENCY * OUTPUT_TOKENS
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}


async def run_rounds(model_dir: Path, num_pairs: int, seed: int) -> tuple[list[dict], list[float], dict]:
    metrics, records = RouterMetrics(SLO, MODEL_NAME), []

    def observe(record):
        records.append(record)
        metrics.observe(record)

    rng = random.Random(seed)
    async with InProcessCluster(model_dir, slo=SLO) as cluster:
        metrics.watch(cluster.orchestrator)
        scraper = Scraper(metrics.serve("127.0.0.1", 0))
        try:
            await run_round(cluster, rng, RANDOM_SERVING_SPEC.vocab_size, "warmup")
            rounds = []
            for index, on in enumerate(_abba(num_pairs)):
                cluster.orchestrator.observer = observe if on else None
                scraper.enabled.set() if on else scraper.enabled.clear()
                result = await run_round(cluster, rng, RANDOM_SERVING_SPEC.vocab_size, f"r{index}")
                rounds.append({"metrics": on, **result})
                print(f"  round {index:2d} metrics {'on ' if on else 'off'} {result['tokens_per_s']:7.1f} tok/s",
                      flush=True)
            micro = micro_costs(cluster, records[-1])
        finally:
            scraper.enabled.clear()
            scraper.stop()
            await asyncio.to_thread(metrics.stop)
    return rounds, scraper.durations_s, micro


def _abba(num_pairs: int) -> list[bool]:
    """off, on, on, off, off, on, ...: each mode equally often first and second."""
    return [bool((i + i // 2) % 2) for i in range(2 * num_pairs)]


def micro_costs(cluster: InProcessCluster, record) -> dict:
    """Microseconds per call of the always-on pieces and of observe()."""
    engine = cluster.prefill_workers[0].engine
    timeline = RequestTimeline(time.monotonic())
    fresh = RouterMetrics(SLO, MODEL_NAME)
    number = 20000

    def per_call_us(fn, n: int = number) -> float:
        return min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e6

    return {"worker_counters_us_per_report": per_call_us(lambda: worker_counters(engine, 0)),
            "timeline_on_tokens_us_per_chunk": per_call_us(lambda: timeline.on_tokens(1, False, time.monotonic())),
            "observe_us_per_request": per_call_us(lambda: fresh.observe(record), 2000),
            "observed_request_output_tokens": record.num_output_tokens}


def summarize(rounds: list[dict], scrapes_s: list[float]) -> dict:
    """Medians over all rounds, and the on/off ratio within each ABBA block of four rounds (which
    cancels drift slower than a block)."""
    on = [r["tokens_per_s"] for r in rounds if r["metrics"]]
    off = [r["tokens_per_s"] for r in rounds if not r["metrics"]]
    blocks = [rounds[i:i + 4] for i in range(0, len(rounds) - 3, 4)]
    block_ratios = [statistics.mean(r["tokens_per_s"] for r in block if r["metrics"])
                    / statistics.mean(r["tokens_per_s"] for r in block if not r["metrics"]) for block in blocks]
    return {"median_tokens_per_s_on": statistics.median(on), "median_tokens_per_s_off": statistics.median(off),
            "ratio_on_over_off": statistics.median(on) / statistics.median(off),
            "abba_block_ratios": block_ratios, "median_block_ratio": statistics.median(block_ratios),
            "min_max_on": [min(on), max(on)], "min_max_off": [min(off), max(off)],
            "scrapes": len(scrapes_s), "median_scrape_ms": 1000 * statistics.median(scrapes_s) if scrapes_s else None}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = report["rounds"]
    fig, ax = plt.subplots(figsize=(8, 4))
    colors = ["tab:orange" if r["metrics"] else "tab:blue" for r in rounds]
    ax.bar(range(len(rounds)), [r["tokens_per_s"] for r in rounds], color=colors)
    summary = report["summary"]
    for key, color, label in (("median_tokens_per_s_on", "tab:orange", "metrics on"),
                              ("median_tokens_per_s_off", "tab:blue", "metrics off")):
        ax.axhline(summary[key], color=color, linestyle="--", label=f"{label}: median {summary[key]:.0f} tok/s")
    ax.set_xlabel("round (ABBA order)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Router metrics on vs off: ratio {summary['ratio_on_over_off']:.3f} (ABBA blocks: median "
                 f"{summary['median_block_ratio']:.3f})\n"
                 f"({WAVES_PER_ROUND} x {CONCURRENCY} requests of {PROMPT_TOKENS}+{OUTPUT_TOKENS} tokens per round)",
                 fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 pairs of rounds, written to the temp directory")
    parser.add_argument("--pairs", type=int, default=20, help="pairs of (off, on) rounds (default 20, even)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    model_dir = cached_tiny_model(RANDOM_SERVING_SPEC)
    rounds, scrapes_s, micro = asyncio.run(run_rounds(model_dir, 2 if args.quick else args.pairs, args.seed))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    report = {"command": " ".join(sys.argv), "commit": commit, "platform": platform.platform(),
              "workload": {"concurrency": CONCURRENCY, "waves_per_round": WAVES_PER_ROUND, "prompt_tokens": PROMPT_TOKENS,
                           "output_tokens": OUTPUT_TOKENS, "scrape_interval_s": SCRAPE_INTERVAL_S,
                           "model": "random llama, 4 layers, hidden 256 (RANDOM_SERVING_SPEC)", "torch_threads": 1},
              "rounds": rounds, "summary": summarize(rounds, scrapes_s), "micro_costs": micro}
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metrics_overhead.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out_dir / "metrics_overhead.png")
    print(json.dumps({**report["summary"], **micro}, indent=1))
    print(f"wrote {out_dir}/metrics_overhead.json and .png")


if __name__ == "__main__":
    main()
