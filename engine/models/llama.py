"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, Gemma, Gemma 2, Gemma 3, SmolLM3, OLMo 2, and the
mixtures of experts Qwen3-MoE, Mixtral and GPT-OSS) over a flattened, paged batch.

Differences between the architectures are data in `LlamaFamilyArch` (biases, per-head
q/k RMSNorm, sliding windows, tied embeddings, partial rotary, Granite's multipliers; Gemma's
(1 + weight) norms, scaled embeddings, GeLU-tanh MLP, Gemma 2 and 3's sandwich norms and attention
scale, Gemma 2's logit softcapping, Gemma 3's local RoPE, SmolLM3's layers without RoPE, OLMo 2's post-norm
layers and q/k norms over whole projections, GPT-OSS's attention sinks and float32 norms; sparse expert layers:
engine/models/moe.py); the numerics follow Hugging Face transformers op for op so greedy outputs agree token for
token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.models.layer_ops import GatedActivation, LayerOps
from splitserve.engine.models.moe import ClampedSwigluExpert, SparseMoeArch, SparseMoeBlock


@dataclass(frozen=True)
class LlamaFamilyArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    """Qwen3, Qwen3-MoE and Gemma 3: RMSNorm over head_dim on each query and key head before RoPE (OLMo 2: over the
    whole projections, qk_norm_over_projection)."""
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: attention window in tokens, or None for full attention."""
    unit_offset_norms: bool = False
    """Gemma: every RMSNorm scales by (1 + weight), in float32 before rounding to the model's dtype."""
    scale_embeddings_by_sqrt_hidden: bool = False
    """Gemma: the token embeddings are multiplied by sqrt(hidden_size) rounded to the model's dtype."""
    gelu_tanh_mlp: bool = False
    """Gemma: the MLP gates with gelu(approximate="tanh") instead of SiLU."""
    sandwich_norms: bool = False
    """Gemma 2 and 3: the attention and MLP outputs are normed (post_attention_layernorm, post_feedforward_layernorm)
    before their residual adds, and the MLP's input by pre_feedforward_layernorm."""
    local_rope_layers: frozenset[int] = frozenset()
    """Gemma 3: the layers (its sliding_attention ones) rotated by the model's local_rotary instead of its rotary."""
    attention_softcap: float | None = None
    """Gemma 2's attn_logit_softcapping: each scaled attention score s becomes softcap * tanh(s / softcap)."""
    final_logit_softcap: float | None = None
    """Gemma 2 and 3's final_logit_softcapping: each logit x becomes softcap * tanh(x / softcap)."""
    rope_length_limit: int | None = None
    """Longest sequence the RoPE tables hold for, when below max_position_embeddings (rope_type longrope:
    original_max_position_embeddings, past which transformers switches every position to other frequencies)."""
    rotary_dim: int | None = None
    """Phi3 with partial_rotary_factor < 1: RoPE rotates the first rotary_dim dims of each query and key head
    and passes the rest through; None rotates all head_dim."""
    attention_scale: float | None = None
    """The softmax scale of q.k (Granite's attention_multiplier, Gemma 2 and 3's query_pre_attn_scalar ** -0.5);
    None is 1 / sqrt(head_dim)."""
    embedding_multiplier: float = 1.0
    """Granite: the token embeddings are multiplied by this before the first layer."""
    residual_multiplier: float = 1.0
    """Granite: each attention and MLP output is multiplied by this before it is added to the residual stream."""
    logits_scaling: float = 1.0
    """Granite: the logits are divided by this."""
    moe: SparseMoeArch | None = None
    """Mixture-of-experts models: the experts, the router and which layers are sparse; None for dense models."""
    nope_layers: frozenset[int] = frozenset()
    """SmolLM3: the layers (its no_rope_layers zeros) whose queries and keys are not rotated at all."""
    post_norms: bool = False
    """OLMo 2: no input_layernorm; the attention and MLP outputs are normed (post_attention_layernorm,
    post_feedforward_layernorm) before their residual adds."""
    qk_norm_over_projection: bool = False
    """OLMo 2 (with qk_norm): q_norm and k_norm are RMSNorms over the whole query (q_size) and key (kv_size)
    projections rather than over each head."""
    attention_sinks: bool = False
    """GPT-OSS: each attention layer holds `sinks` [num_heads], a logit per query head that joins its softmax's
    denominator (AttentionBackend.forward)."""
    float32_norms: bool = False
    """GPT-OSS: every RMSNorm computes weight * normalize(x) in float32 and rounds once to the model's dtype
    (transformers keeps its norms' weights in float32)."""

    def is_sparse_layer(self, layer_index: int) -> bool:
        """Whether the layer's feed-forward is the experts' block (moe) rather than a dense MLP."""
        return self.moe is not None and layer_index in self.moe.sparse_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: LayerOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, size]
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x in place; returns the norm of the sum."""
        return self.ops.add_rms_norm(residual, x, self.weight, self.eps)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: normalize(x) * (1 + weight), in float32 (its checkpoints store weight - 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, size]
        return self.ops.rms_norm_unit_offset(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x in place; returns the norm of the sum."""
        return self(residual.add_(x))


