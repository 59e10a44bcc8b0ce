"""Load a Hugging Face model directory (config + safetensors or PyTorch .bin weights) into a LlamaFamilyForCausalLM.

q/k/v projections are fused into one `qkv_proj` and gate/up into `gate_up_proj` at load
time so each layer runs two matmuls fewer per step (a Phi-3 checkpoint stores them fused already).
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from splitserve.common.errors import UnsupportedModelError, json_excerpt
from splitserve.common.model_dir import (SEQUENCE_CLASSIFICATION_ARCHITECTURES, SUPPORTED_ARCHITECTURES,
                                         activation_field, chosen_architecture, no_architecture_message,
                                         unsupported_architecture_message, weight_files)
from splitserve.engine.attention import AttentionBackend
from splitserve.engine.cpu_kernels import cpu_kernel_isa
from splitserve.engine.models.llama import LlamaFamilyArch, LlamaFamilyForCausalLM, RotaryEmbedding
from splitserve.engine.models.layer_ops import CpuKernelLayerOps, LayerOps, TorchLayerOps
from splitserve.engine.models.moe import ClampedSwiglu, SparseMoeArch
from splitserve.engine.models.packed_linear import can_pack, pack_linears
from splitserve.engine.quantization.formats import concat_rows
from splitserve.engine.quantization.loader import install_quantized_linears, unpack_checkpoint
from splitserve.common.quantization_spec import NONE, PACKED_METHODS, QuantizationSpec


def model_fingerprint(model_dir: Path) -> str:
    """Identity of a model for the KV handshake: a hash of its config.json and weight file names/sizes."""
    digest = hashlib.sha256((Path(model_dir) / "config.json").read_bytes())
    for path in weight_files(Path(model_dir)):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def load_hf_config(model_dir: Path) -> PretrainedConfig:
    """The model's config as transformers reads it; a config.json transformers cannot read (its validators raise
    KeyError/ValueError/TypeError, e.g. on an older RoPE layout, or its strict field and shape checks fail) is an
    UnsupportedModelError naming what it holds."""
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a model directory: no config.json")
    try:
        return AutoConfig.from_pretrained(model_dir, local_files_only=True)
    except StrictDataclassError as error:
        # transformers 5's config classes check field types and shapes as huggingface_hub strict dataclasses,
        # whose errors are no ValueError; the wrapped cause names the field or the shapes at fault
        raise UnsupportedModelError(f"config.json: {_refusal(error.__cause__ or error)}") from None
    except (KeyError, ValueError, TypeError) as error:
        raise UnsupportedModelError(_unreadable_config_message(model_dir, error)) from None


def _unreadable_config_message(model_dir: Path, error: Exception) -> str:
    """Names the RoPE field a failure comes from when config.json has one (transformers validates RoPE
    parameters while reading a config), else the config as a whole."""
    reason = _refusal(error)
    raw = json.loads((model_dir / "config.json").read_text())  # valid JSON: transformers parsed it before failing
    for field in ("rope_scaling", "rope_parameters"):
        rope = raw.get(field)
        if not isinstance(rope, dict):
            continue
        rope_type = rope.get("rope_type", rope.get("type"))
        if rope_type == "su":
            return (f"config.json's {field} type 'su' (Phi-3's legacy name for 'longrope'): {reason}; newer Phi-3 "
                    "checkpoints name it 'longrope' (set its type to \"longrope\")")
        return f"config.json's {field} {json_excerpt(rope)}: {reason}"
    return f"config.json: {reason}"


def _refusal(error: BaseException) -> str:
    """How an unreadable config.json's messages say why: transformers' own error."""
    return f"transformers cannot read it ({type(error).__name__}: {error})"


def parse_arch(config: PretrainedConfig) -> LlamaFamilyArch:
    if not config.architectures:
        raise UnsupportedModelError(no_architecture_message())
    architecture = chosen_architecture(config.architectures)
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(unsupported_architecture_message(architecture))
    activation = activation_field(architecture)
    if getattr(config, activation.name, activation.default) not in activation.accepted:
        raise UnsupportedModelError(activation.unsupported_message(getattr(config, activation.name)))
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                                    f"{num_kv_heads} (grouped-query attention gives each KV head the same number "
                                    "of query heads)")
    qkv_bias, o_bias, mlp_bias = _biases(config, architecture)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return LlamaFamilyArch(
        architecture=architecture,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=config.intermediate_size,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", OLMO2),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_windows=_sliding_windows(config, architecture),
        rope_length_limit=_rope_length_limit(config),
        rotary_dim=_rotary_dim(config, architecture, head_dim),
        moe=_sparse_moe(config, architecture),
        **_granite_multipliers(config, architecture),
        **_gemma_fields(config, architecture),
        **_smollm3_fields(config, architecture),
        **_olmo2_fields(architecture),
        **_gpt_oss_fields(architecture),
    )


SMOLLM3 = "SmolLM3ForCausalLM"
OLMO2 = "Olmo2ForCausalLM"
GPT_OSS = "GptOssForCausalLM"


def _gpt_oss_fields(architecture: str) -> dict:
    """GPT-OSS's attention sinks and float32 norms (its experts: _sparse_moe)."""
    if architecture != GPT_OSS:
        return {}
    return dict(attention_sinks=True, float32_norms=True)


