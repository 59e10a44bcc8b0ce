"""`splitserve quantize`: write a GPTQ or AWQ checkpoint of a float model directory.

Calibration text defaults to the trained model's training split (its training record names the
held-out share of the stdlib, which calibration never reads). The model runs in float32 through
transformers; decoder layers are processed in order, each from inputs captured by hooks on its
projections with the layers before it already processed (GPTQ: quantized, so later layers
compensate for earlier errors; AWQ: scaled, an exact rewrite). Output: the public formats
(engine/quantization/formats.py) with `quantization_config` in config.json, loadable by this
engine and by GPTQ/AWQ-aware loaders elsewhere.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from splitserve.common.config import QUANTIZATION_GROUP_SIZES
from splitserve.common.errors import UnsupportedModelError
from splitserve.common.model_dir import (PYTORCH_INDEX, SAFETENSORS_INDEX, SPARSE_MOE_ARCHITECTURES, WEIGHT_FILE_PATTERNS,
                                         chosen_architecture)
from splitserve.engine.quantization.awq import search_clip, search_scales
from splitserve.engine.quantization.formats import PACK_FACTOR, QuantizedWeight, awq_pack, gptq_pack
from splitserve.engine.quantization.gptq import GptqConfig, HessianAccumulator, gptq_quantize
from splitserve.engine.quantization.rtn import int4_grouped
from splitserve.engine.stdlib_corpus import CorpusSplit, stdlib_root
from splitserve.engine.tiny_training import RECORD_FILE, read_record, token_stream

METHODS = ("gptq", "awq")
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
INPUT_SHARERS = {"self_attn.q_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.down_proj": ("mlp.down_proj",)}
"""Where inputs are captured (one projection per distinct input) -> every projection reading that input."""
FUSED_PROJECTION_ARCHITECTURES = {"Phi3ForCausalLM": "self_attn.qkv_proj, mlp.gate_up_proj"}
"""Architectures whose transformers model fuses PROJECTIONS' q/k/v and gate/up -> its fused projections."""
_GEMMA_NORMS = "its norms scale by (1 + weight), so dividing a norm's weight does not divide its output"
AWQ_UNFOLDABLE_ARCHITECTURES = {
    "GemmaForCausalLM": _GEMMA_NORMS,
    "Gemma2ForCausalLM": f"{_GEMMA_NORMS}, and pre_feedforward_layernorm, not post_attention_layernorm, feeds its MLP",
    "Gemma3ForCausalLM": f"{_GEMMA_NORMS}, and pre_feedforward_layernorm, not post_attention_layernorm, feeds its MLP",
    "Olmo2ForCausalLM": "it norms each sublayer's output instead (it has no input_layernorm)",
}
"""Architectures AWQ_GROUPS does not describe -> why: AWQ divides input_layernorm's weight by the q/k/v scales
and post_attention_layernorm's by the gate/up scales, which is exact only for norms that multiply by their weight
and feed those projections (the Llama layout)."""
CAPTURE_BATCH = 8
"""Calibration windows per forward pass while capturing inputs."""
CALIBRATION_TOKENS_PER_WINDOW_FACTOR = 4
"""Tokenize files until the stream holds this many times the tokens the windows need (variety)."""


@dataclass(frozen=True)
class QuantizeConfig:
    method: str
    """gptq or awq."""
    group_size: int = 128
    """Input channels per scale: 32, 64 or 128."""
    act_order: bool = False
    """GPTQ only: quantize columns in decreasing Hessian diagonal (desc_act; writes a permuting g_idx)."""
    num_samples: int = 32
    """Calibration windows."""
    seq_len: int = 512
    """Tokens per calibration window."""
    damp_percent: float = 0.01
    """GPTQ only: Hessian damping as a fraction of its mean diagonal."""
    seed: int = 0
    """Picks the calibration files and windows."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.group_size not in QUANTIZATION_GROUP_SIZES:
            raise ValueError(f"group_size must be one of {QUANTIZATION_GROUP_SIZES}, got {self.group_size}")
        if self.act_order and self.method != "gptq":
            raise ValueError("act_order is a GPTQ option (AWQ groups are contiguous)")
        if self.num_samples < 1 or self.seq_len < 2:
            raise ValueError(f"need num_samples >= 1 and seq_len >= 2, got {self.num_samples} and {self.seq_len}")

    def quantization_config(self) -> dict:
        """config.json's quantization_config, as AutoGPTQ / AutoAWQ write it."""
        if self.method == "gptq":
            return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.act_order,
                    "sym": False, "static_groups": False, "damp_percent": self.damp_percent,
                    "checkpoint_format": "gptq"}
        return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                "version": "gemm"}


