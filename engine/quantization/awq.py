"""AWQ (Lin et al., 2023): protect the input channels that see large activations by scaling them up
before round-to-nearest and folding the inverse scale into the op that produces those inputs.

For the projections that share one input (q/k/v after input_layernorm, gate/up after
post_attention_layernorm, down after up_proj), per-input-channel scales s = mean|x|^alpha
(normalized to a geometric mean of 1) are searched over a grid of alpha in [0, 1); the alpha
whose quantized outputs x (Q(W s) / s)^T are closest (mean squared error) to x W^T on the
calibration inputs wins. The checkpoint then stores Q(W s) and the producer divided by s, an
exact rewrite in real arithmetic. (AutoAWQ also scales o_proj through v_proj when their shapes
agree and searches a clipping range; neither is done here.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.quantization.rtn import int4_grouped

GRID_POINTS = 20
"""alpha in {0, 1/20, ..., 19/20}, as AutoAWQ."""


def _output_error(x: torch.Tensor, weights: Sequence[torch.Tensor], scales: torch.Tensor | None,
                  group_size: int, reference: torch.Tensor) -> float:
    """Mean squared error of the projections' outputs after RTN of W * scales (x: [T, K])."""
    if scales is None:
        scales = torch.ones(x.shape[1])
    quantized = torch.cat([int4_grouped(w * scales, group_size).dequantize() / scales for w in weights])  # [N, K]
    return torch.mean((x @ quantized.t() - reference) ** 2).item()


def search_scales(x: torch.Tensor, weights: Sequence[torch.Tensor], group_size: int) -> torch.Tensor:
    """The best per-input-channel scales [K] for projections `weights` ([N_i, K] each) reading `x` [T, K]."""
    x = x.float()
    reference = x @ torch.cat(list(weights)).float().t()  # [T, sum N_i]
    activation = x.abs().mean(dim=0).clamp(min=1e-4)  # [K]
    best_scales, best_error = torch.ones_like(activation), _output_error(x, weights, None, group_size, reference)
    for step in range(1, GRID_POINTS):
        scales = activation.pow(step / GRID_POINTS)
        scales = scales / torch.sqrt(scales.max() * scales.min())
        error = _output_error(x, weights, scales, group_size, reference)
        if error < best_error:
            best_scales, best_error = scales, error
    return best_scales
