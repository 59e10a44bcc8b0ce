"""Attention backend interface and the per-step metadata it consumes.

KV pool layout (one tensor per layer): [num_blocks, 2, block_size, num_kv_heads, head_dim],
index 0 of dim 1 holds keys, index 1 values. Token at position p of a request lives in
block block_table[p // block_size] at offset p % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from splitserve.engine.attention.paged_kv_metadata import FlashInferMetadata


@dataclass(frozen=True)
class PrefillSpan:
    """One request's chunk of more than one query token (a prefill or prefill chunk)."""

    query_start: int
    """Index of the chunk's first token in the flattened batch."""
    query_len: int
    context_len: int
    """Tokens with KV after this step: start_position + query_len."""
    block_table: torch.Tensor  # [ceil(context_len / block_size)] int64

    @property
    def start_position(self) -> int:
        return self.context_len - self.query_len


@dataclass(frozen=True)
class DecodeBatch:
    """Chunks of exactly one query token with similar context lengths, attended together.

    Decodes are bucketed by context length so padding to the longest one wastes little.
    """

    token_indices: torch.Tensor  # [B] int64, positions in the flattened batch
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    context_lens: torch.Tensor  # [B] int64

    @property
    def size(self) -> int:
        return int(self.token_indices.shape[0])


@dataclass(frozen=True)
class AttentionMetadata:
    positions: torch.Tensor  # [T] int64
    key_slots: torch.Tensor  # [T] int64, row of the token's key in the pool viewed as [-1, H, D]
    value_slots: torch.Tensor  # [T] int64, same for values
    prefills: tuple[PrefillSpan, ...]
    decodes: tuple[DecodeBatch, ...]
    block_size: int
    paged: FlashInferMetadata | None = None
    """The step in FlashInfer's paged-KV format (host tensors), built only for backends that set
    needs_paged_metadata; prefills and decodes are then empty (such a backend reads only this)."""
    step_cache: dict = field(default_factory=dict, compare=False)
    """Backend tensors (gather rows, masks) built by the first layer and shared by the rest of the step."""


class AttentionBackend(Protocol):
    pads_decode_batches: bool
    """True when a decode batch is computed padded to its longest context (the runner then groups
    decodes of similar length); False when each sequence costs only its own context."""
    needs_paged_metadata: bool
    """True when forward reads AttentionMetadata.paged (FlashInfer's format), which the runner then builds."""
    supports_attention_sinks: bool
    """True when forward attends with `sinks` (GPT-OSS); the loader refuses a model with sinks otherwise."""

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        sliding_window: int | None,
        scale: float | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's keys/values into the pool, then attend each query to its context: softmax(scale * q.k)
        weights over the values, scale 1 / sqrt(head_dim) when None (a model's own, e.g. Granite's
        attention_multiplier, otherwise). With softcap (Gemma 2's attn_logit_softcapping) each score s = scale * q.k
        is first capped to softcap * tanh(s / softcap). With sinks (GPT-OSS's attention sinks) query head h's softmax
        runs over its scores and one more logit, sinks[h], which weighs no value: the weights sum to less than 1."""
        ...
