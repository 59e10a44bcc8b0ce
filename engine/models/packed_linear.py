"""Linear layers whose weights are packed once at load (CPU): for oneDNN, or for the panel kernel.

`F.linear` on CPU hands the weight to the GEMM library in its stored layout on every call, so
the library repacks it into its blocked format each time. Packing once at load with oneDNN
(torch's mkldnn ops, what inductor's freezing does) measured, on the 2-core AVX-512 machines,
for an [4096, 768] weight: bf16 2.5x faster at 1 row, 1.15x at 64 rows, 1.1x at 2048 rows
(bitwise equal results); fp32 2.6x at 1 row, 1.75x at 64 rows (a different summation order:
differences of ~1e-6 relative).

Where the C++ kernels run, the linears may instead run on engine/csrc/panel_linear.cpp (`PanelLinear`,
`uses_panels` says where): weights in panels of 16 columns, bf16 ones kept bf16 and widened in registers,
which streams the weights at a higher bandwidth than oneDNN does at a few rows. There an MLP's gate and up
projections also run with its activation-and-mul (Llama's SiLU, Gemma's GeLU-tanh) in one pass
(`PanelGatedLinear`): the [N, 2I] gate_up product is never written to memory and read back. On a CPU without bf16
GEMMs (engine/cpu_gemm.py) and without the C++ kernels, a bf16 model's weights are *widened* at
load: packed once as fp32, the bf16 activations widened on the way in and the product rounded back
to bf16 on the way out (results within one bf16 ulp of the bf16 GEMM's; the price is twice the
weight memory, and twice the bytes a decode step streams).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from splitserve.engine.cpu_gemm import cpu_gemm_dtype, has_bf16_gemm
from splitserve.engine.cpu_kernels import AVX2, CpuKernelIsa
from splitserve.engine.models.layer_ops import GatedActivation

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


PANEL_COLUMNS = 16
"""Output columns per panel of csrc/panel_linear.cpp."""


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] in csrc/panel_linear.cpp's layout, padded with zeros to whole panels:
    bf16 -> int32 [ceil(N / 16), ceil(K / 2), 16], word (p, k2, j) holding W[16 p + j, 2 k2] in its low half
    and W[16 p + j, 2 k2 + 1] in its high half; fp32 -> float32 [ceil(N / 16), K, 16], (p, k, j) = W[16 p + j, k]."""
    out_features, in_features = weight.shape
    panels, per_word = -(-out_features // PANEL_COLUMNS), 2 if weight.dtype == torch.bfloat16 else 1
    steps = -(-in_features // per_word)
    padded = torch.zeros(panels * PANEL_COLUMNS, steps * per_word, dtype=weight.dtype)
    padded[:out_features, :in_features] = weight
    # [P, 16, steps, per_word] -> [P, steps, 16, per_word]; a bf16 column's (2 k2, 2 k2 + 1) is one word
    stepped = padded.view(panels, PANEL_COLUMNS, steps, per_word).transpose(1, 2).contiguous()
    if per_word == 2:
        stepped = stepped.view(torch.int32)
    return stepped.view(panels, steps, PANEL_COLUMNS)


class PanelLinear(nn.Module):
    """y = x W^T + b with W (bf16 or fp32) in csrc/panel_linear.cpp's panels; bf16 weights stay bf16 (half the
    memory of widened fp32 on CPUs without a bf16 GEMM). Each output is summed in float32 in ascending k and
    rounded once to x's dtype, independently of the other rows of x."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer("panels", pack_panels(linear.weight.detach()), persistent=False)
        bias = None if linear.bias is None else _padded_bias(linear.bias.detach(), self.panels.shape[0]).flatten()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, in] -> [N, out]
        return torch.ops.splitserve_cpu.panel_linear(x.contiguous(), self.panels, self.bias, self.out_features)


GATED_PANEL_OPS = {GatedActivation.SILU: "panel_linear_silu_mul",
                   GatedActivation.GELU_TANH: "panel_linear_gelu_tanh_mul"}
"""csrc/panel_linear.cpp's fused gate/up product (torch.ops.splitserve_cpu.<name>) per activation."""


class PanelGatedLinear(nn.Module):
    """act(x G^T + b_G) * (x U^T + b_U) for an MLP's fused [G | U] projection (an nn.Linear [2I, K]) on
    csrc/panel_linear.cpp's panel_linear_silu_mul (act = SiLU) or panel_linear_gelu_tanh_mul (GeLU-tanh): G's
    and U's panels interleaved (gate panel q, then up panel q), each padded past I on its own. Equal bit for bit
    to CpuKernelLayerOps' silu_and_mul / gelu_tanh_and_mul of PanelLinear(gate_up)(x)."""

    def __init__(self, gate_up: nn.Linear, activation: GatedActivation) -> None:
        super().__init__()
        self.activation = activation
        self.gated_op = getattr(torch.ops.splitserve_cpu, GATED_PANEL_OPS[activation])  # the kernels are loaded
        self.intermediate = gate_up.out_features // 2
        gate, up = gate_up.weight.detach().split(self.intermediate)  # [I, K] each
        self.register_buffer("panels", _pairs(pack_panels(gate), pack_panels(up)), persistent=False)
        bias = None
        if gate_up.bias is not None:
            gate_bias, up_bias = gate_up.bias.detach().split(self.intermediate)
            bias = _pairs(*(_padded_bias(b, self.panels.shape[0] // 2) for b in (gate_bias, up_bias))).flatten()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, K] -> [N, I]
        return self.gated_op(x.contiguous(), self.panels, self.bias, self.intermediate)


def _padded_bias(bias: torch.Tensor, num_panels: int) -> torch.Tensor:
    """bias [N] as float32 [num_panels, 16], zero past N."""
    padded = torch.zeros(num_panels * PANEL_COLUMNS)
    padded[:bias.numel()] = bias
    return padded.view(num_panels, PANEL_COLUMNS)


def _pairs(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[Q, ...] twice -> [2 Q, ...]: gate row q at 2 q, up row q at 2 q + 1."""
    return torch.stack((gate, up), dim=1).flatten(0, 1).contiguous()


def uses_panels(dtype: torch.dtype, kernel_isa: CpuKernelIsa | None, bf16_gemm: bool) -> bool:
    """Whether a CPU model's linears run on the panel kernel (else oneDNN), where bench/panel_linear.py measured
    it at least as fast (88M shapes, 1 thread, AVX2): bf16 on CPUs without a bf16 GEMM, 1.6-2.7x at 1-4 rows and
    1.03-1.2x at 8-512 rows against oneDNN on widened weights (which also hold twice the memory); fp32 on AVX2,
    1.2-1.65x at 1-4 rows, 0.94-1.02x at 8-512. Not for fp32 on AVX-512 (not measured there), nor for bf16 with
    a bf16 GEMM (oneDNN's vdpbf16ps runs twice the kernel's multiply-add rate)."""
    if kernel_isa is None or dtype not in PACKABLE_DTYPES:
        return False
    if dtype == torch.bfloat16:
        return not bf16_gemm
    return kernel_isa == AVX2


@runtime_checkable
class GatedMLP(Protocol):
    """An MLP computing act(gate) * up from its fused [gate | up] projection (the Llama family's, Gemma's)."""

    gate_up_proj: nn.Module
    activation: GatedActivation

    def fuse_activation_and_mul(self, projection: nn.Module) -> None:
        """Make `projection` (x -> act(gate) * up) its gate_up_proj; it then skips its own activation-and-mul."""
        ...


def pack_linears(model: nn.Module, dtype: torch.dtype, kernel_isa: CpuKernelIsa | None,
                 fuse_mlp_activation: bool = True) -> None:
    """Replace every nn.Linear of `model` (weights in `dtype`) by a PanelLinear where `uses_panels` says so
    (`kernel_isa`: the loaded C++ kernels' ISA, None when the model runs without them), an MLP's gate_up_proj
    then by a PanelGatedLinear (unless not `fuse_mlp_activation`: LoRA adapts the gate/up product itself), else
    by a PackedLinear, in place."""
    panels = uses_panels(dtype, kernel_isa, has_bf16_gemm())
    compute_dtype = cpu_gemm_dtype(dtype)
    for parent in list(model.modules()):
        if panels and fuse_mlp_activation and isinstance(parent, GatedMLP) and isinstance(parent.gate_up_proj, nn.Linear):
            parent.fuse_activation_and_mul(PanelGatedLinear(parent.gate_up_proj, parent.activation))
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PanelLinear(child) if panels else PackedLinear(child, compute_dtype))
