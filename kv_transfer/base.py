"""The transfer backend interface: one instance per worker, owning that worker's agent.

A backend moves whole KV blocks (every layer, keys and values) from a remote worker's
pool into this worker's pool. The consumer *pulls* with two one-sided READs per request:
the data READ (all of its scattered blocks) and, once that completed, the check READ of the
remote blocks' generation words, whose completion notification (the request id) tells the
producer the pull is over.

Generations: besides its KV pool every agent registers one int64 word per block, its
generation. The producer bumps a block's generation before the block may be freed and reused
(ProducerConnector decides when), and never lowers it. The consumer's check READ copies the
remote words into a local scratch word per *local* block (a local block belongs to one pull at a
time, so pulls never share scratch words).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod

import torch

from splitserve.common.kv_transfer_types import (AgentMetadata, KVLayout, KVLayoutMismatchError, KVTransferError,
                                                 TransferParams)


class PullState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class PullHandle:
    """Backend-specific handle of one in-flight pull; opaque to callers except `error`."""

    error: str | None = None
    """Why the pull failed, set by the backend when poll_pull returns FAILED (None otherwise)."""


class TransferBackend(ABC):
    """Owns one agent; thread-compatible but not thread-safe (one engine thread drives it)."""

    agent_name: str

    @abstractmethod
    def register_kv_pool(self, layers: list[torch.Tensor], layout: KVLayout) -> None:
        """Register this worker's pool: layers[l] is [num_blocks, 2, block_size, kv_heads, head_dim];
        and its generation and scratch words (num_blocks each, generations starting at 0)."""

    @abstractmethod
    def metadata(self) -> AgentMetadata:
        """This worker's metadata for peers (after register_kv_pool)."""

    @abstractmethod
    def add_peer(self, peer: AgentMetadata) -> None:
        """Handshake: accept a producer's metadata; KVLayoutMismatchError names every difference."""

    @abstractmethod
    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer (it restarted or left); later pulls from it fail.

        Pulls from it still PENDING are abandoned: they poll FAILED and write no more bytes."""

    @abstractmethod
    def has_peer(self, agent_name: str) -> bool:
        """Whether add_peer accepted this agent and it was not removed since."""

    @abstractmethod
    def start_pull(self, params: TransferParams, local_block_ids: tuple[int, ...],
                   layers: range | None = None) -> PullHandle:
        """Start the data READ of params.block_ids (remote) into local_block_ids (same order, same
        count): of the layers in `layers` (consecutive, inside [0, num_layers)), or of every layer
        when None (a layer-wise pull posts one READ per announced layer range). It notifies nobody:
        the check READ does (start_check).

        KVTransferError when the pull cannot be set up (unknown or removed peer, a layout other
        than the handshake's, remote ids outside the producer's pool, a dead producer);
        ValueError for the caller's bugs (block counts, local ids outside the pool)."""

    @abstractmethod
    def start_check(self, params: TransferParams, local_block_ids: tuple[int, ...]) -> PullHandle:
        """Start the check READ: the generation words of params.block_ids (remote) into the scratch
        words of local_block_ids; its completion notifies the producer with the request id.

        Call it only after the data READ of the same pull polled DONE (the check proves something
        only about a READ that completed before it started). Raises as start_pull does."""

    @abstractmethod
    def checked_generations(self, local_block_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The scratch words of local_block_ids: what the last check READ into them read."""

    @abstractmethod
    def generations(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Producer side: the current generations of its own blocks."""

    @abstractmethod
    def bump_generations(self, block_ids: tuple[int, ...]) -> None:
        """Producer side: add one to the generation of each of its own blocks (distinct ids).

        Invariant: once this returns, a check READ that starts later reads the new values."""

    @abstractmethod
    def poll_pull(self, handle: PullHandle) -> PullState:
        """Non-blocking state of one READ (data or check); DONE means its bytes are in local memory
        (and, for a check READ, the producer's notification is sent unless a fault hook dropped it)."""

    @abstractmethod
    def release_pull(self, handle: PullHandle) -> None:
        """Free the handle's resources (after DONE/FAILED, or to abandon a PENDING READ).

        Invariant: once this returns, the READ writes no more bytes into local memory, so
        the caller may free and reuse the local blocks."""

    @abstractmethod
    def take_notifications(self) -> list[str]:
        """Producer side: request ids whose check READs completed since the last call.

        Call it regularly while leases are held: NIXL (without a progress thread) receives
        notifications only inside this call."""

    @abstractmethod
    def close(self) -> None:
        """Deregister memory and drop the agent."""


def check_kv_pool(layers: list[torch.Tensor], layout: KVLayout) -> int:
    """Validate a pool against its layout and return num_blocks (ValueError names the problem).

    Every layer must be one contiguous [num_blocks, 2, block_size, kv_heads, row_width] tensor of
    the layout's dtype, all on one device, so block b of layer l is one contiguous byte range.
    """
    if len(layers) != layout.num_layers:
        raise ValueError(f"KV pool has {len(layers)} layers, layout says {layout.num_layers}")
    num_blocks = layers[0].shape[0]
    expected = (num_blocks, 2, layout.block_size, layout.num_kv_heads, layout.row_width)
    for index, layer in enumerate(layers):
        if tuple(layer.shape) != expected:
            raise ValueError(f"KV layer {index} has shape {tuple(layer.shape)}, expected {expected}")
        if str(layer.dtype) != f"torch.{layout.dtype}":
            raise ValueError(f"KV layer {index} has dtype {layer.dtype}, layout says {layout.dtype}")
        if not layer.is_contiguous():
            raise ValueError(f"KV layer {index} is not contiguous")
        if layer.device != layers[0].device:
            raise ValueError(f"KV layer {index} is on {layer.device}, layer 0 on {layers[0].device}")
    kind = memory_kind(layers[0].device)
    if kind != layout.memory_kind:
        raise ValueError(f"KV pool is on {layers[0].device} ({kind}), layout says {layout.memory_kind}")
    return num_blocks


def memory_kind(device: torch.device) -> str:
    """NIXL's memory type of a pool on `device`: VRAM on CUDA, DRAM on the host."""
    return "VRAM" if device.type == "cuda" else "DRAM"


def check_layouts_match(ours: KVLayout, theirs: KVLayout, peer_name: str) -> None:
    """Handshake check: KVLayoutMismatchError listing every differing field (ours != theirs)."""
    differences = ours.mismatches(theirs)
    if differences:
        raise KVLayoutMismatchError(f"refusing to pull from {peer_name!r}: KV layouts differ "
                                    f"(ours != theirs): {'; '.join(differences)}")


def pull_layers(layers: range | None, num_layers: int) -> range:
    """The layers one data READ covers: `layers`, or all of them for None; ValueError unless it is a
    non-empty range of consecutive layers inside [0, num_layers) (the caller's bug)."""
    if layers is None:
        return range(num_layers)
    if layers.step != 1 or not 0 <= layers.start < layers.stop <= num_layers:
        raise ValueError(f"a READ covers a non-empty range of consecutive layers in [0, {num_layers}), got {layers}")
    return layers


def check_pull_blocks(params: TransferParams, local_block_ids: tuple[int, ...], num_local_blocks: int,
                      num_remote_blocks: int) -> None:
    """A pull's block ids: same non-zero count on both sides, each in [0, num_*_blocks).

    Local problems are the caller's bug (ValueError); a remote id out of range means the
    producer's pool is not what its handshake said (KVTransferError).
    """
    if not params.block_ids or len(local_block_ids) != len(params.block_ids):
        raise ValueError(f"{params.request_id}: {len(local_block_ids)} local blocks for "
                         f"{len(params.block_ids)} remote blocks (need the same non-zero count)")
    if not all(0 <= block < num_local_blocks for block in local_block_ids):
        raise ValueError(f"{params.request_id}: local block ids {local_block_ids} outside [0, {num_local_blocks})")
    if not all(0 <= block < num_remote_blocks for block in params.block_ids):
        raise KVTransferError(f"{params.request_id}: remote block ids {params.block_ids} outside the "
                              f"producer's pool [0, {num_remote_blocks})")


GENERATIONS, SCRATCH = 0, 1
"""Rows of an agent's generation words (see new_generation_words)."""


def new_generation_words(num_blocks: int) -> torch.Tensor:
    """[2, num_blocks] int64 zeros in host memory: row GENERATIONS[b] is this agent's generation of
    block b (peers READ it), row SCRATCH[b] receives the check READ of the pull writing local block b.

    Host memory even for a GPU pool: the producer bumps generations from its engine thread, and a
    host store needs no stream synchronisation to be visible to a later READ."""
    return torch.zeros(2, num_blocks, dtype=torch.int64)


def bump_generation_words(words: torch.Tensor, block_ids: tuple[int, ...]) -> None:
    """words[GENERATIONS, b] += 1 for each b in block_ids (distinct)."""
    index = torch.tensor(block_ids, dtype=torch.long)
    words[GENERATIONS].index_add_(0, index, torch.ones(len(block_ids), dtype=torch.int64))


def read_generation_words(words: torch.Tensor, row: int, block_ids: tuple[int, ...]) -> tuple[int, ...]:
    """words[row, b] for each b in block_ids, in order."""
    return tuple(words[row, list(block_ids)].tolist())
