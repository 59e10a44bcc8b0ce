"""Decode steps captured as CUDA graphs, one per batch-size bucket, replayed instead of the eager forward (CUDA-only).

What a replay needs is decided on the host by engine/decode_buckets.py (the bucket, the padded
inputs; tested on CPU); this module holds what only runs on a GPU: static input tensors per bucket,
FlashInfer decode wrappers with fixed index buffers (FlashInferGraphKernels), the capture and the
replay. Before each replay the step's inputs are copied into the bucket's static tensors (from
pinned memory, without waiting) and each wrapper is planned again for the step's pages (plan() runs
on the host and rewrites the fixed buffers, which the captured kernels read). Only steps whose
chunks are all decodes that sample take a graph; any other step runs eagerly.

Capture order is largest bucket first, all graphs in one memory pool, after one eager warm-up
forward per bucket (lazy initialisation inside kernels must not happen during capture).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.common.config import EngineConfig
from splitserve.engine.attention.base import AttentionMetadata
from splitserve.engine.attention.flashinfer import (AttentionShape, FlashInferAttention, FlashInferGraphKernels,
                                                    PlannedPart, StepPlan, plan_key, window_left)
from splitserve.engine.attention.paged_kv_metadata import FlashInferMetadata
from splitserve.engine.decode_buckets import DecodeBucketTable, PaddedDecodeStep, pad_decode_step
from splitserve.engine.host_inputs import to_device
from splitserve.engine.kv_cache import KVCache
from splitserve.engine.models.llama import LlamaFamilyForCausalLM
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput


@dataclass
class _CapturedBucket:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor  # [bucket] int64, static
    positions: torch.Tensor  # [bucket] int64, static
    key_slots: torch.Tensor  # [bucket] int64, static
    value_slots: torch.Tensor  # [bucket] int64, static: key_slots + block_size
    logits: torch.Tensor  # [bucket, vocab] model dtype, written by each replay
    kernels: FlashInferGraphKernels


class CudaGraphDecodeRunner:
    """Owns the captured decode graphs of one engine (one CUDA device)."""

    def __init__(self, model: LlamaFamilyForCausalLM, kv_cache: KVCache, backend: FlashInferAttention,
                 table: DecodeBucketTable, max_blocks_per_seq: int) -> None:
        if kv_cache.dummy_block is None:
            raise ValueError("CUDA graphs need a KV pool with a reserved dummy block for padding rows")
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.table = table
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = kv_cache.layers[0].device
        arch = model.arch
        self.shape = AttentionShape(arch.num_heads, arch.num_kv_heads, arch.head_dim, kv_cache.spec.block_size,
                                    kv_cache.spec.dtype, kv_cache.spec.dtype)
        self.windows = tuple(sorted(set(arch.sliding_windows), key=lambda w: -1 if w is None else w))
        self._buckets: dict[int, _CapturedBucket] = {}
        self._pool = None

    def can_run(self, output: SchedulerOutput) -> bool:
        return self.table.takes(output.chunks)

    @torch.inference_mode()
    def capture(self) -> None:
        for size in reversed(self.table.sizes):
            self._buckets[size] = self._capture(size)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> torch.Tensor:
        """Logits [num_chunks, vocab] (float32) of a step that can_run, by one replay."""
        bucket_size = self.table.bucket_for(len(output.chunks))
        bucket = self._buckets[bucket_size]
        step = pad_decode_step(output.chunks, bucket_size, self.kv_cache.spec.block_size, self.kv_cache.dummy_block)
        self._load(bucket, step)
        bucket.graph.replay()
        return bucket.logits[:step.num_real].to(torch.float32, copy=True)

    def _load(self, bucket: _CapturedBucket, step: PaddedDecodeStep) -> None:
        """Copy a step into the bucket's static inputs and plan its wrappers for the step's pages."""
        bucket.input_ids.copy_(to_device(step.input_ids, self.device), non_blocking=True)
        bucket.positions.copy_(to_device(step.positions, self.device), non_blocking=True)
        bucket.key_slots.copy_(to_device(step.key_slots, self.device), non_blocking=True)
        bucket.value_slots.copy_(to_device(step.key_slots + step.block_size, self.device), non_blocking=True)
        for window in self.windows:
            bucket.kernels.decode(window_left(window)).plan(step.paged, self.shape, window_left(window))

    def _capture(self, size: int) -> _CapturedBucket:
        step = self._padding_only(size)
        kernels = FlashInferGraphKernels(self.backend.kernels, size, size * self.max_blocks_per_seq)
        static = [torch.empty(size, dtype=torch.long, device=self.device) for _ in range(4)]
        bucket = _CapturedBucket(torch.cuda.CUDAGraph(), *static, logits=torch.empty(0), kernels=kernels)
        self._load(bucket, step)
        metadata = self._metadata(bucket, step)
        side = torch.cuda.Stream(self.device)  # warm-up off the capture stream, as torch's graph docs do
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(bucket, metadata)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        with torch.cuda.graph(bucket.graph, pool=self._pool):
            bucket.logits = self._forward(bucket, metadata)
        self._pool = bucket.graph.pool()
        return bucket

    def _padding_only(self, size: int) -> PaddedDecodeStep:
        """A step of `size` padding rows (what the graph is captured with; the shapes are all that matter)."""
        dummy = self.kv_cache.dummy_block
        chunks = tuple(ScheduledChunk(f"capture-{row}", (0,), 0, (dummy,), True) for row in range(size))
        return pad_decode_step(chunks, size, self.kv_cache.spec.block_size, dummy)

    def _metadata(self, bucket: _CapturedBucket, step: PaddedDecodeStep) -> AttentionMetadata:
        """The static tensors as the backend's metadata, with the graph wrappers as the step's plans."""
        plans = {plan_key(window): StepPlan((PlannedPart(bucket.kernels.decode(window_left(window)), None),))
                 for window in self.windows}
        return AttentionMetadata(positions=bucket.positions, key_slots=bucket.key_slots,
                                 value_slots=bucket.value_slots, prefills=(),
                                 decodes=(), block_size=self.kv_cache.spec.block_size,
                                 paged=FlashInferMetadata(prefill=None, decode=step.paged), step_cache=plans)

    def _forward(self, bucket: _CapturedBucket, metadata: AttentionMetadata) -> torch.Tensor:
        hidden = self.model(bucket.input_ids, bucket.positions, self.kv_cache.layers, metadata)  # [bucket, hidden]
        return self.model.compute_logits(hidden)  # [bucket, vocab]


def build_decode_graphs(config: EngineConfig, model: LlamaFamilyForCausalLM, kv_cache: KVCache, attention,
                        max_model_len: int) -> CudaGraphDecodeRunner | None:
    """The captured decode graphs when config.cuda_graphs (ValueError unless the backend is FlashInfer on CUDA)."""
    if not config.cuda_graphs:
        return None
    if not isinstance(attention, FlashInferAttention) or kv_cache.layers[0].device.type != "cuda":
        raise ValueError("cuda_graphs needs device 'cuda' and the flashinfer attention backend "
                         "(attention_backend flashinfer or auto, dtype float16 or bfloat16)")
    block_size = kv_cache.spec.block_size
    runner = CudaGraphDecodeRunner(model, kv_cache, attention, DecodeBucketTable.up_to(config.max_num_seqs),
                                   -(-max_model_len // block_size))
    runner.capture()
    return runner
