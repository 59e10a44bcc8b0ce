"""Quantized weights in one typed form, and the public 4-bit checkpoint formats (GPTQ v1, AWQ GEMM).

Every format decodes to a `QuantizedWeight`: integer codes [N, K] (N output channels, K input
channels), per-group scales and zero points [G, N], and each input channel's group [K]; the
weight it stands for is `(code - zero) * scale` (the reference formula the kernels and tests use).

Packing, eight 4-bit codes per int32, least significant nibble first:
- GPTQ (AutoGPTQ / GPTQModel `checkpoint_format: gptq`, a.k.a. v1): `qweight` [K / 8, N] packs 8
  consecutive input channels of one output channel; `qzeros` [G, N / 8] packs 8 consecutive output
  channels and stores `zero - 1` (the v1 off-by-one, undone at load); `scales` [G, N] fp16;
  `g_idx` [K] int32 (with act-order the groups are not contiguous in K).
- AWQ GEMM (AutoAWQ `version: gemm`): `qweight` [K, N / 8] and `qzeros` [G, N / 8] pack 8 output
  channels in the interleaved order AWQ_PACK_ORDER: nibble i holds channel AWQ_PACK_ORDER[i] of the
  eight; `scales` [G, N] fp16; groups are contiguous (channel k is in group k // group_size).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PACK_FACTOR = 8
"""4-bit codes per int32 word."""
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ GEMM: nibble i of a word holds output channel AWQ_PACK_ORDER[i] of its eight."""
_SHIFTS = torch.arange(PACK_FACTOR, dtype=torch.int32) * 4  # [8] bit offset of nibble i


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [N, K] stored as integer codes with per-(group, output channel) scales and zero points."""

    codes: torch.Tensor
    """[N, K] int32: 0..15 for 4 bits, -128..127 for 8 bits."""
    scales: torch.Tensor
    """[G, N] float32."""
    zeros: torch.Tensor
    """[G, N] float32 integer-valued zero points: the weight is (code - zero) * scale."""
    group_index: torch.Tensor
    """[K] int64: the group of each input channel (GPTQ's g_idx), in [0, G)."""
    bits: int
    """4 or 8."""

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.scales.shape != self.zeros.shape or self.scales.shape[1] != n or self.group_index.shape != (k,):
            raise ValueError(f"inconsistent quantized weight: codes {tuple(self.codes.shape)}, scales "
                             f"{tuple(self.scales.shape)}, zeros {tuple(self.zeros.shape)}, "
                             f"group_index {tuple(self.group_index.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self) -> torch.Tensor:
        """The weight [N, K] in float32: (code - zero) * scale, per input channel's group."""
        scales = self.scales[self.group_index].t()  # [N, K]
        zeros = self.zeros[self.group_index].t()  # [N, K]
        return (self.codes.float() - zeros) * scales

    @staticmethod
    def concat(parts: Sequence["QuantizedWeight"]) -> "QuantizedWeight":
        """Stack along output channels (a fused q/k/v or gate/up projection); the parts must share
        their input grouping, as projections quantized from the same input activations do."""
        first = parts[0]
        if any(p.bits != first.bits or not torch.equal(p.group_index, first.group_index) for p in parts[1:]):
            raise ValueError("cannot fuse quantized projections with different bits or input groups (g_idx)")
        return QuantizedWeight(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts], dim=1),
                               torch.cat([p.zeros for p in parts], dim=1), first.group_index, first.bits)


