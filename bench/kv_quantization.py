"""Quantized KV cache (kv_cache_dtype auto / int8 / fp8_e4m3): capacity, bytes moved, decode speed, quality.

Models: the trained `default` model (5.5M Llama: 6 layers, 4 KV heads of 32) and the 88M Llama shape of
bench/engine_throughput.py (12 layers, 4 KV heads of 64, random weights).
Per model, in one process:
  - KV capacity: tokens a 1 GiB pool holds (whole blocks of 16), from the pool's own sizing (exact);
  - KV bytes moved per request: TransferParams.num_bytes of a 512-token prompt's blocks (what a pull moves);
  - decode tokens/s at batch 64: 64 requests with 128-token prompts, all prefilled, then `--steps` decode steps
    timed (64 tokens each), in wall time and in this process's CPU time; the three KV dtypes run in
    interleaved rounds (auto, int8, fp8, auto, ...) and the median round counts. bfloat16 compute, 2 torch
    threads. The machine is shared with other work: compare the ratios, measured side by side, and prefer
    tokens per CPU-second (other processes stretch wall time far more than the cycles a step needs);
  - scale granularity (trained model, its real keys and values of held-out windows): the relative error
    ||x' - x|| / ||x|| of int8 and fp8 round trips with a scale per token per KV head (what the pool stores),
    per block per KV head (16 tokens share one) and per token (all KV heads share one);
  - quality (trained model only: a random model's perplexity means nothing): the quality harness
    (splitserve.eval) over the held-out windows, perplexity, top-1 agreement and KL against the model in
    float32 through transformers, for each KV dtype under float32 and bfloat16 compute.
Targets (issue 17): perplexity within +1% of the same compute dtype's auto KV, capacity 2x and bytes moved
0.5x of bf16.

Writes bench/results/kv_quantization.json and .png. Run: .venv/bin/python bench/kv_quantization.py
(--quick: fewer steps and windows, written to the temp directory).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

from serving_common import bench_parser, positive_int, random_prompt, report_header, start_bench, write_report
from splitserve.common.config import EngineConfig
from splitserve.common.kv_transfer_types import TransferParams
from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.kv_cache import num_blocks_for
from splitserve.engine.tiny_model import TinyModelSpec, resolve_model_path
from splitserve.eval import EngineVariant, evaluate, heldout_windows
from splitserve.testing.tiny_models import cached_tiny_model

RESULTS = Path(__file__).parent / "results"
KV_DTYPES = ("auto", "int8", "fp8_e4m3")
SHAPE_88M = TinyModelSpec(num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                          vocab_size=8192, seed=0)
"""bench/engine_throughput.py's 88M Llama."""
BATCH, PROMPT_LEN, MOVED_PROMPT_LEN = 64, 128, 512
CAPACITY_BYTES = 1 << 30
THREADS = 2


def _engine(model_dir: Path, kv_cache_dtype: str, dtype: str = "bfloat16") -> EngineCore:
    return EngineCore(model_dir, EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=16,
                                              max_num_seqs=BATCH, max_num_batched_tokens=2048, max_model_len=512,
                                              kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
                                              device="cpu", num_threads=THREADS))


