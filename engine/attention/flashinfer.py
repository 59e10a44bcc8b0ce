"""Paged attention by FlashInfer's batch wrappers (CUDA); TorchReferenceAttention is its oracle.

The backend itself is device-neutral: it writes the step's keys and values into the pool (the
same slots as the reference), reads the step's FlashInfer metadata (built on the host by
engine/attention/paged_kv_metadata.py), plans each kernel once per step and sliding window (the
first layer plans, the others reuse the plan from the step cache), and runs it per layer over the
gathered query rows. What computes the attention is a `PagedKernels` source: `FlashInferKernels`
wraps BatchPrefillWithPagedKVCacheWrapper / BatchDecodeWithPagedKVCacheWrapper (the only CUDA-only
code here, and the only place `flashinfer` is imported, lazily); splitserve.testing.paged_reference
implements the same two calls in torch over exactly the same metadata, so the whole backend runs
and is tested on CPU.

Pool layout: each layer's [num_blocks, 2, block_size, num_kv_heads, head_dim] tensor is FlashInfer's
single-tensor "NHD" paged layout (pool[:, 0] keys, pool[:, 1] values), the layout every backend
and the KV handshake already use (common.kv_transfer_types.KV_POOL_LAYOUT).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from splitserve.engine.attention.base import AttentionMetadata
from splitserve.engine.attention.paged_kv_metadata import FlashInferMetadata, PagedKVBatch
from splitserve.engine.host_inputs import to_device

WORKSPACE_BYTES = 128 << 20
"""FlashInfer's float workspace (split-KV partial results), allocated once per device and shared by
every wrapper: the size FlashInfer's documentation recommends. Zero-filled: the decode wrapper's
documentation requires it to be zero on first use."""
KV_LAYOUT = "NHD"
"""FlashInfer's name for the pool layout (see the module docstring)."""
BACKEND = "fa2"
"""FlashInfer's kernel family for both wrappers. Its default, "auto", takes fa3 for prefill on Hopper
(sm90): a second set of kernels to compile or ship (prebuilt kernel sets are built per family) that
no test here has compared. fa2 runs on every GPU FlashInfer supports, and pinning it also keeps the
decode wrapper off cuDNN, which "auto" may pick on Blackwell."""
DECODE_GROUP_SIZES = frozenset({1, 2, 3, 4, 6, 8, 16})
"""Query heads per KV head that FlashInfer's CUDA-core decode kernel is compiled for
(DISPATCH_GQA_GROUP_SIZE in include/flashinfer/utils.cuh); it raises "Unsupported group_size" for others."""


@dataclass(frozen=True)
class AttentionShape:
    """What a plan needs besides the metadata: heads, sizes and dtypes of one model's attention."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scale: float | None = None
    """The model's softmax scale of q.k (Granite's attention_multiplier); None for 1 / sqrt(head_dim)."""
    softcap: float | None = None
    """Gemma 2's attn_logit_softcapping: scores s become softcap * tanh(s / softcap) (FlashInfer's logits_soft_cap)."""

    @classmethod
    def of(cls, query: torch.Tensor, kv_cache: torch.Tensor, scale: float | None = None,
           softcap: float | None = None) -> AttentionShape:
        """query [T, H, D], kv_cache [num_blocks, 2, block_size, Hkv, D]."""
        return cls(query.shape[1], kv_cache.shape[-2], query.shape[-1], kv_cache.shape[2], query.dtype,
                   kv_cache.dtype, scale, softcap)

    @property
    def sm_scale(self) -> float:
        return self.head_dim ** -0.5 if self.scale is None else self.scale


class PagedKernel(Protocol):
    """One wrapper: planned once per step (host work), then run once per layer."""

    def plan(self, batch: PagedKVBatch, shape: AttentionShape, window_left: int) -> None:
        """window_left: a query at position i sees keys i - window_left .. i; -1 for no window."""
        ...

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """query [batch.num_queries, H, D] (the ragged rows) -> output of the same shape."""
        ...


class PagedKernels(Protocol):
    """The kernels of one device, reused across steps: one per part and window."""

    def prefill(self, window_left: int) -> PagedKernel:
        """Causal prefill over the paged pool (BatchPrefillWithPagedKVCacheWrapper)."""
        ...

    def decode(self, window_left: int) -> PagedKernel:
        """One query per request (BatchDecodeWithPagedKVCacheWrapper)."""
        ...


@dataclass(frozen=True)
class PlannedPart:
    kernel: PagedKernel
    rows: torch.Tensor | None  # [num_queries] int64 on the device; None when the part is the whole step in order


@dataclass(frozen=True)
class StepPlan:
    """A step's planned kernels for one sliding window (each layer of that window runs them)."""

    parts: tuple[PlannedPart, ...]