def concat_rows(parts: Sequence[torch.Tensor | QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """Fuse projections along output channels, quantized or not."""
    if isinstance(parts[0], QuantizedWeight):
        return QuantizedWeight.concat(parts)
    return torch.cat(list(parts))


def pack_int4(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """Pack 0..15 codes 8 per int32 along `dim` (consecutive, least significant nibble first)."""
    moved = codes.to(torch.int32).movedim(dim, -1)  # [..., L]
    nibbles = moved.reshape(*moved.shape[:-1], -1, PACK_FACTOR)  # [..., L / 8, 8]
    words = (nibbles.long() << _SHIFTS.long()).sum(-1)  # [..., L / 8] in [0, 2^32)
    return _to_int32(words).movedim(-1, dim)


def unpack_int4(words: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of pack_int4: int32 words -> int32 codes 0..15, 8x longer along `dim`."""
    moved = words.to(torch.int32).movedim(dim, -1)  # [..., L / 8]
    nibbles = (moved.unsqueeze(-1) >> _SHIFTS) & 0xF  # [..., L / 8, 8]
    return nibbles.reshape(*moved.shape[:-1], -1).movedim(-1, dim)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 (two's complement)."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _awq_order(codes: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [..., N] with each run of 8 channels placed in AWQ's nibble order."""
    runs = codes.reshape(*codes.shape[:-1], -1, PACK_FACTOR)
    return runs[..., list(AWQ_PACK_ORDER)].reshape(codes.shape)


def _awq_unorder(codes: torch.Tensor) -> torch.Tensor:
    inverse = [AWQ_PACK_ORDER.index(i) for i in range(PACK_FACTOR)]
    runs = codes.reshape(*codes.shape[:-1], -1, PACK_FACTOR)
    return runs[..., inverse].reshape(codes.shape)


@dataclass(frozen=True)
class PackedTensors:
    """One linear layer's tensors as a checkpoint stores them (names without the module prefix)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    """GPTQ only."""


def gptq_pack(weight: QuantizedWeight) -> PackedTensors:
    """GPTQ v1 tensors of a 4-bit weight (zeros stored minus one, so a zero point must be >= 1)."""
    if int(weight.zeros.min()) < 1:
        raise ValueError("GPTQ v1 stores zero - 1 in 4 bits: zero points must be in [1, 15]")
    return PackedTensors(qweight=pack_int4(weight.codes.t(), dim=0),
                         qzeros=pack_int4(weight.zeros.to(torch.int32) - 1, dim=1),
                         scales=weight.scales.half(), g_idx=weight.group_index.to(torch.int32))


def gptq_unpack(tensors: PackedTensors, zero_offset: int = 1) -> QuantizedWeight:
    """Reference: w[n, k] = scales[g, n] * (q[k, n] - (qzeros[g, n] + 1)) with g = g_idx[k] (v1; the
    v2 format stores the zero point itself: zero_offset=0)."""
    codes = unpack_int4(tensors.qweight, dim=0).t().contiguous()  # [N, K]
    zeros = (unpack_int4(tensors.qzeros, dim=1) + zero_offset).float()  # [G, N]
    return QuantizedWeight(codes, tensors.scales.float(), zeros, tensors.g_idx.long(), bits=4)


def awq_pack(weight: QuantizedWeight, group_size: int) -> PackedTensors:
    """AWQ GEMM tensors of a 4-bit weight whose groups are contiguous runs of `group_size` channels."""
    expected = torch.arange(weight.shape[1]) // group_size
    if not torch.equal(weight.group_index, expected):
        raise ValueError("AWQ stores contiguous groups only (no act-order)")
    return PackedTensors(qweight=pack_int4(_awq_order(weight.codes.t()), dim=1),
                         qzeros=pack_int4(_awq_order(weight.zeros.to(torch.int32)), dim=1),
                         scales=weight.scales.half(), g_idx=None)


def awq_unpack(tensors: PackedTensors, group_size: int) -> QuantizedWeight:
    """Reference: w[n, k] = scales[g, n] * (q[k, n] - qzeros[g, n]) with g = k // group_size."""
    codes = _awq_unorder(unpack_int4(tensors.qweight, dim=1)).t().contiguous()  # [N, K]
    zeros = _awq_unorder(unpack_int4(tensors.qzeros, dim=1)).float()  # [G, N]
    group_index = torch.arange(codes.shape[1]) // group_size
    return QuantizedWeight(codes, tensors.scales.float(), zeros, group_index, bits=4)
