"""The Llama family (Llama, Mistral, Qwen2, Qwen3, and the mixtures of experts Qwen3-MoE and Mixtral) over a
flattened, paged batch.

Differences between the architectures are data in `LlamaFamilyArch` (biases, per-head
q/k RMSNorm, sliding windows, tied embeddings, sparse expert layers: engine/models/moe.py); the
numerics follow Hugging Face transformers op for op so greedy outputs agree token for token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from splitserve.engine.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.models.layer_ops import LayerOps
from splitserve.engine.models.moe import SparseMoeArch, SparseMoeBlock


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
    """Qwen3: RMSNorm over head_dim on each query and key head before RoPE."""
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    """Per layer: attention window in tokens, or None for full attention."""
    rope_length_limit: int | None = None
    """Longest sequence the RoPE tables hold for, when below max_position_embeddings (rope_type longrope:
    original_max_position_embeddings, past which transformers switches every position to other frequencies)."""
    moe: SparseMoeArch | None = None
    """Mixture-of-experts models: the experts, the router and which layers are sparse; None for dense models."""

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


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the non-interleaved (rotate_half) RoPE convention."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [head_dim / 2]
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos, sin  # [T, head_dim] each


class Attention(nn.Module):
    def __init__(self, arch: LlamaFamilyArch, sliding_window: int | None, backend: AttentionBackend,
                 ops: LayerOps) -> None:
        super().__init__()
        self.arch = arch
        self.sliding_window = sliding_window
        self.backend = backend
        self.ops = ops
        self.qkv_proj = nn.Linear(arch.hidden_size, arch.q_size + 2 * arch.kv_size, bias=arch.qkv_bias)
        self.o_proj = nn.Linear(arch.q_size, arch.hidden_size, bias=arch.o_bias)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, ops)

    def forward(self, hidden, rope, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        arch = self.arch
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        qk, v = qkv.split((arch.q_size + arch.kv_size, arch.kv_size), dim=-1)
        qk = qk.view(-1, arch.num_heads + arch.num_kv_heads, arch.head_dim)  # query heads, then key heads
        v = v.view(-1, arch.num_kv_heads, arch.head_dim)
        if arch.qk_norm:
            q, k = qk.split((arch.num_heads, arch.num_kv_heads), dim=1)
            qk = torch.cat((self.q_norm(q.reshape(-1, arch.head_dim)).view(q.shape),
                            self.k_norm(k.reshape(-1, arch.head_dim)).view(k.shape)), dim=1)
        # One rotation for queries and keys together: same positions, half the ops.
        q, k = self.ops.rotary(qk, *rope).split((arch.num_heads, arch.num_kv_heads), dim=1)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.sliding_window)  # [T, H, D]
        return self.o_proj(out.reshape(-1, arch.q_size))


class MLP(nn.Module):
    def __init__(self, arch: LlamaFamilyArch, ops: LayerOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)
        self.gate_up_applies_silu = False
        """True once gate_up_proj returns silu(gate) * up itself (fuse_silu_and_mul)."""

    def fuse_silu_and_mul(self, projection: nn.Module) -> None:
        """Replace gate_up_proj by `projection`, which maps x [T, hidden] to silu(gate) * up [T, I] in one pass."""
        self.gate_up_proj = projection
        self.gate_up_applies_silu = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.gate_up_proj(x)  # [T, I] when fused, else [T, 2I]
        if not self.gate_up_applies_silu:
            gated = self.ops.silu_and_mul(gated)  # -> [T, I]
        return self.down_proj(gated)  # [T, hidden]


def build_feed_forward(arch: LlamaFamilyArch, layer_index: int, ops: LayerOps) -> nn.Module:
    """The dense MLP, or in a sparse layer the experts (MLPs of their own width, without biases) and their router."""
    moe = arch.moe
    if moe is None or layer_index not in moe.sparse_layers:
        return MLP(arch, ops)
    expert_arch = replace(arch, intermediate_size=moe.expert_intermediate_size, mlp_bias=False)
    return SparseMoeBlock(moe, arch.hidden_size, lambda: MLP(expert_arch, ops))


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaFamilyArch, layer_index: int, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = Attention(arch, arch.sliding_windows[layer_index], backend, ops)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp = build_feed_forward(arch, layer_index, ops)

    def forward(self, hidden, rope, kv_cache, metadata):
        """hidden [T, hidden_size] is updated in place (the residual stream) and returned."""
        attended = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, metadata)
        normed = self.post_attention_layernorm.add_and_norm(hidden, attended)
        return hidden.add_(self.mlp(normed))


class LlamaFamilyForCausalLM(nn.Module):
    def __init__(self, arch: LlamaFamilyArch, rotary: RotaryEmbedding, backend: AttentionBackend,
                 ops: LayerOps) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, backend, ops) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.rotary = rotary
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                on_layer: Callable[[int], None] | None = None):
        """on_layer(l) runs once layer l has written its keys and values for every token of the step
        (host order: on CUDA the kernels may still be in flight)."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary(positions, hidden.dtype)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            hidden = layer(hidden, rope, kv_cache, metadata)
            if on_layer is not None:
                on_layer(index)
        return self.norm(hidden)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [N, vocab]
