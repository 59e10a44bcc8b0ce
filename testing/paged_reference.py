"""FlashInfer's two paged wrappers re-done in plain torch, over exactly FlashInfer's metadata format.

`ReferencePagedKernels` implements engine.attention.flashinfer.PagedKernels: plan() keeps the CSR
arrays (qo_indptr, kv_indptr, kv_indices, kv_last_page_len), run() reads nothing else. So the
FlashInfer backend, with everything it builds (the metadata, the plans, the row gathers), runs on
CPU, and tests compare it with TorchReferenceAttention, which reads the pool its own way (block
tables and slots). On CUDA tests/gpu compares FlashInfer itself with both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention.flashinfer import AttentionShape
from splitserve.engine.attention.paged_kv_metadata import PagedKVBatch
from splitserve.engine.attention.torch_ref import attention


@dataclass(frozen=True)
class _Plan:
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int64
    kv_last_page_len: list[int]
    page_size: int
    window_left: int
    sm_scale: float
    softcap: float | None


class ReferencePagedKernel:
    """One wrapper (prefill or decode): causal attention of each request's ragged queries to its pages."""

    def __init__(self) -> None:
        self.num_plans = 0
        """How often plan() ran (tests check it runs once per step, not once per layer)."""
        self._plan: _Plan | None = None

    def plan(self, batch: PagedKVBatch, shape: AttentionShape, window_left: int) -> None:
        self.num_plans += 1
        self._plan = _Plan(batch.qo_indptr.tolist(), batch.kv_indptr.tolist(), batch.kv_indices.long(),
                           batch.kv_last_page_len.tolist(), shape.page_size, window_left, shape.sm_scale,
                           shape.softcap)

    def run(self, query: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """query [qo_indptr[-1], H, D], kv_cache [num_pages, 2, page_size, Hkv, D] (NHD) -> [qo_indptr[-1], H, D]."""
        plan = self._plan
        output = torch.empty_like(query)
        for b in range(len(plan.kv_last_page_len)):
            rows = slice(plan.qo_indptr[b], plan.qo_indptr[b + 1])
            pages = plan.kv_indices[plan.kv_indptr[b]:plan.kv_indptr[b + 1]]
            kv_len = (len(pages) - 1) * plan.page_size + plan.kv_last_page_len[b]
            output[rows] = _attend(query[rows], kv_cache[pages], kv_len, plan)
        return output


def _attend(query: torch.Tensor, blocks: torch.Tensor, kv_len: int, plan: _Plan) -> torch.Tensor:
    """One request: query [q, H, D] at positions kv_len - q .. kv_len - 1, blocks [n, 2, P, Hkv, D]."""
    keys = blocks[:, 0].reshape(-1, *blocks.shape[-2:])[:kv_len]  # [kv_len, Hkv, D]
    values = blocks[:, 1].reshape(-1, *blocks.shape[-2:])[:kv_len]
    query_pos = torch.arange(kv_len - query.shape[0], kv_len).unsqueeze(1)  # [q, 1]
    key_pos = torch.arange(kv_len).unsqueeze(0)  # [1, kv_len]
    visible = key_pos <= query_pos
    if plan.window_left >= 0:
        visible &= query_pos - key_pos <= plan.window_left
    out = attention(query.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                    values.transpose(0, 1).unsqueeze(0), visible.to(query.device), plan.sm_scale,
                    plan.softcap)  # [1, H, q, D]
    return out[0].transpose(0, 1)


class ReferencePagedKernels:
    """engine.attention.flashinfer.PagedKernels in torch: one kernel per part and window, as FlashInfer's."""

    def __init__(self) -> None:
        self.kernels: dict[tuple[str, int], ReferencePagedKernel] = {}

    def prefill(self, window_left: int) -> ReferencePagedKernel:
        return self.kernels.setdefault(("prefill", window_left), ReferencePagedKernel())

    def decode(self, window_left: int) -> ReferencePagedKernel:
        return self.kernels.setdefault(("decode", window_left), ReferencePagedKernel())