def sizes(engine: EngineCore) -> dict:
    """Capacity and bytes moved, from the pool's sizing and its transfer layout."""
    spec, layout = engine.kv_cache.spec, engine.kv_layout("bench")
    blocks = num_blocks_for(EngineConfig(kv_cache_memory_bytes=CAPACITY_BYTES), spec, torch.device("cpu"))
    num_blocks = -(-MOVED_PROMPT_LEN // spec.block_size)
    params = TransferParams("r", "p", tuple(range(num_blocks)), MOVED_PROMPT_LEN, layout, 30.0, (0,) * num_blocks)
    return {"kv_bytes_per_token": spec.bytes_per_token, "tokens_per_gib": blocks * spec.block_size,
            "bytes_moved_per_request": params.num_bytes, "pool_dtype": layout.dtype, "row_width": layout.row_width}


def _prefill_all(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> None:
    """Admit every prompt and step until each has its first token (all of them decode from here on)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{engine.num_generation_tokens}-{index}", prompt, params)  # unique per round
    while engine.stats().num_waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()


def decode_round(engine: EngineCore, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of `steps` decode steps of the whole batch (every request
    keeps decoding throughout). CPU time is the steadier measure on a shared machine: other processes
    stretch the wall time of a step much more than the cycles it needs."""
    _prefill_all(engine, prompts, steps + 2)
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - started, time.process_time() - cpu_started
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    while engine.has_work():
        engine.step()
    return seconds


def measure_model(name: str, model_dir: Path, steps: int, rounds: int) -> dict:
    engines = {kv: _engine(model_dir, kv) for kv in KV_DTYPES}
    rng = random.Random(0)
    prompts = [random_prompt(rng, PROMPT_LEN, engines["auto"].vocab_size) for _ in range(BATCH)]
    for engine in engines.values():  # warm-up: kernels built, buffers allocated
        decode_round(engine, prompts[:4], 2)
    seconds: dict[str, list[tuple[float, float]]] = {kv: [] for kv in KV_DTYPES}
    for round_index in range(rounds):
        for kv, engine in engines.items():
            seconds[kv].append(decode_round(engine, prompts, steps))
        print(f"{name} round {round_index}: " + ", ".join(f"{kv} {s[-1][0]:.2f} s ({s[-1][1]:.2f} s CPU)"
                                                          for kv, s in seconds.items()), flush=True)
    rows = {}
    for kv, engine in engines.items():
        wall, cpu = (statistics.median(part) for part in zip(*seconds[kv]))
        rows[kv] = {**sizes(engine), "decode_tokens_per_s": BATCH * steps / wall,
                    "decode_tokens_per_cpu_s": BATCH * steps / cpu, "round_seconds": seconds[kv]}
    fp32 = sizes(_engine(model_dir, "auto", "float32"))
    for kv in KV_DTYPES:
        rows[kv]["capacity_vs_bf16"] = rows[kv]["tokens_per_gib"] / rows["auto"]["tokens_per_gib"]
        rows[kv]["bytes_moved_vs_bf16"] = rows[kv]["bytes_moved_per_request"] / rows["auto"]["bytes_moved_per_request"]
        rows[kv]["bytes_moved_vs_fp32"] = rows[kv]["bytes_moved_per_request"] / fp32["bytes_moved_per_request"]
        rows[kv]["decode_vs_auto"] = rows[kv]["decode_tokens_per_s"] / rows["auto"]["decode_tokens_per_s"]
        rows[kv]["decode_cpu_vs_auto"] = rows[kv]["decode_tokens_per_cpu_s"] / rows["auto"]["decode_tokens_per_cpu_s"]
    arch = engines["auto"].model.arch
    return {"model": name, "num_layers": arch.num_layers, "num_kv_heads": arch.num_kv_heads, "head_dim": arch.head_dim,
            "float32_auto": fp32, "rows": rows}


GRANULARITIES = {"token x kv head": (-1,), "block x kv head": (-3, -1), "token": (-2, -1)}
"""Scale granularity -> the dims of a pool layer [num_blocks, 2, block_size, Hkv, D] that share one scale."""


def _round_trip_error(x: torch.Tensor, dims: tuple[int, ...], max_code: float, fp8: bool) -> float:
    """||x' - x|| / ||x|| for the pool's formulas (engine/kv_quant.py) with one scale per `dims` slice."""
    scale = (x.abs().amax(dim=dims, keepdim=True) / max_code).to(torch.bfloat16).float()
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    scaled = (x / scale).clamp(-max_code, max_code)
    codes = scaled.to(torch.float8_e4m3fn).float() if fp8 else scaled.round()
    return ((codes * scale - x).norm() / x.norm()).item()


def measure_granularity(model_dir: Path, windows: torch.Tensor) -> dict:
    """Round-trip errors of the model's own keys and values (float32 pools filled by scoring each window)."""
    from splitserve.engine import LLM

    length = windows.shape[1] - 1
    llm = LLM(model_dir, dtype="float32", block_size=16, max_model_len=length, num_kv_blocks=-(-length // 16),
              enable_prefix_caching=False)
    layers: list[torch.Tensor] = []
    for window in windows:
        llm.prompt_logits(window[:-1].tolist())
        layers += [layer.clone() for layer in llm.engine.kv_cache.layers]  # the pool holds just this window
    errors = {}
    for name, dims in GRANULARITIES.items():
        for kv, max_code, fp8 in (("int8", 127.0, False), ("fp8_e4m3", 448.0, True)):
            errors[f"{kv}, {name}"] = statistics.mean(_round_trip_error(x, dims, max_code, fp8) for x in layers)
    return errors


def measure_quality(model_dir: Path, max_windows: int | None) -> list[dict]:
    variants = [EngineVariant(f"{dtype}-kv-{kv}", dtype=dtype, kv_cache_dtype=kv)
                for dtype in ("float32", "bfloat16") for kv in KV_DTYPES]
    windows = heldout_windows(model_dir, max_windows)
    results = evaluate(model_dir, variants, windows, show_progress=sys.stderr.isatty())
    rows = [{"variant": r.variant, "dtype": r.dtype, "perplexity": r.perplexity, "top1_agreement": r.top1_agreement,
             "kl_divergence": r.kl_divergence, "num_windows": r.num_windows} for r in results]
    baseline = {r["dtype"]: r["perplexity"] for r in rows if r["variant"].endswith("kv-auto")}
    for row in rows[1:]:
        row["perplexity_vs_auto_kv"] = row["perplexity"] / baseline[row["dtype"]]
    return rows


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    models = [m["model"] for m in report["models"]]
    width = 0.25
    for offset, kv in enumerate(KV_DTYPES):
        xs = [i + (offset - 1) * width for i in range(len(models))]
        for ax, key, scale in ((axes[0], "tokens_per_gib", 1e-3), (axes[1], "decode_tokens_per_cpu_s", 1.0)):
            values = [m["rows"][kv][key] * scale for m in report["models"]]
            bars = ax.bar(xs, values, width, label=f"KV {kv}")
            ax.bar_label(bars, [f"{v:.0f}" for v in values], fontsize=7)
    axes[0].set_ylabel("KV capacity, thousand tokens per GiB (bf16 compute)")
    axes[1].set_ylabel(f"decode tokens per CPU-second, batch {BATCH}, bf16")
    for ax in axes[:2]:
        ax.set_xticks(range(len(models)), models)
        ax.legend()
    quality = report["quality"][1:]
    bars = axes[2].barh([r["variant"] for r in quality], [r["perplexity"] for r in quality], color="tab:green")
    axes[2].bar_label(bars, [f"{r['perplexity']:.3f} ({(r['perplexity_vs_auto_kv'] - 1) * 100:+.2f}%), "
                             f"top-1 {r['top1_agreement']:.4f}" for r in quality], fontsize=7)
    axes[2].set_xlabel(f"held-out perplexity, {DEFAULT_MODEL_NAME} ({quality[0]['num_windows']} windows)")
    axes[2].invert_yaxis()
    axes[2].set_xlim(0, max(r["perplexity"] for r in quality) * 1.6)
    fig.suptitle("Quantized KV cache: capacity, decode speed and quality per kv_cache_dtype")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = bench_parser(__doc__.splitlines()[0], "10 decode steps x 2 rounds, 8 quality windows", RESULTS)
    parser.add_argument("--steps", type=positive_int, default=16, help="timed decode steps per round")
    parser.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds per KV dtype")
    parser.add_argument("--max-windows", type=positive_int, default=16, help="quality windows (default 16 of the held-out set)")
    args = parser.parse_args()
    start_bench()
    steps, rounds = (10, 2) if args.quick else (args.steps, args.rounds)
    max_windows = 8 if args.quick else args.max_windows
    report = report_header("bench/kv_quantization.py", args)
    default_dir = resolve_model_path(DEFAULT_MODEL_NAME)
    report["models"] = [measure_model(DEFAULT_MODEL_NAME, default_dir, steps, rounds),
                        measure_model("88M", cached_tiny_model(SHAPE_88M), steps, rounds)]
    report["quality"] = measure_quality(default_dir, max_windows)
    report["scale_granularity_relative_error"] = measure_granularity(default_dir, heldout_windows(default_dir, 8))
    out_dir = write_report(report, "kv_quantization", args, RESULTS, plot)
    for model in report["models"]:
        for kv, row in model["rows"].items():
            print(f"{model['model']:<8} KV {kv:<9} {row['kv_bytes_per_token']:>6} B/token  "
                  f"{row['tokens_per_gib']:>8} tokens/GiB ({row['capacity_vs_bf16']:.3f}x)  moved "
                  f"{row['bytes_moved_per_request']:>9} B ({row['bytes_moved_vs_bf16']:.3f}x bf16, "
                  f"{row['bytes_moved_vs_fp32']:.3f}x fp32)  decode {row['decode_tokens_per_s']:8.1f} tok/s "
                  f"({row['decode_vs_auto']:.3f}x), {row['decode_tokens_per_cpu_s']:8.1f} tok/CPU-s "
                  f"({row['decode_cpu_vs_auto']:.3f}x)")
    for row in report["quality"]:
        print(f"{row['variant']:<26} ppl {row['perplexity']:8.4f} ({(row.get('perplexity_vs_auto_kv', 1) - 1) * 100:+.2f}%)"
              f"  top-1 {row['top1_agreement']:.4f}  KL {row['kl_divergence']:.2e}")
    for name, error in report["scale_granularity_relative_error"].items():
        print(f"round-trip error {name:<28} {error:.4f}")
    print(f"wrote {out_dir / 'kv_quantization.json'} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
