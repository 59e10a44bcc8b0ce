"""Sparse mixture-of-experts feed-forward blocks (Qwen3-MoE, Mixtral, GPT-OSS) over a flattened batch.

A router picks `experts_per_token` of `num_experts` gated MLPs per token; the block returns the
routing-weighted sum of their outputs. The numerics follow transformers 5.x (its default `grouped_mm`
experts implementation) op for op so greedy outputs agree token for token: router logits in the model's
dtype, softmax in float32, top-k over the probabilities, optional renormalization in float32 (GPT-OSS: top-k
over the logits, softmax over those k in the model's dtype), each expert's output scaled by its weight, then the
k scaled outputs of a token summed in rank order. Qwen3-MoE's and Mixtral's experts are SiLU MLPs without biases;
GPT-OSS's are ClampedSwigluExpert, with biases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ClampedSwiglu:
    """GPT-OSS's expert activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)."""

    alpha: float
    """config.json swiglu_alpha (1.702)."""
    limit: float
    """config.json swiglu_limit (7.0)."""

    def __post_init__(self) -> None:
        if not self.limit > 0:
            raise ValueError(f"swiglu_limit must be > 0, got {self.limit}")


@dataclass(frozen=True)
class SparseMoeArch:
    num_experts: int
    """Experts per sparse layer (Qwen3-MoE num_experts, Mixtral num_local_experts)."""
    experts_per_token: int
    """Experts each token runs through (config.json num_experts_per_tok)."""
    expert_intermediate_size: int
    """Each expert's MLP width (Qwen3-MoE moe_intermediate_size, Mixtral intermediate_size)."""
    normalize_top_k: bool
    """Divide the k chosen probabilities by their sum (Qwen3-MoE norm_topk_prob; always in Mixtral)."""
    weights_in_model_dtype: bool
    """Round the routing weights to the model's dtype before scaling the experts' outputs (Qwen3-MoE); else
    they stay float32 and the scaled outputs are summed in float32 (Mixtral). Equal in a float32 model."""
    sparse_layers: frozenset[int]
    """Decoder layers whose feed-forward is this block; the others run the dense MLP."""
    router_bias: bool = False
    """GPT-OSS: the router's linear has a bias."""
    softmax_over_top_k: bool = False
    """GPT-OSS: the top k are picked from the router's logits and weighted by a softmax over those k logits alone,
    in the model's dtype (normalize_top_k and weights_in_model_dtype then change nothing)."""
    clamped_swiglu: ClampedSwiglu | None = None
    """GPT-OSS: the experts are ClampedSwigluExpert (with biases); None for SiLU MLPs without biases."""

    def __post_init__(self) -> None:
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be between 1 and num_experts {self.num_experts}, "
                             f"got {self.experts_per_token}")


class SparseMoeBlock(nn.Module):
    """`gate` (the router, a Linear hidden -> num_experts) and `experts` (a ModuleList of MLPs, each x [T, hidden]
    -> [T, hidden]); the same module names as the checkpoint's after the loader fuses each expert's gate/up."""

    def __init__(self, moe: SparseMoeArch, hidden_size: int, make_expert: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=moe.router_bias)
        self.experts = nn.ModuleList(make_expert() for _ in range(moe.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) for x [T, hidden], ranked by descending probability."""
        logits = self.gate(x)  # [T, num_experts], the model's dtype
        if self.moe.softmax_over_top_k:
            top_logits, experts = torch.topk(logits, self.moe.experts_per_token, dim=-1)
            return torch.softmax(top_logits, dim=-1, dtype=logits.dtype), experts
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.moe.experts_per_token, dim=-1)
        if self.moe.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.moe.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        weights, experts = self.route(x)
        return self.mix(x, weights, experts)

    def mix(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over r of weights[t, r] * experts[t, r](x[t]), each expert run once on all the tokens that chose it."""
        num_tokens, k = experts.shape
        slot_experts = experts.flatten()  # [T * k]: slot s is token s // k's choice of rank s % k
        slot_weights = weights.flatten()
        by_expert = torch.argsort(slot_experts, stable=True)
        counts = torch.bincount(slot_experts, minlength=self.moe.num_experts).tolist()  # one host sync per layer
        # [T * k, hidden]: each slot's expert output times its weight (float32 when the weights are)
        scaled = x.new_empty((num_tokens * k, x.shape[1]), dtype=torch.promote_types(x.dtype, weights.dtype))
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                slots = by_expert[start:start + count]
                scaled[slots] = expert(x[slots // k]) * slot_weights[slots].unsqueeze(1)
                start += count
        # Summed over the ranks (transformers' reshape + sum), not accumulated per expert (its eager index_add_).
        return scaled.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)


class ClampedSwigluExpert(nn.Module):
    """GPT-OSS's expert: down_proj(activation(gate_up_proj(x))) with biases, the gate/up rows de-interleaved at load
    (engine/model_loader.py: the checkpoint's columns alternate gate, up) into [gate | up], as transformers'
    GptOssExperts computes it op for op (each clamp, the sigmoid's product and the + 1 rounded to the dtype)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: ClampedSwiglu) -> None:
        super().__init__()
        self.swiglu = activation
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        limit = self.swiglu.limit
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * self.swiglu.alpha)
        return self.down_proj((up + 1) * glu)
