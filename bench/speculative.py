"""Speculative decoding on the trained `default` model, offline (EngineCore): off / ngram / draft.

Workloads (greedy, ignore_eos, OUTPUT_TOKENS new tokens each):
  code  prompts of PROMPT_TOKENS tokens cut from the model's held-out stdlib files
        (splitserve.eval.heldout_windows: files the model never trained on): code continuation
  chat  chat-template prompts (user questions about Python) through the model's ChatML template
At batch 1, 8 and 32 (one wave of that many requests), each method runs in the same process,
alternating in rounds (the machine's speed drifts); medians over rounds. The engine runs one torch
thread and time is the process's CPU time (time.process_time): the development machine is shared
(load average 10-16 on 2 cores while this was measured), which makes wall time meaningless, while
a one-thread process's CPU time is what its wall time would be on an idle core. Per run: ITL (a
request's decode time / (its tokens - 1), averaged over requests; tokens of a verified run arrive
together, so this is vLLM's mean TPOT), output tok/s (all tokens / time), acceptance rate
(accepted / draft tokens) and mean accepted length (tokens emitted per verification, vLLM's
definition).
Every run's token ids must equal `off`'s (greedy identity): the bench stops if not.

`--crossover` also runs ngram and draft with no batch threshold on code at batch 2, 4, 16 and 32, to
find where speculation stops paying (config.DEFAULT_BATCH_LIMITS, the default of
SpeculativeConfig.disable_above_batch_size).

Writes bench/results/speculative.json and .png. Run: .venv/bin/python bench/speculative.py
(--quick: batch 1 and 8, 1 round, to the temp directory).

`--cluster` measures through a 1P+1D cluster instead (serving_common's bench cluster: Ray actors
with one torch thread each on loopback, `disaggregation: always`, the prompt's KV pulled over NIXL,
the decode pool speculating via `decode.engine.speculative`), one fresh cluster per method, the
same workloads at batch 1 and 8 (CLUSTER_BATCH_SIZES), `--waves` waves each after a warm-up,
medians. A gRPC client in its own process sends a wave's requests at once and times the
messages: ITL = a request's time from its second message to its last / the tokens after its second
message (the first gap holds the KV pull and the hand-off to the decode worker, which
bench/serving_latency.py measures), averaged over requests; output tok/s = the wave's tokens / its
wall time (send to last token). Wall time on the shared machine: the JSON records the CPU other
processes used during each method (serving_common.ForeignCpu). Acceptance comes from the decode
worker's counters. Every wave's token ids must equal `off`'s. Writes
bench/results/speculative_cluster.json and .png (--quick: 1 wave, to the temp directory).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from splitserve.common.config import EngineConfig, SpeculativeConfig
from splitserve.common.model_dir import DEFAULT_MODEL_NAME, DRAFT_MODEL_NAME
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.llm import load_tokenizer
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.eval import heldout_windows

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PROMPT_TOKENS, OUTPUT_TOKENS = 192, 64
BATCH_SIZES = (1, 8, 32)
CROSSOVER_BATCH_SIZES = (2, 4, 16, 32)
CHAT_QUESTIONS = (
    "How do I read a file line by line in Python?", "Write a function that reverses a list.",
    "What does the with statement do?", "Explain list comprehensions with an example.",
    "How do I parse command line arguments?", "Write a class for a stack with push and pop.",
    "How can I sort a dictionary by value?", "What is a generator in Python?",
)
ENGINE = EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, num_kv_blocks=2048, device="cpu", num_threads=1)
"""One torch thread: the process's CPU time is then its compute time, whatever else runs on the machine."""
METHODS = {
    "off": None,
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=4),
    "draft": SpeculativeConfig(method="draft", draft_model=DRAFT_MODEL_NAME, num_speculative_tokens=4),
}


