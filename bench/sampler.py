"""What sampling one step costs: the batched sampler (engine/sampler.py) against the per-row sampler
it replaced (testing/sampler_oracle.py, the reference it equals bit for bit), on random float32 logits.

Workloads, each at batch 1, 8, 64 and 256 with vocab 32000; every row has a 512-token prompt and
128 output tokens:
  greedy   every row temperature 0
  sampled  every row temperature 1, top_k 50, top_p 0.9 (half seeded, half on the shared generator)
  mixed    rows in turn: greedy; greedy + repetition penalty 1.2; temperature 0.8 + top_p 0.9 +
           frequency 0.5 / presence 0.3 penalties + logprobs 5; temperature 1.2 + top_k 40 + min_p 0.05
  controls rows in turn: greedy; greedy + a 300-entry logit_bias; temperature 1 + 2000 allowed_token_ids;
           temperature 0.8 + top_p 0.9 + 100 bad words of 1-3 tokens (logit controls on 3 rows in 4)
A timed call builds the rows as the engine's call site does (the old rows copied each output list,
the new ones reference the request's token list) and samples. Calls of the two alternate in rounds
(the machine's speed drifts); each measurement repeats the call for at least 20 ms; medians. The
noise floor is one exponential_ over [sampled rows, vocab]: what both must draw.
Before timing, each case checks that the two return the same tokens and logprobs.

Writes bench/results/sampler.json and .png. Run: .venv/bin/python bench/sampler.py (about 2 minutes;
--quick: batch 1 and 8, 3 rounds, written to the temp directory).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.sampler import Sampler, SamplerOutput, SamplingRow
from splitserve.testing import sampler_oracle as oracle

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
VOCAB_SIZE = 32_000
PROMPT_TOKENS, OUTPUT_TOKENS = 512, 128
BATCH_SIZES = (1, 8, 64, 256)
MIN_MEASURE_S = 0.02
WORKLOADS: dict[str, tuple[SamplingParams, ...]] = {
    "greedy": (SamplingParams(temperature=0.0),),
    "sampled": (SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1),
                SamplingParams(temperature=1.0, top_k=50, top_p=0.9)),
    "mixed": (SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, repetition_penalty=1.2),
              SamplingParams(temperature=0.8, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.3, logprobs=5),
              SamplingParams(temperature=1.2, top_k=40, min_p=0.05)),
    "controls": (SamplingParams(temperature=0.0),
                 SamplingParams(temperature=0.0, logit_bias={t: (t % 7) - 3.0 for t in range(0, VOCAB_SIZE, 107)}),
                 SamplingParams(temperature=1.0, allowed_token_ids=range(0, VOCAB_SIZE, 16)),
                 SamplingParams(temperature=0.8, top_p=0.9,
                                bad_words_token_ids=[tuple(range(t, t + 1 + t % 3)) for t in range(100, 20_000, 199)])),
}
"""Row i of a batch gets WORKLOADS[name][i % len]."""


class Case:
    """One workload at one batch size: the requests' token lists, generators and logits [batch, vocab]."""

    def __init__(self, workload: str, batch_size: int, seed: int) -> None:
        cycle = WORKLOADS[workload]
        self.params = [cycle[i % len(cycle)] for i in range(batch_size)]
        tokens = torch.randint(0, VOCAB_SIZE, (batch_size, PROMPT_TOKENS + OUTPUT_TOKENS),
                               generator=torch.Generator().manual_seed(seed))
        self.all_token_ids = tokens.tolist()
        self.logits = torch.randn(batch_size, VOCAB_SIZE, generator=torch.Generator().manual_seed(seed + 1)) * 3

    def generators(self) -> list[torch.Generator]:
        shared = torch.Generator().manual_seed(0)
        return [shared if p.seed is None else torch.Generator().manual_seed(p.seed + i)
                for i, p in enumerate(self.params)]

    def old_call(self, generators: list[torch.Generator]) -> Callable[[], oracle.SamplerOutput]:
        sampler = oracle.Sampler()

        def call():
            rows = [oracle.SamplingRow(p, tokens[:PROMPT_TOKENS], tokens[PROMPT_TOKENS:], g)
                    for p, tokens, g in zip(self.params, self.all_token_ids, generators)]
            return sampler(self.logits, rows)
        return call

    def new_call(self, generators: list[torch.Generator]) -> Callable[[], SamplerOutput]:
        sampler = Sampler()

        def call():
            rows = [SamplingRow(p, tokens, PROMPT_TOKENS, g)
                    for p, tokens, g in zip(self.params, self.all_token_ids, generators)]
            return sampler(self.logits, rows)
        return call

    def noise_call(self) -> Callable[[], torch.Tensor]:
        """One exponential_ over [sampled rows, vocab]."""
        generator = torch.Generator().manual_seed(0)
        noise = torch.empty(sum(not p.is_greedy for p in self.params), VOCAB_SIZE)
        return lambda: noise.exponential_(generator=generator)


