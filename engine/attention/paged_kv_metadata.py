"""FlashInfer's paged-KV metadata for one step, built on the host from the scheduled chunks (plain code).

FlashInfer's batch wrappers describe a batch of requests by CSR arrays over pages (= our KV blocks):
request b's queries are rows qo_indptr[b]:qo_indptr[b+1] of a ragged query tensor, its KV lives in
pages kv_indices[kv_indptr[b]:kv_indptr[b+1]] (in position order), and the last of those pages
holds kv_last_page_len[b] (in [1, page_size]) valid tokens. A query row is causally aligned to the
end of its request's KV: query i of a request with q queries and L KV tokens is at position
L - q + i. The pool is one [num_blocks, 2, block_size, num_kv_heads, head_dim] tensor per layer,
which is FlashInfer's single-tensor "NHD" layout, so no block moves or changes shape for it.

A step is split in two such batches, each planned and run by its own wrapper: the decodes (chunks
of one query token) and the prefill chunks (more than one). The step's tokens are flattened in
chunk order, so each batch also carries `query_rows`: where its ragged queries sit in the step's
[T, ...] tensors (gather before the kernel, scatter its output back).

Everything here is int32/int64 tensors on the host: FlashInfer's plan() reads the indptr arrays on
the host (a device indptr would cost a device-to-host copy), and only kv_indices and query_rows are
copied to the device, without waiting (see engine/host_inputs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ChunkPages:
    """One request's share of a step, as the metadata builder needs it (host data only)."""

    query_start: int
    """Row of the chunk's first token in the step's flattened batch."""
    query_len: int
    context_len: int
    """Tokens with KV once this step has written its own: start position + query_len."""
    block_table: Sequence[int]
    """The request's blocks in position order; at least ceil(context_len / page_size) of them."""

    def __post_init__(self) -> None:
        if not 1 <= self.query_len <= self.context_len:
            raise ValueError(f"a chunk needs 1 <= query_len <= context_len, got {self.query_len}, {self.context_len}")


@dataclass(frozen=True)
class PagedKVBatch:
    """FlashInfer's description of a batch of B requests (host tensors)."""

    qo_indptr: torch.Tensor  # [B + 1] int32, qo_indptr[0] = 0: request b's rows of the ragged query
    kv_indptr: torch.Tensor  # [B + 1] int32, kv_indptr[0] = 0: request b's entries of kv_indices
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32: block ids, each request's in position order
    kv_last_page_len: torch.Tensor  # [B] int32 in [1, page_size]: valid tokens of each request's last block
    query_rows: torch.Tensor  # [qo_indptr[-1]] int64: row of each ragged query in the step's flattened batch
    page_size: int

    @property
    def batch_size(self) -> int:
        return int(self.kv_last_page_len.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.query_rows.shape[0])

    def kv_lens(self) -> torch.Tensor:
        """[B] int64: KV tokens of each request, (pages - 1) * page_size + last page length."""
        pages = (self.kv_indptr[1:] - self.kv_indptr[:-1]).long()
        return (pages - 1) * self.page_size + self.kv_last_page_len.long()


@dataclass(frozen=True)
class FlashInferMetadata:
    """A step as FlashInfer's two wrappers see it: each part is None when the step has none of it."""

    prefill: PagedKVBatch | None
    """Chunks of more than one query token: BatchPrefillWithPagedKVCacheWrapper, causal."""
    decode: PagedKVBatch | None
    """Chunks of exactly one query token: BatchDecodeWithPagedKVCacheWrapper."""


def build_paged_kv_batch(chunks: Sequence[ChunkPages], page_size: int) -> PagedKVBatch:
    """The CSR arrays of `chunks`, in the given order (ValueError on a block table too short)."""
    query_lens = np.fromiter((c.query_len for c in chunks), dtype=np.int64, count=len(chunks))
    context_lens = np.fromiter((c.context_len for c in chunks), dtype=np.int64, count=len(chunks))
    num_pages = -(-context_lens // page_size)  # [B] ceil
    for chunk, pages in zip(chunks, num_pages.tolist()):
        if len(chunk.block_table) < pages:
            raise ValueError(f"a chunk of context {chunk.context_len} needs {pages} blocks of {page_size}, "
                             f"its table has {len(chunk.block_table)}")
    indices = [np.asarray(c.block_table[:pages], dtype=np.int32) for c, pages in zip(chunks, num_pages.tolist())]
    rows = [np.arange(c.query_start, c.query_start + c.query_len, dtype=np.int64) for c in chunks]
    return PagedKVBatch(
        qo_indptr=_indptr(query_lens), kv_indptr=_indptr(num_pages),
        kv_indices=torch.from_numpy(np.concatenate(indices) if indices else np.zeros(0, np.int32)),
        kv_last_page_len=torch.from_numpy((context_lens - (num_pages - 1) * page_size).astype(np.int32)),
        query_rows=torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int64)),
        page_size=page_size)


def build_flashinfer_metadata(chunks: Sequence[ChunkPages], page_size: int) -> FlashInferMetadata:
    """Split a step's chunks into FlashInfer's decode batch (one query token) and prefill batch (more)."""
    decodes = [chunk for chunk in chunks if chunk.query_len == 1]
    prefills = [chunk for chunk in chunks if chunk.query_len > 1]
    return FlashInferMetadata(prefill=build_paged_kv_batch(prefills, page_size) if prefills else None,
                              decode=build_paged_kv_batch(decodes, page_size) if decodes else None)


def _indptr(lengths: np.ndarray) -> torch.Tensor:
    """[len(lengths) + 1] int32 running sum starting at 0."""
    indptr = np.zeros(len(lengths) + 1, dtype=np.int32)
    indptr[1:] = np.cumsum(lengths)
    return torch.from_numpy(indptr)