@dataclass(frozen=True)
class Run:
    workload: str
    method: str
    batch_size: int
    threshold: int | None
    """The run's effective disable_above_batch_size (None: off; 1024: always speculating)."""
    itl_ms: float
    """The median over rounds (offline; in process CPU time, first token to last) or waves (--cluster;
    wall time at the client, second message to last) of the requests' mean ITL."""
    output_tokens_per_s: float
    """The median over rounds / waves of the tokens over the process CPU time / the wave's wall time."""
    acceptance_rate: float
    mean_accepted_length: float
    identical_to_off: bool


def code_prompts(model_dir: Path, count: int) -> list[list[int]]:
    windows = heldout_windows(model_dir)  # [N, context_len + 1]
    step = max(1, len(windows) // count)
    return [windows[i * step % len(windows), :PROMPT_TOKENS].tolist() for i in range(count)]


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    tokenizer = load_tokenizer(model_dir)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
            for i in range(count)]


def generate(engine: EngineCore, prompts: list[list[int]]) -> tuple[list[list[int]], list[float], float]:
    """(token ids per prompt, ITL seconds per request, seconds) of one wave, on the process's CPU clock."""
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"b{index}", prompt, params)
    tokens: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    started = time.process_time()
    while engine.has_unfinished_requests():
        deltas = engine.step()
        now = time.process_time()
        for delta in deltas:
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            first.setdefault(delta.request_id, now)
            last[delta.request_id] = now
    wall = time.process_time() - started
    ids = [f"b{i}" for i in range(len(prompts))]
    itls = [(last[r] - first[r]) / (len(tokens[r]) - 1) for r in ids]
    return [tokens[r] for r in ids], itls, wall


def measure(engines: dict[str, EngineCore], workload: str, prompts: list[list[int]], rounds: int,
            thresholds: dict[str, int | None]) -> list[Run]:
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    before = {name: engine.stats().spec_decode for name, engine in engines.items()}
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            tokens, itls, wall = generate(engines[name], prompts)
            outputs[name] = tokens
            samples[name].append((statistics.mean(itls), sum(map(len, tokens)) / wall))
    runs = []
    for name, engine in engines.items():
        rate, length = _acceptance(before[name], engine.stats().spec_decode)
        runs.append(Run(workload, name, len(prompts), thresholds[name],
                        statistics.median(s[0] for s in samples[name]) * 1e3,
                        statistics.median(s[1] for s in samples[name]), rate, length,
                        outputs[name] == outputs["off"]))
    return runs


def _acceptance(before, after) -> tuple[float, float]:
    """(acceptance rate, mean accepted length) between two SpecDecodeStats snapshots (0, 0 when off)."""
    if after is None or after.num_drafts == before.num_drafts:
        return 0.0, 0.0
    drafts = after.num_drafts - before.num_drafts
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return accepted / (after.num_draft_tokens - before.num_draft_tokens), 1.0 + accepted / drafts


def build_engines(model_dir: Path, threshold: int | None, use_default_threshold: bool) -> dict[str, EngineCore]:
    engines = {}
    for name, speculative in METHODS.items():
        if speculative is not None and not use_default_threshold:
            speculative = replace(speculative, disable_above_batch_size=threshold)
        engines[name] = EngineCore(model_dir, replace(ENGINE, speculative=speculative))
    return engines


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.workload for r in runs})
    figure, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        for method in METHODS:
            points = sorted((r.batch_size, r.itl_ms) for r in runs if r.workload == workload and r.method == method)
            if points:
                axis.plot(*zip(*points), marker="o", label=method)
        axis.set(title=workload, xlabel="batch size", ylabel="ITL (ms)", xscale="log")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)


# ---- through the cluster (--cluster) ----------------------------------------------------------
CLUSTER_BATCH_SIZES = (1, 8)


