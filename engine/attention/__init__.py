"""Attention backends; `select_backend` picks one by name, device and dtype."""

import importlib.util

import torch

from splitserve.engine.attention.base import AttentionBackend, AttentionMetadata, DecodeBatch, PrefillSpan
from splitserve.engine.attention.cpu import CpuPagedAttention
from splitserve.engine.attention.torch_ref import TorchReferenceAttention
from splitserve.engine.cpu_kernels import KERNEL_DTYPES

FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
"""FlashInfer's kernels are built for 16-bit queries and KV only."""


def flashinfer_installed() -> bool:
    """Whether the optional `splitserve[gpu]` extra is there (without importing it)."""
    return importlib.util.find_spec("flashinfer") is not None


def select_backend(name: str, device_type: str, cpu_kernels: bool = True,
                   dtype: torch.dtype = torch.float32, quantized_kv: bool = False) -> AttentionBackend:
    """`torch` is the reference (any device); `cpu` the CPU-tuned backend (its C++ kernels when
    `cpu_kernels` and `dtype` is one they are built for, KERNEL_DTYPES); `flashinfer` FlashInfer's paged
    kernels (CUDA, float16/bfloat16, a plain KV pool);
    `auto` picks `cpu` on CPU, `flashinfer` on CUDA when it is installed, the dtype is 16-bit and the KV
    pool is not quantized (`quantized_kv`: kv_cache_dtype int8 / fp8_e4m3), else the reference."""
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        return CpuPagedAttention(use_kernels=cpu_kernels and dtype in KERNEL_DTYPES)
    if name == "flashinfer" or (name == "auto" and dtype in FLASHINFER_DTYPES and not quantized_kv
                                and flashinfer_installed()):
        return _flashinfer(device_type, dtype, quantized_kv)
    if name in ("auto", "torch"):
        return TorchReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}")


def _flashinfer(device_type: str, dtype: torch.dtype, quantized_kv: bool) -> AttentionBackend:
    if device_type != "cuda":
        raise ValueError(f"attention_backend 'flashinfer' needs device 'cuda', got {device_type!r}")
    if dtype not in FLASHINFER_DTYPES:
        raise ValueError(f"attention_backend 'flashinfer' needs dtype float16 or bfloat16, got {dtype}")
    if quantized_kv:
        # The pool's rows are codes plus a scale (engine/kv_quant.py), not the [.., head_dim] rows of the
        # model dtype that FlashInfer's paged kernels read.
        raise ValueError("attention_backend 'flashinfer' needs kv_cache_dtype auto (a quantized KV pool is read "
                         "by the torch backend)")
    if not flashinfer_installed():
        raise ValueError("attention_backend 'flashinfer' needs the flashinfer package: pip install 'splitserve[gpu]'")
    from splitserve.engine.attention.flashinfer import FlashInferAttention  # noqa: PLC0415 - imports flashinfer

    return FlashInferAttention()


__all__ = ["AttentionBackend", "AttentionMetadata", "CpuPagedAttention", "DecodeBatch", "PrefillSpan",
           "TorchReferenceAttention", "flashinfer_installed", "select_backend"]
