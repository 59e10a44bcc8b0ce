"""Weight-only quantization: decode / prefill speed and quality of none / int8 / int4 / GPTQ / AWQ.

Speed, on the trained `default` model and the 88M Llama shape of bench/engine_throughput.py
(random weights, 8192 vocabulary), all engines bfloat16 on CPU, loaded side by side in this
process and measured in interleaved rounds (the machine is shared; each number is the median
over rounds, each round's value the median of its steps):
  - batch-1 decode tokens/s: one request at 256 tokens of context;
  - batch-64 decode tokens/s: 64 requests at 128 tokens of context, one decode step each;
  - prefill tokens/s: one 480-token prompt, from its first chunk to its first token.
GPTQ and AWQ checkpoints run the same int4 kernel as int4 (act-order adds an input gather); their
speed is measured on `default`, for which `splitserve quantize` writes them here.

Quality (default model only; the 88M model has random weights): splitserve.eval's held-out
perplexity, top-1 agreement and KL against transformers float32, every engine in float32.
Targets (issue 17): batch-1 decode >= 1.7x bf16 with int8 and >= 2.5x with int4 on 88M;
perplexity within +1% (int8) and +5% (int4); GPTQ and AWQ better than round-to-nearest int4.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from splitserve.common.config import EngineConfig
from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.quantization.quantize import QuantizeConfig, quantize_model
from splitserve.engine.tiny_model import TinyModelSpec, resolve_model_path
from splitserve.eval import EngineVariant, evaluate, heldout_windows
from splitserve.testing.tiny_models import cached_tiny_model

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SHAPE_88M = TinyModelSpec(num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, intermediate_size=2048,
                          vocab_size=8192, seed=0)
"""bench/engine_throughput.py's 88M model."""
GROUP_SIZE = 128
BATCH = 64
TARGETS = {"int8": 1.7, "int4": 2.5}
"""Batch-1 decode speedup over bf16 on 88M."""


@dataclass(frozen=True)
class Variant:
    name: str
    quantization: str
    model_dir: Path


@dataclass(frozen=True)
class SpeedRow:
    model: str
    variant: str
    decode_batch1_tok_s: float
    decode_batch64_tok_s: float
    prefill_tok_s: float


def _engine(variant: Variant, num_blocks: int) -> EngineCore:
    """Default engine fields otherwise: max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512
    made the 88M model's bf16 batch-1 decode step 4x slower (125 vs 30 ms, on main too)."""
    config = EngineConfig(dtype="bfloat16", quantization=variant.quantization, quantization_group_size=GROUP_SIZE,
                          num_kv_blocks=num_blocks, enable_prefix_caching=False)
    return EngineCore(variant.model_dir, config)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _drain(engine: EngineCore) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _decode_tok_s(engine: EngineCore, batch: int, context: int, steps: int, tag: str) -> float:
    """Tokens/s of `steps` decode steps of `batch` requests at `context` tokens (median step)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [3 + (i + j) % 500 for j in range(context)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill (chunked under the token budget)
    engine.step()  # first all-decode step, warm
    step_s = statistics.median(_timed(engine.step) for _ in range(steps))
    _drain(engine)
    return batch / step_s


def _prefill_tok_s(engine: EngineCore, prompt_len: int, tag: str) -> float:
    engine.add_request(tag, [3 + j % 500 for j in range(prompt_len)], SamplingParams(temperature=0.0, max_tokens=1))
    seconds = _timed(lambda: _drain(engine))
    return prompt_len / seconds


def measure_speed(model: str, variants: list[Variant], rounds: int, steps: int) -> list[SpeedRow]:
    engines = {v.name: _engine(v, num_blocks=BATCH * (128 + steps + 8) // 16 + 64) for v in variants}
    samples: dict[str, dict[str, list[float]]] = {v.name: {"b1": [], "b64": [], "prefill": []} for v in variants}
    for r in range(rounds):
        for name, engine in engines.items():  # interleaved: every variant once per round
            samples[name]["b1"].append(_decode_tok_s(engine, 1, 256, steps, f"b1-{r}"))
            samples[name]["b64"].append(_decode_tok_s(engine, BATCH, 128, max(2, steps // 4), f"b64-{r}"))
            samples[name]["prefill"].append(_prefill_tok_s(engine, 480, f"prefill-{r}"))
        print(f"  {model} round {r + 1}/{rounds}", flush=True)
    return [SpeedRow(model, name, *(statistics.median(s[k]) for k in ("b1", "b64", "prefill")))
            for name, s in samples.items()]


def quantized_checkpoints(model_dir: Path, scratch: Path, num_samples: int, seq_len: int) -> dict[str, Path]:
    checkpoints = {}
    for method in ("gptq", "awq"):
        config = QuantizeConfig(method, GROUP_SIZE, num_samples=num_samples, seq_len=seq_len)
        started = time.perf_counter()
        checkpoints[method] = quantize_model(model_dir, scratch / method, config)
        print(f"  {method} checkpoint in {time.perf_counter() - started:.0f} s", flush=True)
    return checkpoints


def measure_quality(model_dir: Path, checkpoints: dict[str, Path], max_windows: int | None) -> list[dict]:
    variants = [EngineVariant("none", quantization="none"), EngineVariant("int8", quantization="int8"),
                EngineVariant("int4", quantization="int4", quantization_group_size=GROUP_SIZE),
                *(EngineVariant(name, model_dir=path) for name, path in checkpoints.items())]
    results = evaluate(model_dir, variants, heldout_windows(model_dir, max_windows))
    return [{**asdict(r), "perplexity": r.perplexity} for r in results]


def summarize(speed: list[SpeedRow], quality: list[dict]) -> dict:
    """Ratios against the same model's unquantized bf16 row, and perplexity against float32 `none`."""
    base = {row.model: row for row in speed if row.variant == "none"}
    ratios = {f"{row.model}/{row.variant}": {"decode_batch1": row.decode_batch1_tok_s / base[row.model].decode_batch1_tok_s,
                                             "decode_batch64": row.decode_batch64_tok_s / base[row.model].decode_batch64_tok_s,
                                             "prefill": row.prefill_tok_s / base[row.model].prefill_tok_s}
              for row in speed}
    full = next(q["perplexity"] for q in quality if q["variant"] == "none")
    perplexity_change = {q["variant"]: q["perplexity"] / full - 1 for q in quality}
    return {"speedup_vs_bf16": ratios, "perplexity_change_vs_none": perplexity_change,
            "targets": {name: {"goal_batch1_speedup": goal, "measured": ratios[f"88M/{name}"]["decode_batch1"]}
                        for name, goal in TARGETS.items()}}


