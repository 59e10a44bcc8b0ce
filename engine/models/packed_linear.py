"""Linear layers whose weights oneDNN reorders once at load (CPU).

`F.linear` on CPU hands the weight to the GEMM library in its stored layout on every call, so
the library repacks it into its blocked format each time. Packing once at load with oneDNN
(torch's mkldnn ops, what inductor's freezing does) measured, on the 2-core AVX-512 machines,
for an [4096, 768] weight: bf16 2.5x faster at 1 row, 1.15x at 64 rows, 1.1x at 2048 rows
(bitwise equal results); fp32 2.6x at 1 row, 1.75x at 64 rows (a different summation order:
differences of ~1e-6 relative).
"""

from __future__ import annotations

import torch
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

BATCH_SIZE_HINT = 64
"""Rows oneDNN is told to expect when it picks the packed format; any row count works."""


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packing exists for fp32 and (on CPUs with bf16 support) bf16 weights on CPU."""
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(nn.Module):
    """y = x W^T + b with W held only in oneDNN's packed layout (an opaque mkldnn tensor)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()  # [out, in]
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_SIZE_HINT),
                             persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().contiguous(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, in] -> [N, out]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> None:
    """Replace every nn.Linear of `model` by a PackedLinear (in place)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