def client_wave(port: int, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Every prompt at once (greedy, ignore_eos); serving_common.stream_one's records with the output ids."""
    import asyncio

    from serving_common import stream_one, with_stub

    async def body(stub):
        origin = time.perf_counter()
        return await asyncio.gather(*(stream_one(stub, f"w{i}", "wave", prompt, max_tokens, origin, keep_output=True)
                                      for i, prompt in enumerate(prompts)))

    return asyncio.run(with_stub(port, body))


def decode_itl_s(arrivals: list[tuple[float, int]]) -> float:
    """Seconds per token from a request's second message to its last (arrivals: (time, tokens) per message)."""
    tokens = sum(count for _, count in arrivals[2:])
    return (arrivals[-1][0] - arrivals[1][0]) / tokens


def wave_numbers(records: list[dict]) -> tuple[float, float]:
    """(mean decode ITL in seconds, output tokens per second) of one wave."""
    tokens = sum(r["completion_tokens"] for r in records)
    wall = max(r["arrivals"][-1][0] for r in records) - min(r["sent_s"] for r in records)
    return statistics.mean(decode_itl_s(r["arrivals"]) for r in records), tokens / wall


async def decode_spec_stats(cluster):
    """The decode worker's SpecDecodeStats (None when it does not speculate)."""
    (actor,) = cluster.decode_actors
    return (await actor.stats.remote()).engine.spec_decode


def cluster_method(client, method: str, workloads: dict[str, dict[int, list[list[int]]]], waves: int, part,
                   reference: dict[tuple[str, int, int], list[list[int]]]) -> list[Run]:
    """One fresh 1P+1D cluster whose decode pool runs `method`, every workload and batch size on it.
    `reference`: (workload, batch size, wave) -> `off`'s token ids, which `off` (measured first)
    fills and the other methods are compared with."""
    from serving_common import Cluster, cluster_config

    speculative = METHODS[method]
    overrides = {"router.routing.disaggregation": "always", "prefill.engine.dtype": ENGINE.dtype,
                 "decode.engine.dtype": ENGINE.dtype}
    if speculative is not None:
        overrides["decode.engine.speculative"] = asdict(speculative)
    runs = []
    with part(method), Cluster(cluster_config(DEFAULT_MODEL_NAME, "disaggregated", **overrides)) as (cluster, loop):
        client.submit(client_wave, cluster.port, workloads["code"][1], 8).result()  # warm-up: handshake, first steps
        for workload, by_batch in workloads.items():
            for batch_size, prompts in by_batch.items():
                before = loop.run(decode_spec_stats(cluster))
                numbers, identical = [], True
                for wave in range(waves):
                    records = client.submit(client_wave, cluster.port, prompts, OUTPUT_TOKENS).result()
                    numbers.append(wave_numbers(records))
                    tokens = [r["output_token_ids"] for r in records]
                    identical &= reference.setdefault((workload, batch_size, wave), tokens) == tokens
                rate, length = _acceptance(before, loop.run(decode_spec_stats(cluster)))
                runs.append(Run(workload, method, batch_size, speculative and speculative.batch_limit,
                                       statistics.median(n[0] for n in numbers) * 1e3,
                                       statistics.median(n[1] for n in numbers), rate, length, identical))
                print_cluster_run(runs[-1])
    return runs


def print_cluster_run(run: Run) -> None:
    print(f"  {run.workload} b{run.batch_size} {run.method}: ITL {run.itl_ms:.2f} ms, {run.output_tokens_per_s:.0f} "
          f"tok/s, accept {run.acceptance_rate:.2f}, len {run.mean_accepted_length:.2f}, same {run.identical_to_off}",
          flush=True)


def run_cluster_bench(waves: int, quick: bool) -> None:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from serving_common import ForeignCpu, code_version, load_recorder, machine_info, warn_noisy_parts

    model_dir = resolve_model_path(DEFAULT_MODEL_NAME)
    workloads = {name: {b: make(model_dir, b) for b in CLUSTER_BATCH_SIZES}
                 for name, make in (("code", code_prompts), ("chat", chat_prompts))}
    report = {"machine": machine_info(), "code": code_version(),
              "load": {"loadavg_1m_at_start": os.getloadavg()[0]}, "setup": "1P+1D, disaggregation always, NIXL",
              "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "waves": waves,
              "methods": {name: (None if s is None else asdict(s)) for name, s in METHODS.items()}}
    foreign = ForeignCpu()
    part = load_recorder(report, foreign)
    reference: dict[tuple[str, int, int], list[list[int]]] = {}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as client:
        runs = [run for method in METHODS
                for run in cluster_method(client, method, workloads, waves, part, reference)]
    foreign.stop()
    report["runs"] = [asdict(r) for r in runs]
    warn_noisy_parts(report["load"])
    assert all(r.identical_to_off for r in runs), "speculative greedy output through the cluster differs from off"
    out_dir = Path(tempfile.mkdtemp()) if quick else RESULTS
    (out_dir / "speculative_cluster.json").write_text(json.dumps(report, indent=1) + "\n")
    plot_cluster(runs, out_dir / "speculative_cluster.png")
    print(f"wrote {out_dir / 'speculative_cluster.json'}")


def plot_cluster(runs: list[Run], path: Path) -> None:
    """ITL and output tok/s per workload and batch size, a bar per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted({(r.workload, r.batch_size) for r in runs}, key=lambda c: (c[0] != "code", c[1]))
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(METHODS)
    panels = ((axes[0], "itl_ms", "decode ITL (ms)"), (axes[1], "output_tokens_per_s", "output tok/s"))
    for axis, field, label in panels:
        for index, method in enumerate(METHODS):
            by_cell = {(r.workload, r.batch_size): getattr(r, field) for r in runs if r.method == method}
            axis.bar([i + index * width for i in range(len(cells))], [by_cell[c] for c in cells], width, label=method)
        axis.set_xticks([i + width for i in range(len(cells))], [f"{w} b{b}" for w, b in cells])
        axis.set(ylabel=label, title=f"1P+1D cluster: {label}")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--crossover", action="store_true")
    parser.add_argument("--cluster", action="store_true", help="through a 1P+1D cluster instead of offline")
    parser.add_argument("--waves", type=int, default=2, help="--cluster: waves per workload and batch size")
    args = parser.parse_args()
    if args.cluster:
        run_cluster_bench(1 if args.quick else args.waves, args.quick)
        return
    rounds = 1 if args.quick else args.rounds
    batch_sizes = (1, 8) if args.quick else BATCH_SIZES
    model_dir = resolve_model_path(DEFAULT_MODEL_NAME)
    runs: list[Run] = []
    engines = build_engines(model_dir, None, use_default_threshold=True)
    thresholds = {name: (None if s is None else s.batch_limit) for name, s in METHODS.items()}
    for workload, make in (("code", code_prompts), ("chat", chat_prompts)):
        for batch_size in batch_sizes:
            runs.extend(measure(engines, workload, make(model_dir, batch_size), rounds, thresholds))
            print(*(f"{r.workload} b{r.batch_size} {r.method}: ITL {r.itl_ms:.2f} ms, {r.output_tokens_per_s:.0f} tok/s,"
                    f" accept {r.acceptance_rate:.2f}, len {r.mean_accepted_length:.2f}, same {r.identical_to_off}"
                    for r in runs[-len(engines):]), sep="\n", flush=True)
    if args.crossover:
        engines = build_engines(model_dir, 1024, use_default_threshold=False)
        no_threshold = dict.fromkeys(engines)
        for batch_size in CROSSOVER_BATCH_SIZES:
            for run in measure(engines, "code", code_prompts(model_dir, batch_size), rounds, no_threshold):
                runs.append(replace(run, workload="code, no threshold"))
                print(f"crossover b{batch_size} {run.method}: ITL {run.itl_ms:.2f} ms", flush=True)
    assert all(r.identical_to_off for r in runs), "speculative greedy output differs from off"
    out_dir = Path(tempfile.mkdtemp()) if args.quick else RESULTS
    result = {"machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                          "torch": torch.__version__, "threads": torch.get_num_threads()},
              "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "rounds": rounds,
              "methods": {name: (None if s is None else asdict(s)) for name, s in METHODS.items()},
              "runs": [asdict(r) for r in runs]}
    (out_dir / "speculative.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(runs, out_dir / "speculative.png")
    print(f"wrote {out_dir / 'speculative.json'}")


if __name__ == "__main__":
    main()