def calibration_texts(model_dir: Path, calibration_dir: Path | None) -> list[str]:
    """Files of `calibration_dir` (*.py, *.txt), else the model's training split of the stdlib."""
    if calibration_dir is not None:
        paths = sorted(p for p in calibration_dir.rglob("*") if p.suffix in (".py", ".txt") and p.is_file())
        if not paths:
            raise FileNotFoundError(f"{calibration_dir} holds no *.py or *.txt files")
        return [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    if not (model_dir / RECORD_FILE).is_file():
        raise FileNotFoundError(f"{model_dir} has no {RECORD_FILE} (not a model trained here): "
                                f"pass --calibration-dir DIR with text files")
    split = CorpusSplit.of(stdlib_root(), read_record(model_dir).config.heldout_every)
    return split.read(split.train)


def calibration_windows(tokenizer, texts: list[str], config: QuantizeConfig) -> torch.Tensor:
    """[num_samples, seq_len] token windows from a seeded sample of `texts`."""
    rng = random.Random(config.seed)
    order = rng.sample(range(len(texts)), len(texts))
    wanted = CALIBRATION_TOKENS_PER_WINDOW_FACTOR * config.num_samples * config.seq_len
    chosen: list[str] = []
    for index in order:
        chosen.append(texts[index])
        if sum(len(t) for t in chosen) // 4 >= wanted:  # ~4 characters per token: enough to tokenize
            break
    stream = token_stream(tokenizer, chosen)
    if len(stream) < config.seq_len:
        raise ValueError(f"the calibration text holds {len(stream)} tokens, fewer than seq_len={config.seq_len}")
    starts = [rng.randrange(len(stream) - config.seq_len + 1) for _ in range(config.num_samples)]
    return torch.stack([stream[s:s + config.seq_len] for s in starts])


class _LayerDone(Exception):
    """Raised by a hook after the layer being calibrated: the rest of the forward pass is not needed."""


def _stop(module: nn.Module, args: tuple, output: object) -> None:
    raise _LayerDone


def _capture_inputs(model: PreTrainedModel, layer: nn.Module, windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """Inputs [num_tokens, K] of the layer's projections, one per distinct input (INPUT_SHARERS' keys),
    over all windows, the model in its current state; the forward pass stops after `layer`."""
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in INPUT_SHARERS}

    def hook(name: str) -> Callable:
        return lambda module, args: captured[name].append(args[0].reshape(-1, args[0].shape[-1]).detach())

    handles = [layer.get_submodule(name).register_forward_pre_hook(hook(name)) for name in INPUT_SHARERS]
    handles.append(layer.register_forward_hook(_stop))
    try:
        for batch in windows.split(CAPTURE_BATCH):
            try:
                model(input_ids=batch)
            except _LayerDone:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return {name: torch.cat(parts) for name, parts in captured.items()}


def _input_of(projection: str) -> str:
    return next(owner for owner, sharers in INPUT_SHARERS.items() if projection in sharers)


def _gptq_layer(layer: nn.Module, inputs: dict[str, torch.Tensor], config: QuantizeConfig) -> dict[str, QuantizedWeight]:
    """Quantize the layer's projections, those sharing an input as one stacked weight (rows are
    independent given the Hessian); writes the dequantized weights back (later layers see them)."""
    gptq = GptqConfig(config.group_size, config.act_order, config.damp_percent)
    result = {}
    for owner, sharers in INPUT_SHARERS.items():
        hessian = HessianAccumulator(inputs[owner].shape[1])
        hessian.add(inputs[owner])
        linears = [layer.get_submodule(name) for name in sharers]
        stacked = gptq_quantize(torch.cat([linear.weight.detach() for linear in linears]), hessian.hessian, gptq)
        start = 0
        for name, linear in zip(sharers, linears):
            rows = slice(start, start + linear.out_features)
            result[name] = QuantizedWeight(stacked.codes[rows], stacked.scales[:, rows], stacked.zeros[:, rows],
                                           stacked.group_index, bits=4)
            linear.weight.data = result[name].dequantize().to(linear.weight.dtype)
            start = rows.stop
    return result


AWQ_GROUPS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
              ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
              ("mlp.up_proj", ("mlp.down_proj",)))
"""AWQ: (producer, the projections reading its output); the producer absorbs 1 / scales."""
UNCLIPPED = ("self_attn.q_proj", "self_attn.k_proj")
"""AutoAWQ's auto-clip leaves q and k alone (the attention softmax amplifies their errors)."""


def _awq_layer(layer: nn.Module, inputs: dict[str, torch.Tensor], config: QuantizeConfig) -> dict[str, QuantizedWeight]:
    """Scale the layer (producers divided, consumers multiplied), clip, then round-to-nearest the
    projections. The layer keeps its scaled float weights: its outputs, hence later layers' inputs,
    are unchanged."""
    get = layer.get_submodule
    scales_of: dict[str, torch.Tensor] = {}  # projection -> the scales its input columns were multiplied by
    for producer, consumers in AWQ_GROUPS:
        scales = search_scales(inputs[_input_of(consumers[0])], [get(c).weight.detach() for c in consumers],
                               config.group_size)
        producer_weight = get(producer).weight.data  # [K] for a norm, [K, in] for up_proj
        producer_weight.div_(scales if producer_weight.dim() == 1 else scales[:, None])
        for consumer in consumers:
            get(consumer).weight.data.mul_(scales[None, :])
            scales_of[consumer] = scales
    result = {}
    for name in PROJECTIONS:
        weight = get(name).weight.detach()
        if name not in UNCLIPPED:
            x = inputs[_input_of(name)]
            weight = search_clip(x / scales_of[name] if name in scales_of else x, weight, config.group_size)
        result[name] = int4_grouped(weight, config.group_size)
    return result


