"""Decode batch-size buckets for captured (CUDA-graph) decode steps, and how a batch is padded to one (plain code).

A captured graph replays fixed shapes, so decode steps are captured for a few batch sizes (the
bucket table) and a batch of n decodes runs the graph of the smallest bucket >= n, padded with
bucket - n rows. A padding row must not touch any real request's KV: it is a one-token request at
position 0 whose only block is the pool's reserved dummy block (KVCache(reserve_dummy_block=True),
never handed out by the block manager), so its key/value write lands in that block and its
attention reads only that block. Real rows keep their order and come first, so the first n rows
of the graph's output are the batch's logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.attention.base import AttentionMetadata
from splitserve.engine.attention.paged_kv_metadata import (ChunkPages, FlashInferMetadata, PagedKVBatch,
                                                           build_paged_kv_batch)
from splitserve.engine.model_runner import decode_key_slot
from splitserve.engine.scheduler import ScheduledChunk

SMALL_BUCKETS = (1, 2, 4)
BUCKET_STEP = 8
"""Above SMALL_BUCKETS, buckets are the multiples of 8 (what vLLM captures): at most 7 padding rows."""


@dataclass(frozen=True)
class DecodeBucketTable:
    sizes: tuple[int, ...]
    """Captured batch sizes, ascending, distinct, >= 1."""

    def __post_init__(self) -> None:
        if not self.sizes or self.sizes[0] < 1 or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"bucket sizes must be distinct, ascending and >= 1, got {self.sizes}")

    @classmethod
    def up_to(cls, max_batch_size: int) -> DecodeBucketTable:
        """1, 2, 4, 8, 16, 24, ... below max_batch_size, then max_batch_size itself."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        sizes = [s for s in (*SMALL_BUCKETS, *range(BUCKET_STEP, max_batch_size, BUCKET_STEP)) if s < max_batch_size]
        return cls((*sizes, max_batch_size))

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, batch_size: int) -> int | None:
        """The smallest bucket holding batch_size rows; None above the largest (the step runs eagerly)."""
        return next((size for size in self.sizes if size >= batch_size), None)

    def takes(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether a captured graph runs this step: decodes only (one token each), each sampling (the graph's
        logits are its rows), and no more than the largest bucket."""
        return (0 < len(chunks) <= self.max_batch_size
                and all(chunk.num_tokens == 1 and chunk.samples for chunk in chunks))


@dataclass(frozen=True)
class PaddedDecodeStep:
    """A decode-only step padded to a bucket: what is copied into a captured graph's static inputs."""

    num_real: int
    """Rows 0 .. num_real - 1 are the step's decodes, in order; the rest are padding."""
    input_ids: torch.Tensor  # [bucket] int64, padding rows 0
    positions: torch.Tensor  # [bucket] int64, padding rows 0
    key_slots: torch.Tensor  # [bucket] int64, padding rows: slot 0 of the dummy block
    paged: PagedKVBatch
    """The decode batch over all bucket rows; a padding row's only page is the dummy block."""
    block_size: int

    def attention_metadata(self) -> AttentionMetadata:
        """The step as the FlashInfer backend reads it (host tensors)."""
        return AttentionMetadata(positions=self.positions, key_slots=self.key_slots,
                                 value_slots=self.key_slots + self.block_size, prefills=(), decodes=(),
                                 block_size=self.block_size, paged=FlashInferMetadata(prefill=None, decode=self.paged))


def pad_decode_step(chunks: Sequence[ScheduledChunk], bucket: int, block_size: int, dummy_block: int) -> PaddedDecodeStep:
    """The decodes `chunks` (one token each, at most `bucket`) padded to `bucket` rows (ValueError otherwise)."""
    if not 0 < len(chunks) <= bucket:
        raise ValueError(f"{len(chunks)} decodes do not fit a bucket of {bucket}")
    if any(chunk.num_tokens != 1 for chunk in chunks):
        raise ValueError("only decode steps (one token per chunk) are padded to a bucket")
    padding = bucket - len(chunks)
    pages = [ChunkPages(row, 1, chunk.context_len, chunk.block_table) for row, chunk in enumerate(chunks)]
    pages += [ChunkPages(len(chunks) + row, 1, 1, (dummy_block,)) for row in range(padding)]
    positions = [chunk.start_position for chunk in chunks] + [0] * padding
    key_slots = [decode_key_slot(chunk, block_size) for chunk in chunks] + [dummy_block * 2 * block_size] * padding
    return PaddedDecodeStep(
        num_real=len(chunks), input_ids=torch.tensor([chunk.token_ids[0] for chunk in chunks] + [0] * padding),
        positions=torch.tensor(positions), key_slots=torch.tensor(key_slots),
        paged=build_paged_kv_batch(pages, block_size), block_size=block_size)