def _smollm3_fields(config: PretrainedConfig, architecture: str) -> dict:
    """SmolLM3's NoPE layers: the zeros of no_rope_layers (its config derives the list from no_rope_layer_interval,
    every n-th layer unrotated, when config.json has none)."""
    if architecture != SMOLLM3:
        return {}
    flags = list(config.no_rope_layers)
    if len(flags) != config.num_hidden_layers or any(flag not in (0, 1) for flag in flags):
        raise UnsupportedModelError(f"no_rope_layers must hold one 0 or 1 per layer ({config.num_hidden_layers}), "
                                    f"got {flags}")
    return dict(nope_layers=frozenset(i for i, flag in enumerate(flags) if flag == 0))


def _olmo2_fields(architecture: str) -> dict:
    """OLMo 2's post-norm layers and its q/k norms over the whole projections."""
    if architecture != OLMO2:
        return {}
    return dict(post_norms=True, qk_norm_over_projection=True)


GEMMA_ARCHITECTURES = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
SANDWICH_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
"""Gemma 2 and 3: norms around each sublayer, query_pre_attn_scalar, final_logit_softcapping."""


def _check_gemma_fields(config: PretrainedConfig, architecture: str) -> None:
    """UnsupportedModelError naming a field of a Gemma config that asks for something the engine does not run:
    bidirectional attention, or Gemma 3's attn_logit_softcapping (null in every released Gemma 3; transformers 5's
    Gemma 3 does not apply it, so the model it serves for such a config is not the one the field describes)."""
    if getattr(config, "use_bidirectional_attention", None):
        raise UnsupportedModelError(f"use_bidirectional_attention is not supported ({architecture} is served "
                                    "causal only)")
    if architecture == "Gemma3ForCausalLM" and config.attn_logit_softcapping is not None:
        raise UnsupportedModelError(f"attn_logit_softcapping {config.attn_logit_softcapping!r} is not supported "
                                    "for Gemma3ForCausalLM (transformers does not apply it): set it to null")


def _gemma_fields(config: PretrainedConfig, architecture: str) -> dict:
    """The Gemma families' LlamaFamilyArch fields (none for the other architectures, which never read them):
    softcapping as transformers applies it, Gemma 2 to attention scores and logits, Gemma 3 to logits only."""
    if architecture not in GEMMA_ARCHITECTURES:
        return {}
    _check_gemma_fields(config, architecture)
    fields = dict(unit_offset_norms=True, scale_embeddings_by_sqrt_hidden=True, gelu_tanh_mlp=True)
    if architecture in SANDWICH_ARCHITECTURES:
        fields.update(sandwich_norms=True, attention_scale=config.query_pre_attn_scalar ** -0.5,
                      final_logit_softcap=config.final_logit_softcapping,
                      local_rope_layers=_local_rope_layers(config, architecture))
    if architecture == "Gemma2ForCausalLM":
        fields.update(attention_softcap=config.attn_logit_softcapping)
    return fields


PHI3 = "Phi3ForCausalLM"
GRANITE = "GraniteForCausalLM"


def _rotary_dim(config: PretrainedConfig, architecture: str, head_dim: int) -> int | None:
    """Phi3's int(head_dim * partial_rotary_factor) when below head_dim (transformers' Phi3 rotates that many
    leading dims of each head); None otherwise. The other architectures' modules rotate all of head_dim whatever
    the config says, and their RoPE initializers would size the tables by the factor: build_rotary refuses those."""
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if architecture != PHI3 or factor == 1.0:
        return None
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise UnsupportedModelError(f"partial_rotary_factor {factor} of head_dim {head_dim} rotates {rotary_dim} "
                                    f"dims; RoPE needs an even number from 2 to {head_dim}")
    return rotary_dim if rotary_dim < head_dim else None


def _granite_multipliers(config: PretrainedConfig, architecture: str) -> dict[str, float]:
    """Granite's four scalars as LlamaFamilyArch fields (none for the other architectures, which never read them)."""
    if architecture != GRANITE:
        return {}
    return dict(attention_scale=float(config.attention_multiplier),
                embedding_multiplier=float(config.embedding_multiplier),
                residual_multiplier=float(config.residual_multiplier),
                logits_scaling=float(config.logits_scaling))


