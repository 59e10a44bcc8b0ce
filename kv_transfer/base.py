"""The transfer backend interface: one instance per worker, owning that worker's agent.

A backend moves whole KV blocks (every layer, keys and values) from a remote worker's
pool into this worker's pool. The consumer *pulls* (one READ per request covering all of
its scattered blocks) and the producer learns of the completed pull through a
notification carrying the request id.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from splitserve.common.kv_transfer_types import KVLayout, TransferParams


class KVTransferError(RuntimeError):
    """A transfer could not be set up or did not complete."""


class KVLayoutMismatchError(KVTransferError):
    """The handshake found two workers whose KV layouts differ."""


@dataclass(frozen=True)
class AgentMetadata:
    """What a worker publishes so peers can read from it (exchanged once per worker pair)."""

    agent_name: str
    layout: KVLayout
    backend_metadata: bytes
    """Opaque to everything but the backend (NIXL agent metadata, or empty in-process)."""


class PullState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class PullHandle:
    """Backend-specific handle of one in-flight pull; opaque to callers."""


class TransferBackend(ABC):
    """Owns one agent; thread-compatible but not thread-safe (one engine thread drives it)."""

    agent_name: str

    @abstractmethod
    def register_kv_pool(self, layers: list[torch.Tensor], layout: KVLayout) -> None:
        """Register this worker's pool: layers[l] is [num_blocks, 2, block_size, kv_heads, head_dim]."""

    @abstractmethod
    def metadata(self) -> AgentMetadata:
        """This worker's metadata for peers (after register_kv_pool)."""

    @abstractmethod
    def add_peer(self, peer: AgentMetadata) -> None:
        """Handshake: accept a producer's metadata; KVLayoutMismatchError names every difference."""

    @abstractmethod
    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer (it restarted or left); later pulls from it fail."""

    @abstractmethod
    def start_pull(self, params: TransferParams, local_block_ids: tuple[int, ...]) -> PullHandle:
        """Start reading params.block_ids (remote) into local_block_ids (same order, same count)."""

    @abstractmethod
    def poll_pull(self, handle: PullHandle) -> PullState:
        """Non-blocking; DONE means the bytes are in the local pool and the producer was notified."""

    @abstractmethod
    def release_pull(self, handle: PullHandle) -> None:
        """Free the handle's resources (after DONE/FAILED, or to abandon a PENDING pull)."""

    @abstractmethod
    def take_notifications(self) -> list[str]:
        """Producer side: request ids whose pulls completed since the last call."""

    @abstractmethod
    def close(self) -> None:
        """Deregister memory and drop the agent."""
