"""In-process transfer backend: agents in one process share a registry and copy with torch.

Same interface and semantics as the NIXL backend (a data READ copies scattered remote blocks
into local ones; a check READ then copies the remote blocks' generation words into local scratch
words and notifies the producer), so workers and connectors are tested without NIXL.

READs complete inside start_pull / start_check unless the backend is built with
`defer_completion=True` (or `defer_completions()` is called); then they stay PENDING (nothing
copied yet) until `complete_pending_pulls()`, which lets tests exercise in-flight aborts, peer
removal, late completion and a producer reclaiming blocks between a pull's two READs. Fault hooks
make the next data READs fail, or the next check READs complete without notifying the producer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from splitserve.common.kv_transfer_types import AgentMetadata, KVLayout, TransferParams
from splitserve.kv_transfer.base import (GENERATIONS, SCRATCH, KVTransferError, PullHandle, PullState,
                                         TransferBackend, bump_generation_words, check_kv_pool, check_layouts_match,
                                         check_pull_blocks, new_generation_words, pull_layers, read_generation_words)


@dataclass
class _Endpoint:
    """One registered agent: its pool, its generation words and the request ids of pulls that read from it."""

    layers: list[torch.Tensor]
    """layers[l]: [num_blocks, 2, block_size, kv_heads, head_dim]."""
    layout: KVLayout
    words: torch.Tensor
    """[2, num_blocks] int64: generations and check scratch (base.new_generation_words)."""
    notifications: deque[str] = field(default_factory=deque)
    """Appended by consumers' threads, drained by the owner's: deque append/popleft are atomic."""

    @property
    def num_blocks(self) -> int:
        return self.layers[0].shape[0]


_REGISTRY: dict[str, _Endpoint] = {}
"""Every registered, not yet closed, in-process agent by name."""


class _InProcessPull(PullHandle):
    """One READ: of the blocks' data in `layers` (check=False) or of their generation words (check=True)."""

    def __init__(self, params: TransferParams, local_block_ids: tuple[int, ...], check: bool,
                 layers: range) -> None:
        self.params = params
        self.local_block_ids = local_block_ids
        self.check = check
        self.layers = layers
        self.state = PullState.PENDING

    def fail(self, error: str) -> None:
        self.state = PullState.FAILED
        self.error = error