def _biases(config: PretrainedConfig, architecture: str) -> tuple[bool, bool, bool]:
    """(q/k/v, o, MLP) biases as transformers' modules of `architecture` build them: Llama and SmolLM3 read
    attention_bias (q/k/v and o) and mlp_bias, Qwen3, Qwen3-MoE, OLMo 2 and the Gemmas attention_bias only, Qwen2 always
    biases q/k/v and nothing else, Mistral, Mixtral and Phi3 bias nothing, Granite reads what Llama reads, GPT-OSS
    attention_bias (its experts' and router's biases: _sparse_moe). A field
    an architecture's modules never read (mlp_bias in a Qwen2 config.json, attention_bias in a Mistral one) is
    ignored, as transformers ignores it."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    if architecture == "Qwen2ForCausalLM":
        return True, False, False
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM", PHI3):
        return False, False, False
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", OLMO2, GPT_OSS, *GEMMA_ARCHITECTURES):
        return attention_bias, attention_bias, False
    return attention_bias, attention_bias, bool(getattr(config, "mlp_bias", False))


def _sliding_windows(config: PretrainedConfig, architecture: str) -> tuple[int | None, ...]:
    """Per layer: the attention window, or None, as transformers' modules read config.json: Llama, Granite, OLMo 2
    and Gemma attend fully in every layer whatever sliding_window or layer_types say; SmolLM3: see
    _smollm3_sliding_windows; Mistral windows every layer
    (those layer_types names, when it has them) and reads no use_sliding_window; Mixtral windows every layer;
    Phi3 windows every layer when sliding_window is set, whatever layer_types say; Qwen2 and Qwen3 window the
    layers of their layer_types, which their configs derive from use_sliding_window and max_window_layers
    (dropping sliding_window when use_sliding_window is false); Qwen3-MoE windows every layer when
    use_sliding_window (its config drops sliding_window otherwise; neither it nor Mixtral has layer_types);
    Gemma 2 and 3 window their layer_types' sliding_attention layers, which Gemma 2's config alternates and
    Gemma 3's derives from sliding_window_pattern (every 6th layer full) when config.json has none; so does
    GPT-OSS, whose config alternates them (sliding first) when config.json has none."""
    if architecture in ("LlamaForCausalLM", GRANITE, "GemmaForCausalLM", OLMO2):
        return (None,) * config.num_hidden_layers
    if architecture == SMOLLM3:
        return _smollm3_sliding_windows(config)
    if architecture == PHI3:
        return (getattr(config, "sliding_window", None),) * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or [SLIDING_LAYER_TYPE] * config.num_hidden_layers
    return tuple(window if kind == SLIDING_LAYER_TYPE else None for kind in layer_types)


def _smollm3_sliding_windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    """SmolLM3 windows its layer_types' sliding_attention layers when use_sliding_window and sliding_window are set
    (its config derives layer_types from them: the NoPE layers slide). A sliding_attention layer without them is
    refused: transformers' eager and SDPA attention would still mask it by the window (the masks follow
    layer_types) while its flash attention would not, so no one model answers to that config."""
    windowed = bool(config.use_sliding_window) and config.sliding_window is not None
    layer_types = list(config.layer_types)
    if not windowed and SLIDING_LAYER_TYPE in layer_types:
        raise UnsupportedModelError("layer_types names sliding_attention layers but use_sliding_window is false or "
                                    "sliding_window is null (transformers' attention implementations disagree on "
                                    "such a layer): set both, or make every layer full_attention")
    return tuple(config.sliding_window if kind == SLIDING_LAYER_TYPE else None for kind in layer_types)


def _local_rope_layers(config: PretrainedConfig, architecture: str) -> frozenset[int]:
    """Gemma 3's sliding_attention layers, which transformers rotates with rope_parameters["sliding_attention"]
    (rope_local_base_freq in older config.json files) instead of rope_parameters["full_attention"]."""
    if architecture != "Gemma3ForCausalLM":
        return frozenset()
    return frozenset(i for i, kind in enumerate(config.layer_types) if kind == SLIDING_LAYER_TYPE)


SLIDING_LAYER_TYPE = "sliding_attention"
FULL_LAYER_TYPE = "full_attention"
"""The layer_types entries of windowed and full-attention layers (Gemma 3 also keys its per-layer-type
rope_parameters by them: its sliding layers rotate by the local RoPE)."""


def _sparse_moe(config: PretrainedConfig, architecture: str) -> SparseMoeArch | None:
    """The experts as transformers' modules read config.json: Mixtral makes every layer sparse, its experts
    intermediate_size wide, and always renormalizes the top k; GPT-OSS makes every layer sparse, its experts
    intermediate_size wide with biases and the clamped SwiGLU of swiglu_alpha / swiglu_limit, its router biased,
    weighting the top k logits by their softmax; Qwen3-MoE makes layer l sparse when num_experts > 0,
    l is not in mlp_only_layers and decoder_sparse_step divides l + 1 (the other layers run a dense MLP
    intermediate_size wide), its experts moe_intermediate_size wide, and renormalizes when norm_topk_prob."""
    layers = range(config.num_hidden_layers)
    if architecture == "MixtralForCausalLM":
        return _checked_moe(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True,
                            False, frozenset(layers))
    if architecture == GPT_OSS:
        return _checked_moe(config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, False,
                            True, frozenset(layers), router_bias=True, softmax_over_top_k=True,
                            clamped_swiglu=_clamped_swiglu(config))
    if architecture != "Qwen3MoeForCausalLM":
        return None
    step, dense = config.decoder_sparse_step, set(config.mlp_only_layers or ())
    if step < 1:
        raise UnsupportedModelError(f"decoder_sparse_step must be >= 1, got {step}")
    sparse = frozenset(i for i in layers if config.num_experts > 0 and i not in dense and (i + 1) % step == 0)
    if not sparse:
        return None
    return _checked_moe(config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                        bool(config.norm_topk_prob), True, sparse)


def _checked_moe(*fields, **named_fields) -> SparseMoeArch:
    try:
        return SparseMoeArch(*fields, **named_fields)
    except ValueError as error:
        raise UnsupportedModelError(str(error)) from None


def _clamped_swiglu(config: PretrainedConfig) -> ClampedSwiglu:
    try:
        return ClampedSwiglu(alpha=float(config.swiglu_alpha), limit=float(config.swiglu_limit))
    except ValueError as error:
        raise UnsupportedModelError(str(error)) from None


def _rope_length_limit(config: PretrainedConfig) -> int | None:
    """original_max_position_embeddings of a `longrope` model whose max_position_embeddings is larger.

    transformers rotates every position of a forward pass with long_factor once the sequence is longer
    than original_max_position_embeddings (short_factor below), so the keys already cached would have
    to be rotated again; up to that length its frequencies are fixed and the engine matches it."""
    params = getattr(config, "rope_parameters", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    original = params.get("original_max_position_embeddings", config.max_position_embeddings)
    return original if original < config.max_position_embeddings else None


def build_rotary(config: PretrainedConfig, arch: LlamaFamilyArch,
                 layer_type: str | None = None) -> RotaryEmbedding:
    """inv_freq and attention scaling from transformers' own RoPE initializers; `layer_type` selects one entry
    of per-layer-type rope_parameters (Gemma 3's).

    `dynamic` NTK scaling is applied statically (as for max_position_embeddings).
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None:
        params = dict(params.get(layer_type) or {})
    rope_type = params.get("rope_type", "default")
    if params.get("partial_rotary_factor", 1.0) != 1.0 and arch.architecture != PHI3:
        raise UnsupportedModelError(f"partial_rotary_factor != 1 is not supported for {arch.architecture}")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = arch.rotary_dim or arch.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return RotaryEmbedding(1.0 / (base**exponents), 1.0)
    if rope_type not in ROPE_INIT_FUNCTIONS or (layer_type is not None and rope_type == "longrope"):
        # longrope's switch past original_max_position_embeddings is handled for one table only (_rope_length_limit)
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported")
    try:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), layer_type=layer_type)
    except (KeyError, ValueError, TypeError) as error:
        # a parameter the initializer needs is missing or malformed (transformers' own message names it)
        raise UnsupportedModelError(f"rope_parameters {json_excerpt(params)}: transformers cannot build its RoPE "
                                    f"({type(error).__name__}: {error})") from None
    return RotaryEmbedding(inv_freq, float(scaling))


