"""LoRA deltas on a model's projections, per group of rows of the flattened batch.

`install_lora_linears` wraps each decoder layer's qkv_proj, o_proj, gate_up_proj and down_proj in a
`LoRALinear` that runs the base projection (its fast kernel unchanged: packed, panels, column-major) and then,
for each adapter of the step, adds scaling * (x[rows] A^T) B^T to its rows' output columns. Which rows run which
adapter is the step's `LoRABatch`, set on the model's shared `LoRAContext` around the forward by the model
runner; without one (base-model steps, captured CUDA graphs) the wrappers add nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitserve.engine.lora_adapter import LoRAAdapter

LORA_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
"""The projections of each decoder layer an adapter may adapt (engine/lora_adapter.py's Slice.projection)."""


@dataclass(frozen=True)
class LoRAGroup:
    rows: torch.Tensor  # [n] int64: the rows of the step's flattened batch that run `adapter`
    adapter: LoRAAdapter


@dataclass(frozen=True)
class LoRABatch:
    """The adapted rows of one forward, one group per adapter: the groups' rows are disjoint (a row runs one
    adapter), so each output row gets at most one adapter's delta; rows of no group run the base model."""

    groups: tuple[LoRAGroup, ...]


class LoRAContext:
    """The batch the model's LoRALinears read during one forward (None outside LoRA steps)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None


class LoRALinear(nn.Module):
    """base(x), plus each group's adapter delta on that group's rows (x: [T, in] -> [T, out])."""

    def __init__(self, base: nn.Module, layer_index: int, projection: str, context: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.key = (layer_index, projection)
        self.context = context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)  # [T, out], a fresh tensor: the deltas are added in place
        batch = self.context.batch
        if batch is None:
            return out
        for group in batch.groups:
            pairs = group.adapter.pairs.get(self.key, ())
            if not pairs:
                continue
            rows = x.index_select(0, group.rows)  # [n, in]
            for pair in pairs:
                delta = (rows @ pair.a.t()) @ pair.b.t()  # [n, r] -> [n, end - start]
                out[:, pair.slice.start:pair.slice.end].index_add_(0, group.rows, delta)
        return out


def install_lora_linears(model: nn.Module) -> LoRAContext:
    """Wrap every decoder layer's LORA_PROJECTIONS of `model` (a LlamaFamilyForCausalLM with dense MLPs) in a
    LoRALinear, in place; returns the context they share. The MLP must compute act(gate) * up after gate_up_proj
    (load_model's fuse_mlp_activation=False): a gate_up_proj fused with its activation has no output to adapt."""
    context = LoRAContext()
    for index, layer in enumerate(model.layers):
        if getattr(layer.mlp, "gate_up_applies_activation", False):
            raise ValueError("the MLP's gate/up projection is fused with its activation: load the model with "
                             "fuse_mlp_activation=False for LoRA")
        for projection in LORA_PROJECTIONS:
            parent_name, name = projection.split(".")
            parent = getattr(layer, parent_name)
            setattr(parent, name, LoRALinear(getattr(parent, name), index, projection, context))
    return context
