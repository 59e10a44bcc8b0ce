"""Decode steps captured as CUDA graphs, one per batch-size bucket, replayed instead of the eager forward.

The host decides what a replay needs (engine/decode_buckets.py: the bucket, the padded inputs).
`DecodeGraphRunner` keeps each bucket's static input tensors and its decode kernels, captures the
forward once per bucket, and before each replay copies the step's inputs into the static tensors
(from pinned memory, without waiting) and plans each kernel again for the step's pages (plan runs
on the host and rewrites the buffers the captured kernels read). Only steps whose chunks are all
decodes that sample take a graph. Any other step runs eagerly.

Two seams keep the CUDA-only part thin: the graph (`CudaGraphs`: torch.cuda.CUDAGraph, captured
largest bucket first into one memory pool after an eager warm-up on a side stream) and the
kernels (`FlashInferGraphKernels`: decode wrappers with fixed index buffers). Tests on CPU run the
same runner with splitserve.testing's stand-ins (a "graph" that runs the captured function again,
torch kernels over FlashInfer's metadata).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from splitserve.common.config import EngineConfig
from splitserve.engine.attention.base import AttentionMetadata
from splitserve.engine.attention.flashinfer import (AttentionShape, FlashInferAttention, FlashInferGraphKernels,
                                                    PagedKernels, PlannedPart, StepPlan, plan_key, window_left)
from splitserve.engine.attention.paged_kv_metadata import FlashInferMetadata
from splitserve.engine.decode_buckets import DecodeBucketTable, PaddedDecodeStep, pad_decode_step
from splitserve.engine.host_inputs import to_device
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.models.llama import LlamaFamilyForCausalLM
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput


class Graph(Protocol):
    def replay(self) -> None:
        """Run the captured work again, reading the static inputs' current contents."""
        ...


class Graphs(Protocol):
    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        """Capture `forward` (a closure over static inputs); returns the graph and its static output."""
        ...


GraphKernels = Callable[[int, int], PagedKernels]
"""(bucket size, most pages of a bucket's batch) -> the kernels a bucket's graph captures."""


