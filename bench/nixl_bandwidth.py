"""NIXL pull bandwidth for a realistic KV layout vs a single-process memcpy of the same bytes.

Two processes, as in a deployment (prefill and decode are different Ray actors): a producer
process registers its KV pool with a NixlBackend and drains notifications; this process is
the consumer and pulls N scattered blocks (every layer of each) as a ConsumerConnector does: the
data READ (NixlBackend.start_pull/poll_pull), then the check READ of the N generation words
(start_check, which notifies the producer), for N in 16..1024. The baseline, timed in alternating rounds
in this process on a local copy of the same pool, gathers the same blocks with
torch.index_select into a preallocated buffer (one read + one write per byte, like the READ)
on one thread (NIXL's copy also runs on one thread).

Layout: Llama-8B-like KV per layer (8 KV heads x 128 head dim, fp32, 16-token blocks) on 8
layers: 128 KiB per block per layer, 1 MiB per block. Bandwidth = bytes pulled per second.
The first pull of every N is checked byte for byte against the local copy. `--block-size T` makes each
block T tokens (T / 16 times the bytes per descriptor; the pools grow with it): whether a pull is bound by
bytes or by the number of descriptors.

`--device cuda` puts both pools in GPU memory (registered as VRAM; UCX picks cuda_ipc between the two
processes on one GPU) and times the baseline gather on the GPU (CUDA-synchronised): the KV pull from VRAM
against a device memcpy of the same blocks.

Writes bench/results/nixl_bandwidth.json and .png (`--device cuda`: nixl_bandwidth_cuda.*; another
--block-size T adds _blockT).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import random
import statistics
import time
import uuid
from dataclasses import asdict, dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from splitserve.common.kv_transfer_types import KVLayout, TransferParams
from splitserve.kv_transfer.base import PullState, memory_kind
from splitserve.kv_transfer.nixl_backend import NixlBackend, NixlConfig

DEFAULT_BLOCK_SIZE = 16
POOL_BLOCKS = 1536
"""Blocks per pool (1.5 GiB at 16 tokens per block): pulls of up to 1024 blocks are still scattered."""
BLOCK_COUNTS = (16, 32, 64, 128, 256, 512, 1024)
RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Row:
    num_blocks: int
    num_bytes: int
    nixl_s: float
    """Median seconds from start_pull to DONE."""
    memcpy_s: float
    """Median seconds of the index_select gather of the same blocks."""
    repeats: int

    @property
    def nixl_gb_per_s(self) -> float:
        return self.num_bytes / self.nixl_s / 1e9

    @property
    def memcpy_gb_per_s(self) -> float:
        return self.num_bytes / self.memcpy_s / 1e9


def bench_layout(device: torch.device, block_size: int) -> KVLayout:
    return KVLayout(model_id="bench-llama-like", dtype="float32", block_size=block_size, num_layers=8,
                    num_kv_heads=8, head_dim=128, hash_seed=0, memory_kind=memory_kind(device))


def make_pool(num_blocks: int, device: torch.device, layout: KVLayout) -> list[torch.Tensor]:
    """layers[l]: [num_blocks, 2, block_size, 8, 128] fp32, deterministic and different in every block and layer."""
    shape = (num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    numel = num_blocks * 2 * layout.block_size * layout.num_kv_heads * layout.head_dim
    return [torch.arange(numel, dtype=torch.float32, device=device).add_(layer * 0.5).reshape(shape)
            for layer in range(layout.num_layers)]


def serve_producer(conn, config: NixlConfig, device: torch.device, block_size: int) -> None:
    """Producer process: register the pool, publish metadata, drain notifications until 'stop'."""
    backend = NixlBackend(f"bench-prefill-{uuid.uuid4().hex[:8]}", config)
    layout = bench_layout(device, block_size)
    backend.register_kv_pool(make_pool(POOL_BLOCKS, device, layout), layout)
    conn.send(backend.metadata())
    notified = 0
    while not conn.poll(0.001):
        notified += len(backend.take_notifications())
    conn.recv()
    conn.send(notified + len(backend.take_notifications()))
    backend.close()


def timed_pull(backend: NixlBackend, params: TransferParams, local_ids: tuple[int, ...]) -> float:
    """Seconds for the data READ and then the check READ (both, as one pull needs them)."""
    start = time.perf_counter()
    for start_read in (backend.start_pull, backend.start_check):
        handle = start_read(params, local_ids)
        while (state := backend.poll_pull(handle)) is PullState.PENDING:
            pass
        backend.release_pull(handle)
        if state is not PullState.DONE:
            raise RuntimeError(f"pull {params.request_id} failed: {handle.error}")
    elapsed = time.perf_counter() - start
    if backend.checked_generations(local_ids) != params.block_generations:
        raise RuntimeError(f"pull {params.request_id}: the producer's generations changed")
    return elapsed


def timed_memcpy(source: list[torch.Tensor], block_ids: tuple[int, ...], out: list[torch.Tensor]) -> float:
    index = torch.tensor(block_ids, dtype=torch.long, device=source[0].device)
    synchronize(source[0].device)
    start = time.perf_counter()
    for layer, buffer in zip(source, out):
        torch.index_select(layer, 0, index, out=buffer[:len(block_ids)])  # buffer: [N, 2, block_size, 8, 128]
    synchronize(source[0].device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(backend: NixlBackend, producer: str, layout: KVLayout, local: list[torch.Tensor],
            source: list[torch.Tensor], out: list[torch.Tensor], num_blocks: int, min_repeats: int,
            min_seconds: float, rng: random.Random) -> Row:
    """Alternate NIXL pulls and memcpy gathers of fresh scattered block sets; medians of each."""
    nixl, memcpy = [], []
    while len(nixl) < min_repeats or sum(nixl) + sum(memcpy) < min_seconds:
        remote_ids = tuple(rng.sample(range(POOL_BLOCKS), num_blocks))
        local_ids = tuple(rng.sample(range(POOL_BLOCKS), num_blocks))
        params = TransferParams(f"pull-{num_blocks}-{len(nixl)}", producer, remote_ids,
                                num_blocks * layout.block_size, layout, 60.0, (0,) * num_blocks)  # the producer process never bumps a generation
        seconds = timed_pull(backend, params, local_ids)
        if nixl:  # the first pull of each size is the warm-up and the byte-exact check
            nixl.append(seconds)
        else:
            check_pulled(local, local_ids, source, remote_ids)
            nixl.append(timed_pull(backend, params, local_ids))
        memcpy.append(timed_memcpy(source, remote_ids, out))
    num_bytes = num_blocks * layout.num_layers * layout.bytes_per_block_per_layer
    return Row(num_blocks, num_bytes, statistics.median(nixl), statistics.median(memcpy), len(nixl))


def check_pulled(local: list[torch.Tensor], local_ids: tuple[int, ...], source: list[torch.Tensor],
                 remote_ids: tuple[int, ...]) -> None:
    for layer, (dst, src) in enumerate(zip(local, source)):
        if not torch.equal(dst[list(local_ids)], src[list(remote_ids)]):
            raise AssertionError(f"layer {layer}: pulled bytes differ from the source blocks")


def plot(rows: list[Row], path: Path, baseline: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [row.num_blocks for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(counts, [row.nixl_gb_per_s for row in rows], "o-", label="NIXL READ (2 processes)")
    left.plot(counts, [row.memcpy_gb_per_s for row in rows], "s--", color="tab:gray",
              label=baseline)
    left.set(xscale="log", xlabel="blocks per pull (1 MiB each)", ylabel="GB/s", title="KV pull bandwidth")
    left.set_xticks(counts, [str(c) for c in counts])
    if max(row.memcpy_gb_per_s / row.nixl_gb_per_s for row in rows) > 20:
        left.set_yscale("log")  # both series stay readable when the READ is far below the copy
    else:
        left.set_ylim(bottom=0)
    left.legend(loc="lower right")
    right.plot(counts, [row.nixl_gb_per_s / row.memcpy_gb_per_s for row in rows], "o-")
    right.axhline(1.0, color="tab:gray", linewidth=0.8)
    right.set(xscale="log", xlabel="blocks per pull", ylabel="NIXL / memcpy", title="ratio (1.0 = memcpy speed)")
    right.set_xticks(counts, [str(c) for c in counts])
    right.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ucx-error-handling-mode", default="none", choices=("none", "peer"))
    parser.add_argument("--min-repeats", type=int, default=7)
    parser.add_argument("--min-seconds", type=float, default=0.5, help="per block count, NIXL + memcpy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both KV pools live")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    config = NixlConfig(ucx_error_handling_mode=args.ucx_error_handling_mode)
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    layout = bench_layout(device, args.block_size)
    process = context.Process(target=serve_producer, args=(child, config, device, args.block_size), daemon=True)
    process.start()
    backend = NixlBackend(f"bench-decode-{uuid.uuid4().hex[:8]}", config)
    try:
        local = [layer.zero_() for layer in make_pool(POOL_BLOCKS, device, layout)]
        backend.register_kv_pool(local, layout)
        metadata = parent.recv()
        backend.add_peer(metadata)
        source = make_pool(POOL_BLOCKS, device, layout)
        out = [torch.empty_like(layer[:max(BLOCK_COUNTS)]).zero_() for layer in source]
        rng = random.Random(args.seed)
        rows = [measure(backend, metadata.agent_name, layout, local, source, out, n, args.min_repeats,
                        args.min_seconds, rng) for n in BLOCK_COUNTS]
        parent.send("stop")
        notified = parent.recv()
    finally:
        backend.close()
        process.join(30)
    write_report(rows, notified, config, layout, args)


def nixl_version() -> str:
    """The installed NIXL build (nixl-cu12 on CPU machines; GPU machines may have another CUDA variant)."""
    for name in ("nixl-cu12", "nixl-cu13", "nixl"):
        try:
            return f"{name} {version(name)}"
        except PackageNotFoundError:
            continue
    return "unknown"


def write_report(rows: list[Row], notified: int, config: NixlConfig, layout: KVLayout,
                 args: argparse.Namespace) -> None:
    expected = sum(row.repeats + 1 for row in rows)
    report = {
        "layout": asdict(layout), "bytes_per_block": layout.num_layers * layout.bytes_per_block_per_layer,
        "pool_blocks": POOL_BLOCKS, "nixl": asdict(config), "seed": args.seed,
        "device": args.device,
        "machine": {"platform": platform.platform(), "nixl": nixl_version(), "torch": torch.__version__,
                    "memcpy_threads": torch.get_num_threads(),
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None},
        "notifications": {"pulls": expected, "received_by_producer": notified},
        "rows": [dict(asdict(row), nixl_gb_per_s=row.nixl_gb_per_s, memcpy_gb_per_s=row.memcpy_gb_per_s,
                      ratio=row.nixl_gb_per_s / row.memcpy_gb_per_s) for row in rows],
    }
    RESULTS.mkdir(exist_ok=True)
    suffix = ("" if config.ucx_error_handling_mode == "none" else f"_{config.ucx_error_handling_mode}") + (
        "_cuda" if args.device == "cuda" else "") + (
        "" if layout.block_size == DEFAULT_BLOCK_SIZE else f"_block{layout.block_size}")
    (RESULTS / f"nixl_bandwidth{suffix}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, RESULTS / f"nixl_bandwidth{suffix}.png",
         "device memcpy (index_select on the GPU)" if args.device == "cuda" else "memcpy (index_select, 1 thread)")
    print(f"{'blocks':>6} {'MiB':>6} {'NIXL ms':>8} {'GB/s':>6} {'memcpy ms':>9} {'GB/s':>6} {'ratio':>6}")
    for row in rows:
        print(f"{row.num_blocks:6d} {row.num_bytes / 2**20:6.0f} {1e3 * row.nixl_s:8.2f} {row.nixl_gb_per_s:6.2f} "
              f"{1e3 * row.memcpy_s:9.2f} {row.memcpy_gb_per_s:6.2f} {row.nixl_gb_per_s / row.memcpy_gb_per_s:6.2f}")
    print(f"producer notifications: {notified} of {expected} pulls")


if __name__ == "__main__":
    main()
