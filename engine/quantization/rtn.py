"""Round-to-nearest quantization of a float weight at load (and the grid GPTQ and AWQ search on)."""

from __future__ import annotations

import torch

from splitserve.engine.quantization.formats import QuantizedWeight

INT4_MAX_CODE = 15
INT8_MAX_CODE = 127


def int8_per_channel(weight: torch.Tensor) -> QuantizedWeight:
    """Symmetric, one scale per output channel: code = round(w / s), s = max|w_row| / 127."""
    weight = weight.float()  # [N, K]
    scales = (weight.abs().amax(dim=1) / INT8_MAX_CODE).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
    codes = torch.round(weight / scales[:, None]).clamp(-INT8_MAX_CODE, INT8_MAX_CODE).to(torch.int32)
    group_index = torch.zeros(weight.shape[1], dtype=torch.long)  # one group spanning K
    return QuantizedWeight(codes, scales[None, :], torch.zeros_like(scales)[None, :], group_index, bits=8)


def int4_group_params(weight: torch.Tensor, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min-max grid of each row of `weight` [N, L] (one group): scale [N], zero [N].

    The range always includes 0 (as GPTQ's quantizer does), so a zero weight is exact; zero is an
    integer in [min_zero, 15] (GPTQ v1 checkpoints need min_zero = 1).
    """
    low = weight.amin(dim=1).clamp(max=0.0)
    high = weight.amax(dim=1).clamp(min=0.0)
    scale = ((high - low) / INT4_MAX_CODE).clamp(min=1e-8)
    zero = torch.round(-low / scale).clamp(min_zero, INT4_MAX_CODE)
    return scale, zero


def int4_codes(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Codes [N, L] of `weight` [N, L] on a per-row grid (scale, zero [N])."""
    return torch.clamp(torch.round(weight / scale[:, None]) + zero[:, None], 0, INT4_MAX_CODE)


def int4_grouped(weight: torch.Tensor, group_size: int, min_zero: int = 0) -> QuantizedWeight:
    """Asymmetric 4-bit, one (scale, zero) per run of `group_size` input channels (the last may be shorter)."""
    weight = weight.float()  # [N, K]
    groups = weight.split(group_size, dim=1)
    params = [int4_group_params(group, min_zero) for group in groups]
    codes = torch.cat([int4_codes(g, s, z) for g, (s, z) in zip(groups, params)], dim=1).to(torch.int32)
    scales = torch.stack([s for s, _ in params])  # [G, N]
    zeros = torch.stack([z for _, z in params])  # [G, N]
    group_index = torch.arange(weight.shape[1]) // group_size
    return QuantizedWeight(codes, scales, zeros, group_index, bits=4)
