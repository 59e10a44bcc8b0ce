"""Gemma 3 against Llama at the 88M shape on CPU: offline LLM.generate tokens/s, the two models in turn.

Both random-weight checkpoints (engine/tiny_model.py's BPE tokenizer; prompts are token ids) have hidden 768,
12 layers, 12 query / 4 KV heads of 64, MLP 2048, vocab 8192; Gemma 3 (its config's defaults otherwise) adds
its (1 + weight) norms, sandwich norms, q/k norms, GeLU-tanh MLP, scaled embeddings and tied LM head. Workload: 16 prompts of 128 random token ids, 64
greedy output tokens each (ignore_eos), 2 torch threads, prefix caching off. Each round runs every model once
in each dtype, a warm-up generate first; the machine may be shared, so every run is recorded, and the ratio
Gemma 3 / Llama is taken per round (the two ran back to back) and summarized by its median.

Writes bench/results/gemma_vs_llama.json and .png (--quick: one round, float32 only, to the temp directory):

    .venv/bin/python bench/gemma_vs_llama.py --rounds 3
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from serving_common import bench_parser, positive_int, report_header, write_report
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.cpu_kernels import cpu_kernel_isa
from splitserve.engine.tiny_model import build_tokenizer

SHAPE = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
PROMPTS, PROMPT_TOKENS, OUTPUT_TOKENS = 16, 128, 64
FAMILIES = ("llama", "gemma3")
RESULTS = Path(__file__).resolve().parent / "results"


def save_checkpoint(out_dir: Path, family: str) -> Path:
    """A random-weight float32 checkpoint of `family` ('llama' or 'gemma3') at SHAPE."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

    config = {"llama": LlamaConfig, "gemma3": Gemma3TextConfig}[family](**SHAPE)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out_dir)
    build_tokenizer(SHAPE["vocab_size"], seed=0).save_pretrained(out_dir)
    return out_dir


def timed_generate(model_dir: Path, dtype: str, cpu_kernels: bool) -> float:
    """Output tokens/s of one generate of the workload (after a warm-up generate) on a fresh LLM."""
    llm = LLM(model_dir, dtype=dtype, num_threads=2, enable_prefix_caching=False, cpu_kernels=cpu_kernels,
              kv_cache_memory_bytes=1 << 30)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, SHAPE["vocab_size"]) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(output.outputs[0].token_ids) == OUTPUT_TOKENS for output in outputs)
    return PROMPTS * OUTPUT_TOKENS / elapsed


def summarize(runs: list[dict], dtype: str) -> dict:
    """Per dtype: each model's median tokens/s and the median over rounds of Gemma 3 / Llama."""
    rates = {family: [r["output_tokens_per_s"] for r in runs if r["dtype"] == dtype and r["family"] == family]
             for family in FAMILIES}
    ratios = [gemma / llama for llama, gemma in zip(rates["llama"], rates["gemma3"])]
    return {"dtype": dtype, **{f"{family}_median": statistics.median(rates[family]) for family in FAMILIES},
            "gemma3_over_llama_median": statistics.median(ratios), "gemma3_over_llama_per_round": ratios}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for offset, family in zip((-0.2, 0.2), FAMILIES):
        for index, summary in enumerate(report["summary"]):
            runs = [r["output_tokens_per_s"] for r in report["runs"]
                    if r["dtype"] == summary["dtype"] and r["family"] == family]
            ax.bar(index + offset, summary[f"{family}_median"], 0.4, color="C0" if family == "llama" else "C1",
                   label=family if index == 0 else None)
            ax.scatter([index + offset] * len(runs), runs, color="black", s=10, zorder=3)
        ax.set_xticks(range(len(report["summary"])), [s["dtype"] for s in report["summary"]])
    for index, summary in enumerate(report["summary"]):
        ax.annotate(f"gemma3 / llama {summary['gemma3_over_llama_median']:.2f}", (index, 0), textcoords="offset points",
                    xytext=(0, 4), ha="center", fontsize=8)
    ax.set_ylabel("output tokens/s (bars: median, dots: runs)")
    ax.set_title(f"88M shape, {PROMPTS} x {PROMPT_TOKENS} in / {OUTPUT_TOKENS} out, 2 threads, CPU kernels "
                 f"{report['kernel_isa']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = bench_parser(__doc__, "one round, float32 only, written to the temp directory", RESULTS)
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false")
    args = parser.parse_args()
    dtypes, rounds = (["float32"], 1) if args.quick else (args.dtypes, args.rounds)
    isa = cpu_kernel_isa().name if args.cpu_kernels and cpu_kernel_isa() else "off"
    report = report_header("bench/gemma_vs_llama.py", args)
    report["kernel_isa"] = isa
    report["runs"] = []
    with tempfile.TemporaryDirectory() as scratch:
        models = {family: save_checkpoint(Path(scratch) / family, family) for family in FAMILIES}
        for round_index in range(rounds):
            for dtype in dtypes:
                for family, model_dir in models.items():
                    rate = timed_generate(model_dir, dtype, args.cpu_kernels)
                    report["runs"].append({"round": round_index, "dtype": dtype, "family": family,
                                           "output_tokens_per_s": rate})
                    print(f"round {round_index} {family:7s} {dtype:9s} {rate:7.1f} output tokens/s", flush=True)
    report["summary"] = [summarize(report["runs"], dtype) for dtype in dtypes]
    for summary in report["summary"]:
        print(f"{summary['dtype']:9s} gemma3 / llama, median of rounds: {summary['gemma3_over_llama_median']:.2f}")
    out_dir = write_report(report, "gemma_vs_llama", args, RESULTS, plot)
    print(f"wrote {out_dir / 'gemma_vs_llama.json'} and .png")


if __name__ == "__main__":
    main()
