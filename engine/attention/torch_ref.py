"""Reference paged attention in plain torch: correct on any device, the oracle for others.

Decode tokens are attended in padded batches of similar context length; each prefill chunk
gets its own call. A chunk starting at position 0 attends only to itself (causal, no
gather from the pool).

A quantized pool (engine/kv_quant.py) is written as codes and scales and read back dequantized
to the query's dtype; the step's own keys and values are attended as the pool holds them (their
round trip), so every path attends to exactly the KV a later step or a pulling worker sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.engine.attention.base import AttentionMetadata, DecodeBatch, PrefillSpan
from splitserve.engine.kv_quant import pool_quantization


class TorchReferenceAttention:
    pads_decode_batches = True
    needs_paged_metadata = False
    supports_attention_sinks = True

    def __init__(self) -> None:
        self._workspace = torch.empty(0)

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, sliding_window, scale=None,
                softcap=None, sinks=None):
        key, value = self._write(key, value, kv_cache, metadata)
        if not metadata.prefills and len(metadata.decodes) == 1:
            # A decode-only step in one bucket: its token indices are 0..T-1 in order.
            return self._decode(query, kv_cache, metadata.decodes[0], 0, metadata, sliding_window, scale, softcap,
                                sinks)
        output = torch.empty_like(query)
        for span in metadata.prefills:
            rows = slice(span.query_start, span.query_start + span.query_len)
            output[rows] = self._prefill(query[rows], key[rows], value[rows], kv_cache, span, metadata,
                                         sliding_window, scale, softcap, sinks)
        for index, decode in enumerate(metadata.decodes):
            output[decode.token_indices] = self._decode(query[decode.token_indices], kv_cache, decode, index,
                                                        metadata, sliding_window, scale, softcap, sinks)
        return output

    @staticmethod
    def _write(key, value, kv_cache, metadata: AttentionMetadata):
        """Store the step's keys and values at their slots; returns them as the pool now holds them."""
        quantization = pool_quantization(kv_cache)
        if quantization is None:
            flat_cache = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])  # [num_blocks*2*block_size, H, D]
            flat_cache.index_copy_(0, metadata.key_slots, key)
            flat_cache.index_copy_(0, metadata.value_slots, value)
            return key, value
        key_rows, value_rows = quantization.quantize(key), quantization.quantize(value)  # [T, Hkv, D + 2] each
        # index_copy_ has no float8 kernel on CPU: copy the rows as bytes.
        flat_cache = kv_cache.view(torch.uint8).view(-1, kv_cache.shape[-2], kv_cache.shape[-1])
        flat_cache.index_copy_(0, metadata.key_slots, key_rows.view(torch.uint8))
        flat_cache.index_copy_(0, metadata.value_slots, value_rows.view(torch.uint8))
        return quantization.dequantize(key_rows, key.dtype), quantization.dequantize(value_rows, value.dtype)

    def _prefill(self, query, key, value, kv_cache, span: PrefillSpan, metadata, sliding_window, scale=None,
                 softcap=None, sinks=None):
        """scale: the softmax scale, None for SDPA's 1 / sqrt(head_dim); softcap and sinks as `forward`'s."""
        if span.start_position == 0 and sliding_window is None and softcap is None and sinks is None:
            # 4-D inputs: a 3-D call falls back to the unfused math kernel on CPU (3x slower).
            out = F.scaled_dot_product_attention(
                query.unsqueeze(0).transpose(1, 2), key.unsqueeze(0).transpose(1, 2),
                value.unsqueeze(0).transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True)  # [1, H, q, D]
            return out[0].transpose(0, 1)
        keys, values = self._gather(kv_cache, span.block_table.unsqueeze(0), span.context_len,
                                    query.dtype)  # [1, Hkv, ctx, D]
        mask = _cached(metadata, ("prefill", span.query_start, sliding_window),
                       lambda: _prefill_mask(span, sliding_window, query.device))
        out = attention(query.transpose(0, 1).unsqueeze(0), keys, values, mask, scale, softcap,
                        sinks)  # [1, H, q, D]
        return out[0].transpose(0, 1)

    def _decode(self, query, kv_cache, decode: DecodeBatch, index: int, metadata, sliding_window, scale=None,
                softcap=None, sinks=None):
        max_len = decode.block_tables.shape[1] * metadata.block_size
        keys, values = self._gather(kv_cache, decode.block_tables, max_len, query.dtype)  # [B, Hkv, L, D]
        mask = _cached(metadata, ("decode", index, sliding_window),
                       lambda: _decode_mask(decode, max_len, sliding_window))
        out = attention(query.unsqueeze(2), keys, values, mask, scale, softcap, sinks)  # [B, H, 1, D]
        return out.squeeze(2)

    def _gather(self, kv_cache: torch.Tensor, block_tables: torch.Tensor, length: int, dtype: torch.dtype):
        """Keys and values of `length` leading positions: two [B, Hkv, length, D] tensors of `dtype`.

        Whole blocks are copied with index_select into a reused workspace: allocating fresh
        tensors of this size each layer costs 4-5x the copy itself on CPU (page faults).
        The returned views are valid until the next gather. A quantized pool's rows are gathered as
        bytes and dequantized into new tensors.
        """
        quantization = pool_quantization(kv_cache)
        pool_view = kv_cache if quantization is None else kv_cache.view(torch.uint8)
        num_blocks_total, _, block_size, num_kv_heads, row_width = kv_cache.shape
        batch, num_blocks = block_tables.shape
        block_numel = block_size * num_kv_heads * row_width
        workspace = self._reserve(2 * batch * num_blocks * block_numel, pool_view)
        pool = pool_view.view(num_blocks_total, 2, block_numel)
        shape = (batch, num_blocks * block_size, num_kv_heads, row_width)
        gathered = []
        for half, side in enumerate((0, 1)):
            out = workspace[half * batch * num_blocks * block_numel:][: batch * num_blocks * block_numel]
            torch.index_select(pool[:, side], 0, block_tables.reshape(-1), out=out.view(-1, block_numel))
            rows = out.view(shape)[:, :length].transpose(1, 2)  # [B, Hkv, length, row_width]
            if quantization is not None:
                rows = quantization.dequantize(rows.view(kv_cache.dtype), dtype)
            gathered.append(rows)
        return gathered[0], gathered[1]

    def _reserve(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        if (self._workspace.numel() < numel or self._workspace.dtype != like.dtype
                or self._workspace.device != like.device):
            self._workspace = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._workspace[:numel]


def attention(query, keys, values, mask, scale: float | None, softcap: float | None,
              sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [B, H, q, D] to keys / values [B, Hkv, L, D] (GQA: query head h reads KV head h // (H / Hkv)) where
    mask (broadcast to [B, H, q, L], True = visible) allows -> [B, H, q, D]: torch's SDPA, or with a softcap or
    sinks [H] (which SDPA lacks) transformers' eager attention op for op: scores scaled, capped, masked, each
    head's sink logit appended as one more column (GPT-OSS), softmax in float32 rounded to the query's dtype, the
    sink's column dropped, weighted sum of the values."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, keys.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))  # [B, H, q, L]
    if sinks is not None:
        sink_column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat((scores, sink_column), dim=-1)  # [B, H, q, L + 1]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, values)


def _cached(metadata: AttentionMetadata, key, build):
    """Per-step tensors (masks) built by the first layer and reused by the others."""
    value = metadata.step_cache.get(key)
    if value is None:
        value = metadata.step_cache[key] = build()
    return value


def _prefill_mask(span: PrefillSpan, sliding_window: int | None, device) -> torch.Tensor:
    """[q, ctx] True where query i (position start+i) may attend key position j."""
    query_pos = torch.arange(span.start_position, span.context_len, device=device).unsqueeze(1)
    key_pos = torch.arange(span.context_len, device=device).unsqueeze(0)
    mask = key_pos <= query_pos
    if sliding_window is not None:
        mask &= query_pos - key_pos < sliding_window
    return mask


def _decode_mask(decode: DecodeBatch, max_len: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, L] True where key position j < context_len (and inside the window)."""
    key_pos = torch.arange(max_len, device=decode.context_lens.device).unsqueeze(0)
    context = decode.context_lens.unsqueeze(1)
    mask = key_pos < context
    if sliding_window is not None:
        mask &= (context - 1) - key_pos < sliding_window
    return mask[:, None, None, :]
