"""Paged attention tuned for CPU; TorchReferenceAttention is its oracle (tests compare the two).

What differs from the reference, and why (measured on the 2-core AVX-512 machines):
- Decode: torch's fused SDPA kernel for CPU tiles over query rows; with one query row and a
  padding mask it runs 10x slower than two batched matmuls in bf16 (6.5 ms against 0.56 ms for
  64 sequences x 144 positions x 12 heads), and the reference first gathers every block into a
  workspace. Here decode runs the C++ kernel of csrc/paged_attention.cpp, which reads keys and
  values where they are in the pool (float32 scores, softmax and sums; 64 sequences x 100-272
  positions, 12 heads / 4 KV heads, pool in cache: 1.4 ms bf16 and 3.6 ms fp32 per layer, against
  3.6 / 8.5 ms for the matmul path below; docs/performance.md has it within a whole step).
- Without the kernel (no compiler), decode is attended as grouped matmuls: the G = num_heads /
  num_kv_heads query heads sharing a KV head form the rows of one [G, D] x [D, L] product per
  (sequence, KV head), in the model's dtype (fp32 for bf16 on a CPU without bf16 GEMMs,
  engine/cpu_gemm.py), with the softmax in float32 over an additive padding bias (what Hugging
  Face's eager attention does), over keys and values gathered head-major.
- Prefill chunks in bf16 run the C++ kernel of csrc/prefill_attention.cpp: flash-attention style
  tiles on AVX512-BF16 dot instructions, keys and values read from the pool (a cached prefix
  included), causal and sliding-window masks applied per tile. 2047-token prompt, one thread:
  24.6 against 41.7 ms (8 heads / 4 KV heads of 32) and 54.0 against 106.8 ms (12 / 4 of 64) for
  torch's fused causal SDPA. In fp32 the same kernel (float FMAs) is slower than torch's for a
  full causal chunk (50.8 / 119.7 ms for those two), so it runs only with a sliding window, whose
  out-of-window tiles it skips (2047 tokens, window 256, 12 / 4 heads of 64: 28.8 against 217.3
  ms for the masked SDPA call). Otherwise (fp32, no kernels, head sizes that are not a multiple
  of 16) prefill chunks use SDPA like the reference, one call per chunk. A chunk that continues a prefix (a
  cached prefix, or the rest of a prompt chunked at the step budget) is attended in two parts
  merged by their log-sum-exp: the chunk's queries against the prefix's keys (no mask: every
  prefix position is visible), and the chunk against its own keys, square and causal. The
  reference's single call takes an explicit [q, ctx] mask, with which the fused kernel computes
  every tile, masked or not (2x the work of the causal call, plus building the mask): 43 ms
  against 21 ms for 2046 tokens after a 1-token prefix, 8 heads / 4 KV heads of 32.
- A softcapped model (Gemma 2's attn_logit_softcapping) runs both kernels, which cap each scaled float32 score
  (softcap * tanh(s / softcap), Sleef's tanh) before the mask and softmax; the prefill kernel takes its fp32
  chunks too, since torch's fused SDPA cannot cap scores. Without the kernels it attends on the reference's
  eager torch path (gather, matmuls, cap, float32 softmax).
- A model with attention sinks (GPT-OSS: a logit per query head that joins each softmax's denominator) runs both
  kernels too: decode adds the sink to its softmax's max and sum; prefill starts each row's online softmax from
  the sink (its max, a sum of 1, a zero output), and takes every chunk with sinks, fp32 ones included (torch's
  fused SDPA has no sinks). 1024-token chunk, 16 / 2 heads of 64, one thread (measured on the shared 2-core
  machine under load, best of 3): fp32 135.8 ms against 494.5 ms for the reference's eager path with sinks (and
  71.9 ms for causal SDPA without them); bf16 56.8 against 2999.0 ms. Without the kernels (or a head size that
  is no multiple of 16 in prefill) sink models attend on the reference's eager path, as softcapped ones do.
- A quantized pool (int8 / fp8_e4m3 codes with a bf16 scale per row, engine/kv_quant.py) takes the same
  paths: both kernels read the codes in place (decode widens them in registers and folds each row's scale
  into its score and its weight; prefill dequantizes them into its packed tiles), and the torch paths
  attend what the reference's gather dequantizes.
"""

