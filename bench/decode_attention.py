"""One layer of decode attention at the 88M model's shape (12 heads / 4 KV heads of 64): the C++ paged kernel
(engine/csrc/paged_attention.cpp, built for this CPU's instruction set: AVX-512 or AVX2) against the pure-torch
path it replaces when the kernels cannot load (CpuPagedAttention(use_kernels=False): gather + grouped matmuls).

Cases: batch 1 and 64, contexts drawn in [100, 272] (issue 13's decode steps), float32 and bfloat16, blocks of
16 scattered through a 1024-block pool. One torch thread. Each case checks the two paths agree (the bounds of
tests/test_cpu_kernels.py), then alternates them for `rounds` rounds and keeps each one's median; the time is the
thread's CPU time (time.thread_time), which other processes taking the cores do not inflate, with wall time
beside it. The pool of one layer (32 MiB in fp32) stays in the L3 cache between calls, so the kernel is also
timed over LAYERS pools in turn, as a decode step's layers follow each other, where its keys and values come
from DRAM ("cold"); effective bandwidth is the batch's KV bytes (each attended position's key and value rows)
over that time.

Writes bench/results/decode_attention.json and .png. Run: .venv/bin/python bench/decode_attention.py (under a
minute; --quick: 3 rounds, written to the temp directory).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path

import torch

from serving_common import bench_parser, loaded_kernel_isa, positive_int, report_header, start_bench, write_report
from splitserve.engine.attention import CpuPagedAttention
from splitserve.engine.attention.base import AttentionMetadata, DecodeBatch

RESULTS = Path(__file__).resolve().parent / "results"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 12, 4, 64, 16, 1024
CONTEXT_RANGE = (100, 272)
LAYERS = 12  # the 88M model's
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    dtype: torch.dtype
    batch: int


def decode_inputs(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """query [B, H, D], pool [NUM_BLOCKS, 2, BLOCK_SIZE, Hkv, D], and the batch's metadata."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(case.dtype)
    context_lens = torch.randint(CONTEXT_RANGE[0], CONTEXT_RANGE[1] + 1, (case.batch,), generator=generator)
    width = -(-CONTEXT_RANGE[1] // BLOCK_SIZE)
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=generator)[:width] for _ in range(case.batch)])
    query = torch.randn(case.batch, NUM_HEADS, HEAD_DIM, generator=generator).to(case.dtype)
    decode = DecodeBatch(token_indices=torch.arange(case.batch), block_tables=tables, context_lens=context_lens)
    metadata = AttentionMetadata(positions=None, key_slots=None, value_slots=None, prefills=(), decodes=(decode,),
                                 block_size=BLOCK_SIZE)
    return query, pool, metadata


def kv_bytes(pool: torch.Tensor, metadata: AttentionMetadata) -> int:
    """Bytes of the key and value rows the batch attends (what the kernel must read from memory)."""
    return int(metadata.decodes[0].context_lens.sum()) * 2 * NUM_KV_HEADS * HEAD_DIM * pool.element_size()


def cold_kernel_ms(layers: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]], rounds: int) -> float:
    """Median thread CPU time of the kernel over the layers' pools in turn (none left in cache by the last)."""
    attention = CpuPagedAttention(use_kernels=True)
    times = []
    for _ in range(rounds):
        for query, pool, metadata in layers:
            started = time.thread_time()
            attention._decode(query, pool, metadata.decodes[0], 0, metadata, None)
            times.append(time.thread_time() - started)
    return 1e3 * statistics.median(times)