class Float32RMSNorm(RMSNorm):
    """GPT-OSS's RMSNorm: weight * normalize(x) in float32, rounded once to x's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, size]
        return self.ops.rms_norm_float32(x, self.weight, self.eps)

    def add_and_norm(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual += x in place; returns the norm of the sum."""
        return self(residual.add_(x))


def make_rms_norm(arch: LlamaFamilyArch, size: int, ops: LayerOps) -> RMSNorm:
    if arch.unit_offset_norms:
        return UnitOffsetRMSNorm(size, arch.rms_norm_eps, ops)
    return (Float32RMSNorm if arch.float32_norms else RMSNorm)(size, arch.rms_norm_eps, ops)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the non-interleaved (rotate_half) RoPE convention."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        super().__init__()
        # [rotary_dim / 2]: rotary_dim is head_dim, or less for a partial rotary (the ops rotate only that many dims)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos, sin  # [T, rotary_dim] each


class Attention(nn.Module):
    def __init__(self, arch: LlamaFamilyArch, layer_index: int, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.arch = arch
        self.sliding_window = arch.sliding_windows[layer_index]
        self.rotates = layer_index not in arch.nope_layers
        self.backend = backend
        self.ops = ops
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            over_projection = arch.qk_norm_over_projection
            self.q_norm = make_rms_norm(arch, arch.q_size if over_projection else arch.head_dim, ops)
            self.k_norm = make_rms_norm(arch, arch.kv_size if over_projection else arch.head_dim, ops)
        self.sinks = nn.Parameter(torch.zeros(arch.num_heads)) if arch.attention_sinks else None

    def forward(self, hidden, rope, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        arch = self.arch
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        if arch.qk_norm_over_projection:
            q, k, v = qkv.split((arch.q_size, arch.kv_size, arch.kv_size), dim=-1)
            qk = torch.cat((self.q_norm(q.contiguous()), self.k_norm(k.contiguous())), dim=-1)
        else:
            qk, v = qkv.split((arch.q_size + arch.kv_size, arch.kv_size), dim=-1)
        qk = qk.reshape(-1, arch.num_heads + arch.num_kv_heads, arch.head_dim)  # query heads, then key heads
        v = v.view(-1, arch.num_kv_heads, arch.head_dim)
        if arch.qk_norm and not arch.qk_norm_over_projection:
            q, k = qk.split((arch.num_heads, arch.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q.reshape(-1, arch.head_dim)).view(q.shape),
                            self.k_norm(k.reshape(-1, arch.head_dim)).view(k.shape)), dim=1)
        if self.rotates:  # One rotation for queries and keys together: same positions, half the ops.
            qk = self.ops.rotary(qk, *rope)
        q, k = qk.split((arch.num_heads, arch.num_kv_heads), dim=1)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.sliding_window,
                                   arch.attention_scale, arch.attention_softcap, self.sinks)  # [T, H, D]
        return self.o_proj(out.reshape(-1, arch.q_size))


