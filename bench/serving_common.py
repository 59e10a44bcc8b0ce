"""What the whole-cluster benchmarks share (serving_latency.py, routing.py).

- The load generator's side: one streamed Generate call, timed at the client. It runs in a
  spawned process (its own GIL, like a real client) and imports only grpc, the generated code
  and the torch-free client; so this module imports only the standard library at the top, and
  heavy imports live inside the functions that run in the parent.
- The cluster: the bench model's cluster config (every worker a Ray actor with one torch thread
  and 0.5 Ray CPUs, so the workers and the router share the 2-core machine) and a context that
  starts it on a fresh Ray session.
- Statistics (percentiles, summaries, per-token gaps), the CPU used by other processes while a
  part runs, and the machine and code version a result was measured on.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

POOL_NUM_CPUS = 0.5
"""Ray CPUs per worker actor, so 2 workers + the router fit the 2-core machine (Ray's own
OMP_NUM_THREADS is then 1, and each engine runs 1 torch thread)."""
DECODE_KV_BYTES = 512 << 20
"""Decode pool per worker (the product default is 2 GiB; 512 MiB = 2048 blocks is plenty here)."""
BLOCK_SIZE = 16
"""Tokens per KV block in every pool of the bench cluster."""
MS = 1000.0


# ---- the load generator (runs in the spawned client process) -------------------------------
def build_request(request_id: str, token_ids: list[int], max_tokens: int):
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.deploy.client import build_generate_request

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return build_generate_request(token_ids=token_ids, params=params, request_id=request_id)


async def stream_one(stub, request_id: str, klass: str, token_ids: list[int], max_tokens: int, origin: float,
                     keep_output: bool = False) -> dict:
    """One Generate call; arrivals are (seconds since origin, tokens in the message).
    keep_output: the record also carries the output token ids."""
    request = build_request(request_id, token_ids, max_tokens)
    sent = time.perf_counter()
    arrivals, final, output = [], None, []
    async for response in stub.Generate(request):
        now = time.perf_counter()
        if response.token_ids:
            arrivals.append((now - origin, len(response.token_ids)))
            output += response.token_ids
        if response.finish_reason:
            final = response
    t = final.timing
    record = {"request_id": request_id, "class": klass, "prompt_tokens": len(token_ids), "sent_s": sent - origin,
              "arrivals": arrivals, "finish_reason": final.finish_reason,
              "cached_tokens": final.usage.cached_tokens, "completion_tokens": final.usage.completion_tokens,
              "timing": {"queue_s": t.queue_s, "prefill_s": t.prefill_s, "transfer_s": t.transfer_s,
                         "first_token_s": t.first_token_s, "total_s": t.total_s}}
    if keep_output:
        record["output_token_ids"] = output
    return record


async def with_stub(port: int, body):
    """await body(stub) on a channel to the cluster's gRPC port."""
    import grpc

    from splitserve.proto.splitserve.v1 import generation_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        return await body(generation_pb2_grpc.GenerationStub(channel))


def client_sequential(port: int, requests: list[tuple[str, str, list[int], int]]) -> list[dict]:
    """(request_id, class, token_ids, max_tokens) one after another."""
    async def body(stub):
        return [await stream_one(stub, rid, klass, ids, n, time.perf_counter()) for rid, klass, ids, n in requests]

    return asyncio.run(with_stub(port, body))


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(length)]  # ids 0..2 are special tokens


# ---- statistics -------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(values_s: list[float]) -> dict:
    if not values_s:
        return {"n": 0}
    return {"n": len(values_s), "p50_ms": MS * percentile(values_s, 50), "p90_ms": MS * percentile(values_s, 90),
            "p99_ms": MS * percentile(values_s, 99), "mean_ms": MS * statistics.fmean(values_s),
            "max_ms": MS * max(values_s)}


def token_gaps(arrivals: list[tuple[float, int]], skip: int = 0) -> list[float]:
    """Per-token latencies: a message of k tokens after a gap g counts k tokens of g/k.
    Gaps 0..skip-1 (0 = first token -> next message) are left out."""
    gaps = []
    for index in range(max(1, skip + 1), len(arrivals)):
        gap, count = arrivals[index][0] - arrivals[index - 1][0], arrivals[index][1]
        gaps += [gap / count] * count
    return gaps


def ttft_s(record: dict) -> float:
    return record["arrivals"][0][0] - record["sent_s"]


