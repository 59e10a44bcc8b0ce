"""Linear layers over quantized weights, one interface, the kernel picked by device and dtype.

CPU (float32 / bfloat16 activations): torch's weight-packed matmuls,
- int8: `aten._weight_int8pack_mm(x, codes int8 [N, K], scales [N])` = x (codes * scales)^T;
- int4: `aten._convert_weight_to_int4pack_for_cpu(codes int32 [N, K], 1)` packs once at load, then
  `aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros [G, N, 2])` computes
  x W^T with W[n, k] = (code - 8) * scale + offset, g = k // group_size (established by experiment on
  torch 2.13; it needs N % 16 == 0 and K % group_size == 0, so both are padded here). With float32
  activations that kernel runs a path 15x slower than with bfloat16 ones, and slower than rebuilding W from
  the packed codes (unpack_int4pack) and running the dense GEMM from 2 rows on: above
  INT4_FP32_KERNEL_MAX_ROWS rows a float32 layer does that.
Elsewhere (CUDA, float16): dequantize-then-matmul from the same codes.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.cpu_gemm import cpu_gemm_dtype, has_bf16_gemm
from splitserve.engine.quantization.formats import QuantizedWeight

CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
INT4_KERNEL_MIDPOINT = 8
"""The int4 CPU kernel subtracts 8 from every code; offsets absorb the real zero point."""
INT4_KERNEL_N_MULTIPLE = 32
"""Output channels are padded to this multiple: the kernel needs 16, and with 32 every packed block has the
layout unpack_int4pack reads."""
INT4_FP32_KERNEL_MAX_ROWS = 1
"""Above this many rows of float32 activations, rebuilding W and running the dense GEMM beats
_weight_int4pack_mm_for_cpu (a [4096, 768] weight, 2 threads, AVX2: 3.6 / 6.2 / 24.7 / 1587 ms at 1 / 2 / 8 / 512
rows, rebuild-and-GEMM 4.3 / 3.1 / 4.9 / 24 ms). With bfloat16 activations the kernel wins at every row count
measured (1.2 against 8.1 ms at 16 rows, 37 against 162 ms at 512: this CPU has no bf16 GEMM)."""
INT8_KERNEL_MAX_ROWS = 24
"""Above this many rows of bfloat16 activations, casting the int8 codes and running the dense GEMM beats
_weight_int8pack_mm where the CPU has a bf16 GEMM (measured on a [4096, 768] weight, AVX-512: kernel 0.67 /
1.35 / 2.7 ms at 16 / 32 / 64 rows, cast-and-GEMM 0.83 / 1.06 / 1.6 ms; 480 rows 20 vs 9.5 ms)."""
INT8_WIDENED_KERNEL_MAX_ROWS = 96
"""The same for a CPU without a bf16 GEMM, where the dense product runs in float32 (engine/cpu_gemm.py):
[4096, 768], 2 threads, AVX2: kernel 1.9 / 2.4 / 4.7 / 11.3 ms at 24 / 32 / 64 / 128 rows, widened
cast-and-GEMM 6.8 / 6.0 / 5.8 / 8.2 ms."""
INT8_FP32_KERNEL_MAX_ROWS = 1
"""The same for float32 activations, for which the kernel takes a path ~10x slower than for bfloat16 ones:
[4096, 768], AVX2: kernel 2.3 / 3.1 / 5.1 / 24 ms at 1 / 2 / 3 / 16 rows, cast-and-GEMM 2.8 / 2.4 / 2.6 / 4.1
ms."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def unpack_int4pack(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The codes [N, K] (uint8, 0..15) that _convert_weight_to_int4pack_for_cpu packed into `packed` [N, K / 2],
    N a multiple of 32. Its layout on torch 2.13's CPU: per block of 32 output rows and input k, 16 bytes whose
    low nibbles hold rows 0..15 of the block and high nibbles rows 16..31. int4pack_layout_is_known() checks it
    on this torch before any layer relies on it."""
    blocks = packed.view(-1, in_features, 16)  # [N / 32, K, 16]
    codes = torch.cat((blocks & 0xF, blocks >> 4), dim=2)  # [N / 32, K, 32]
    return codes.transpose(1, 2).reshape(-1, in_features)  # [N, K]


@functools.cache
def int4pack_layout_is_known() -> bool:
    """Whether unpack_int4pack inverts this torch's int4 packing (on a random probe): else the int4 layer never
    unpacks and runs the kernel at every row count."""
    codes = torch.randint(0, 16, (64, 64), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    return packed.shape == (64, 32) and torch.equal(unpack_int4pack(packed, 64).to(torch.int32), codes)


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W held quantized. x: [T, in_features] -> [T, out_features]."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits = weight.bits
        self.register_buffer("bias", None if bias is None else bias.to(dtype).contiguous(), persistent=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


class Int8CpuLinear(QuantizedLinear):
    """Per-output-channel symmetric int8 (one group spanning K, zero point 0)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(weight, bias, dtype)
        if weight.scales.shape[0] != 1 or bool(weight.zeros.any()):
            raise ValueError("the int8 CPU kernel takes one scale per output channel and no zero point")
        self.register_buffer("codes", weight.codes.to(torch.int8).contiguous(), persistent=False)  # [N, K]
        self.register_buffer("scales", weight.scales[0].to(dtype).contiguous(), persistent=False)  # [N]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > _int8_kernel_max_rows(x.dtype):
            dtype = cpu_gemm_dtype(x.dtype)  # bfloat16 widened where the CPU has no bf16 GEMM
            bias = None if self.bias is None else self.bias.to(dtype)
            return F.linear(x.to(dtype), self.codes.to(dtype) * self.scales.to(dtype)[:, None], bias).to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.codes, self.scales)
        return y if self.bias is None else y.add_(self.bias)


