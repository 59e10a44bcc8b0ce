"""Linear layers, bf16 and fp32: the C++ panel kernel (PanelLinear, engine/csrc/panel_linear.cpp) against
oneDNN's GEMM over weights packed at load (PackedLinear), which for bf16 on a CPU without a bf16 GEMM means
weights widened to fp32 at load.

Shapes: the 88M model's projections (hidden 768, intermediate 2048, 12 heads / 4 KV heads of 64, vocab 8192):
qkv 768->1280, o 768->768, gate_up 768->4096, down 2048->768, lm_head 768->8192; a forward's linear time is
12 x (qkv + o + gate_up + down) + lm_head. Rows (tokens in the step) 1 to 512: 1 is batch-1 decode, 64 a
decode batch, 256-512 a prefill chunk. One torch thread; each case checks the paths agree (within a bf16
rounding; 1e-4 in fp32), then alternates them for `rounds` rounds and keeps each one's median thread CPU time
(time.thread_time: other processes taking the cores do not inflate it).

Also the MLP's gate and up projections and SiLU-and-mul as the engine runs them where it uses panels: one pass
(PanelGatedLinear, SiLU) against two (PanelLinear, then the fused_ops silu_and_mul kernel), bit-identical, at 1 to
2048 rows (a 2048-token prefill step).

And one decode step's linears as the engine runs them, with the weights streaming from DRAM as in a real step
(LAYERS layers of distinct weights, 327 MB in fp32, then the LM head; the cases above reuse one layer's weights,
which stay in cache): the panel kernel (the gate/up projection in one pass with SiLU-and-mul) against oneDNN
(gate_up, then the fused_ops SiLU-and-mul kernel), on every CPU's thread as in the engine, wall time, the two
alternated for `rounds` rounds of 5 steps (medians). This is where the kernel's prefetching of the next panel
shows.

Writes bench/results/panel_linear.json and .png. Run: .venv/bin/python bench/panel_linear.py (about 4 minutes;
--quick: 3 rounds, 3 row counts, written to the temp directory).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch

from serving_common import bench_parser, loaded_kernel_isa, positive_int, report_header, start_bench, write_report
from splitserve.engine.cpu_gemm import cpu_gemm_dtype, has_bf16_gemm
from splitserve.engine.models.layer_ops import CpuKernelLayerOps, GatedActivation
from splitserve.engine.models.packed_linear import PanelGatedLinear, PanelLinear, PackedLinear

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"qkv": (768, 1280), "o": (768, 768), "gate_up": (768, 4096), "down": (2048, 768), "lm_head": (768, 8192)}
"""name -> (in_features, out_features) of the 88M model."""
LAYERS = 12
ROWS = (1, 2, 4, 8, 16, 64, 256, 512)
QUICK_ROWS = (1, 64, 256)
GATED_ROWS = (1, 64, 512, 2048)
STEP_ROWS = (1, 4, 16, 64, 128)
QUICK_STEP_ROWS = (16, 64)
QUICK_GATED_ROWS = (64, 2048)


DTYPES = (torch.bfloat16, torch.float32)
TOLERANCE = {torch.bfloat16: 2 ** -7, torch.float32: 1e-4}


def random_linear(dtype: torch.dtype, in_features: int, out_features: int, seed: int) -> torch.nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5)
    return linear.to(dtype)


def layer_paths(dtype: torch.dtype, in_features: int, out_features: int, seed: int) -> dict[str, torch.nn.Module]:
    """The kernel and what the engine runs without it (oneDNN: native bf16, or widened to fp32)."""
    linear = random_linear(dtype, in_features, out_features, seed)
    return {"panels": PanelLinear(linear), "onednn": PackedLinear(linear, compute_dtype=cpu_gemm_dtype(dtype))}


def median_ms(call, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.thread_time()
        call()
        times.append(time.thread_time() - started)
    return 1e3 * statistics.median(times)


def measure(dtype: torch.dtype, name: str, rows: int, rounds: int, seed: int) -> dict:
    in_features, out_features = SHAPES[name]
    paths = layer_paths(dtype, in_features, out_features, seed)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(seed + rows)).to(dtype)
    outputs = {path: layer(x).float() for path, layer in paths.items()}
    torch.testing.assert_close(outputs["panels"], outputs["onednn"], rtol=TOLERANCE[dtype], atol=1e-3)
    times = {path: [] for path in paths}
    for _ in range(rounds):
        for path, layer in paths.items():
            times[path].append(median_ms(lambda: layer(x), 3))
    return {"dtype": str(dtype).removeprefix("torch."), "shape": name, "rows": rows,
            **{f"{path}_ms": statistics.median(t) for path, t in times.items()}}


def measure_gated(dtype: torch.dtype, rows: int, rounds: int, seed: int) -> dict:
    """gate_up then SiLU-and-mul: two passes against one (the same bits)."""
    gate_up = random_linear(dtype, *SHAPES["gate_up"], seed)
    projection, fused, ops = PanelLinear(gate_up), PanelGatedLinear(gate_up, GatedActivation.SILU), CpuKernelLayerOps()
    x = torch.randn(rows, gate_up.in_features, generator=torch.Generator().manual_seed(seed + rows)).to(dtype)
    paths = {"two_passes": lambda: ops.silu_and_mul(projection(x)), "fused": lambda: fused(x)}
    assert torch.equal(paths["two_passes"](), paths["fused"]())
    times = {path: [] for path in paths}
    for _ in range(rounds):
        for path, call in paths.items():
            times[path].append(median_ms(call, 3))
    result = {"dtype": str(dtype).removeprefix("torch."), "rows": rows,
              **{f"{path}_ms": statistics.median(t) for path, t in times.items()}}
    result["speedup"] = result["two_passes_ms"] / result["fused_ms"]
    return result


class StepLinears:
    """One forward's linear layers as the engine runs them on one path, LAYERS layers of distinct weights:
    qkv, o, gate/up with SiLU-and-mul, down; then the LM head."""

    def __init__(self, dtype: torch.dtype, panels: bool, seed: int) -> None:
        compute_dtype = cpu_gemm_dtype(dtype)
        ops = CpuKernelLayerOps()

        def dense(name: str, index: int) -> torch.nn.Module:
            linear = random_linear(dtype, *SHAPES[name], seed + index)
            return PanelLinear(linear) if panels else PackedLinear(linear, compute_dtype=compute_dtype)

        def gated(index: int):
            linear = random_linear(dtype, *SHAPES["gate_up"], seed + index)
            if panels:
                return PanelGatedLinear(linear, GatedActivation.SILU)
            packed = PackedLinear(linear, compute_dtype=compute_dtype)
            return lambda x: ops.silu_and_mul(packed(x))

        self.layers = [(dense("qkv", 4 * i), dense("o", 4 * i + 1), gated(4 * i + 2), dense("down", 4 * i + 3))
                       for i in range(LAYERS)]
        self.lm_head = dense("lm_head", 4 * LAYERS)

    def __call__(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] feeds every hidden-sized input; attended [rows, q_size] the o projection."""
        for qkv, o, gate_up, down in self.layers:
            qkv(x)
            o(attended)
            down(gate_up(x))
        return self.lm_head(x)