def build_rotaries(config: PretrainedConfig, arch: LlamaFamilyArch) -> tuple[RotaryEmbedding, RotaryEmbedding | None]:
    """The model's RoPE and, when some layers rotate by another (arch.local_rope_layers), theirs."""
    if arch.architecture != "Gemma3ForCausalLM":
        return build_rotary(config, arch), None
    local = build_rotary(config, arch, SLIDING_LAYER_TYPE) if arch.local_rope_layers else None
    return build_rotary(config, arch, FULL_LAYER_TYPE), local


def read_checkpoint(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, with the `model.` prefix removed."""
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        for name, tensor in _read_weight_file(path):
            tensors[name.removeprefix("model.")] = tensor
    return tensors


def _read_weight_file(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one safetensors file, or of a PyTorch .bin state dict: unpickled with
    weights_only (tensors and plain containers only, never code the file names), memory-mapped when it
    is the zip format torch.save has written since torch 1.6."""
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
        return
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except Exception as error:  # pickle and zip errors have no common base; every one means the same to the user
        raise UnsupportedModelError(f"{path}: not a loadable PyTorch state dict: {error}") from None
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise UnsupportedModelError(f"{path}: not a state dict of tensors")
    yield from state.items()


def fuse_checkpoint(checkpoint: dict[str, torch.Tensor], arch: LlamaFamilyArch) -> dict[str, torch.Tensor]:
    """Map HF parameter names onto the fused module's state dict (a projection's weight may be a
    QuantizedWeight: see engine/quantization/loader.py)."""
    outside = "outside the decoder layers"
    if arch.tie_word_embeddings and "embed_tokens.weight" not in checkpoint and isinstance(
            checkpoint.get("lm_head.weight"), torch.Tensor):
        # transformers ties either tensor of a tied config to the other: the shared matrix stored as lm_head alone
        checkpoint["embed_tokens.weight"] = checkpoint.pop("lm_head.weight")
    state = {"embed_tokens.weight": _take(checkpoint, "embed_tokens.weight", outside, arch, (arch.vocab_size,
                                                                                              arch.hidden_size)),
             "norm.weight": _take(checkpoint, "norm.weight", outside, arch, (arch.hidden_size,))}
    state["lm_head.weight"] = _lm_head(checkpoint, state["embed_tokens.weight"], arch)
    for i in range(arch.num_layers):
        state.update(_fuse_layer(checkpoint, i, arch))
    return state


def _lm_head(checkpoint: dict[str, torch.Tensor], embedding: torch.Tensor, arch: LlamaFamilyArch) -> torch.Tensor:
    """The output projection as transformers loads it: the checkpoint's lm_head.weight whenever it has one
    (transformers unties a tied config's two tensors when the checkpoint stores both with different values),
    else the embedding when tie_word_embeddings says so; otherwise the checkpoint cannot run (transformers
    would give the model a random output projection)."""
    tied = arch.tie_word_embeddings
    if tied and "lm_head.weight" not in checkpoint:
        return embedding
    lm_head = _take(checkpoint, "lm_head.weight", "the output projection; config.json does not set tie_word_embeddings; "
                    "a checkpoint saved without its LM head, as embedding models are, runs with runner 'pooling' "
                    "(--runner pooling) only", arch, (arch.vocab_size, arch.hidden_size))
    # A tied checkpoint that stores both equal tensors keeps one (on CUDA nothing else copies it); a tied
    # quantized one (a QuantizedWeight: lm_head is never run quantized) ties as before.
    if tied and (not isinstance(lm_head, torch.Tensor) or torch.equal(lm_head, embedding)):
        return embedding
    return lm_head


def _take(checkpoint: dict[str, torch.Tensor], name: str, where: str, arch: LlamaFamilyArch,
          shape: tuple[int, ...]) -> torch.Tensor:
    """Pop the tensor `name` (its checkpoint name without the `model.` prefix); a checkpoint without
    it, or with it in another shape than config.json implies, is one this model cannot run (`where`
    says which part of the model needs it). A QuantizedWeight (engine/quantization) is not checked here."""
    tensor = checkpoint.pop(name, None)
    if tensor is None:
        raise UnsupportedModelError(f"the checkpoint has no tensor {name} ({where})")
    if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) != shape:
        raise UnsupportedModelError(f"the checkpoint's {name} has shape {list(tensor.shape)}, config.json implies "
                                    f"{list(shape)} ({_shape_fields(arch)})")
    return tensor


