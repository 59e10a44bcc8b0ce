"""Attention backends; `select_backend` picks one by name and device."""

from splitserve.engine.attention.base import AttentionBackend, AttentionMetadata, DecodeBatch, PrefillSpan
from splitserve.engine.attention.cpu import CpuPagedAttention
from splitserve.engine.attention.torch_ref import TorchReferenceAttention


def select_backend(name: str, device_type: str, cpu_kernels: bool = True) -> AttentionBackend:
    """`torch` is the reference (any device); `cpu` the CPU-tuned backend (its C++ decode kernel when
    `cpu_kernels`); `auto` picks `cpu` on CPU and the reference elsewhere."""
    if name == "cpu" or (name == "auto" and device_type == "cpu"):
        return CpuPagedAttention(use_kernels=cpu_kernels)
    if name in ("auto", "torch"):
        return TorchReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "CpuPagedAttention", "DecodeBatch", "PrefillSpan",
           "TorchReferenceAttention", "select_backend"]