def decode_uses_tensor_cores(shape: AttentionShape) -> bool:
    """Whether the decode wrapper runs FlashInfer's tensor-core decode (its prefill kernels): for the
    groups the CUDA-core decode kernel has no instance of (e.g. 7, Qwen2.5-7B's 28 / 4 heads)."""
    return shape.num_qo_heads // shape.num_kv_heads not in DECODE_GROUP_SIZES


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's window for ours: we attend keys with query_pos - key_pos < sliding_window, FlashInfer
    keys with query_pos - key_pos <= window_left."""
    return -1 if sliding_window is None else sliding_window - 1


def plan_key(sliding_window: int | None) -> tuple:
    return ("flashinfer-plan", sliding_window)


def plan_step(metadata: FlashInferMetadata, kernels: PagedKernels, shape: AttentionShape,
              sliding_window: int | None, device: torch.device) -> StepPlan:
    """Plan each non-empty part; a part covering the whole step in row order needs no gather."""
    parts = []
    num_rows = sum(batch.num_queries for batch in (metadata.prefill, metadata.decode) if batch is not None)
    for batch, kernel in ((metadata.prefill, kernels.prefill), (metadata.decode, kernels.decode)):
        if batch is None:
            continue
        planned = kernel(window_left(sliding_window))
        planned.plan(batch, shape, window_left(sliding_window))
        whole = batch.num_queries == num_rows  # then query_rows is 0..T-1: chunks of one kind, in order
        parts.append(PlannedPart(planned, None if whole else to_device(batch.query_rows, device)))
    return StepPlan(tuple(parts))


class FlashInferAttention:
    pads_decode_batches = False
    """Decodes attend only their own pages."""
    needs_paged_metadata = True
    """The runner builds AttentionMetadata.paged for this backend."""
    supports_attention_sinks = False
    """The wrappers it plans take no sinks (docs/gpu.md: GPT-OSS is refused on this backend)."""

    def __init__(self, kernels: PagedKernels | None = None) -> None:
        """kernels: FlashInfer's (the default, CUDA) or a stand-in with the same calls (tests on CPU)."""
        self.kernels = kernels if kernels is not None else FlashInferKernels()

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, sliding_window, scale=None,
                softcap=None, sinks=None):
        if sinks is not None:  # the loader refuses such a model first (supports_attention_sinks)
            raise ValueError("FlashInferAttention does not attend with attention sinks")
        if metadata.paged is None:
            raise ValueError("FlashInferAttention needs AttentionMetadata.paged (an InputBuilder with paged_metadata)")
        flat_cache = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])  # [num_blocks*2*block_size, H, D]
        flat_cache.index_copy_(0, metadata.key_slots, key)
        flat_cache.index_copy_(0, metadata.value_slots, value)
        plan = metadata.step_cache.get(plan_key(sliding_window))
        if plan is None:
            plan = metadata.step_cache[plan_key(sliding_window)] = plan_step(
                metadata.paged, self.kernels, AttentionShape.of(query, kv_cache, scale, softcap), sliding_window,
                query.device)
        return run_plan(plan, query, kv_cache)


def run_plan(plan: StepPlan, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """[T, H, D] attention output of every row of the step."""
    if len(plan.parts) == 1 and plan.parts[0].rows is None:
        return plan.parts[0].kernel.run(query, kv_cache)
    output = torch.empty_like(query)
    for part in plan.parts:
        output.index_copy_(0, part.rows, part.kernel.run(query.index_select(0, part.rows), kv_cache))
    return output


class FlashInferKernels:
    """FlashInfer's wrappers on one CUDA device (CUDA-only): one workspace, one wrapper per part and
    window, created on first use and planned again every step."""

    def __init__(self, module=None, device: torch.device | None = None) -> None:
        """module: the flashinfer package, imported here (and nowhere else) when None; device: where the
        wrappers run, the current CUDA device at the first plan when None. Only tests pass either: they
        check the wrappers' calls on CPU with a stand-in module."""
        if module is None:
            import flashinfer  # noqa: PLC0415 - optional extra `splitserve[gpu]`; CUDA only

            module = flashinfer
        self.module = module
        self._device = device
        self._workspace: torch.Tensor | None = None
        self._wrappers: dict[tuple[str, int], PagedKernel] = {}

    def device(self) -> torch.device:
        if self._device is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        return self._device

    def prefill(self, window_left: int) -> PagedKernel:
        return self._wrapper("prefill", window_left)

    def decode(self, window_left: int) -> PagedKernel:
        return self._wrapper("decode", window_left)

    def workspace(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device())
        return self._workspace

    def _wrapper(self, part: str, window: int) -> PagedKernel:
        wrapper = self._wrappers.get((part, window))
        if wrapper is None:
            cls = _FlashInferPrefill if part == "prefill" else _FlashInferDecode
            wrapper = self._wrappers[(part, window)] = cls(self)
        return wrapper


class _StagedPlan:
    """One wrapper's plan() stages its schedule in the wrapper's one pinned host buffer and queues its copy to
    the device without waiting (the cudaMemcpyAsync that ends PrefillPlan / DecodePlan in FlashInfer's
    include/flashinfer/attention/scheduler.cuh); the wrapper's next plan() rewrites that buffer. A step that
    samples nothing (a chunk of a long prompt) never waits for the GPU, so the host may run a step ahead of it:
    the next plan() first waits for an event recorded after the previous one. The wait returns at once when
    the previous step sampled (its sampled ids already waited for the GPU)."""

    def __init__(self) -> None:
        self._copied = None  # torch.cuda.Event after the last plan's copy; None before the first (or on CPU)

    def replan(self, device: torch.device, plan: Callable[[], None]) -> None:
        if self._copied is not None:
            self._copied.synchronize()
        plan()
        if device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device))