def write_png(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 5))
    for ax, key, title in zip(axes, ("decode_batch1_tok_s", "decode_batch64_tok_s", "prefill_tok_s"),
                              ("decode, batch 1", "decode, batch 64", "prefill (480 tokens)")):
        rows = report["speed"]
        labels = [f"{r['model']} {r['variant']}" for r in rows]
        bars = ax.barh(labels, [r[key] for r in rows], color="tab:blue")
        ax.bar_label(bars, [f"{r[key]:.0f}" for r in rows], padding=3, fontsize=8)
        ax.set_xlabel("tokens/s (bf16 engines, CPU)")
        ax.set_title(title)
        ax.invert_yaxis()
    quality = [q for q in report["quality"] if q["variant"] != "transformers-float32"]
    bars = axes[3].barh([q["variant"] for q in quality], [q["perplexity"] for q in quality], color="tab:orange")
    axes[3].bar_label(bars, [f"{q['perplexity']:.4f}" for q in quality], padding=3, fontsize=8)
    axes[3].set_xlim(min(q["perplexity"] for q in quality) * 0.995, max(q["perplexity"] for q in quality) * 1.005)
    axes[3].set_title("held-out perplexity, default model (float32)")
    axes[3].invert_yaxis()
    fig.suptitle("Weight-only quantization (interleaved rounds on a shared 2-core machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per batch-1 measurement")
    parser.add_argument("--max-windows", type=int, default=None, help="held-out windows for quality (default all)")
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--calibration-seq-len", type=int, default=512)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    default_dir = resolve_model_path(DEFAULT_MODEL_NAME)
    with tempfile.TemporaryDirectory() as scratch:
        checkpoints = quantized_checkpoints(default_dir, Path(scratch), args.calibration_samples,
                                            args.calibration_seq_len)
        quality = measure_quality(default_dir, checkpoints, args.max_windows)
        default_variants = [Variant("none", "none", default_dir), Variant("int8", "int8", default_dir),
                            Variant("int4", "int4", default_dir),
                            *(Variant(name, "auto", path) for name, path in checkpoints.items())]
        model_88m = cached_tiny_model(SHAPE_88M)
        speed = measure_speed("88M", [Variant(q, q, model_88m) for q in ("none", "int8", "int4")], args.rounds, args.steps)
        speed += measure_speed("default", default_variants, args.rounds, args.steps)
    report = {"speed": [asdict(row) for row in speed], "quality": quality, "summary": summarize(speed, quality),
              "config": vars(args) | {"out": str(args.out), "group_size": GROUP_SIZE},
              "machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quantization.json").write_text(json.dumps(report, indent=1) + "\n")
    write_png(report, args.out / "quantization.png")
    for row in speed:
        print(f"{row.model:<8} {row.variant:<5} decode b1 {row.decode_batch1_tok_s:8.1f}  b64 "
              f"{row.decode_batch64_tok_s:8.1f}  prefill {row.prefill_tok_s:8.1f} tok/s")
    for q in quality:
        print(f"{q['variant']:<22} ppl {q['perplexity']:.4f}  top-1 {q['top1_agreement']:.4f}  KL {q['kl_divergence']:.2e}")
    print(json.dumps(report["summary"], indent=1))
    print(f"wrote {args.out / 'quantization.json'} and {args.out / 'quantization.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