def per_call_s(call: Callable) -> float:
    """Seconds per call, from repeating it for at least MIN_MEASURE_S."""
    calls, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < MIN_MEASURE_S or calls == 0:
        call()
        calls += 1
    return elapsed / calls


def check_equal(case: Case) -> None:
    old, new = case.old_call(case.generators())(), case.new_call(case.generators())()
    assert (old.token_ids, old.logprobs) == (new.token_ids, new.logprobs), "batched sampler != reference"


def measure(case: Case, rounds: int, with_noise: bool) -> dict:
    check_equal(case)
    calls = {"old": case.old_call(case.generators()), "new": case.new_call(case.generators())}
    if with_noise:
        calls["noise_floor"] = case.noise_call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            times[name].append(per_call_s(call))
    result = {f"{name}_ms": 1000 * statistics.median(values) for name, values in times.items()}
    return {**result, "speedup": result["old_ms"] / result["new_ms"]}


def run(batch_sizes: tuple[int, ...], rounds: int) -> list[dict]:
    results = []
    for workload in WORKLOADS:
        for batch_size in batch_sizes:
            case = Case(workload, batch_size, seed=batch_size)
            result = measure(case, rounds, with_noise=not all(p.is_greedy for p in case.params))
            results.append({"workload": workload, "batch_size": batch_size, **result})
            noise = f"  (noise floor {result['noise_floor_ms']:.3f} ms)" if "noise_floor_ms" in result else ""
            print(f"  {workload:8s} batch {batch_size:3d}: old {result['old_ms']:8.3f} ms  new "
                  f"{result['new_ms']:8.3f} ms  x{result['speedup']:.2f}{noise}", flush=True)
    return results


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(13, 4))
    for ax, workload in zip(axes, WORKLOADS):
        rows = [r for r in report["results"] if r["workload"] == workload]
        batches = [r["batch_size"] for r in rows]
        ax.plot(batches, [r["old_ms"] for r in rows], "o-", label="per-row (old)")
        ax.plot(batches, [r["new_ms"] for r in rows], "o-", label="batched (new)")
        noise = [r for r in rows if "noise_floor_ms" in r]
        if noise:
            ax.plot([r["batch_size"] for r in noise], [r["noise_floor_ms"] for r in noise], "k:",
                    label="noise floor (exponential_)")
        for r in rows:
            ax.annotate(f"x{r['speedup']:.1f}", (r["batch_size"], r["new_ms"]), textcoords="offset points",
                        xytext=(0, -12), ha="center", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("ms per step")
        ax.set_title(workload)
        ax.legend(fontsize=8)
    fig.suptitle(f"Sampler step, vocab {VOCAB_SIZE}, {report['torch_threads']} torch thread(s)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, 3 rounds, written to the temp directory")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = run(BATCH_SIZES[:2] if args.quick else BATCH_SIZES, 3 if args.quick else args.rounds)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    report = {"command": " ".join(sys.argv), "commit": commit, "platform": platform.platform(),
              "torch": torch.__version__, "torch_threads": args.threads, "vocab_size": VOCAB_SIZE,
              "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
              "workloads": {name: [repr(p) for p in cycle] for name, cycle in WORKLOADS.items()},
              "results": results}
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sampler.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out_dir / "sampler.png")
    print(f"wrote {out_dir}/sampler.json and .png")


if __name__ == "__main__":
    main()