from __future__ import annotations

import torch

from splitserve.engine.attention.base import AttentionMetadata, DecodeBatch, PrefillSpan
from splitserve.engine.attention.torch_ref import TorchReferenceAttention, _cached
from splitserve.engine.cpu_gemm import cpu_gemm_dtype
from splitserve.engine.cpu_kernels import load_cpu_kernels


class CpuPagedAttention(TorchReferenceAttention):
    """The reference backend with the C++ kernels (decode; prefill in bf16, or with a sliding window or a softcap)
    and, for other fp32 prefill chunks after a prefix, the split into two fused calls."""

    def __init__(self, use_kernels: bool = True) -> None:
        """use_kernels=False keeps to pure torch (the path taken when the kernels cannot be built)."""
        super().__init__()
        self.use_kernels = use_kernels and load_cpu_kernels()
        self.pads_decode_batches = not self.use_kernels  # the kernel reads each sequence's own context
        self._head_major = torch.empty(0)

    def _prefill(self, query, key, value, kv_cache, span: PrefillSpan, metadata: AttentionMetadata,
                 sliding_window, scale=None, softcap=None, sinks=None):
        eager_only = softcap is not None or sinks is not None  # what torch's fused SDPA cannot compute
        if self.use_kernels and query.shape[-1] % 16 == 0 and (
                query.dtype == torch.bfloat16 or sliding_window or eager_only):
            out = torch.empty_like(query)  # [q, H, D]
            torch.ops.splitserve_cpu.paged_prefill_attention(
                query.contiguous(), kv_cache, span.block_table, span.start_position, sliding_window or 0,
                _softmax_scale(query, scale), softcap or 0.0, _sink_logits(sinks), out)
            return out
        if eager_only:  # the reference's eager attention
            return super()._prefill(query, key, value, kv_cache, span, metadata, sliding_window, scale, softcap,
                                    sinks)
        if span.start_position == 0 or sliding_window is not None:
            return super()._prefill(query, key, value, kv_cache, span, metadata, sliding_window, scale)
        return self._prefill_after_prefix(query, key, value, kv_cache, span, scale)

    def _prefill_after_prefix(self, query, key, value, kv_cache, span: PrefillSpan,
                              scale: float | None = None) -> torch.Tensor:
        """Attention of a chunk whose first position is span.start_position > 0, no sliding window.

        softmax over [prefix, chunk] = the two parts' outputs weighted by exp(lse_part - lse_all),
        with lse_all = logaddexp of the parts' log-sum-exps; the merge runs in float32.
        """
        queries = query.transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
        block_size = kv_cache.shape[2]
        prefix_blocks = span.block_table[:(span.start_position + block_size - 1) // block_size]
        prefix_keys, prefix_values = self._gather(kv_cache, prefix_blocks.unsqueeze(0), span.start_position,
                                                  query.dtype)  # [1, Hkv, start, D] each
        prefix_out, prefix_lse = _flash_attention(queries, prefix_keys, prefix_values, False, scale)
        chunk_out, chunk_lse = _flash_attention(queries, key.transpose(0, 1).unsqueeze(0),
                                                value.transpose(0, 1).unsqueeze(0), True, scale)
        total_lse = torch.logaddexp(prefix_lse, chunk_lse)  # [1, H, q] float32
        merged = prefix_out.float().mul_((prefix_lse - total_lse).exp_().unsqueeze(-1))
        merged.addcmul_(chunk_out.float(), (chunk_lse - total_lse).exp_().unsqueeze(-1))
        return merged[0].transpose(0, 1).to(query.dtype)  # [q, H, D]

    def _decode(self, query, kv_cache, decode: DecodeBatch, index: int, metadata: AttentionMetadata,
                sliding_window, scale=None, softcap=None, sinks=None):
        if self.use_kernels:
            out = torch.empty_like(query)  # [B, H, D]
            torch.ops.splitserve_cpu.paged_decode_attention(
                query.contiguous(), kv_cache, decode.block_tables, decode.context_lens, sliding_window or 0,
                _softmax_scale(query, scale), softcap or 0.0, _sink_logits(sinks), out)
            return out
        if softcap is not None or sinks is not None:
            # the grouped matmuls below neither cap scores nor add sinks: the reference's eager attention
            return super()._decode(query, kv_cache, decode, index, metadata, sliding_window, scale, softcap, sinks)
        return self._decode_by_matmul(query, kv_cache, decode, index, metadata, sliding_window, scale)

    def _decode_by_matmul(self, query, kv_cache, decode: DecodeBatch, index: int, metadata: AttentionMetadata,
                          sliding_window, scale: float | None = None):
        batch, num_heads, head_dim = query.shape  # query: [B, H, D]
        num_kv_heads = kv_cache.shape[-2]
        group = num_heads // num_kv_heads
        max_len = decode.block_tables.shape[1] * metadata.block_size
        compute = cpu_gemm_dtype(query.dtype)
        keys, values = self._gather_head_major(kv_cache, decode.block_tables, compute)  # [B, Hkv, L, D] each
        bias = _cached(metadata, ("decode_bias", index, sliding_window),
                       lambda: _decode_bias(decode, max_len, sliding_window))  # [B, 1, 1, L] float32
        grouped = query.view(batch, num_kv_heads, group, head_dim).to(compute)  # [B, Hkv, G, D]
        scores = torch.matmul(grouped, keys.transpose(-1, -2)).float()  # [B, Hkv, G, L]
        scores.mul_(_softmax_scale(query, scale)).add_(bias)
        probs = torch.softmax(scores, dim=-1).to(query.dtype).to(compute)  # rounded as in the model's dtype
        return torch.matmul(probs, values).view(batch, num_heads, head_dim).to(query.dtype)  # [B, H, D]

    def _gather_head_major(self, kv_cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype):
        """Keys and values of every position of the tables' blocks as two contiguous [B, Hkv, L, D] of dtype.

        One block-level index_select per side, then one transposing copy into a reused buffer
        (fresh buffers of this size cost page faults on every layer). Valid until the next call.
        """
        keys, values = self._gather(kv_cache, block_tables, block_tables.shape[1] * kv_cache.shape[2], dtype)
        batch, num_kv_heads, length, head_dim = keys.shape
        numel = batch * num_kv_heads * length * head_dim
        if self._head_major.numel() < 2 * numel or self._head_major.dtype != dtype:
            self._head_major = torch.empty(2 * numel, dtype=dtype, device=kv_cache.device)
        out_keys = self._head_major[:numel].view(batch, num_kv_heads, length, head_dim)
        out_values = self._head_major[numel:2 * numel].view(batch, num_kv_heads, length, head_dim)
        out_keys.copy_(keys)
        out_values.copy_(values)
        return out_keys, out_values


def _softmax_scale(query: torch.Tensor, scale: float | None) -> float:
    """The scale of q.k: the model's, else 1 / sqrt(head_dim) (query [..., head_dim])."""
    return query.shape[-1] ** -0.5 if scale is None else scale


def _sink_logits(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The kernels' sinks: float32 [H] (a model's are in its dtype), or None."""
    return None if sinks is None else sinks.float().contiguous()


def _flash_attention(query, key, value, is_causal: bool, scale: float | None):
    """torch's fused CPU attention with its log-sum-exp: ([1, H, q, D], [1, H, q] float32); scale None is its
    1 / sqrt(D).

    Keys and values may have fewer heads than the query (GQA: head h reads KV head h // G).
    """
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, 0.0, is_causal,
                                                                       scale=scale)


def _decode_bias(decode: DecodeBatch, max_len: int, sliding_window: int | None) -> torch.Tensor:
    """[B, 1, 1, L] float32: 0 where key position j is attended, -inf past the context (or window)."""
    key_pos = torch.arange(max_len, device=decode.context_lens.device).unsqueeze(0)  # [1, L]
    context = decode.context_lens.unsqueeze(1)  # [B, 1]
    visible = key_pos < context
    if sliding_window is not None:
        visible &= (context - 1) - key_pos < sliding_window
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
    return bias.masked_fill_(~visible, float("-inf"))[:, None, None, :]