@torch.inference_mode()
def quantize_model(model_dir: Path, out_dir: Path, config: QuantizeConfig, calibration_dir: Path | None = None,
                   show_progress: bool = False) -> Path:
    """Write `out_dir`: the model of `model_dir` with every decoder projection quantized by `config`."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check_packable(model, config.method)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = calibration_windows(tokenizer, calibration_texts(model_dir, calibration_dir), config)
    quantize_layer = _gptq_layer if config.method == "gptq" else _awq_layer
    quantized: dict[str, QuantizedWeight] = {}
    layers = model.model.layers
    for index, layer in enumerate(tqdm(layers, desc=f"{config.method} {model_dir.name}", disable=not show_progress)):
        for name, weight in quantize_layer(layer, _capture_inputs(model, layer, windows), config).items():
            quantized[f"model.layers.{index}.{name}"] = weight
    return write_checkpoint(model_dir, out_dir, model, quantized, config)


def check_packable(model: PreTrainedModel, method: str) -> None:
    """ValueError naming the first decoder projection the format cannot pack, before any calibration:
    both pack PACK_FACTOR 4-bit codes per int32 along the output channels (the zero points; AWQ's
    codes too), GPTQ its codes along the input channels. UnsupportedModelError for a mixture of experts, whose
    experts and router the engine runs in float only, and for a model whose layers hold fused projections
    (FUSED_PROJECTION_ARCHITECTURES), which PROJECTIONS and the quantized checkpoint loader name separately."""
    architecture = chosen_architecture(model.config.architectures or ["?"])
    if architecture in SPARSE_MOE_ARCHITECTURES:
        raise UnsupportedModelError(f"{method} quantization of mixture-of-experts models ({architecture}) is not "
                                    f"supported: the engine runs their experts and router in float only")
    if architecture in FUSED_PROJECTION_ARCHITECTURES:
        raise UnsupportedModelError(f"{method} quantization of {architecture} is not supported: its layers hold "
                                    f"fused projections ({FUSED_PROJECTION_ARCHITECTURES[architecture]}), and "
                                    f"quantization reads and writes q_proj, k_proj, v_proj, gate_proj and up_proj "
                                    f"separately")
    if method == "awq" and architecture in AWQ_UNFOLDABLE_ARCHITECTURES:
        raise UnsupportedModelError(f"awq quantization of {architecture} is not supported: AWQ folds its scales into "
                                    "input_layernorm (for q/k/v) and post_attention_layernorm (for gate/up), and "
                                    f"{AWQ_UNFOLDABLE_ARCHITECTURES[architecture]}")
    packed_dims = (("output channels", 0), ("input channels", 1)) if method == "gptq" else (("output channels", 0),)
    for index, layer in enumerate(model.model.layers):
        for name in PROJECTIONS:
            shape = layer.get_submodule(name).weight.shape  # [out_features, in_features]
            for what, dim in packed_dims:
                if shape[dim] % PACK_FACTOR:
                    raise ValueError(f"{method} packs {PACK_FACTOR} 4-bit codes per int32 along the {what}: "
                                     f"model.layers.{index}.{name} has {shape[dim]} (a multiple of {PACK_FACTOR} "
                                     f"is needed)")


def _is_weight_or_config(path: Path) -> bool:
    """A file the quantized checkpoint replaces. Every file a loader could read weights from counts, not
    only the ones this checkpoint's index names: out_dir has no index, so a copied consolidated.safetensors
    or pytorch_model.bin would be loaded next to model.safetensors."""
    return (path.name in ("config.json", SAFETENSORS_INDEX, PYTORCH_INDEX)
            or any(path.match(pattern) for pattern in WEIGHT_FILE_PATTERNS))


def write_checkpoint(model_dir: Path, out_dir: Path, model: PreTrainedModel, quantized: dict[str, QuantizedWeight],
                     config: QuantizeConfig) -> Path:
    """The model's other tensors in float32, the quantized projections packed, the source directory's
    other files, and config.json with quantization_config. float32 because AWQ divides the norms by
    its scales: rounded back to bfloat16 they would cost more than the scales gain (measured)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.removesuffix(".weight") in quantized or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        tensors[name] = tensor.float().contiguous()
    for prefix, weight in quantized.items():
        packed = gptq_pack(weight) if config.method == "gptq" else awq_pack(weight, config.group_size)
        for field in ("qweight", "qzeros", "scales", "g_idx"):
            if getattr(packed, field) is not None:
                tensors[f"{prefix}.{field}"] = getattr(packed, field).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    for path in model_dir.iterdir():
        if path.is_file() and not _is_weight_or_config(path):
            shutil.copy2(path, out_dir / path.name)
    hf_config = json.loads((model_dir / "config.json").read_text())
    hf_config["quantization_config"] = config.quantization_config()
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out_dir
