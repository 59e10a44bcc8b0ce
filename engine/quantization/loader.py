"""Put quantized linear layers into a model being loaded (model_loader.load_model calls these).

1. `unpack_checkpoint` turns a GPTQ/AWQ checkpoint's packed tensors of each projection into one
   QuantizedWeight under the projection's `.weight` name, so fusing q/k/v and gate/up works as for
   float weights (formats.concat_rows);
2. `install_quantized_linears` replaces each decoder projection of the (meta) model by a
   QuantizedLinear, quantizing float weights round-to-nearest (int8 / int4), and removes their
   weights and biases from the state the rest of the model loads from. lm_head stays unquantized
   (as GPTQ/AWQ checkpoints keep it).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.quantization.formats import PackedTensors, QuantizedWeight, awq_unpack, gptq_unpack
from splitserve.engine.quantization.linear import make_quantized_linear
from splitserve.engine.quantization.rtn import int4_grouped, int8_per_channel
from splitserve.common.quantization_spec import QuantizationSpec

UNQUANTIZED_LINEARS = ("lm_head",)


def unpack_checkpoint(checkpoint: dict[str, torch.Tensor], spec: QuantizationSpec) -> None:
    """In place: every `<prefix>.qweight/.qzeros/.scales[/.g_idx]` becomes `<prefix>.weight`, a QuantizedWeight."""
    for prefix in [name.removesuffix(".qweight") for name in checkpoint if name.endswith(".qweight")]:
        tensors = PackedTensors(qweight=checkpoint.pop(prefix + ".qweight"), qzeros=checkpoint.pop(prefix + ".qzeros"),
                                scales=checkpoint.pop(prefix + ".scales"), g_idx=checkpoint.pop(prefix + ".g_idx", None))
        if spec.method == "awq":
            checkpoint[prefix + ".weight"] = awq_unpack(tensors, spec.group_size)
        else:
            checkpoint[prefix + ".weight"] = _gptq_weight(tensors, spec)


def _gptq_weight(tensors: PackedTensors, spec: QuantizationSpec) -> QuantizedWeight:
    if tensors.g_idx is None:  # some exporters omit g_idx without act-order: groups are contiguous
        k = tensors.qweight.shape[0] * 8
        tensors = PackedTensors(tensors.qweight, tensors.qzeros, tensors.scales,
                                torch.arange(k, dtype=torch.int32) // spec.group_size)
    return gptq_unpack(tensors, spec.gptq_zero_offset)


def quantize_float_weight(weight: torch.Tensor, spec: QuantizationSpec) -> QuantizedWeight:
    """Round-to-nearest at load: int8 per output channel, int4 per group."""
    if spec.method == "int8":
        return int8_per_channel(weight)
    if spec.method == "int4":
        return int4_grouped(weight, spec.group_size)
    raise ValueError(f"a {spec.method} model must be loaded from a {spec.method} checkpoint, "
                     f"but a projection has float weights")


def install_quantized_linears(model: nn.Module, state: dict, spec: QuantizationSpec, dtype: torch.dtype,
                              device: torch.device) -> None:
    """Replace the model's projections by quantized layers; pops their `.weight` / `.bias` from `state`."""
    names = [name for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and name not in UNQUANTIZED_LINEARS]
    for name in names:
        weight = state.pop(name + ".weight")
        if not isinstance(weight, QuantizedWeight):
            weight = quantize_float_weight(weight, spec)
        parent, _, child = name.rpartition(".")
        layer = make_quantized_linear(weight, state.pop(name + ".bias", None), spec.group_size or 0, dtype, device)
        setattr(model.get_submodule(parent), child, layer)
