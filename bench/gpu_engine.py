"""The engine on a CUDA GPU: the torch reference attention, FlashInfer, and FlashInfer with CUDA graphs, on the
same models and workloads; batch-1 decode against the HBM roofline.

Models (random weights, bfloat16, built by the bench like every other bench model): engine_throughput.py's 88M
Llama, and a 1.1B Llama (TinyLlama's shape: 22 layers, hidden 2048, 32 heads / 4 KV heads, intermediate 5632,
with an 8192-token vocabulary). Workloads are engine_throughput.py's (random prompt tokens, greedy, ignore_eos,
all submitted at once): batch 64 x 128/128, mixed (128 requests, prompts 32-512, outputs 16-256), one request
128/128, prefill 8 x 2047/1. Each (model, variant) gets one `LLM`: a warm-up generate before every timed one.

Batch-1 decode: the median `EngineCore.step` of one request with a 256-token context (the step ends when the
sampled id reaches the host, so it is timed whole), against the bytes it must read (weights + the request's KV)
at the HBM bandwidth measured in the same rounds by a 1 GiB device-to-device copy, counted as bytes read plus
bytes written (a decode step only reads, so this is the bandwidth it could reach).

vLLM's GPU build is not run here: it is compared only where its wheel can be installed on the GPU machine (the
machines this was measured on have no package registry); the JSON says so.

Writes bench/results/gpu_engine.json and .png.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine_throughput import (MAX_MODEL_LEN, MODELS, WORKLOADS, Timed, generate, make_workloads, run_workloads,
                               warmup_workload, weight_bytes_per_step)
from serving_common import bench_parser, code_version, write_report
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.engine.tiny_model import TinyModelSpec
from splitserve.testing.tiny_models import cached_tiny_model

GPU_MODELS = {"88M": MODELS["88M"],
              "1.1B": TinyModelSpec(num_layers=22, hidden_size=2048, num_heads=32, num_kv_heads=4,
                                    intermediate_size=5632, vocab_size=MODELS["88M"].vocab_size, seed=0,
                                    initializer_range=0.02)}
VARIANTS = {"torch": {"attention_backend": "torch", "cuda_graphs": False},
            "flashinfer": {"attention_backend": "flashinfer", "cuda_graphs": False},
            "flashinfer+graphs": {"attention_backend": "flashinfer", "cuda_graphs": True}}
ENGINE_ARGS = {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 256, "max_num_batched_tokens": 4096,
               "max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 8 << 30, "enable_prefix_caching": False}
RESULTS = Path(__file__).parent / "results"
VLLM_NOT_RUN = ("vLLM's GPU build was not run: the GPU machine has no package registry and its wheel (with its "
                "CUDA dependencies) is far over what can be carried there")


@dataclass(frozen=True)
class DecodeRoofline:
    model: str
    variant: str
    step_ms: float
    roofline_ms: float
    fraction_of_roofline: float
    """Median over rounds of roofline time / step time (bandwidth and steps measured in alternation)."""
    weight_bytes: int
    kv_bytes_per_step: int
    hbm_bytes_per_s: float
    """Device copy bandwidth, bytes read + bytes written per second."""


def hbm_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    src = torch.ones(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / statistics.median(times)


def batch1_decode(llm: LLM, model: str, variant: str, rounds: int = 5, steps_per_round: int = 20,
                  context: int = 256) -> DecodeRoofline:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=rounds * steps_per_round + 2, ignore_eos=True)
    engine.add_request("roofline", list(range(3, 3 + context)), params)
    engine.step()  # prefill
    engine.step()  # the first decode (a CUDA graph's replay is warm after it)
    weight_bytes = weight_bytes_per_step(engine.model.arch, torch.bfloat16)
    spec = engine.kv_cache.spec
    kv_bytes = spec.bytes_per_block * (context + rounds * steps_per_round // 2) // spec.block_size
    bandwidths, steps = [], []
    for _ in range(rounds):
        bandwidths.append(hbm_bandwidth())
        times = []
        for _ in range(steps_per_round):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        steps.append(statistics.median(times))
    while engine.has_unfinished_requests():
        engine.step()
    fractions = [(weight_bytes + kv_bytes) / bw / step for bw, step in zip(bandwidths, steps)]
    bandwidth, step_s = statistics.median(bandwidths), statistics.median(steps)
    return DecodeRoofline(model, variant, 1e3 * step_s, 1e3 * (weight_bytes + kv_bytes) / bandwidth,
                          statistics.median(fractions), weight_bytes, kv_bytes, bandwidth)


def run_variant(model: str, variant: str, workloads, warmup) -> tuple[dict, DecodeRoofline]:
    print(f"{model} {variant}", flush=True)
    start = time.perf_counter()
    llm = LLM(cached_tiny_model(GPU_MODELS[model]), **ENGINE_ARGS, **VARIANTS[variant])
    startup_s = time.perf_counter() - start
    results: dict[str, Timed] = run_workloads(lambda workload: generate(llm, workload), workloads, warmup)
    roofline = batch1_decode(llm, model, variant)
    print(f"  batch-1 decode {roofline.step_ms:.2f} ms/step, roofline {roofline.roofline_ms:.2f} ms "
          f"({100 * roofline.fraction_of_roofline:.0f}%)", flush=True)
    del llm
    torch.cuda.empty_cache()
    return ({"model": model, "variant": variant, "startup_s": startup_s,
             "results": {name: dict(asdict(t), tokens_per_s=t.tokens_per_s) for name, t in results.items()}},
            roofline)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, names = report["runs"], report["workloads"]
    fig, axes = plt.subplots(1, len(names) + 1, figsize=(4 * (len(names) + 1), 4))
    for ax, name in zip(axes, names):
        labels = [f"{run['model']}\n{run['variant']}" for run in runs]
        ax.bar(range(len(runs)), [run["results"][name]["tokens_per_s"] for run in runs],
               color=[f"C{list(VARIANTS).index(run['variant'])}" for run in runs])
        ax.set_xticks(range(len(runs)), labels, rotation=60, fontsize=7)
        ax.set(title=name, ylabel=f"{report['counts'][name]} tokens/s")
    roof = report["batch1_decode"]
    ax = axes[-1]
    ax.bar(range(len(roof)), [100 * r["fraction_of_roofline"] for r in roof],
           color=[f"C{list(VARIANTS).index(r['variant'])}" for r in roof])
    ax.set_xticks(range(len(roof)), [f"{r['model']}\n{r['variant']}" for r in roof], rotation=60, fontsize=7)
    ax.set(title="batch-1 decode", ylabel="% of HBM roofline")
    fig.suptitle(f"splitserve on {report['machine']['gpu']} (bf16; no vLLM GPU run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = bench_parser(__doc__, "88M only, smaller workloads", RESULTS)
    parser.add_argument("--models", nargs="+", choices=list(GPU_MODELS), default=list(GPU_MODELS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    workloads = {name: workload for name, workload in make_workloads(MODELS["88M"].vocab_size, args.seed,
                                                                     args.quick).items() if name in args.workloads}
    warmup = warmup_workload(MODELS["88M"].vocab_size, args.seed)
    report = {"command": " ".join(["bench/gpu_engine.py", *sys.argv[1:]]), "code": code_version(),
              "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "cuda": torch.version.cuda},
              "engine_args": ENGINE_ARGS, "variants": VARIANTS, "vllm": VLLM_NOT_RUN,
              "workloads": list(workloads), "counts": {name: w.counts for name, w in workloads.items()},
              "runs": [], "batch1_decode": []}
    for model in (["88M"] if args.quick else args.models):
        for variant in args.variants:
            run, roofline = run_variant(model, variant, workloads, warmup)
            report["runs"].append(run)
            report["batch1_decode"].append(asdict(roofline))
            # Written after every run: a bench cut off by a time limit keeps what it measured.
            out_dir = write_report(report, "gpu_engine", args, RESULTS, plot)
    print(f"wrote {out_dir / 'gpu_engine.json'}")


if __name__ == "__main__":
    main()
