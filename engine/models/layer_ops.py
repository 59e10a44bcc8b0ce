"""The elementwise ops of a Llama-family layer, behind one interface with two implementations.

`TorchLayerOps` is Hugging Face's computation op by op (the reference, any device);
`CpuKernelLayerOps` runs the fused C++ kernels of engine/csrc/fused_ops.cpp, one pass over memory
per op, rounding where the reference rounds (tests compare the two). The model asks for one at
load time (`select_layer_ops`).
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch
import torch.nn.functional as F

from splitserve.engine.cpu_kernels import KERNEL_DTYPES, load_cpu_kernels


class GatedActivation(enum.Enum):
    """The activation of a gated MLP's act(gate) * up (LayerOps.silu_and_mul, LayerOps.gelu_tanh_and_mul)."""

    SILU = "silu"
    GELU_TANH = "gelu_tanh"


class LayerOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * normalize(x) over the last dim; x: [N, H]."""
        ...

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += x (in place), then rms_norm(residual); residual, x: [N, H]."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up]: [N, 2I] -> [N, I]."""
        ...

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x * cos + rotate_half(x) * sin per head over its first R dims, the other D - R unchanged (a partial
        rotary); x: [T, heads, D], cos/sin: [T, R] with R even and <= D. May write into x."""
        ...

    def rms_norm_unit_offset(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Gemma's RMSNorm: normalize(x) * (1 + weight) in float32, rounded once to x's dtype; x: [N, H]."""
        ...

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu(gate, approximate="tanh") * up for gate_up = [gate | up]: [N, 2I] -> [N, I] (Gemma's MLP)."""
        ...

    def rms_norm_float32(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """GPT-OSS's RMSNorm: weight * normalize(x) in float32, rounded once to x's dtype; x: [N, H]."""
        ...


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' GemmaRMSNorm / Gemma3RMSNorm op for op."""
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


def rms_norm_float32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' GptOssRMSNorm op for op (its weight kept in float32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused kernel, the same formula in float32
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' GELUTanh (gelu_pytorch_tanh) of the gate times the up projection, in gate_up's dtype."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class TorchLayerOps:
    def rms_norm(self, x, weight, eps):
        if x.dtype == torch.float32:
            # One fused kernel instead of six ops; same formula as below in float32.
            return F.rms_norm(x, weight.shape, weight, eps)
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)

    def add_rms_norm(self, residual, x, weight, eps):
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def silu_and_mul(self, gate_up):
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, x, cos, sin):
        rotary_dim = cos.shape[-1]
        if rotary_dim < x.shape[-1]:  # transformers' partial rotary: rotate [..., :R], concatenate the rest
            return torch.cat((self.rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D]: broadcast over heads
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def rms_norm_unit_offset(self, x, weight, eps):
        return rms_norm_unit_offset(x, weight, eps)

    def gelu_tanh_and_mul(self, gate_up):
        return gelu_tanh_and_mul(gate_up)

    def rms_norm_float32(self, x, weight, eps):
        return rms_norm_float32(x, weight, eps)


class CpuKernelLayerOps:
    def rms_norm(self, x, weight, eps):
        out = torch.empty_like(x)
        torch.ops.splitserve_cpu.rms_norm(x, weight, eps, out)
        return out

    def add_rms_norm(self, residual, x, weight, eps):
        out = torch.empty_like(x)
        torch.ops.splitserve_cpu.add_rms_norm(residual, x, weight, eps, out)
        return out

    def silu_and_mul(self, gate_up):
        out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype, device=gate_up.device)
        torch.ops.splitserve_cpu.silu_and_mul(gate_up, out)
        return out

    def rotary(self, x, cos, sin):
        torch.ops.splitserve_cpu.rotary_embedding(x, cos, sin)
        return x

    # Gemma's two ops stay the reference's torch ops (docs/performance.md, "Gemma on the CPU kernels": a norm
    # kernel would save ~1% of a step, a GeLU-tanh one alone ran no faster than torch's); where the linears run
    # on panels the GeLU-tanh is fused with the gate/up projection instead (PanelGatedLinear).
    def rms_norm_unit_offset(self, x, weight, eps):
        return rms_norm_unit_offset(x, weight, eps)

    def gelu_tanh_and_mul(self, gate_up):
        return gelu_tanh_and_mul(gate_up)

    def rms_norm_float32(self, x, weight, eps):  # GPT-OSS's norms: the reference's torch ops (no kernel)
        return rms_norm_float32(x, weight, eps)


def select_layer_ops(device: torch.device, dtype: torch.dtype, use_cpu_kernels: bool) -> LayerOps:
    """The C++ kernels on CPU for fp32/bf16 when wanted and buildable, else the torch reference."""
    if use_cpu_kernels and device.type == "cpu" and dtype in KERNEL_DTYPES and load_cpu_kernels():
        return CpuKernelLayerOps()
    return TorchLayerOps()