class CudaGraphs:
    """torch.cuda.CUDAGraph capture (CUDA-only): all graphs of an engine share one memory pool."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pool = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> tuple[Graph, torch.Tensor]:
        side = torch.cuda.Stream(self.device)  # warm-up off the capture stream, as torch's graph docs do
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = forward()
        self._pool = graph.pool()
        return graph, output


@dataclass
class _Bucket:
    input_ids: torch.Tensor  # [bucket] int64, static
    positions: torch.Tensor  # [bucket] int64, static
    key_slots: torch.Tensor  # [bucket] int64, static
    value_slots: torch.Tensor  # [bucket] int64, static: key_slots + block_size
    kernels: PagedKernels
    graph: Graph | None = None
    logits: torch.Tensor | None = None  # [bucket, vocab] model dtype, rewritten by each replay


class DecodeGraphRunner:
    """Owns the captured decode steps of one engine."""

    def __init__(self, model: LlamaFamilyForCausalLM, kv_cache: KVCache, table: DecodeBucketTable,
                 max_blocks_per_seq: int, graphs: Graphs, graph_kernels: GraphKernels) -> None:
        if kv_cache.dummy_block is None:
            raise ValueError("captured decode steps need a KV pool with a reserved dummy block for padding rows")
        self.model = model
        self.kv_cache = kv_cache
        self.table = table
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = kv_cache.layers[0].device
        arch = model.arch
        self.shape = AttentionShape(arch.num_heads, arch.num_kv_heads, arch.head_dim, kv_cache.spec.block_size,
                                    kv_cache.spec.dtype, kv_cache.spec.dtype, arch.attention_scale,
                                    arch.attention_softcap)
        self.windows = tuple(dict.fromkeys(arch.sliding_windows))  # distinct, in layer order
        self._graphs = graphs
        self._graph_kernels = graph_kernels
        self._buckets: dict[int, _Bucket] = {}
        self.num_replays = 0

    def can_run(self, output: SchedulerOutput) -> bool:
        return self.table.takes(output.chunks)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (smaller graphs then reuse the largest one's memory)."""
        for size in reversed(self.table.sizes):
            self._buckets[size] = self._capture(size)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits [num_chunks, vocab] (float32) of a step that can_run, by one replay."""
        size = self.table.bucket_for(len(output.chunks))
        bucket = self._buckets[size]
        step = pad_decode_step(output.chunks, size, self.kv_cache.spec.block_size, self.kv_cache.dummy_block)
        self._load(bucket, step)
        bucket.graph.replay()
        self.num_replays += 1
        return bucket.logits[:step.num_real].to(torch.float32, copy=True)

    def _load(self, bucket: _Bucket, step: PaddedDecodeStep) -> None:
        """Copy a step into the bucket's static inputs and plan its kernels for the step's pages."""
        bucket.input_ids.copy_(to_device(step.input_ids, self.device), non_blocking=True)
        bucket.positions.copy_(to_device(step.positions, self.device), non_blocking=True)
        bucket.key_slots.copy_(to_device(step.key_slots, self.device), non_blocking=True)
        bucket.value_slots.copy_(to_device(step.key_slots + step.block_size, self.device), non_blocking=True)
        for window in self.windows:
            bucket.kernels.decode(window_left(window)).plan(step.paged, self.shape, window_left(window))

    def _capture(self, size: int) -> _Bucket:
        step = self._padding_only(size)
        bucket = _Bucket(*(torch.empty(size, dtype=torch.long, device=self.device) for _ in range(4)),
                         kernels=self._graph_kernels(size, size * self.max_blocks_per_seq))
        self._load(bucket, step)
        metadata = self._metadata(bucket, step)
        bucket.graph, bucket.logits = self._graphs.capture(lambda: self._forward(bucket, metadata))
        return bucket

    def _padding_only(self, size: int) -> PaddedDecodeStep:
        """A step of `size` padding rows: what a graph is captured with (only the shapes matter)."""
        dummy = self.kv_cache.dummy_block
        chunks = tuple(ScheduledChunk(f"capture-{row}", (0,), 0, (dummy,), True) for row in range(size))
        return pad_decode_step(chunks, size, self.kv_cache.spec.block_size, dummy)

    def _metadata(self, bucket: _Bucket, step: PaddedDecodeStep) -> AttentionMetadata:
        """The static tensors as the backend's metadata, with the bucket's kernels as the step's plans (the
        backend runs them and plans nothing inside the graph)."""
        plans = {plan_key(window): StepPlan((PlannedPart(bucket.kernels.decode(window_left(window)), None),))
                 for window in self.windows}
        return AttentionMetadata(positions=bucket.positions, key_slots=bucket.key_slots,
                                 value_slots=bucket.value_slots, prefills=(), decodes=(),
                                 block_size=self.kv_cache.spec.block_size,
                                 paged=FlashInferMetadata(prefill=None, decode=step.paged), step_cache=plans)

    def _forward(self, bucket: _Bucket, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(bucket.input_ids, bucket.positions, self.kv_cache.layers, metadata)  # [bucket, hidden]
        return self.model.compute_logits(hidden)  # [bucket, vocab]


def uses_cuda_graphs(requested: bool | None, device: torch.device, attention, sparse_moe: bool = False) -> bool:
    """Whether an engine captures its decode steps: EngineConfig.cuda_graphs where set (True is refused unless the
    backend is FlashInfer on CUDA and the model is no mixture of experts), else exactly where it can."""
    capturable = isinstance(attention, FlashInferAttention) and device.type == "cuda"
    if requested and not capturable:
        raise ValueError("cuda_graphs needs device 'cuda' and the flashinfer attention backend "
                         "(attention_backend flashinfer or auto, dtype float16 or bfloat16)")
    if requested and sparse_moe:
        raise ValueError("cuda_graphs cannot capture a mixture-of-experts model: each layer reads back from the "
                         "device how many tokens chose each expert (engine/models/moe.py); set cuda_graphs false")
    return (capturable and not sparse_moe) if requested is None else requested


def build_decode_graphs(config: EngineConfig, model: LlamaFamilyForCausalLM, kv_cache: KVCache, attention,
                        max_model_len: int) -> DecodeGraphRunner:
    """The captured decode steps (an engine for which uses_cuda_graphs)."""
    device = kv_cache.layers[0].device
    runner = DecodeGraphRunner(model, kv_cache, DecodeBucketTable.up_to(config.max_num_seqs),
                               -(-max_model_len // kv_cache.spec.block_size), CudaGraphs(device),
                               lambda size, max_pages: FlashInferGraphKernels(attention.kernels, size, max_pages))
    runner.capture()
    return runner
