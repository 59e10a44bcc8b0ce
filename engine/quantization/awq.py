"""AWQ (Lin et al., 2023): protect the input channels that see large activations by scaling them up
before round-to-nearest and folding the inverse scale into the op that produces those inputs.

For the projections that share one input (q/k/v after input_layernorm, gate/up after
post_attention_layernorm, down after up_proj), per-input-channel scales s = mean|x|^alpha
(normalized to a geometric mean of 1) are searched over a grid of alpha in [0, 1); the alpha
whose quantized outputs x (Q(W s) / s)^T are closest (mean squared error) to x W^T on the
calibration inputs wins. The checkpoint then stores Q(W s) and the producer divided by s, an
exact rewrite in real arithmetic. Then, as AutoAWQ's auto-clip, each (output channel, group) of
the scaled weights (but q and k, whose errors the attention softmax amplifies) is clipped to the
fraction of its largest magnitude, on a grid from 1 down to 0.5, whose quantized group outputs
x_g w_g are closest to the unclipped float ones. (AutoAWQ also scales o_proj through v_proj when
their shapes agree; not done here.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.quantization.rtn import int4_codes, int4_group_params, int4_grouped

GRID_POINTS = 20
"""alpha in {0, 1/20, ..., 19/20}, and clip ratios 1, 0.975, ..., 0.525, as AutoAWQ."""
MAX_SHRINK = 0.5
"""Clipping never goes below this fraction of a group's largest magnitude."""
SEARCH_ROWS = 512
"""Calibration rows (tokens, evenly strided) the output error is measured on: the search costs
GRID_POINTS matmuls of this many rows; mean|x| still uses every row."""


def _output_error(x: torch.Tensor, weights: Sequence[torch.Tensor], scales: torch.Tensor | None,
                  group_size: int, reference: torch.Tensor) -> float:
    """Mean squared error of the projections' outputs after RTN of W * scales (x: [T', K])."""
    if scales is None:
        scales = torch.ones(x.shape[1])
    quantized = torch.cat([int4_grouped(w * scales, group_size).dequantize() / scales for w in weights])  # [N, K]
    return torch.mean((x @ quantized.t() - reference) ** 2).item()


def search_scales(x: torch.Tensor, weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """The best per-input-channel scales [K] for projections `weights` ([N_i, K] each) reading `x` [T, K]."""
    activation = x.float().abs().mean(dim=0).clamp(min=1e-4)  # [K]
    x = x[::max(1, len(x) // SEARCH_ROWS)].float()  # [<= 2 * SEARCH_ROWS, K]
    reference = x @ torch.cat(list(weights)).float().t()  # [T', sum N_i]
    best_scales, best_error = torch.ones_like(activation), _output_error(x, weights, None, group_size, reference)
    for step in range(1, GRID_POINTS):
        scales = activation.pow(step / GRID_POINTS)
        scales = scales / torch.sqrt(scales.max() * scales.min())
        error = _output_error(x, weights, scales, group_size, reference)
        if error < best_error:
            best_scales, best_error = scales, error
    return best_scales


def _fake_quantize_groups(weight: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest int4 of each row of `weight` [R, L] (one group per row), dequantized."""
    scale, zero = int4_group_params(weight)
    return (int4_codes(weight, scale, zero) - zero[:, None]) * scale[:, None]


def search_clip(x: torch.Tensor, weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """`weight` [N, K] with each (output channel, group) clipped to its best range (x: [T, K])."""
    x = x[::max(1, len(x) // SEARCH_ROWS)].float()
    n, k = weight.shape
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(weight.float(), (0, groups * group_size - k))  # [N, G * gs]
    w = padded.view(n, groups, group_size)  # [N, G, gs]
    xg = torch.nn.functional.pad(x, (0, groups * group_size - k)).view(len(x), groups, group_size)  # [T, G, gs]
    reference = torch.einsum("tgs,ngs->tng", xg, w)  # [T, N, G]: each group's share of each output
    largest = w.abs().amax(dim=-1, keepdim=True)  # [N, G, 1]
    best_error = torch.full((n, groups), float("inf"))
    best = w.clone()
    for step in range(GRID_POINTS):
        limit = largest * (1 - step * (1 - MAX_SHRINK) / GRID_POINTS)
        clipped = torch.maximum(torch.minimum(w, limit), -limit)
        quantized = _fake_quantize_groups(clipped.reshape(n * groups, group_size)).view(n, groups, group_size)
        error = ((torch.einsum("tgs,ngs->tng", xg, quantized) - reference) ** 2).mean(dim=0)  # [N, G]
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best = torch.where(better[..., None], clipped, best)
    return best.reshape(n, groups * group_size)[:, :k]