def _shape_fields(arch: LlamaFamilyArch) -> str:
    fields = (f"vocab_size {arch.vocab_size}, hidden_size {arch.hidden_size}, num_attention_heads {arch.num_heads}, "
              f"num_key_value_heads {arch.num_kv_heads}, head_dim {arch.head_dim}, "
              f"intermediate_size {arch.intermediate_size}")
    if arch.moe is not None:
        fields += f", num_experts {arch.moe.num_experts}, expert width {arch.moe.expert_intermediate_size}"
    return fields


def _layer_shapes(arch: LlamaFamilyArch) -> dict[str, tuple[int, ...]]:
    """Each decoder-layer tensor's shape as config.json implies it, by its name inside the layer."""
    hidden, inner, q_size, kv_size = arch.hidden_size, arch.intermediate_size, arch.q_size, arch.kv_size
    q_norm_size, k_norm_size = (q_size, kv_size) if arch.qk_norm_over_projection else (arch.head_dim, arch.head_dim)
    return {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (q_size, hidden), "self_attn.k_proj.weight": (kv_size, hidden),
            "self_attn.v_proj.weight": (kv_size, hidden), "self_attn.o_proj.weight": (hidden, q_size),
            "self_attn.q_proj.bias": (q_size,), "self_attn.k_proj.bias": (kv_size,),
            "self_attn.v_proj.bias": (kv_size,), "self_attn.o_proj.bias": (hidden,),
            "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
            "mlp.down_proj.weight": (hidden, inner), "mlp.gate_proj.bias": (inner,), "mlp.up_proj.bias": (inner,),
            "self_attn.qkv_proj.weight": (q_size + 2 * kv_size, hidden), "mlp.gate_up_proj.weight": (2 * inner, hidden),
            "mlp.down_proj.bias": (hidden,), "self_attn.q_norm.weight": (q_norm_size,),
            "self_attn.k_norm.weight": (k_norm_size,), "self_attn.sinks": (arch.num_heads,),
            "pre_feedforward_layernorm.weight": (hidden,),
            "post_feedforward_layernorm.weight": (hidden,)}