class _FlashInferPrefill:
    """BatchPrefillWithPagedKVCacheWrapper, causal (CUDA-only)."""

    def __init__(self, kernels: FlashInferKernels) -> None:
        self._kernels = kernels
        self._wrapper = None
        self._staged = _StagedPlan()

    def plan(self, batch: PagedKVBatch, shape: AttentionShape, window_left: int) -> None:
        device = self._kernels.device()
        if self._wrapper is None:
            self._wrapper = self._kernels.module.BatchPrefillWithPagedKVCacheWrapper(
                self._kernels.workspace(), KV_LAYOUT, backend=BACKEND)
        # indptr arrays stay on the host (plan reads them there); the indices go to the device.
        kv_indices = to_device(batch.kv_indices, device)
        self._staged.replan(device, lambda: self._wrapper.plan(
            batch.qo_indptr, batch.kv_indptr, kv_indices, batch.kv_last_page_len, shape.num_qo_heads,
            shape.num_kv_heads, shape.head_dim, shape.page_size, causal=True, sm_scale=shape.sm_scale,
            window_left=window_left, logits_soft_cap=shape.softcap, q_data_type=shape.q_dtype,
            kv_data_type=shape.kv_dtype))

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(query.contiguous(), kv_cache)  # query may be a head slice of the fused q/k tensor


class _FlashInferDecode:
    """BatchDecodeWithPagedKVCacheWrapper (CUDA-only); with `graph_batch_size`, the CUDA-graph variant whose
    index buffers are fixed for a batch of exactly that many requests (engine/cuda_graphs.py)."""

    def __init__(self, kernels: FlashInferKernels, graph_batch_size: int = 0, max_pages: int = 0) -> None:
        self._kernels = kernels
        self._graph_batch_size = graph_batch_size
        self._max_pages = max_pages
        self._wrapper = None
        self._staged = _StagedPlan()

    def plan(self, batch: PagedKVBatch, shape: AttentionShape, window_left: int) -> None:
        device = self._kernels.device()
        if self._wrapper is None:
            self._wrapper = self._new_wrapper(device, decode_uses_tensor_cores(shape))
        kv_indices = to_device(batch.kv_indices, device)
        self._staged.replan(device, lambda: self._wrapper.plan(
            batch.kv_indptr, kv_indices, batch.kv_last_page_len, shape.num_qo_heads, shape.num_kv_heads,
            shape.head_dim, shape.page_size, window_left=window_left, sm_scale=shape.sm_scale,
            logits_soft_cap=shape.softcap, q_data_type=shape.q_dtype, kv_data_type=shape.kv_dtype))

    def _new_wrapper(self, device: torch.device, use_tensor_cores: bool):
        cls = self._kernels.module.BatchDecodeWithPagedKVCacheWrapper
        workspace = self._kernels.workspace()
        if not self._graph_batch_size:
            return cls(workspace, KV_LAYOUT, use_tensor_cores=use_tensor_cores, backend=BACKEND)
        size = self._graph_batch_size
        return cls(workspace, KV_LAYOUT, use_cuda_graph=True, use_tensor_cores=use_tensor_cores, backend=BACKEND,
                   paged_kv_indptr_buffer=torch.empty(size + 1, dtype=torch.int32, device=device),
                   paged_kv_indices_buffer=torch.empty(self._max_pages, dtype=torch.int32, device=device),
                   paged_kv_last_page_len_buffer=torch.empty(size, dtype=torch.int32, device=device))

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self._wrapper.run(query.contiguous(), kv_cache)  # query may be a head slice of the fused q/k tensor


class FlashInferGraphKernels:
    """Decode kernels for one captured batch size (CUDA-only): wrappers with fixed buffers, so a graph
    captured around their run() stays valid when plan() rewrites the buffers' contents."""

    def __init__(self, kernels: FlashInferKernels, batch_size: int, max_pages: int) -> None:
        self._kernels = kernels
        self._batch_size = batch_size
        self._max_pages = max_pages
        self._wrappers: dict[int, PagedKernel] = {}

    def prefill(self, window_left: int) -> PagedKernel:
        raise ValueError("a captured decode step has no prefill part")

    def decode(self, window_left: int) -> PagedKernel:
        if window_left not in self._wrappers:
            self._wrappers[window_left] = _FlashInferDecode(self._kernels, self._batch_size, self._max_pages)
        return self._wrappers[window_left]