class InProcessBackend(TransferBackend):
    """One agent, driven by one thread like every backend; agents on other threads may pull from
    it concurrently (the registry is shared by all agents of the process)."""

    def __init__(self, agent_name: str, *, defer_completion: bool = False) -> None:
        if agent_name in _REGISTRY:
            raise KVTransferError(f"agent {agent_name!r} already exists in this process")
        self.agent_name = agent_name
        self._defer = defer_completion
        self._peers: set[str] = set()
        self._pending: list[_InProcessPull] = []
        """READs started, not completed, not released (only with defer_completion), in start order."""
        self._fail_next = 0
        self._drop_next = 0

    # ---- fault hooks ---------------------------------------------------------------------
    def fail_next_pulls(self, count: int = 1) -> None:
        """The next `count` data READs to complete fail without copying (and their pulls notify nobody)."""
        self._fail_next += count

    def drop_next_notifications(self, count: int = 1) -> None:
        """The next `count` check READs to complete read the generations but never notify the producer."""
        self._drop_next += count

    def defer_completions(self, enabled: bool = True) -> None:
        """From the next start_pull / start_check on, READs stay PENDING until complete_pending_pulls()
        (False: they complete inside the start call again). Lets a test hold a pull in flight."""
        self._defer = enabled

    def complete_pending_pulls(self) -> int:
        """Complete every pending READ now, in start order (defer_completion only); returns how many.
        A check READ started by a connector's poll after this is pending again (while deferring)."""
        pending, self._pending = self._pending, []
        for pull in pending:
            self._complete(pull)
        return len(pending)

    # ---- TransferBackend -----------------------------------------------------------------
    def register_kv_pool(self, layers: list[torch.Tensor], layout: KVLayout) -> None:
        check_kv_pool(layers, layout)
        if self.agent_name in _REGISTRY:
            raise KVTransferError(f"agent {self.agent_name!r} already registered a KV pool")
        _REGISTRY[self.agent_name] = _Endpoint(list(layers), layout, new_generation_words(layers[0].shape[0]))

    def metadata(self) -> AgentMetadata:
        return AgentMetadata(self.agent_name, self._own().layout, b"")

    def add_peer(self, peer: AgentMetadata) -> None:
        check_layouts_match(self._own().layout, peer.layout, peer.agent_name)
        if peer.agent_name not in _REGISTRY:
            raise KVTransferError(f"peer {peer.agent_name!r} is not a live agent in this process")
        self._peers.add(peer.agent_name)

    def remove_peer(self, agent_name: str) -> None:
        self._peers.discard(agent_name)
        for pull in [pull for pull in self._pending if pull.params.producer_id == agent_name]:
            self._pending.remove(pull)
            pull.fail(f"peer {agent_name!r} was removed while the pull was in flight")

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    def start_pull(self, params: TransferParams, local_block_ids: tuple[int, ...],
                   layers: range | None = None) -> PullHandle:
        return self._start(params, local_block_ids, False, pull_layers(layers, params.layout.num_layers))

    def start_check(self, params: TransferParams, local_block_ids: tuple[int, ...]) -> PullHandle:
        return self._start(params, local_block_ids, True, range(0))

    def checked_generations(self, local_block_ids: tuple[int, ...]) -> tuple[int, ...]:
        return read_generation_words(self._own().words, SCRATCH, local_block_ids)

    def generations(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        return read_generation_words(self._own().words, GENERATIONS, block_ids)

    def bump_generations(self, block_ids: tuple[int, ...]) -> None:
        bump_generation_words(self._own().words, block_ids)

    def poll_pull(self, handle: PullHandle) -> PullState:
        assert isinstance(handle, _InProcessPull)
        return handle.state

    def release_pull(self, handle: PullHandle) -> None:
        """A pending READ is dropped before it copies anything (so nothing writes after this)."""
        if handle in self._pending:
            self._pending.remove(handle)

    def take_notifications(self) -> list[str]:
        queue = self._own().notifications
        return [queue.popleft() for _ in range(len(queue))]

    def close(self) -> None:
        _REGISTRY.pop(self.agent_name, None)
        self._peers.clear()
        self._pending.clear()

    # ---- internals -----------------------------------------------------------------------
    def _own(self) -> _Endpoint:
        own = _REGISTRY.get(self.agent_name)
        if own is None:
            raise KVTransferError(f"agent {self.agent_name!r} has no registered KV pool (or was closed)")
        return own

    def _remote(self, params: TransferParams) -> _Endpoint:
        if params.producer_id not in self._peers:
            raise KVTransferError(f"unknown peer {params.producer_id!r}: no handshake, or it was removed")
        check_layouts_match(self._own().layout, params.layout, params.producer_id)
        remote = _REGISTRY.get(params.producer_id)
        if remote is None:
            raise KVTransferError(f"peer {params.producer_id!r} has closed")
        return remote

    def _start(self, params: TransferParams, local_block_ids: tuple[int, ...], check: bool,
               layers: range) -> _InProcessPull:
        own = self._own()
        remote = self._remote(params)
        check_pull_blocks(params, tuple(local_block_ids), own.num_blocks, remote.num_blocks)
        pull = _InProcessPull(params, tuple(local_block_ids), check, layers)
        if self._defer:
            self._pending.append(pull)
        else:
            self._complete(pull)
        return pull

    def _complete(self, pull: _InProcessPull) -> None:
        """Land one READ now, reading the producer's memory as it is at this moment."""
        remote = _REGISTRY.get(pull.params.producer_id)
        if remote is None:
            pull.fail(f"peer {pull.params.producer_id!r} closed before the pull completed")
        elif pull.check:
            self._complete_check(pull, remote)
        elif self._fail_next:
            self._fail_next -= 1
            pull.fail("injected failure (InProcessBackend.fail_next_pulls)")
        else:
            layers = pull.layers
            _copy_blocks(remote.layers[layers.start:layers.stop], pull.params.block_ids,
                         self._own().layers[layers.start:layers.stop], pull.local_block_ids)
            pull.state = PullState.DONE

    def _complete_check(self, pull: _InProcessPull, remote: _Endpoint) -> None:
        """Copy the generation words, then notify the producer (unless told not to): the same order
        as NIXL, which sends a READ's notification after the READ completed."""
        local_index = torch.tensor(pull.local_block_ids, dtype=torch.long)
        remote_index = torch.tensor(pull.params.block_ids, dtype=torch.long)
        self._own().words[SCRATCH].index_copy_(0, local_index, remote.words[GENERATIONS].index_select(0, remote_index))
        pull.state = PullState.DONE
        if self._drop_next:
            self._drop_next -= 1
        else:
            remote.notifications.append(pull.params.request_id)


def _block_index(block_ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[len(block_ids)] int64 on `device`. On CUDA through pinned memory without blocking: torch.tensor(...,
    device="cuda") copies from pageable memory, which waits for everything queued on the stream before it
    (in a layer-wise pull, the rest of the producer's forward), so no READ would overlap the forward."""
    index = torch.tensor(block_ids, dtype=torch.long)
    if device.type != "cuda":
        return index
    return index.pin_memory().to(device, non_blocking=True)


def _copy_blocks(src_layers: list[torch.Tensor], src_ids: tuple[int, ...], dst_layers: list[torch.Tensor],
                 dst_ids: tuple[int, ...]) -> None:
    """dst_layers[l][dst_ids[i]] = src_layers[l][src_ids[i]] for every layer l and index i, as bytes (as NIXL
    moves them: a quantized pool's codes and scales alike; torch has no float8 index_copy_ on CPU)."""
    for src, dst in zip(src_layers, dst_layers):
        # src, dst: [num_blocks, 2, block_size, kv_heads, row_width] (num_blocks may differ), viewed as bytes
        src_index, dst_index = _block_index(src_ids, src.device), _block_index(dst_ids, dst.device)
        dst.view(torch.uint8).index_copy_(0, dst_index, src.view(torch.uint8).index_select(0, src_index).to(dst.device))