def measure_step(dtype: torch.dtype, rows: int, rounds: int, seed: int) -> dict:
    """One decode step's linears from DRAM, panels against oneDNN, wall time on all threads (ms per step)."""
    paths = {"panels": StepLinears(dtype, True, seed), "onednn": StepLinears(dtype, False, seed)}
    generator = torch.Generator().manual_seed(seed + rows)
    x = torch.randn(rows, SHAPES["qkv"][0], generator=generator).to(dtype)
    attended = torch.randn(rows, SHAPES["o"][0], generator=generator).to(dtype)
    outputs = {path: step(x, attended).float() for path, step in paths.items()}
    torch.testing.assert_close(outputs["panels"], outputs["onednn"], rtol=TOLERANCE[dtype], atol=1e-3)
    times = {path: [] for path in paths}
    for _ in range(rounds):
        for path, step in paths.items():
            started = time.perf_counter()
            for _ in range(5):
                step(x, attended)
            times[path].append(1e3 * (time.perf_counter() - started) / 5)
    result = {"dtype": str(dtype).removeprefix("torch."), "rows": rows, "threads": torch.get_num_threads(),
              **{f"{path}_ms": statistics.median(t) for path, t in times.items()}}
    result["speedup"] = result["onednn_ms"] / result["panels_ms"]
    return result


