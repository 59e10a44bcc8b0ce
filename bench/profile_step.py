"""Where one engine step's time goes: the torch profiler's op table for a prefill step and a decode step.

The step shapes of issue 13's "batch" workload: 64 requests of 128 random prompt tokens. The
prefill step is the first one after a warm-up step (16 prompts = the 2048-token budget); the
decode step is one of 64 requests at context ~140. Prints, per step, its wall time and the ops
that took the most self CPU time (as a share of the step); writes the same as JSON.

Run: `.venv/bin/python bench/profile_step.py --model 88M --dtype bfloat16` (about 30 s; the model is
built on first use like engine_throughput's). `docs/performance.md` quotes its output.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engine_throughput import MODELS
from splitserve.engine import LLM, SamplingParams
from splitserve.testing.tiny_models import cached_tiny_model

RESULTS = Path(__file__).parent / "results"


def profiled_step(engine, repeats: int) -> dict:
    """Wall time per step and the top ops by self CPU time over `repeats` steps."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            engine.step()
        wall_s = (time.perf_counter() - start) / repeats
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in events)
    top = [{"op": e.key, "calls_per_step": e.count / repeats, "ms_per_step": e.self_cpu_time_total / 1e3 / repeats,
            "share": e.self_cpu_time_total / total_us} for e in events[:12]]
    return {"wall_ms": 1e3 * wall_s, "top_ops": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="88M")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(cached_tiny_model(MODELS[args.model]), dtype=args.dtype, num_threads=args.threads, max_num_seqs=256,
              max_num_batched_tokens=2048, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    engine, rng = llm.engine, random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1024, ignore_eos=True)
    for index in range(64):
        engine.add_request(f"r{index}", [rng.randrange(3, 8192) for _ in range(128)], params)
    engine.step()  # warm-up: the first 16 prompts
    report = {"model": args.model, "dtype": args.dtype, "threads": args.threads,
              "prefill": profiled_step(engine, 1)}
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()
    for _ in range(8):
        engine.step()
    report["decode"] = profiled_step(engine, 5)
    for phase in ("prefill", "decode"):
        print(f"{phase}: {report[phase]['wall_ms']:.1f} ms per step")
        for op in report[phase]["top_ops"]:
            print(f"  {op['op']:48s} {op['ms_per_step']:8.2f} ms {100 * op['share']:5.1f}%  "
                  f"{op['calls_per_step']:6.1f} calls")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"profile_step_{args.model}_{args.dtype}.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