def measure(case: Case, rounds: int, seed: int) -> dict:
    query, pool, metadata = decode_inputs(case, seed)
    paths = {"kernel": CpuPagedAttention(use_kernels=True), "torch": CpuPagedAttention(use_kernels=False)}
    calls = {name: (lambda a=attention: a._decode(query, pool, metadata.decodes[0], 0, metadata, None))
             for name, attention in paths.items()}
    outputs = {name: call().float() for name, call in calls.items()}
    torch.testing.assert_close(outputs["kernel"], outputs["torch"], atol=TOLERANCE[case.dtype], rtol=0)
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    wall: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            started_cpu, started_wall = time.thread_time(), time.perf_counter()
            call()
            cpu[name].append(time.thread_time() - started_cpu)
            wall[name].append(time.perf_counter() - started_wall)
    result = {"dtype": str(case.dtype).removeprefix("torch."), "batch": case.batch}
    for name in calls:
        result[f"{name}_cpu_ms"] = 1e3 * statistics.median(cpu[name])
        result[f"{name}_wall_ms"] = 1e3 * statistics.median(wall[name])
    result["speedup"] = result["torch_cpu_ms"] / result["kernel_cpu_ms"]
    layers = [(query, pool, metadata)] + [decode_inputs(case, seed + layer) for layer in range(1, LAYERS)]
    result["kernel_cold_cpu_ms"] = cold_kernel_ms(layers, rounds)
    result["kv_mb"] = kv_bytes(pool, metadata) / 1e6
    result["kernel_gb_per_s"] = result["kv_mb"] / result["kernel_cpu_ms"]
    result["kernel_cold_gb_per_s"] = result["kv_mb"] / result["kernel_cold_cpu_ms"]
    return result


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['dtype']}\nbatch {r['batch']}" for r in rows]
    positions = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 4.8))
    ax.bar([p - 0.27 for p in positions], [r["torch_cpu_ms"] for r in rows], 0.27, label="pure torch (gather + matmuls)")
    ax.bar(list(positions), [r["kernel_cpu_ms"] for r in rows], 0.27, label=f"C++ kernel ({report['kernel_isa']})")
    ax.bar([p + 0.27 for p in positions], [r["kernel_cold_cpu_ms"] for r in rows], 0.27,
           label=f"C++ kernel, {LAYERS} layers' pools in turn (KV from DRAM)")
    for p, r in zip(positions, rows):
        ax.annotate(f"x{r['speedup']:.1f}", (p, r["kernel_cpu_ms"]), textcoords="offset points", xytext=(0, 3),
                    ha="center", fontsize=8)
        ax.annotate(f"{r['kernel_cold_gb_per_s']:.1f} GB/s", (p + 0.27, r["kernel_cold_cpu_ms"]),
                    textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    ax.set_xticks(list(positions), labels)
    ax.set_yscale("log")
    ax.set_ylabel("ms per layer (thread CPU time, median)")
    ax.set_title("decode attention, one layer, 88M shape (12 / 4 heads of 64), context 100-272, 1 thread")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = bench_parser(__doc__, "3 rounds, written to the temp directory", RESULTS)
    parser.add_argument("--rounds", type=positive_int, default=30)
    args = parser.parse_args()
    start_bench()
    isa = loaded_kernel_isa()
    rounds = 3 if args.quick else args.rounds
    report = report_header("bench/decode_attention.py", args)
    report["kernel_isa"] = isa.name
    report["results"] = [measure(Case(dtype, batch), rounds, args.seed)
                         for dtype in (torch.float32, torch.bfloat16) for batch in (1, 64)]
    for r in report["results"]:
        print(f"{r['dtype']:9s} batch {r['batch']:3d}: kernel {r['kernel_cpu_ms']:7.3f} ms, torch "
              f"{r['torch_cpu_ms']:7.3f} ms (x{r['speedup']:.1f}; wall {r['kernel_wall_ms']:.3f} / "
              f"{r['torch_wall_ms']:.3f} ms); cold kernel {r['kernel_cold_cpu_ms']:7.3f} ms, "
              f"{r['kv_mb']:.1f} MB of KV at {r['kernel_gb_per_s']:.1f} / {r['kernel_cold_gb_per_s']:.1f} GB/s")
    out_dir = write_report(report, "decode_attention", args, RESULTS, plot)
    print(f"wrote {out_dir / 'decode_attention.json'} and .png ({isa.name})")


if __name__ == "__main__":
    main()