def _fuse_layer(checkpoint: dict[str, torch.Tensor], index: int, arch: LlamaFamilyArch) -> dict[str, torch.Tensor]:
    prefix = f"layers.{index}."
    shapes = _layer_shapes(arch)

    def take(name: str) -> torch.Tensor:
        return _take(checkpoint, prefix + name, f"decoder layer {index} of {arch.num_layers}", arch, shapes[name])

    def take_fused(fused: str, parts: tuple[str, ...]) -> torch.Tensor:
        """transformers' Phi3 stores the fused projection itself, with our row order (q, k, v heads; gate, then
        up); the other architectures store its parts."""
        return take(fused) if arch.architecture == PHI3 else concat_rows([take(part) for part in parts])

    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    # OLMo 2's post-norm layers have no input_layernorm
    norms = ("post_attention_layernorm.weight",) if arch.post_norms else ("input_layernorm.weight",
                                                                          "post_attention_layernorm.weight")
    state = {prefix + name: take(name) for name in norms}
    state.update({
        attn + "qkv_proj.weight": take_fused("self_attn.qkv_proj.weight",
                                             tuple(f"self_attn.{p}_proj.weight" for p in "qkv")),
        attn + "o_proj.weight": take("self_attn.o_proj.weight"),
    })
    if arch.is_sparse_layer(index) and arch.moe.clamped_swiglu is not None:
        state.update(fuse_gpt_oss_experts(checkpoint, index, arch))
    elif arch.is_sparse_layer(index):
        state.update(_fuse_experts(checkpoint, index, arch))
    else:
        state[mlp + "gate_up_proj.weight"] = take_fused("mlp.gate_up_proj.weight",
                                                        ("mlp.gate_proj.weight", "mlp.up_proj.weight"))
        state[mlp + "down_proj.weight"] = take("mlp.down_proj.weight")
    if arch.qkv_bias:
        state[attn + "qkv_proj.bias"] = torch.cat([take(f"self_attn.{p}_proj.bias") for p in "qkv"])
    if arch.o_bias:
        state[attn + "o_proj.bias"] = take("self_attn.o_proj.bias")
    if arch.mlp_bias:
        state[mlp + "gate_up_proj.bias"] = torch.cat([take("mlp.gate_proj.bias"), take("mlp.up_proj.bias")])
        state[mlp + "down_proj.bias"] = take("mlp.down_proj.bias")
    if arch.qk_norm:
        state[attn + "q_norm.weight"] = take("self_attn.q_norm.weight")
        state[attn + "k_norm.weight"] = take("self_attn.k_norm.weight")
    if arch.attention_sinks:
        state[attn + "sinks"] = take("self_attn.sinks")
    if arch.sandwich_norms:
        for name in ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"):
            state[prefix + name] = take(name)
    if arch.post_norms:
        state[prefix + "post_feedforward_layernorm.weight"] = take("post_feedforward_layernorm.weight")
    return state


EXPERT_CHECKPOINT_NAMES = {
    "Qwen3MoeForCausalLM": (("mlp",), ("gate_proj", "up_proj", "down_proj")),
    "MixtralForCausalLM": (("block_sparse_moe", "mlp"), ("w1", "w3", "w2")),
}
"""architecture -> (the sparse block's module names in a checkpoint, Hub's first; an expert's gate, up and down
projections in Hub checkpoints)."""


