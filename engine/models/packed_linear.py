"""Linear layers whose weights oneDNN reorders once at load (CPU).

`F.linear` on CPU hands the weight to the GEMM library in its stored layout on every call, so
the library repacks it into its blocked format each time. Packing once at load with oneDNN
(torch's mkldnn ops, what inductor's freezing does) measured, on the 2-core AVX-512 machines,
for an [4096, 768] weight: bf16 2.5x faster at 1 row, 1.15x at 64 rows, 1.1x at 2048 rows
(bitwise equal results); fp32 2.6x at 1 row, 1.75x at 64 rows (a different summation order:
differences of ~1e-6 relative).

On a CPU without bf16 GEMMs (engine/cpu_gemm.py) a bf16 model's weights are *widened*: packed
once as fp32, the bf16 activations widened on the way in and the product rounded back to bf16 on
the way out (results within one bf16 ulp of the bf16 GEMM's; the price is twice the weight memory).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.cpu_gemm import cpu_gemm_dtype

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

BATCH_SIZE_HINT = 64
"""Rows oneDNN is told to expect when it picks the packed format; any row count works."""


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing exists for fp32 and bf16 weights on CPU (bf16 natively or widened to fp32)."""
    return device.type == "cpu" and dtype in PACKABLE_DTYPES and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """y = x W^T + b with W held only in oneDNN's packed layout (an opaque mkldnn tensor), in
    `compute_dtype`; x and y keep the layer's dtype (widened and rounded around the GEMM when the
    two differ)."""

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.compute_dtype = compute_dtype or linear.weight.dtype
        weight = linear.weight.detach().to(self.compute_dtype).contiguous()  # [out, in]
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_SIZE_HINT),
                             persistent=False)
        bias = None if linear.bias is None else linear.bias.detach().to(self.compute_dtype).contiguous()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, in] -> [N, out]
        out = torch.ops.mkldnn._linear_pointwise(x.to(self.compute_dtype).contiguous(), self.packed_weight,
                                                 self.bias, "none", [], "")
        return out.to(x.dtype)


def pack_linears(model: nn.Module, dtype: torch.dtype) -> None:
    """Replace every nn.Linear of `model` (weights in `dtype`) by a PackedLinear (in place)."""
    compute_dtype = cpu_gemm_dtype(dtype)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, compute_dtype))
