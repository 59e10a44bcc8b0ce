"""Which dtype CPU matrix products run in.

A CPU without bf16 instructions (AVX2 machines: no AVX512_BF16, no AMX) has no oneDNN bf16 GEMM,
and torch's fallback for bf16 products is far slower than its fp32 GEMM: on a 2-core AMD EPYC with
AVX2, a [4096, 768] linear at 64 rows ran 10-15x slower, and decode attention's batched product
(64 sequences x 4 KV heads, [3, 64] x [64, 256]) 37x slower (453 against 12 ms). There bf16
operands are widened to fp32 for the product and the result rounded back to bf16: both compute
bf16 x bf16 products exactly and accumulate in fp32, so they agree up to summation order.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def has_bf16_gemm() -> bool:
    """True when oneDNN runs bf16 GEMMs natively on this CPU (AVX512_BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def cpu_gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU matrix product over `dtype` operands runs in (fp32 for bf16 without bf16 GEMMs)."""
    if dtype == torch.bfloat16 and not has_bf16_gemm():
        return torch.float32
    return dtype
