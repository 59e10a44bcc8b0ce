"""GPTQ (Frantar et al., 2022): quantize a weight one input column at a time, spreading each
column's rounding error over the columns not yet quantized through the inverse Hessian of the
layer's calibration inputs, so the layer's outputs on those inputs move as little as possible.

Implemented as in the paper and AutoGPTQ's `fasterquant`: H = 2/n sum x x^T, dead inputs pinned,
damping (a fraction of mean(diag H)) added, the upper Cholesky factor of H^-1 driving the
updates, lazy batch updates over blocks of 128 columns, and optional act-order (columns in
decreasing diag(H), recorded in g_idx). Groups are fixed when the walk reaches their first
column, from the then-updated weights; zero points are kept in [1, 15] for the v1 format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.quantization.formats import QuantizedWeight
from splitserve.engine.quantization.rtn import int4_codes, int4_group_params

BLOCK_COLUMNS = 128
"""Columns per lazy batch update; a multiple of every group size, so no group straddles two blocks."""
MIN_ZERO_POINT = 1
"""GPTQ v1 stores zero - 1 in 4 bits."""


@dataclass(frozen=True)
class GptqConfig:
    group_size: int
    """Input columns per (scale, zero) pair; divides BLOCK_COLUMNS."""
    act_order: bool = False
    """Quantize columns in decreasing Hessian diagonal (desc_act): better loss, a g_idx gather at run time."""
    damp_percent: float = 0.01
    """Damping added to H's diagonal, as a fraction of its mean."""

    def __post_init__(self) -> None:
        if BLOCK_COLUMNS % self.group_size:
            raise ValueError(f"group_size must divide {BLOCK_COLUMNS}, got {self.group_size}")
        if not 0 < self.damp_percent < 1:
            raise ValueError(f"damp_percent must be in (0, 1), got {self.damp_percent}")


class HessianAccumulator:
    """H = 2/n sum over calibration rows of x x^T, accumulated batch by batch (x: [T, K])."""

    def __init__(self, in_features: int) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64)  # [K, K]
        self.num_rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).double()  # [T, K]
        total = self.num_rows + x.shape[0]
        self.hessian *= self.num_rows / total
        self.hessian += (2.0 / total) * (x.t() @ x)
        self.num_rows = total


def _inverse_hessian_factor(hessian: torch.Tensor, weight: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp I)^-1 [K, K]; zeroes weight columns of inputs never seen."""
    hessian = hessian.clone()
    dead = torch.diag(hessian) == 0
    hessian[dead, dead] = 1.0
    weight[:, dead] = 0.0
    hessian += damp_percent * torch.mean(torch.diag(hessian)) * torch.eye(len(hessian), dtype=hessian.dtype)
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(hessian))
    return torch.linalg.cholesky(inverse, upper=True)


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, config: GptqConfig) -> QuantizedWeight:
    """4-bit GPTQ of `weight` [N, K] given its inputs' Hessian [K, K] (float64). Rows are independent
    given H, so projections sharing an input (q/k/v) can be quantized as one stacked weight."""
    weight = weight.double().clone()
    num_columns = weight.shape[1]
    order = torch.argsort(torch.diag(hessian), descending=True, stable=True) if config.act_order else torch.arange(num_columns)
    weight, hessian = weight[:, order], hessian[order][:, order]
    factor = _inverse_hessian_factor(hessian, weight, config.damp_percent)
    codes, scales, zeros = _quantize_columns(weight.float(), factor.float(), config.group_size)
    inverse_order = torch.argsort(order)
    group_index = (torch.arange(num_columns) // config.group_size)[inverse_order]  # g_idx in original columns
    return QuantizedWeight(codes[:, inverse_order].to(torch.int32).contiguous(), torch.stack(scales).float(),
                           torch.stack(zeros).float(), group_index, bits=4)


def _quantize_columns(weight: torch.Tensor, factor: torch.Tensor, group_size: int):
    """The column walk in the (possibly permuted) order: codes [N, K], per-group scales and zeros [N] each."""
    codes = torch.zeros_like(weight)
    scales: list[torch.Tensor] = []
    zeros: list[torch.Tensor] = []
    for start in range(0, weight.shape[1], BLOCK_COLUMNS):
        end = min(start + BLOCK_COLUMNS, weight.shape[1])
        block = weight[:, start:end].clone()  # [N, B], updated in place as its columns are quantized
        errors = torch.zeros_like(block)
        block_factor = factor[start:end, start:end]
        for i in range(end - start):
            if i % group_size == 0:
                scale, zero = int4_group_params(block[:, i:i + group_size], MIN_ZERO_POINT)
                scales.append(scale)
                zeros.append(zero)
            column = block[:, i]
            code = int4_codes(column[:, None], scale, zero)[:, 0]
            codes[:, start + i] = code
            error = (column - (code - zero) * scale) / block_factor[i, i]
            block[:, i:] -= error[:, None] * block_factor[i, i:][None, :]
            errors[:, i] = error
        weight[:, end:] -= errors @ factor[start:end, end:]  # the lazy batch update of later columns
    return codes, scales, zeros
