"""Host cost of a decode step's inputs: what FlashInfer's metadata and CUDA-graph padding add (CPU).

On a GPU the host builds every step's inputs while the device waits for them (decode steps of a
small model take well under a millisecond), so the host-side work of the GPU path is a cost per
step. This measures it on the CPU, where it runs anyway, for decode steps of B requests
(B = 1 .. 256, contexts 200-1000 tokens, 16-token blocks, scattered block tables):

- `baseline`: InputBuilder.build as the reference backend needs it (decode buckets by length);
- `paged`: InputBuilder.build with FlashInfer's metadata and one decode batch, what the
  FlashInfer backend needs;
- `padded`: pad_decode_step to the bucket of B, what a captured-graph replay needs instead.

Each is timed in alternating rounds in this process (median of `--repeats`), and the ratio to the
baseline is reported. No GPU is involved: the numbers are the host's share of a GPU step.
Writes bench/results/step_inputs.json and .png.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from splitserve.engine.decode_buckets import DecodeBucketTable, pad_decode_step
from splitserve.engine.model_runner import InputBuilder
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput

BATCH_SIZES = (1, 8, 32, 64, 128, 256)
BLOCK_SIZE = 16
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Row:
    batch_size: int
    baseline_us: float
    paged_us: float
    padded_us: float

    @property
    def paged_ratio(self) -> float:
        return self.paged_us / self.baseline_us


def decode_step(batch_size: int, rng: random.Random) -> SchedulerOutput:
    """B decodes at contexts 200-1000 over distinct scattered blocks of a 20k-block pool."""
    free = rng.sample(range(20_000), 20_000)
    chunks = []
    for index in range(batch_size):
        position = rng.randint(199, 999)
        table = tuple(free.pop() for _ in range(position // BLOCK_SIZE + 1))
        chunks.append(ScheduledChunk(f"r{index}", (rng.randint(3, 999),), position, table, True))
    return SchedulerOutput(tuple(chunks), ())


def median_us(build, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        build()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(batch_size: int, repeats: int) -> Row:
    output = decode_step(batch_size, random.Random(batch_size))
    cpu = torch.device("cpu")
    baseline = InputBuilder(BLOCK_SIZE, cpu)
    paged = InputBuilder(BLOCK_SIZE, cpu, bucket_decodes=False, paged_metadata=True)
    bucket = DecodeBucketTable.up_to(256).bucket_for(batch_size)
    builds = {"baseline": lambda: baseline.build(output), "paged": lambda: paged.build(output),
              "padded": lambda: pad_decode_step(output.chunks, bucket, BLOCK_SIZE, 20_000)}
    samples: dict[str, list[float]] = {name: [] for name in builds}
    for _round in range(5):  # alternate, so drifting load from other processes hits all three alike
        for name, build in builds.items():
            samples[name].append(median_us(build, repeats))
    return Row(batch_size, *(statistics.median(samples[name]) for name in ("baseline", "paged", "padded")))


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(6, 4))
    sizes = [row.batch_size for row in rows]
    for name in ("baseline", "paged", "padded"):
        axis.plot(sizes, [getattr(row, f"{name}_us") for row in rows], marker="o", label=name)
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("decodes in the step")
    axis.set_ylabel("host time to build the step's inputs (us)")
    axis.set_title("Step inputs on the host (CPU)")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="builds per timed round (median)")
    args = parser.parse_args()
    rows = [measure(size, args.repeats) for size in BATCH_SIZES]
    for row in rows:
        print(f"B={row.batch_size:4d}  baseline {row.baseline_us:8.1f} us  paged {row.paged_us:8.1f} us "
              f"({row.paged_ratio:.2f}x)  padded {row.padded_us:8.1f} us")
    RESULTS.mkdir(exist_ok=True)
    report = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "block_size": BLOCK_SIZE, "repeats": args.repeats,
              "rows": [asdict(row) | {"paged_ratio": row.paged_ratio} for row in rows]}
    (RESULTS / "step_inputs.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, RESULTS / "step_inputs.png")


if __name__ == "__main__":
    main()
