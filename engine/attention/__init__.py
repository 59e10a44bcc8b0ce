"""Attention backends; `select_backend` picks one by name and device."""

from splitserve.engine.attention.base import AttentionBackend, AttentionMetadata, DecodeBatch, PrefillSpan
from splitserve.engine.attention.torch_ref import TorchReferenceAttention


def select_backend(name: str) -> AttentionBackend:
    """`auto` and `torch` both give the reference backend, which runs on CPU and CUDA."""
    if name in ("auto", "torch"):
        return TorchReferenceAttention()
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "AttentionMetadata", "DecodeBatch", "PrefillSpan", "TorchReferenceAttention",
           "select_backend"]