class MLP(nn.Module):
    """The Llama family's MLP: silu(gate) * up."""

    activation = GatedActivation.SILU

    def __init__(self, arch: LlamaFamilyArch, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)
        self.gate_up_applies_activation = False
        """True once gate_up_proj returns act(gate) * up itself (fuse_activation_and_mul)."""

    def fuse_activation_and_mul(self, projection: nn.Module) -> None:
        """Replace gate_up_proj by `projection`, which maps x [T, hidden] to act(gate) * up [T, I] in one pass."""
        self.gate_up_proj = projection
        self.gate_up_applies_activation = True

    def activation_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        return self.ops.silu_and_mul(gate_up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.gate_up_proj(x)  # [T, I] when fused, else [T, 2I]
        if not self.gate_up_applies_activation:
            gated = self.activation_and_mul(gated)  # -> [T, I]
        return self.down_proj(gated)  # [T, hidden]


class GeluTanhMLP(MLP):
    """Gemma's MLP: gelu(gate, approximate="tanh") * up."""

    activation = GatedActivation.GELU_TANH

    def activation_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        return self.ops.gelu_tanh_and_mul(gate_up)


def build_feed_forward(arch: LlamaFamilyArch, layer_index: int, ops: LayerOps) -> nn.Module:
    """The layer's feed-forward: in a sparse layer the experts (SiLU MLPs of their own width, without biases;
    GPT-OSS's clamped-SwiGLU ones with biases) and their router, else the dense MLP (GeLU-tanh for Gemma, SiLU for
    the others)."""
    if not arch.is_sparse_layer(layer_index):
        return GeluTanhMLP(arch, ops) if arch.gelu_tanh_mlp else MLP(arch, ops)
    moe = arch.moe
    if moe.clamped_swiglu is not None:
        return SparseMoeBlock(moe, arch.hidden_size, lambda: ClampedSwigluExpert(
            arch.hidden_size, moe.expert_intermediate_size, moe.clamped_swiglu))
    expert_arch = replace(arch, intermediate_size=moe.expert_intermediate_size, mlp_bias=False)
    return SparseMoeBlock(moe, arch.hidden_size, lambda: MLP(expert_arch, ops))


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaFamilyArch, layer_index: int, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.input_layernorm = make_rms_norm(arch, arch.hidden_size, ops)
        self.self_attn = Attention(arch, layer_index, backend, ops)
        self.post_attention_layernorm = make_rms_norm(arch, arch.hidden_size, ops)
        self.mlp = build_feed_forward(arch, layer_index, ops)
        self.residual_multiplier = arch.residual_multiplier

    def forward(self, hidden, rope, kv_cache, metadata):
        """hidden [T, hidden_size] is updated in place (the residual stream) and returned."""
        attended = self._scaled(self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata))
        normed = self.post_attention_layernorm.add_and_norm(hidden, attended)
        return hidden.add_(self._scaled(self.mlp(normed)))

    def _scaled(self, sublayer_output: torch.Tensor) -> torch.Tensor:
        """Granite's residual_multiplier, a rounding of its own before the add as in transformers (an add with
        alpha would fuse the two). In place: the output is the sublayer's own fresh tensor."""
        if self.residual_multiplier == 1.0:
            return sublayer_output
        return sublayer_output.mul_(self.residual_multiplier)


class SandwichDecoderLayer(nn.Module):
    """Gemma 2 and 3's layer: each sublayer's input and output are normed, the output before its residual add."""

    def __init__(self, arch: LlamaFamilyArch, layer_index: int, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.input_layernorm = make_rms_norm(arch, arch.hidden_size, ops)
        self.self_attn = Attention(arch, layer_index, backend, ops)
        self.post_attention_layernorm = make_rms_norm(arch, arch.hidden_size, ops)
        self.pre_feedforward_layernorm = make_rms_norm(arch, arch.hidden_size, ops)
        self.mlp = build_feed_forward(arch, layer_index, ops)
        self.post_feedforward_layernorm = make_rms_norm(arch, arch.hidden_size, ops)

    def forward(self, hidden, rope, kv_cache, metadata):
        """hidden [T, hidden_size] is updated in place (the residual stream) and returned."""
        attended = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata)
        hidden.add_(self.post_attention_layernorm(attended))
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden.add_(self.post_feedforward_layernorm(fed))