# ---- other users of the machine ------------------------------------------------------------
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_stat(pid: int) -> tuple[int, int, float] | None:
    """(ppid, start time in clock ticks since boot, CPU seconds) of a process; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


class ForeignCpu:
    """CPU seconds used by processes outside this process's tree (the machine is shared), from
    /proc, sampled every second on a daemon thread into the running total `total_s`; `samples`
    keeps (time.perf_counter(), total_s) of every sample."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self._started_ticks = float(Path("/proc/uptime").read_text().split()[0]) * CLOCK_TICKS
        self._cpu: dict[tuple[int, int], float] = {}
        self._mine: set[tuple[int, int]] = set()
        """(pid, start) of every process ever seen in this tree: Ray's leftovers outlive their parent."""
        self.total_s = 0.0
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _processes(self) -> dict[int, tuple[int, int, float]]:
        """pid -> (ppid, start time in ticks since boot, CPU seconds)."""
        stats = {int(entry): process_stat(int(entry)) for entry in filter(str.isdigit, os.listdir("/proc"))}
        return {pid: stat for pid, stat in stats.items() if stat is not None}

    def _sample(self) -> None:
        processes = self._processes()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in processes.items():
            children.setdefault(ppid, []).append(pid)
        mine, stack = set(), [os.getpid()]
        while stack:
            pid = stack.pop()
            mine.add(pid)
            stack += children.get(pid, [])
        self._mine.update((pid, processes[pid][1]) for pid in mine if pid in processes)
        for pid, (_, start, cpu) in processes.items():
            key = (pid, start)
            if key in self._mine:
                continue
            previous = self._cpu.get(key, 0.0 if start > self._started_ticks else cpu)
            self.total_s += cpu - previous
            self._cpu[key] = cpu
        self.samples.append((time.perf_counter(), self.total_s))

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._sample()

    def shares(self, start: float, end: float, window_s: float) -> list[float]:
        """Foreign CPU in each window_s window of [start, end], as a share of the machine's cores."""
        def total_at(moment: float) -> float:  # the last sample at or before moment
            return max(((at, total) for at, total in self.samples if at <= moment), default=(0.0, 0.0))[1]

        # Whole windows; the remainder joins the last one.
        edges = [start + i * window_s for i in range(max(1, int((end - start) // window_s)))] + [end]
        return [round((total_at(b) - total_at(a)) / (b - a) / os.cpu_count(), 3)
                for a, b in zip(edges, edges[1:]) if b > a]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def load_recorder(report: dict, foreign: ForeignCpu, window_s: float = 5.0):
    """A context manager per part: its duration, the load average at its end, and the CPU that
    other processes used meanwhile, in all and per window_s (a part is only as clean as that
    share is small)."""

    @contextmanager
    def part(name: str):
        print(f"{name} ...", flush=True)
        started, foreign_before = time.perf_counter(), foreign.total_s
        yield
        ended = time.perf_counter()
        seconds, foreign_s = ended - started, foreign.total_s - foreign_before
        report["load"][name] = {"seconds": seconds, "loadavg_1m_at_end": os.getloadavg()[0],
                                "foreign_cpu_s": foreign_s, "foreign_share": foreign_s / seconds / os.cpu_count(),
                                "window_s": window_s, "foreign_share_per_window": foreign.shares(started, ended,
                                                                                                  window_s)}
    return part


def wait_while_tests_run(poll_s: float = 5.0, max_wait_s: float = 900.0) -> float:
    """Wait while someone's pytest runs (its load would pollute our numbers); the seconds waited."""
    import subprocess

    started = time.perf_counter()
    while time.perf_counter() - started < max_wait_s:
        if subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode != 0:
            break
        time.sleep(poll_s)
    waited = time.perf_counter() - started
    if waited > 1:
        print(f"  waited {waited:.0f} s for a test run to end", flush=True)
    return waited


def warn_noisy_parts(load: dict) -> None:
    for name, part in load.items():
        if isinstance(part, dict) and part["foreign_share"] > 0.05:
            print(f"\nwarning: other processes used {part['foreign_cpu_s']:.0f} CPU-s "
                  f"({100 * part['foreign_share']:.0f}% of the machine) during {name}; its numbers are noisy")


# ---- the cluster ------------------------------------------------------------------------
def cluster_config(model_dir: Path | str, mode: str, num_prefill: int = 1, num_decode: int = 1, **overrides):
    """The bench cluster serving `model_dir` (a model directory or "default", the embedded model;
    it is also the served model's name): `num_prefill` + `num_decode` workers (colocated: `num_decode` workers
    only), NIXL transfers, 1 torch thread and POOL_NUM_CPUS Ray CPUs per worker, fp32, 16-token
    blocks; `overrides` (dotted keys, e.g. "router.routing.policy") on top."""
    from splitserve.deploy.cluster_config import apply_overrides, default_cluster_config

    disaggregated = mode == "disaggregated"
    settings = {"mode": mode, "prefill.replicas": num_prefill if disaggregated else 0,
                "decode.replicas": num_decode, "router.grpc_port": 0, "kv_transfer_backend": "nixl",
                "decode.engine.kv_cache_memory_bytes": DECODE_KV_BYTES}
    for pool in ("prefill", "decode"):
        settings.update({f"{pool}.engine.num_threads": 1, f"{pool}.engine.device": "cpu",
                         f"{pool}.engine.dtype": "float32", f"{pool}.engine.block_size": BLOCK_SIZE,
                         f"{pool}.resources.num_cpus": POOL_NUM_CPUS})
    settings.update(overrides)
    return apply_overrides(default_cluster_config(str(model_dir)), settings)


class Cluster:
    """running_cluster + ray.shutdown, so every configuration starts from a fresh Ray."""

    def __init__(self, config) -> None:
        from splitserve.testing.local_cluster import running_cluster

        self._context = running_cluster(config)

    def __enter__(self):
        started = time.perf_counter()
        cluster, loop = self._context.__enter__()
        print(f"  cluster up in {time.perf_counter() - started:.1f} s (port {cluster.port})", flush=True)
        return cluster, loop

    def __exit__(self, *exc_info) -> None:
        import ray

        try:
            self._context.__exit__(*exc_info)
        finally:
            ray.shutdown()


# ---- report -----------------------------------------------------------------------------
def _version(distribution: str) -> str | None:
    """The installed version, None where it is not installed (e.g. Ray on a GPU machine given only the engine)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def machine_info() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "ray": _version("ray"), "nixl_cu12": _version("nixl-cu12"),
            "grpcio": _version("grpcio"), "worker_torch_threads": 1, "bench_process_torch_threads": 1,
            "ray_num_cpus_per_actor": POOL_NUM_CPUS,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def code_version() -> dict:
    """The commit measured and the tracked files that differed from it (others may be editing the tree)."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout
        except FileNotFoundError:  # a machine without git (a GPU machine given a copy of the tree)
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {"commit": git("rev-parse", "HEAD").strip(), "modified_files": dirty}


# ---- a bench script's frame -----------------------------------------------------------------
def bench_parser(description: str, quick_help: str, results: Path) -> argparse.ArgumentParser:
    """--quick, --out-dir and --seed; a script adds its own options."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"default: {results} (a --quick run: {tempfile.gettempdir()}, so it never replaces "
                             "the full results)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    return parser


def non_negative_int(text: str) -> int:
    """An argparse type: a bad value is argparse's usage error naming the flag, not a traceback later
    (numpy's generators refuse a negative seed)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def start_bench() -> float:
    """One torch thread in this process, a warning when the machine is already busy; the start time."""
    import torch

    torch.set_num_threads(1)
    if os.getloadavg()[0] > 1.0:
        print(f"warning: load average {os.getloadavg()[0]:.1f} before starting; latencies will be noisy", flush=True)
    return time.perf_counter()


def loaded_kernel_isa():
    """The ISA of the loaded C++ CPU kernels (engine/cpu_kernels.py); exits with the reason when they did
    not load, for benches that compare them with something."""
    from splitserve.engine.cpu_kernels import cpu_kernel_isa

    isa = cpu_kernel_isa()
    if isa is None:
        sys.exit("the CPU kernels did not load on this machine (see the log): nothing to compare")
    return isa


def report_header(script: str, args: argparse.Namespace) -> dict:
    """What every result starts with: how it was run, on what machine and code, how busy the machine was."""
    return {"command": " ".join([script, *sys.argv[1:]]), "quick": args.quick, "seed": args.seed,
            "machine": machine_info(), "code": code_version(), "load": {"loadavg_1m_at_start": os.getloadavg()[0]}}


def write_report(report: dict, name: str, args: argparse.Namespace, results: Path, plot) -> Path:
    """<out dir>/<name>.json and, by plot(report, path), <name>.png; the out dir."""
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) if args.quick else results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out_dir / f"{name}.png")
    return out_dir