def _int8_kernel_max_rows(dtype: torch.dtype) -> int:
    """The most rows _weight_int8pack_mm runs before cast-and-GEMM takes over, for this activation dtype."""
    if dtype == torch.float32:
        return INT8_FP32_KERNEL_MAX_ROWS
    return INT8_KERNEL_MAX_ROWS if has_bf16_gemm() else INT8_WIDENED_KERNEL_MAX_ROWS


class Int4CpuLinear(QuantizedLinear):
    """Group-wise asymmetric int4. With act-order (non-contiguous groups) the input channels are
    permuted once at load so groups become contiguous, and x is permuted the same way per call."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 group_size: int) -> None:
        super().__init__(weight, bias, dtype)
        self.group_size = group_size
        order = torch.argsort(weight.group_index, stable=True)  # [K]: input channels, by group
        if not torch.equal(weight.group_index[order], torch.arange(self.in_features) // group_size):
            raise ValueError(f"every group must hold {group_size} input channels (the last may hold fewer)")
        identity = torch.equal(order, torch.arange(self.in_features))
        self.register_buffer("input_order", None if identity else order, persistent=False)
        self.padded_in = _round_up(self.in_features, group_size)
        padded_out = _round_up(self.out_features, INT4_KERNEL_N_MULTIPLE)
        codes = F.pad(weight.codes[:, order], (0, self.padded_in - self.in_features,
                                               0, padded_out - self.out_features))  # [N', K']
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1),
                             persistent=False)
        scales = F.pad(weight.scales, (0, padded_out - self.out_features), value=1.0)  # [G, N']
        zeros = F.pad(weight.zeros, (0, padded_out - self.out_features), value=INT4_KERNEL_MIDPOINT)
        offsets = (INT4_KERNEL_MIDPOINT - zeros) * scales  # (code - zero) * s = (code - 8) * s + offset
        self.register_buffer("scales_and_zeros", torch.stack([scales, offsets], dim=-1).to(dtype).contiguous(),
                             persistent=False)  # [G, N', 2]
        # float32 activations above INT4_FP32_KERNEL_MAX_ROWS rows: W rebuilt from the packed codes, a dense GEMM
        self.rebuilds_above_kernel_rows = dtype == torch.float32 and int4pack_layout_is_known()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_order is not None:
            x = x.index_select(1, self.input_order)
        if self.padded_in != self.in_features:
            x = F.pad(x, (0, self.padded_in - self.in_features))  # zero inputs: padded weights never count
        if self.rebuilds_above_kernel_rows and x.shape[0] > INT4_FP32_KERNEL_MAX_ROWS:
            y = F.linear(x, self._dense_weight())  # [T, N']
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, self.group_size,
                                                           self.scales_and_zeros)  # [T, N']
        y = y[:, :self.out_features]
        return y if self.bias is None else y + self.bias

    def _dense_weight(self) -> torch.Tensor:
        """W [N', K'] float32 (input channels in the packed order): (code - 8) * scale + offset of its group,
        rebuilt for one call (it lives only while this layer runs)."""
        weight = unpack_int4pack(self.packed, self.padded_in).float()  # [N', K']
        scales, offsets = self.scales_and_zeros.unbind(-1)  # [G, N'] each
        groups = weight.view(weight.shape[0], -1, self.group_size)  # [N', G, group_size]
        groups.sub_(INT4_KERNEL_MIDPOINT).mul_(scales.t()[:, :, None]).add_(offsets.t()[:, :, None])
        return weight


class DequantizingLinear(QuantizedLinear):
    """Any device and dtype: rebuild W from its codes every call, then one dense matmul."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        super().__init__(weight, bias, dtype)
        self.register_buffer("codes", weight.codes.to(torch.int8 if weight.bits == 8 else torch.uint8),
                             persistent=False)  # [N, K]
        self.register_buffer("scales", weight.scales.to(dtype), persistent=False)  # [G, N]
        self.register_buffer("zeros", weight.zeros.to(dtype), persistent=False)  # [G, N]
        self.register_buffer("group_index", weight.group_index, persistent=False)  # [K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        zeros = self.zeros[self.group_index].t()  # [N, K]
        scales = self.scales[self.group_index].t()  # [N, K]
        return F.linear(x, (self.codes.to(x.dtype) - zeros) * scales, self.bias)


def make_quantized_linear(weight: QuantizedWeight, bias: torch.Tensor | None, group_size: int,
                          dtype: torch.dtype, device: torch.device) -> QuantizedLinear:
    """The fastest layer for this device and dtype; `group_size` is the int4 grouping (ignored for int8)."""
    weight = QuantizedWeight(*(t.to(device) for t in (weight.codes, weight.scales, weight.zeros,
                                                         weight.group_index)), bits=weight.bits)
    bias = None if bias is None else bias.to(device)
    if device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES:
        return DequantizingLinear(weight, bias, dtype)
    if weight.bits == 8:
        return Int8CpuLinear(weight, bias, dtype)
    return Int4CpuLinear(weight, bias, dtype, group_size)
