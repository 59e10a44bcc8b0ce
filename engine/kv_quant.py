"""Quantized KV cache: a token's key or value row stored as int8 or fp8 (e4m3) codes with its own scale.

A quantized pool keeps the plain pool's layout, [num_blocks, 2, block_size, Hkv, W] per layer, with the
code dtype as element type (torch.int8 or torch.float8_e4m3fn) and W = head_dim + 2: each (token, KV head)
row is head_dim codes followed by its scale, a bfloat16 in the row's last two bytes.

Why a scale per token per KV head, inside the row:
- A row is written once, when its token's keys and values are computed, and never changes afterwards. A
  scale per block would have to re-quantize a block's earlier tokens whenever a later token raised the
  block's maximum (decode appends one token at a time), rewriting blocks that may already be shared by the
  prefix cache or held for a pull.
- The scale lives in the block's own bytes, so everything that moves a block (a NIXL pull, the in-process
  copy, the prefix cache) moves its scales with it: block ids stay the only address of KV.
- A bfloat16 scale costs 2 bytes per head_dim codes: a token's KV takes (D + 2) / 2D of bf16's bytes
  (0.516 at D = 64, 0.508 at D = 128) and (D + 2) / 4D of float32's. bfloat16 has float32's exponent range,
  so no row's scale under- or overflows.

Formulas, x the row's D values in float32, QMAX = 127 (int8) or 448 (fp8_e4m3, the largest finite code):
    s  = bfloat16(max|x| / QMAX), and 1 where that is 0 (an all-zero row)
    int8: c = clamp(round_half_even(x / s), -127, 127)
    fp8:  c = float8_e4m3fn(clamp(x / s, -448, 448))      (round to nearest even)
    x' = float(c) * float(s)                                (then rounded to the compute dtype)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_BYTES = 2
"""Bytes of a row's bfloat16 scale, stored after its codes."""


@dataclass(frozen=True)
class KVQuantization:
    """One quantized KV element type (the config's kv_cache_dtype spelling and its torch code dtype)."""

    name: str
    """kv_cache_dtype spelling: int8 or fp8_e4m3."""
    code_dtype: torch.dtype
    """Element type of the pool tensors (a row's scale bytes included)."""
    max_code: float
    """Largest code magnitude; a row's max |x| maps to it."""

    def row_width(self, head_dim: int) -> int:
        """Pool elements of one (token, KV head) row: head_dim codes, then the scale."""
        return head_dim + SCALE_BYTES

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> rows [..., D + 2] of code_dtype (codes, then the scale's bytes)."""
        values = x.float()
        amax = values.abs().amax(dim=-1, keepdim=True)  # [..., 1]
        scale = (amax / self.max_code).to(torch.bfloat16)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        scaled = (values / scale.float()).clamp_(-self.max_code, self.max_code)
        codes = scaled.round_().to(torch.int8) if self.code_dtype == torch.int8 else scaled.to(self.code_dtype)
        rows = torch.empty((*x.shape[:-1], self.row_width(x.shape[-1])), dtype=torch.uint8, device=x.device)
        rows[..., :-SCALE_BYTES] = codes.view(torch.uint8)
        rows[..., -SCALE_BYTES:] = scale.view(torch.uint8)
        return rows.view(self.code_dtype)

    def dequantize(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """rows [..., D + 2] of code_dtype (any strides with the last one 1) -> x' [..., D] in dtype."""
        as_bytes = rows.view(torch.uint8)
        codes = as_bytes[..., :-SCALE_BYTES].view(self.code_dtype)  # [..., D]
        scale = as_bytes[..., -SCALE_BYTES:].view(torch.bfloat16)  # [..., 1]
        return (codes.float() * scale.float()).to(dtype)


KV_QUANTIZATIONS = {
    "int8": KVQuantization("int8", torch.int8, 127.0),
    "fp8_e4m3": KVQuantization("fp8_e4m3", torch.float8_e4m3fn, 448.0),
}
"""kv_cache_dtype -> its format; `auto` (not here) stores the model's dtype unquantized."""

_BY_CODE_DTYPE = {quantization.code_dtype: quantization for quantization in KV_QUANTIZATIONS.values()}


def kv_quantization(kv_cache_dtype: str) -> KVQuantization | None:
    """The format of a kv_cache_dtype (None for auto)."""
    if kv_cache_dtype == "auto":
        return None
    if kv_cache_dtype not in KV_QUANTIZATIONS:
        raise ValueError(f"kv_cache_dtype must be auto or one of {tuple(KV_QUANTIZATIONS)}, got {kv_cache_dtype!r}")
    return KV_QUANTIZATIONS[kv_cache_dtype]


def pool_quantization(kv_cache: torch.Tensor) -> KVQuantization | None:
    """The format a pool tensor stores, read from its element type (None: plain, unquantized KV)."""
    return _BY_CODE_DTYPE.get(kv_cache.dtype)
