"""Gemma 3 against Llama at the 88M shape on CPU: offline LLM.generate tokens/s, the two models in turn.

Both random-weight checkpoints (engine/tiny_model.py's BPE tokenizer; prompts are token ids) have hidden 768,
12 layers, 12 query / 4 KV heads of 64, MLP 2048, vocab 8192; Gemma 3 (its config's defaults otherwise) adds
its (1 + weight) norms, sandwich norms, q/k norms, GeLU-tanh MLP, scaled embeddings and tied LM head. Workload: 16 prompts of 128 random token ids, 64
greedy output tokens each (ignore_eos), 2 torch threads, prefix caching off. Each round runs every model once,
a warm-up generate first; the machine may be shared, so every run is printed, not just a summary.

    .venv/bin/python bench/gemma_vs_llama.py --dtype bfloat16 --rounds 2
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.cpu_kernels import cpu_kernel_isa
from splitserve.engine.tiny_model import build_tokenizer

SHAPE = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
PROMPTS, PROMPT_TOKENS, OUTPUT_TOKENS = 16, 128, 64


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false")
    args = parser.parse_args()
    print(f"kernels: {cpu_kernel_isa().name if args.cpu_kernels and cpu_kernel_isa() else 'off'}, dtype {args.dtype}")
    with tempfile.TemporaryDirectory() as scratch:
        models = {family: save_checkpoint(Path(scratch) / family, family) for family in ("llama", "gemma3")}
        for round_index in range(args.rounds):
            for family, model_dir in models.items():
                rate = timed_generate(model_dir, args.dtype, args.cpu_kernels)
                print(f"round {round_index} {family:7s} {args.dtype:9s} {rate:7.1f} output tokens/s", flush=True)


if __name__ == "__main__":
    main()
