"""Paged KV pool: one tensor per layer, sized from an explicit block count or a memory budget.

A quantized pool (kv_cache_dtype int8 / fp8_e4m3) stores codes and a scale per row: see engine/kv_quant.py."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from splitserve.common.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from splitserve.engine.kv_quant import KVQuantization


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """The model's compute dtype (what attention reads the KV as)."""
    quantization: KVQuantization | None = None
    """How the pool stores KV: None keeps `dtype`; otherwise codes and a scale per row."""

    def __post_init__(self) -> None:
        if self.quantization is not None and self.head_dim % 2:
            raise ValueError(f"a quantized KV cache needs an even head_dim (got {self.head_dim}): each row's "
                             f"bfloat16 scale must stay 2-byte aligned")

    @property
    def storage_dtype(self) -> torch.dtype:
        """Element type of the pool tensors."""
        return self.dtype if self.quantization is None else self.quantization.code_dtype

    @property
    def row_width(self) -> int:
        """Pool elements of one (token, KV head) row: head_dim, plus the scale's bytes when quantized."""
        return self.head_dim if self.quantization is None else self.quantization.row_width(self.head_dim)

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (2, self.block_size, self.num_kv_heads, self.row_width)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token's keys and values occupy across all layers (scales included)."""
        element_size = torch.empty((), dtype=self.storage_dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.row_width * element_size

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers (keys and values)."""
        return self.block_size * self.bytes_per_token


def free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class EngineMemory:
    """One engine's device memory before its KV pool exists (bytes), as gpu_memory_utilization reads it."""

    total: int
    """The device's memory."""
    free_at_start: int
    """Free before the engine loaded anything (other processes hold the rest)."""
    used_by_engine: int
    """What the engine holds without its pool: the weights and the peak of its profiling step."""


class KVCacheSizingError(ValueError):
    """gpu_memory_utilization leaves the KV pool no room, or asks for more than the device had free."""


def _gib(num_bytes: int | float) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"


def blocks_for_utilization(utilization: float, memory: EngineMemory, bytes_per_block: int) -> int:
    """Pool size in blocks under vLLM's gpu_memory_utilization: the engine holds at most utilization x total
    bytes, of which memory.used_by_engine are taken; the rest, in whole blocks, is the pool."""
    allowed = int(utilization * memory.total)
    share = f"{_gib(allowed)} ({utilization} x {_gib(memory.total)})"
    if allowed > memory.free_at_start:
        highest = int(memory.free_at_start / memory.total * 100) / 100
        raise KVCacheSizingError(f"gpu_memory_utilization {utilization} asks for {share}, but only "
                                 f"{_gib(memory.free_at_start)} were free when the engine started (other processes "
                                 f"hold the rest); lower it to at most {highest}")
    num_blocks = (allowed - memory.used_by_engine) // bytes_per_block
    if num_blocks < 1:
        raise KVCacheSizingError(f"gpu_memory_utilization {utilization} leaves no room for the KV cache: the "
                                 f"engine uses {_gib(memory.used_by_engine)} (weights and a profiling step) of the "
                                 f"{share} it may use, and one block takes {bytes_per_block} bytes; raise "
                                 "gpu_memory_utilization or set kv_cache_memory_bytes")
    return num_blocks


def sizes_by_utilization(config: EngineConfig, device: torch.device) -> bool:
    """Whether gpu_memory_utilization decides the pool's size: set, on CUDA, and no explicit size given."""
    explicit = (config.num_kv_blocks, config.kv_cache_memory_bytes, config.kv_cache_memory_fraction)
    return config.gpu_memory_utilization is not None and device.type == "cuda" and explicit == (None, None, None)


def num_blocks_for(config: EngineConfig, spec: KVCacheSpec, device: torch.device,
                   memory: EngineMemory | None = None) -> int:
    """Pool size in blocks from whichever sizing field the config sets (default: 1 GiB). `memory`: the engine's
    measured memory, needed exactly when sizes_by_utilization(config, device)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if sizes_by_utilization(config, device):
        if memory is None:
            raise ValueError("gpu_memory_utilization sizes this pool: pass the engine's measured memory")
        return blocks_for_utilization(config.gpu_memory_utilization, memory, spec.bytes_per_block)
    if config.kv_cache_memory_fraction is not None:
        budget = int(free_device_memory(device) * config.kv_cache_memory_fraction)
    else:
        budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
    num_blocks = budget // spec.bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes is smaller than one block "
                         f"({spec.bytes_per_block} bytes)")
    return num_blocks


class KVCache:
    """Owns the pool tensors; the block manager owns which blocks are in use."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device,
                 reserve_dummy_block: bool = False) -> None:
        """reserve_dummy_block: one more block, `dummy_block` = num_blocks, outside the block manager's
        range, where the padding rows of captured decode steps write and read (engine/decode_buckets.py)."""
        self.spec = spec
        self.num_blocks = num_blocks
        self.dummy_block = num_blocks if reserve_dummy_block else None
        rows = num_blocks + (1 if reserve_dummy_block else 0)
        # Zero-filled so padded (masked) gathers never read uninitialized NaN/Inf bit patterns.
        self.layers = [torch.zeros((rows, *spec.block_shape), dtype=spec.storage_dtype, device=device)
                       for _ in range(spec.num_layers)]  # each [rows, 2, block_size, kv_heads, row_width]

    def block(self, layer: int, block_id: int) -> torch.Tensor:
        return self.layers[layer][block_id]  # [2, block_size, kv_heads, row_width]
