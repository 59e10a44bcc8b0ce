"""Load a PEFT LoRA adapter directory for a Llama-family model, onto the engine's fused projections.

A PEFT adapter directory holds adapter_config.json (r, lora_alpha, target_modules, use_rslora, bias, ...) and
adapter_model.safetensors (or adapter_model.bin) with tensors named
`base_model.model.model.layers.{l}.{self_attn|mlp}.{module}.lora_{A|B}.weight`: A [r, in_features], B
[out_features, r]. The adapted projection computes y = x W^T + scaling * (x A^T) B^T, scaling = lora_alpha / r
(lora_alpha / sqrt(r) with use_rslora).

The engine fuses q/k/v into one qkv_proj and gate/up into one gate_up_proj (engine/model_loader.py): an
adapter's q_proj pair adapts qkv_proj's output columns [0, q_size), k_proj [q_size, q_size + kv_size), v_proj
the rest; gate_proj gate_up_proj's [0, I), up_proj [I, 2 I). Phi-3's checkpoints (and so its adapters) name the
fused modules themselves, which adapt all their columns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from splitserve.common.lora import (AdapterConfig, LoRARequest, adapter_weight_file, bad_adapter,
                                   read_adapter_config)
from splitserve.engine.models.llama import LlamaFamilyArch

_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclass(frozen=True)
class Slice:
    """Where one adapted HF module's output lands in the engine's projection: columns [start, end)."""

    projection: str
    """The engine module of each decoder layer: self_attn.qkv_proj, self_attn.o_proj, mlp.gate_up_proj, or
    mlp.down_proj."""
    start: int
    end: int


def module_slices(arch: LlamaFamilyArch) -> dict[str, Slice]:
    """HF module name -> its slice of the engine's projections, for the modules an adapter of `arch` may name."""
    q, kv, inner, hidden = arch.q_size, arch.kv_size, arch.intermediate_size, arch.hidden_size
    slices = {"o_proj": Slice("self_attn.o_proj", 0, hidden), "down_proj": Slice("mlp.down_proj", 0, hidden)}
    if arch.architecture == "Phi3ForCausalLM":  # its modules are fused in the checkpoint too
        slices.update(qkv_proj=Slice("self_attn.qkv_proj", 0, q + 2 * kv),
                      gate_up_proj=Slice("mlp.gate_up_proj", 0, 2 * inner))
        return slices
    slices.update(q_proj=Slice("self_attn.qkv_proj", 0, q), k_proj=Slice("self_attn.qkv_proj", q, q + kv),
                  v_proj=Slice("self_attn.qkv_proj", q + kv, q + 2 * kv),
                  gate_proj=Slice("mlp.gate_up_proj", 0, inner), up_proj=Slice("mlp.gate_up_proj", inner, 2 * inner))
    return slices


@dataclass(frozen=True)
class LoRAPair:
    """One adapted module of one layer: delta [N, end - start] = (x [N, in] @ a^T) @ b^T, added to columns
    [slice.start, slice.end) of the projection's output."""

    slice: Slice
    a: torch.Tensor  # [r, in_features]
    b: torch.Tensor  # [end - start, r], already multiplied by the adapter's scaling


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter's weights in the model's dtype on its device, grouped by (layer, engine projection)."""

    request: LoRARequest
    rank: int
    scaling: float
    pairs: dict[tuple[int, str], tuple[LoRAPair, ...]]
    """(layer index, Slice.projection) -> the pairs adapting that projection (q, k and v share qkv_proj)."""


def load_adapter(request: LoRARequest, arch: LlamaFamilyArch, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """The adapter at request.lora_path, checked against `arch` (every tensor's name and shape), in `dtype` on
    `device`; InvalidRequestError naming lora_request when it cannot run on this model."""
    directory = Path(request.lora_path)
    if not directory.is_dir():
        raise bad_adapter(directory, "no such directory")
    config = read_adapter_config(directory, max_lora_rank)
    tensors = _read_weights(directory)
    slices = module_slices(arch)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.fullmatch(name.replace(".default.", "."))
        if match is None:
            raise bad_adapter(directory, f"tensor {name!r} is not a decoder layer's lora_A/lora_B weight "
                                         f"(embed_tokens, lm_head and saved modules are not supported)")
        layer, module, which = int(match[1]), match[3], match[4]
        if module not in slices or not 0 <= layer < arch.num_layers:
            raise bad_adapter(directory, f"tensor {name!r}: {arch.architecture} has no adaptable module {module!r} in "
                                         f"layer {layer} (it has {', '.join(slices)} in layers "
                                         f"0-{arch.num_layers - 1})")
        found.setdefault((layer, module), {})[which] = tensor
    if not found:
        raise bad_adapter(directory, "the adapter holds no LoRA weights")
    pairs: dict[tuple[int, str], list[LoRAPair]] = {}
    for (layer, module), halves in sorted(found.items()):
        pair = _pair(directory, f"layer {layer} {module}", halves, slices[module], arch, config, dtype, device)
        pairs.setdefault((layer, pair.slice.projection), []).append(pair)
    return LoRAAdapter(request, config.rank, config.scaling, {key: tuple(value) for key, value in pairs.items()})


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    path = adapter_weight_file(directory)
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # safetensors, pickle and zip errors share no base; each means a bad file
        raise bad_adapter(directory, f"{path.name} is not loadable: {error}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise bad_adapter(directory, f"{path.name} is not a state dict of tensors")
    return state


def _pair(directory: Path, where: str, halves: dict[str, torch.Tensor], slice_: Slice, arch: LlamaFamilyArch,
          config: AdapterConfig, dtype: torch.dtype, device: torch.device) -> LoRAPair:
    """One module's A and B, shapes checked: A [r, in], B [out, r], r the config's."""
    if set(halves) != {"A", "B"}:
        missing = "B" if "A" in halves else "A"
        raise bad_adapter(directory, f"{where} has lora_{''.join(halves)} without its lora_{missing}")
    a, b = halves["A"], halves["B"]
    in_features = arch.q_size if slice_.projection == "self_attn.o_proj" else (
        arch.intermediate_size if slice_.projection == "mlp.down_proj" else arch.hidden_size)
    expected_a, expected_b = (config.rank, in_features), (slice_.end - slice_.start, config.rank)
    if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
        raise bad_adapter(directory, f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)}, expected "
                                     f"{list(expected_a)} and {list(expected_b)} (r {config.rank} of this model's "
                                     f"shapes)")
    # scaling folded into B once here: the step then runs two matmuls per pair, no scalar multiply
    return LoRAPair(slice_, a.to(device=device, dtype=dtype).contiguous(),
                    (b.float() * config.scaling).to(device=device, dtype=dtype).contiguous())