def _fuse_experts(checkpoint: dict[str, torch.Tensor], index: int, arch: LlamaFamilyArch) -> dict[str, torch.Tensor]:
    """A sparse layer's router and experts (each expert's gate and up fused), from either form a checkpoint holds
    them in: one tensor per expert and projection, as Hub checkpoints and transformers' save_pretrained store them
    (Qwen3-MoE `mlp.experts.{e}.gate_proj.weight`, Mixtral `block_sparse_moe.experts.{e}.w1.weight`), or the stacks
    transformers 5 holds in memory (`mlp.experts.gate_up_proj` [E, 2 I, hidden], gate rows first, and
    `mlp.experts.down_proj` [E, hidden, I])."""
    moe, hidden = arch.moe, arch.hidden_size
    experts, inner = moe.num_experts, moe.expert_intermediate_size
    blocks, (gate, up, down) = EXPERT_CHECKPOINT_NAMES[arch.architecture]
    prefix = f"layers.{index}."
    block = next((name for name in blocks if f"{prefix}{name}.gate.weight" in checkpoint), blocks[0])

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return _take(checkpoint, f"{prefix}{block}.{name}", f"the experts of decoder layer {index} of "
                     f"{arch.num_layers}", arch, shape)

    router = take("gate.weight", (experts, hidden))
    if f"{prefix}{block}.experts.gate_up_proj" in checkpoint:
        gate_ups = take("experts.gate_up_proj", (experts, 2 * inner, hidden)).unbind(0)
        downs = take("experts.down_proj", (experts, hidden, inner)).unbind(0)
    else:
        gate_ups = [torch.cat([take(f"experts.{e}.{gate}.weight", (inner, hidden)),
                               take(f"experts.{e}.{up}.weight", (inner, hidden))]) for e in range(experts)]
        downs = [take(f"experts.{e}.{down}.weight", (hidden, inner)) for e in range(experts)]
    out = prefix + "mlp."
    state = {out + "gate.weight": router}
    for e, (gate_up, down_weight) in enumerate(zip(gate_ups, downs)):
        state[f"{out}experts.{e}.gate_up_proj.weight"] = gate_up
        state[f"{out}experts.{e}.down_proj.weight"] = down_weight
    return state


def fuse_gpt_oss_experts(checkpoint: dict[str, torch.Tensor], index: int,
                          arch: LlamaFamilyArch) -> dict[str, torch.Tensor]:
    """GPT-OSS's router (`mlp.router`, weight and bias) and experts as transformers stores them: stacks of
    `mlp.experts.gate_up_proj` [E, hidden, 2 I] (multiplied from the right: x @ W), whose columns alternate gate
    and up (column 2 i is gate unit i, 2 i + 1 up unit i), with `gate_up_proj_bias` [E, 2 I] alike, and
    `mlp.experts.down_proj` [E, I, hidden] with `down_proj_bias` [E, hidden]. Each expert's becomes a
    [gate | up] Linear [2 I, hidden] and a down Linear [hidden, I]. The released checkpoints' MXFP4 blocks
    (`gate_up_proj_blocks` / `_scales`) are refused before this (their quantization_config)."""
    moe, hidden = arch.moe, arch.hidden_size
    experts, inner = moe.num_experts, moe.expert_intermediate_size
    prefix = f"layers.{index}.mlp."

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return _take(checkpoint, prefix + name, f"the experts of decoder layer {index} of {arch.num_layers}", arch,
                     shape)

    state = {prefix + "gate.weight": take("router.weight", (experts, hidden)),
             prefix + "gate.bias": take("router.bias", (experts,))}
    gate_up = take("experts.gate_up_proj", (experts, hidden, 2 * inner))
    gate_up_bias = take("experts.gate_up_proj_bias", (experts, 2 * inner))
    down = take("experts.down_proj", (experts, inner, hidden))
    down_bias = take("experts.down_proj_bias", (experts, hidden))
    for e in range(experts):
        out = f"{prefix}experts.{e}."
        state[out + "gate_up_proj.weight"] = torch.cat((gate_up[e, :, 0::2], gate_up[e, :, 1::2]),
                                                     dim=1).t().contiguous()
        state[out + "gate_up_proj.bias"] = torch.cat((gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]))
        state[out + "down_proj.weight"] = down[e].t().contiguous()
        state[out + "down_proj.bias"] = down_bias[e]
    return state