class PostNormDecoderLayer(nn.Module):
    """OLMo 2's layer: no input norm; each sublayer's output is normed before its residual add."""

    def __init__(self, arch: LlamaFamilyArch, layer_index: int, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.self_attn = Attention(arch, layer_index, backend, ops)
        self.post_attention_layernorm = make_rms_norm(arch, arch.hidden_size, ops)
        self.mlp = build_feed_forward(arch, layer_index, ops)
        self.post_feedforward_layernorm = make_rms_norm(arch, arch.hidden_size, ops)

    def forward(self, hidden, rope, kv_cache, metadata):
        """hidden [T, hidden_size] is updated in place (the residual stream) and returned."""
        hidden.add_(self.post_attention_layernorm(self.self_attn(hidden, rope, kv_cache, metadata)))
        return hidden.add_(self.post_feedforward_layernorm(self.mlp(hidden)))


def decoder_layer_class(arch: LlamaFamilyArch) -> type[nn.Module]:
    if arch.post_norms:
        return PostNormDecoderLayer
    return SandwichDecoderLayer if arch.sandwich_norms else DecoderLayer


class LlamaFamilyForCausalLM(nn.Module):
    def __init__(self, arch: LlamaFamilyArch, rotary: RotaryEmbedding, backend: AttentionBackend,
                 ops: LayerOps, local_rotary: RotaryEmbedding | None = None) -> None:
        """local_rotary: the RoPE of arch.local_rope_layers (Gemma 3's sliding layers), when it has any."""
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        layer_class = decoder_layer_class(arch)
        self.layers = nn.ModuleList(layer_class(arch, i, backend, ops) for i in range(arch.num_layers))
        self.norm = make_rms_norm(arch, arch.hidden_size, ops)
        self.rotary = rotary
        self.local_rotary = local_rotary
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.classifier: torch.Tensor | None = None
        """A sequence-classification checkpoint's score head [num_labels, hidden] float32 (load_model sets it)."""
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                on_layer: Callable[[int], None] | None = None):
        """on_layer(l) runs once layer l has written its keys and values for every token of the step
        (host order: on CUDA the kernels may still be in flight)."""
        hidden = self._embed(input_ids)  # [T, hidden]
        rope = self.rotary(positions, hidden.dtype)
        local_rope = rope if self.local_rotary is None else self.local_rotary(positions, hidden.dtype)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden = layer(hidden, local_rope if index in self.arch.local_rope_layers else rope, kv_cache, metadata)
            if on_layer is not None:
                on_layer(index)
        return self.norm(hidden)  # [T, hidden]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings as the first layer reads them: scaled by Granite's embedding_multiplier or Gemma's
        sqrt(hidden_size), each one multiplication rounded to the model's dtype as in transformers."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden], a fresh tensor
        if self.arch.embedding_multiplier != 1.0:
            hidden.mul_(self.arch.embedding_multiplier)
        if self.arch.scale_embeddings_by_sqrt_hidden:
            # transformers multiplies by sqrt(hidden_size) as a tensor of the model's dtype (55.5 for 3072 in bf16,
            # not 55.43); a Python float of that exact value rounds the same and needs no device tensor (CUDA graphs).
            hidden.mul_(torch.tensor(self.arch.hidden_size ** 0.5).to(hidden.dtype).item())
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [N, vocab]
        if self.arch.logits_scaling != 1.0:
            logits = logits / self.arch.logits_scaling  # a division, as transformers' (not a reciprocal's product)
        cap = self.arch.final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap  # transformers' three ops, each rounded to the model's dtype
