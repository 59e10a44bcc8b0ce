"""Layer-wise vs whole-request KV transfer on CPU: TTFT and the time until the decode side's KV is ready.

One prefill engine (the producer) and one consumer pool with its own transfer agent and thread
(splitserve.testing.layerwise_pair), in one process, for the in-process and the NIXL (UCX) backends.
Whole-request: the pull starts when the prompt's first token exists. Layer-wise: the blocks are
held as the final chunk's forward starts, each layer is announced as the forward writes it, and
the consumer thread READs it while the forward goes on. Per request:

- TTFT: admission -> the first token (the prefill step returned). The router streams this token
  from the prefill worker, so layer-wise transfer cannot change it (only overhead would show).
- KV ready: admission -> the consumer's pull is DONE (every layer READ and the generation check
  passed): from then on the decode worker can decode, so it bounds the second token.
- exposed pull: KV ready - first token, the part of the transfer the forward did not hide.

The model has a lot of KV per FLOP (16 layers, 8 KV heads of 32, fp32: 32 KiB per token) so the
transfer is a visible share of the prefill. Modes alternate per prompt, every prompt is new (no
prefix-cache hit), the first prompt of each mode is a warm-up. Numbers from a shared 2-core
machine are noisy: compare the modes within one run only.

Writes bench/results/layerwise_ttft.json and .png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
from pathlib import Path

import torch

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.tiny_model import TinyModelSpec
from splitserve.testing.layerwise_pair import LayerwisePair, PulledPrompt
from splitserve.testing.tiny_models import cached_tiny_model

SPEC = TinyModelSpec(arch="llama", num_layers=16, hidden_size=256, num_heads=8, num_kv_heads=8, vocab_size=2048,
                     seed=0)
BLOCK_SIZE = 16
RESULTS = Path(__file__).parent / "results"
MODES = ("whole", "layerwise")


def engine_config(threads: int, max_prompt: int) -> EngineConfig:
    """fp32 on CPU; the whole prompt in one chunk (the final chunk is the whole forward)."""
    max_model_len = min(max_prompt + 64, SPEC.max_position_embeddings)
    return EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=2 * -(-max_model_len // BLOCK_SIZE),
                        max_num_batched_tokens=max_model_len, max_model_len=max_model_len, dtype="float32",
                        device="cpu", num_threads=threads)


def run_backend(model_dir: Path, backend: str, lengths: list[int], repeats: int, threads: int) -> dict:
    config = engine_config(threads, max(lengths))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    rng = random.Random(0)
    samples: dict[str, dict[int, list[PulledPrompt]]] = {mode: {n: [] for n in lengths} for mode in MODES}
    pairs = {mode: LayerwisePair(model_dir, config, backend, layerwise=mode == "layerwise", threaded=True,
                                 consumer_blocks=config.num_kv_blocks) for mode in MODES}
    try:
        for index in range(repeats + 1):
            for length in lengths:
                for mode in (MODES if index % 2 else MODES[::-1]):
                    prompt = [rng.randrange(3, SPEC.vocab_size) for _ in range(length)]
                    pulled = pairs[mode].prefill(f"{mode}-{length}-{index}", prompt, params)
                    pairs[mode].forget(pulled)
                    if index:  # the first round warms up
                        samples[mode][length].append(pulled)
    finally:
        for pair in pairs.values():
            pair.close()
    return {mode: [_row(length, samples[mode][length]) for length in lengths] for mode in MODES}


def _row(length: int, pulled: list[PulledPrompt]) -> dict:
    ms = lambda values: round(1e3 * statistics.median(values), 3)  # noqa: E731
    return {"prompt_tokens": length, "repeats": len(pulled),
            "ttft_ms": ms([p.first_token_at - p.admitted_at for p in pulled]),
            "kv_ready_ms": ms([p.kv_ready_at - p.admitted_at for p in pulled]),
            "exposed_pull_ms": ms([p.kv_ready_at - p.first_token_at for p in pulled]),
            "kv_bytes": pulled[0].outcome.num_bytes}


def plot(results: dict, path: Path) -> None:
    """Per backend: TTFT and KV ready (top), and the pull time left after the first token (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(5.5 * len(results), 7), squeeze=False)
    for column, (backend, modes) in enumerate(results.items()):
        top, bottom = axes[0][column], axes[1][column]
        for mode, style in zip(MODES, ("s--", "o-")):
            rows = modes[mode]
            lengths = [row["prompt_tokens"] for row in rows]
            top.plot(lengths, [row["kv_ready_ms"] for row in rows], style, label=f"{mode}: KV ready")
            top.plot(lengths, [row["ttft_ms"] for row in rows], style, alpha=0.4, label=f"{mode}: TTFT")
            bottom.plot(lengths, [row["exposed_pull_ms"] for row in rows], style, label=mode)
        top.set(xlabel="prompt tokens", ylabel="ms (median)", title=f"{backend} backend")
        top.set_ylim(bottom=0)
        top.legend(fontsize=8)
        bottom.axhline(0.0, color="tab:gray", linewidth=0.8)
        bottom.set(xlabel="prompt tokens", ylabel="KV ready - first token, ms (median)",
                   title="pull time not hidden by the forward")
        bottom.legend(fontsize=8)
    fig.suptitle("layer-wise vs whole-request KV transfer (1 prefill engine + 1 consumer thread, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 1920])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the prefill engine")
    parser.add_argument("--backends", nargs="+", default=["inprocess", "nixl"])
    parser.add_argument("--out", type=Path, default=RESULTS / "layerwise_ttft.json")
    args = parser.parse_args()
    backends = [b for b in args.backends if b != "nixl" or importlib.util.find_spec("nixl_cu12") is not None
                or importlib.util.find_spec("nixl") is not None]
    model_dir = cached_tiny_model(SPEC)
    results = {backend: run_backend(model_dir, backend, args.lengths, args.repeats, args.threads)
               for backend in backends}
    record = {"model": {"num_layers": SPEC.num_layers, "hidden_size": SPEC.hidden_size,
                        "num_kv_heads": SPEC.num_kv_heads, "head_dim": SPEC.hidden_size // SPEC.num_heads,
                        "dtype": "float32", "block_size": BLOCK_SIZE},
              "threads": args.threads, "cpu_count": os.cpu_count(), "platform": platform.platform(),
              "torch": torch.__version__, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    plot(results, args.out.with_suffix(".png"))
    for backend, modes in results.items():
        for mode, rows in modes.items():
            for row in rows:
                print(f"{backend:9s} {mode:9s} {row['prompt_tokens']:5d} tokens: TTFT {row['ttft_ms']:8.2f} ms, "
                      f"KV ready {row['kv_ready_ms']:8.2f} ms, exposed pull {row['exposed_pull_ms']:7.2f} ms")


if __name__ == "__main__":
    main()