def check_attention_sinks(arch: LlamaFamilyArch, device: torch.device, backend: AttentionBackend) -> None:
    """UnsupportedModelError for a model with attention sinks (GPT-OSS) where they would not be attended: off the
    CPU (FlashInfer's sink support is unverified here: docs/gpu.md), or on a backend that ignores them."""
    if not arch.attention_sinks:
        return
    if device.type != "cpu":
        raise UnsupportedModelError(f"{arch.architecture} (attention sinks) runs on device cpu only: the CUDA "
                                    f"attention path (FlashInfer) has not been verified with sinks (docs/gpu.md); "
                                    f"got device {device.type!r}")
    if not backend.supports_attention_sinks:
        raise UnsupportedModelError(f"{arch.architecture} has attention sinks, which attention backend "
                                    f"{type(backend).__name__} does not attend with; use attention_backend cpu or "
                                    f"torch")


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device, backend: AttentionBackend,
               show_progress: bool = False, ops: LayerOps | None = None,
               quantization: QuantizationSpec = NONE, fuse_mlp_activation: bool = True,
               needs_lm_head: bool = True) -> LlamaFamilyForCausalLM:
    """The model in `dtype` on `device`; `ops` defaults to the torch reference ops; `quantization`
    (common/quantization_spec.py) says how the decoder's projections are stored and run; without
    `fuse_mlp_activation` an MLP's gate/up product is never fused with its activation (LoRA adapts it). Without
    `needs_lm_head` (a pooling engine, which reads the final hidden states) a checkpoint may lack lm_head.weight; a
    sequence-classification checkpoint's score head becomes `model.classifier` (float32, vLLM's head dtype)."""
    config = load_hf_config(model_dir)
    arch = parse_arch(config)
    if arch.moe is not None and quantization.quantized:
        raise UnsupportedModelError(f"quantization {quantization.method!r} is not supported for mixture-of-experts "
                                    f"models ({arch.architecture}): their experts and router run float weights only; "
                                    f"set quantization to none")
    check_attention_sinks(arch, device, backend)
    rotary, local_rotary = build_rotaries(config, arch)
    rotary = rotary.to(device)
    local_rotary = None if local_rotary is None else local_rotary.to(device)
    with torch.device("meta"):
        model = LlamaFamilyForCausalLM(arch, rotary, backend, ops or TorchLayerOps(), local_rotary)
    checkpoint = read_checkpoint(model_dir)
    classifier = _classifier_head(checkpoint, config, model_dir, arch, needs_lm_head)
    if not needs_lm_head and "lm_head.weight" not in checkpoint:
        # An embedding model saved as its base model (BASE_MODEL_ARCHITECTURES): the embedding table stands in for
        # the head a pooling engine never reads (its steps ask for no logit rows).
        checkpoint["lm_head.weight"] = checkpoint["embed_tokens.weight"]
    if quantization.method in PACKED_METHODS:
        unpack_checkpoint(checkpoint, quantization)
    state = fuse_checkpoint(checkpoint, arch)
    if quantization.quantized:
        install_quantized_linears(model, state, quantization, dtype, device)
    tensors = tqdm(state.items(), desc=f"loading {model_dir.name}", disable=not show_progress, unit="tensor")
    state = {name: tensor.to(device=device, dtype=dtype) for name, tensor in tensors}
    model.load_state_dict(state, strict=True, assign=True)
    if can_pack(dtype, device):
        pack_linears(model, dtype, cpu_kernel_isa() if isinstance(ops, CpuKernelLayerOps) else None,
                     fuse_mlp_activation)
    else:
        _use_column_major_weights(model)
    model.rotary = rotary
    model.local_rotary = local_rotary
    model.classifier = None if classifier is None else classifier.to(device=device, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def _classifier_head(checkpoint: dict[str, torch.Tensor], config: PretrainedConfig, model_dir: Path,
                     arch: LlamaFamilyArch, needs_lm_head: bool) -> torch.Tensor | None:
    """A sequence-classification checkpoint's `score.weight` [num_labels, hidden], taken out of the checkpoint (the
    decoder has no such module); None for any other. Such a checkpoint has no LM head: only a pooling engine runs it."""
    classifiers = [name for name in config.architectures if name in SEQUENCE_CLASSIFICATION_ARCHITECTURES]
    if not classifiers:
        return None
    if needs_lm_head:
        raise UnsupportedModelError(f"{model_dir}: a {classifiers[0]} (a sequence-classification head, no LM head) "
                                    "runs with runner 'pooling' (--runner pooling) only")
    return _take(checkpoint, "score.weight", "the sequence-classification head", arch,
                 (int(config.num_labels), arch.hidden_size))


def _use_column_major_weights(model: torch.nn.Module) -> None:
    """Store every Linear weight [out, in] column-major, i.e. as a contiguous [in, out] matrix.

    `F.linear` then multiplies by a contiguous transpose, which on CPU is 1.5-3x faster for the
    small batches of decode (measured on the bench model); large batches are unaffected. The
    tied lm_head gets its own copy so the embedding table keeps its row-major layout.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.detach().t().contiguous().t(), requires_grad=False)