def forward_totals(results: list[dict]) -> list[dict]:
    """Per dtype and row count: the linear time of one forward (LAYERS decoder layers + the LM head) per path."""
    totals = []
    for dtype, rows in sorted({(r["dtype"], r["rows"]) for r in results}):
        at_rows = {r["shape"]: r for r in results if r["rows"] == rows and r["dtype"] == dtype}
        total = {"dtype": dtype, "rows": rows}
        for path in ("panels", "onednn"):
            decoder = sum(at_rows[name][f"{path}_ms"] for name in SHAPES if name != "lm_head")
            total[f"{path}_ms"] = LAYERS * decoder + at_rows["lm_head"][f"{path}_ms"]
        total["speedup"] = total["onednn_ms"] / total["panels_ms"]
        totals.append(total)
    return totals


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    onednn_bf16 = "oneDNN bf16" if report["bf16_gemm"] else "oneDNN fp32 on widened weights"
    fig, (ax, gated_ax, step_ax) = plt.subplots(1, 3, figsize=(19, 4.5))
    plot_per_row(ax, report["forward"], ("panels_ms", "onednn_ms"),
                 lambda dtype: (f"C++ panel kernel ({report['kernel_isa']})",
                                onednn_bf16 if dtype == "bfloat16" else "oneDNN fp32"))
    ax.set_ylabel("ms per row, one forward's linears")
    ax.set_title("88M model's linear layers, 1 thread (x: oneDNN / kernel)")
    plot_per_row(gated_ax, report["gated"], ("fused_ms", "two_passes_ms"),
                 lambda dtype: ("one pass", "gate_up, then SiLU-and-mul"))
    gated_ax.set_ylabel("ms per row, one layer")
    gated_ax.set_title("MLP gate/up + SiLU-and-mul, 1 thread (x: two passes / one)")
    plot_per_row(step_ax, report["step"], ("panels_ms", "onednn_ms"),
                 lambda dtype: (f"C++ panel kernel ({report['kernel_isa']})",
                                onednn_bf16 if dtype == "bfloat16" else "oneDNN fp32"))
    step_ax.set_ylabel("ms per row, one decode step's linears")
    step_ax.set_title(f"weights from DRAM, {report['step'][0]['threads']} threads, wall time (x: oneDNN / kernel)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_per_row(ax, cells: list[dict], keys: tuple[str, str], names) -> None:
    """ms per row of the faster path (keys[0], annotated with its speedup) and the other one, per dtype;
    names(dtype) -> their legend names."""
    for dtype, style in (("bfloat16", "-"), ("float32", "--")):
        at_dtype = [c for c in cells if c["dtype"] == dtype]
        rows = [c["rows"] for c in at_dtype]
        for key, marker, name in zip(keys, ("o", "s"), names(dtype)):
            ax.plot(rows, [c[key] / c["rows"] for c in at_dtype], style, marker=marker, label=f"{dtype}: {name}")
        for c in at_dtype:
            ax.annotate(f"x{c['speedup']:.2f}", (c["rows"], c[keys[0]] / c["rows"]), textcoords="offset points",
                        xytext=(0, -12), ha="center", fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows (tokens in the step)")
    ax.legend(fontsize=8)


def main() -> None:
    parser = bench_parser(__doc__, "3 rounds, 3 row counts, written to the temp directory", RESULTS)
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--step-threads", type=positive_int, default=os.cpu_count(),
                        help="torch threads of the decode-step cases (default: every CPU, as the engine)")
    args = parser.parse_args()
    start_bench()
    isa = loaded_kernel_isa()
    rounds = 3 if args.quick else args.rounds
    report = report_header("bench/panel_linear.py", args)
    report["kernel_isa"], report["bf16_gemm"] = isa.name, has_bf16_gemm()
    report["results"] = [measure(dtype, name, rows, rounds, args.seed) for dtype in DTYPES
                         for rows in (QUICK_ROWS if args.quick else ROWS) for name in SHAPES]
    report["forward"] = forward_totals(report["results"])
    report["gated"] = [measure_gated(dtype, rows, rounds, args.seed) for dtype in DTYPES
                       for rows in (QUICK_GATED_ROWS if args.quick else GATED_ROWS)]
    torch.set_num_threads(args.step_threads)
    report["step"] = [measure_step(dtype, rows, rounds, args.seed) for dtype in DTYPES
                      for rows in (QUICK_STEP_ROWS if args.quick else STEP_ROWS)]
    for t in report["forward"]:
        print(f"{t['dtype']:9s} {t['rows']:4d} rows: kernel {t['panels_ms']:8.2f} ms, oneDNN {t['onednn_ms']:8.2f} ms "
              f"(x{t['speedup']:.2f})")
    for r in report["gated"]:
        print(f"{r['dtype']:9s} {r['rows']:4d} rows: gate_up + SiLU-and-mul {r['two_passes_ms']:8.2f} ms, "
              f"one pass {r['fused_ms']:8.2f} ms (x{r['speedup']:.2f})")
    for r in report["step"]:
        print(f"{r['dtype']:9s} {r['rows']:4d} rows, a decode step's linears from DRAM, {r['threads']} threads: kernel "
              f"{r['panels_ms']:8.2f} ms, oneDNN {r['onednn_ms']:8.2f} ms (x{r['speedup']:.2f})")
    out_dir = write_report(report, "panel_linear", args, RESULTS, plot)
    print(f"wrote {out_dir / 'panel_linear.json'} and .png ({isa.name})")


if __name__ == "__main__":
    main()
