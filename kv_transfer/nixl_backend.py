"""NIXL transfer backend over UCX: the only module that imports nixl.

Descriptors: every (layer, block) pair of a pool is one NIXL descriptor, numbered
l * num_blocks + b (layer-major), so a pull's local and remote index lists line up element by
element; every block's generation word (8 bytes of host memory, base.new_generation_words) is
one more descriptor in a second list, numbered b. Both local lists (the pool, the scratch
words) are prepared once at registration, a peer's (its pool, its generation words) once at
its handshake. A pull is then two make_prepped_xfer("READ", ...) + transfer(): the data READ,
without notification, and once it completed the check READ of the generations, whose
notification (the request id) reaches the producer when that READ completes.

What a peer needs besides NIXL's own agent metadata (the base address of each layer tensor,
the pool's block count, memory type and device, the address of its generation words) travels
inside AgentMetadata.backend_metadata as a small binary header in front of NIXL's bytes.

Measured on our CPU machines (NIXL 1.5.1 with its bundled UCX 1.23), which set NixlConfig's
defaults:
- With ucx_error_handling_mode='none', UCX reads a peer's DRAM one-sidedly (shared memory /
  CMA): the copy runs in the caller's thread inside transfer(), so start_pull usually returns
  with the pull already DONE, and the producer's threads take no part.
- With 'peer' (UCX's default), the shared-memory transports are disqualified and RMA is
  emulated with active messages over TCP loopback (CMA for large payloads): bandwidth between
  processes is similar for 128 KiB descriptors, but every READ waits for the *producer* to make
  progress (a producer that does not poll for 3 s stalls the pull for 3 s), and two agents in
  one process driven by one thread never complete. `UCX_TLS=shm` alone fails in this mode.
- NIXL's progress thread busy-polls one core per agent, even when idle.
- A READ from a producer that died raises NIXL_ERR_REMOTE_DISCONNECT in transfer() (both modes).

Measured on one NVIDIA H200 (NIXL's CUDA-13 build, two processes on the one GPU, 2026-11-28): READs of
VRAM ran at 0.7 GB/s, UCX's protocol table saying "software emulation" over host shared memory. UCX's
cuda_ipc transport turns its GETs off (`UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto`) wherever NVML reports no
active NVLink, which a single GPU, a PCIe-only machine or a VM all do, and a pull is all GETs; so this
module defaults that setting to "y" on machines with CUDA (an operator's own value wins). With it the same
bench read "zero-copy" over cuda_ipc at 15-16.6 GB/s, about 5.4 us per descriptor whatever its size
(bench/README.md, nixl_bandwidth.py).
"""

from __future__ import annotations

import importlib
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from splitserve.common.kv_transfer_types import AgentMetadata, KVLayout, TransferParams
from splitserve.kv_transfer import NIXL_MODULES, nixl_module
from splitserve.kv_transfer.base import (GENERATIONS, SCRATCH, KVTransferError, PullHandle, PullState,
                                         TransferBackend, bump_generation_words, check_kv_pool, check_layouts_match,
                                         check_pull_blocks, memory_kind, new_generation_words, pull_layers,
                                         read_generation_words)

_CUDA_IPC_GETS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}
ENV_DEFAULTS = {"NIXL_LOG_LEVEL": "WARN", **(_CUDA_IPC_GETS if torch.cuda.is_available() else {})}
"""Set unless the environment sets them, before NIXL is imported (it and UCX read them once): a quiet log,
and cuda_ipc GETs for VRAM pulls on machines without NVLink (see the module docstring); the latter only where
CUDA is, since UCX warns about a setting of a transport it did not load."""
for _name, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_name, _value)
if (_NIXL := nixl_module()) is None:
    raise ImportError(f"NIXL is not installed: none of {', '.join(NIXL_MODULES)} can be imported")
_api = importlib.import_module(f"{_NIXL}._api")
nixl_agent, nixl_agent_config = _api.nixl_agent, _api.nixl_agent_config
nixl_prepped_dlist_handle, nixl_xfer_handle = _api.nixl_prepped_dlist_handle, _api.nixl_xfer_handle

_LOCAL = "NIXL_INIT_AGENT"
"""prep_xfer_dlist's name for the initiator's own descriptors."""
_XFER_STATES = {"DONE": PullState.DONE, "PROC": PullState.PENDING, "ERR": PullState.FAILED}
_SETTLE_TIMEOUT_S = 10.0
"""How long release waits for an in-flight READ that NIXL refuses to cancel."""


@dataclass(frozen=True)
class NixlConfig:
    """How a worker's NIXL agent talks UCX (see the module docstring for the measurements)."""

    ucx_error_handling_mode: str = "none"
    """'none': one-sided shared-memory/CMA reads on one host. 'peer': UCX watches peers at the
    transport level, but on CPU each READ then needs the producer's progress (see above)."""
    progress_thread: bool = False
    """NIXL's progress thread spins a core; without it transfers and notifications progress
    inside our own calls (transfer, poll_pull, take_notifications), which the engine loops make."""

    def __post_init__(self) -> None:
        if self.ucx_error_handling_mode not in ("none", "peer"):
            raise ValueError(f"ucx_error_handling_mode must be 'none' or 'peer', got {self.ucx_error_handling_mode!r}")


_HEADER = struct.Struct("<4sH4sIQQI")
"""magic, format version, memory type, device id, num_blocks, generation words' address,
num_layers; then the layer addresses (num_layers x u64), then NIXL's agent metadata."""
_MAGIC, _VERSION = b"SSKV", 2
_WORD_BYTES = 8
"""One generation word: an int64."""


@dataclass(frozen=True)
class _PoolInfo:
    """Where one agent's KV pool lives: block b of layer l is bytes
    [layer_addrs[l] + b * block_bytes, + block_bytes) of `mem_type` memory on `device_id`; the
    generation of block b is the int64 at host (DRAM) address generations_addr + 8 * b."""

    mem_type: str
    """'DRAM' or 'VRAM' (NIXL's names)."""
    device_id: int
    num_blocks: int
    generations_addr: int
    layer_addrs: tuple[int, ...]

    @classmethod
    def of(cls, layers: list[torch.Tensor], words: torch.Tensor) -> _PoolInfo:
        device = layers[0].device
        return cls(memory_kind(device), device.index or 0, layers[0].shape[0], words[GENERATIONS].data_ptr(),
                   tuple(layer.data_ptr() for layer in layers))

    def pack(self, agent_metadata: bytes) -> bytes:
        header = _HEADER.pack(_MAGIC, _VERSION, self.mem_type.encode(), self.device_id, self.num_blocks,
                              self.generations_addr, len(self.layer_addrs))
        return header + struct.pack(f"<{len(self.layer_addrs)}Q", *self.layer_addrs) + agent_metadata

    @classmethod
    def unpack(cls, blob: bytes) -> tuple[_PoolInfo, bytes]:
        """(pool info, NIXL agent metadata); KVTransferError if the blob is not ours."""
        if len(blob) < _HEADER.size:
            raise KVTransferError("peer metadata is too short to be NIXL backend metadata")
        magic, version, mem_type, device_id, num_blocks, generations_addr, num_layers = _HEADER.unpack_from(blob)
        if (magic, version) != (_MAGIC, _VERSION):
            raise KVTransferError(f"peer metadata has format {magic!r} v{version}, expected {_MAGIC!r} v{_VERSION}")
        addrs_end = _HEADER.size + 8 * num_layers
        layer_addrs = struct.unpack_from(f"<{num_layers}Q", blob, _HEADER.size)
        return cls(mem_type.decode(), device_id, num_blocks, generations_addr, layer_addrs), blob[addrs_end:]

    def descriptors(self, block_bytes: int) -> np.ndarray:
        """[num_layers * num_blocks, 3] uint64 rows (address, length, device); row l * num_blocks + b
        is block b of layer l."""
        layer_addrs = np.asarray(self.layer_addrs, dtype=np.uint64)[:, None]  # [num_layers, 1]
        offsets = np.arange(self.num_blocks, dtype=np.uint64)[None, :] * np.uint64(block_bytes)  # [1, num_blocks]
        descs = np.empty((len(self.layer_addrs) * self.num_blocks, 3), dtype=np.uint64)
        descs[:, 0] = (layer_addrs + offsets).ravel()
        descs[:, 1] = block_bytes
        descs[:, 2] = self.device_id
        return descs

    def generation_descriptors(self) -> np.ndarray:
        """[num_blocks, 3] uint64 rows (address, 8, 0) of host memory; row b is block b's generation."""
        return _word_descriptors(self.generations_addr, self.num_blocks)


def _word_descriptors(base_addr: int, num_blocks: int) -> np.ndarray:
    """[num_blocks, 3] uint64 rows (base_addr + 8 * b, 8, 0): consecutive int64 words in host memory."""
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base_addr) + np.arange(num_blocks, dtype=np.uint64) * np.uint64(_WORD_BYTES)
    descs[:, 1] = _WORD_BYTES
    descs[:, 2] = 0
    return descs


def _descriptor_indices(block_ids: tuple[int, ...], layers: range, num_blocks: int) -> np.ndarray:
    """[len(layers) * len(block_ids)] int64: element j * len(block_ids) + i is descriptor
    layers[j] * num_blocks + block_ids[i] (layer-major, so local and remote lists pair up)."""
    rows = np.arange(layers.start, layers.stop, dtype=np.int64)[:, None] * num_blocks  # [len(layers), 1]
    return (rows + np.asarray(block_ids, dtype=np.int64)[None, :]).ravel()


@contextmanager
def _nixl_errors(action: str) -> Iterator[None]:
    """Re-raise NIXL's exceptions (each its own Exception subclass) as KVTransferError."""
    try:
        yield
    except KVTransferError:
        raise
    except Exception as error:  # noqa: BLE001 - nixl's error types share no base below Exception
        raise KVTransferError(f"{action}: {type(error).__name__}: {error}") from error


@dataclass
class _LocalPool:
    layers: list[torch.Tensor]
    """Kept alive while registered: layers[l] is [num_blocks, 2, block_size, kv_heads, head_dim]."""
    words: torch.Tensor
    """Kept alive while registered: [2, num_blocks] int64 generations and check scratch."""
    layout: KVLayout
    info: _PoolInfo
    registrations: tuple[object, object]
    """NIXL's registration descriptor lists of the pool and of the words (for deregister_memory)."""
    dlist: nixl_prepped_dlist_handle
    scratch_dlist: nixl_prepped_dlist_handle
    """The scratch words (row SCRATCH), descriptor b for local block b."""


class _NixlPull(PullHandle):
    def __init__(self, peer: str, xfer: nixl_xfer_handle, state: PullState) -> None:
        self.peer = peer
        self.xfer: nixl_xfer_handle | None = xfer
        """None once released."""
        self.state = state

    def fail(self, error: str) -> None:
        self.state = PullState.FAILED
        self.error = error


@dataclass
class _Peer:
    name: str
    num_blocks: int
    dlist: nixl_prepped_dlist_handle
    generation_dlist: nixl_prepped_dlist_handle
    pending: set[_NixlPull] = field(default_factory=set)
    """Pulls from this peer that are PENDING and not released."""


class NixlBackend(TransferBackend):
    """One NIXL agent with the UCX backend, driven by one thread (sync mode NONE)."""

    def __init__(self, agent_name: str, config: NixlConfig = NixlConfig()) -> None:
        self.agent_name = agent_name
        with _nixl_errors(f"creating NIXL agent {agent_name!r}"):
            self._agent = nixl_agent(agent_name, nixl_agent_config(enable_prog_thread=config.progress_thread,
                                                                   backends=[]))
            self._agent.create_backend("UCX", {"ucx_error_handling_mode": config.ucx_error_handling_mode})
        self._pool: _LocalPool | None = None
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self._drop_next = 0

    def drop_next_notifications(self, count: int = 1) -> None:
        """Fault hook: the next `count` check READs are posted with no notification (NIXL sends
        none for an empty message), so the producer never learns of those pulls and their leases expire."""
        self._drop_next += count

    def register_kv_pool(self, layers: list[torch.Tensor], layout: KVLayout) -> None:
        check_kv_pool(layers, layout)
        agent = self._open()
        if self._pool is not None:
            raise KVTransferError(f"agent {self.agent_name!r} already registered a KV pool")
        words = new_generation_words(layers[0].shape[0])
        info = _PoolInfo.of(layers, words)
        with _nixl_errors("registering the KV pool and its generation words"):
            registrations = (agent.register_memory(list(layers)), agent.register_memory([words]))
            dlist = agent.prep_xfer_dlist(_LOCAL, info.descriptors(layout.bytes_per_block_per_layer), info.mem_type)
            scratch_dlist = agent.prep_xfer_dlist(_LOCAL, _word_descriptors(words[SCRATCH].data_ptr(),
                                                                            info.num_blocks), "DRAM")
        self._pool = _LocalPool(list(layers), words, layout, info, registrations, dlist, scratch_dlist)

    def metadata(self) -> AgentMetadata:
        pool = self._registered()
        with _nixl_errors("reading agent metadata"):
            return AgentMetadata(self.agent_name, pool.layout, pool.info.pack(self._agent.get_agent_metadata()))

    def add_peer(self, peer: AgentMetadata) -> None:
        """Checks the layout first; a known peer is kept as is (agent names are unique per start)."""
        pool = self._registered()
        check_layouts_match(pool.layout, peer.layout, peer.agent_name)
        if peer.agent_name in self._peers:
            return
        info, agent_metadata = _PoolInfo.unpack(peer.backend_metadata)
        if len(info.layer_addrs) != pool.layout.num_layers:
            raise KVTransferError(f"peer {peer.agent_name!r} registered {len(info.layer_addrs)} layers, "
                                  f"its layout says {pool.layout.num_layers}")
        self._load_remote_agent(peer.agent_name, agent_metadata)
        dlist = None
        try:
            with _nixl_errors(f"preparing {peer.agent_name!r}'s descriptors"):
                dlist = self._agent.prep_xfer_dlist(
                    peer.agent_name, info.descriptors(pool.layout.bytes_per_block_per_layer), info.mem_type)
                generation_dlist = self._agent.prep_xfer_dlist(peer.agent_name, info.generation_descriptors(), "DRAM")
        except KVTransferError:
            if dlist is not None:
                dlist.release()
            self._agent.remove_remote_agent(peer.agent_name)
            raise
        self._peers[peer.agent_name] = _Peer(peer.agent_name, info.num_blocks, dlist, generation_dlist)

    def remove_peer(self, agent_name: str) -> None:
        """Abandons the peer's pending pulls (FAILED), then drops its descriptors and connection."""
        peer = self._peers.pop(agent_name, None)
        if peer is None:
            return
        for pull in list(peer.pending):
            self._release_xfer(pull)
            pull.fail(f"peer {agent_name!r} was removed while the pull was in flight")
        with _nixl_errors(f"removing peer {agent_name!r}"):
            peer.dlist.release()
            peer.generation_dlist.release()
            self._agent.remove_remote_agent(agent_name)

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    def start_pull(self, params: TransferParams, local_block_ids: tuple[int, ...],
                   layers: range | None = None) -> PullHandle:
        """The data READ: the given layers (default: every layer) of every block, one READ, no notification."""
        pool, peer = self._pull_sides(params, local_block_ids)
        layers = pull_layers(layers, pool.layout.num_layers)
        local = _descriptor_indices(tuple(local_block_ids), layers, pool.info.num_blocks)
        remote = _descriptor_indices(params.block_ids, layers, peer.num_blocks)
        return self._post_read(f"the READ from {peer.name!r}", params.request_id, peer, pool.dlist, local,
                               peer.dlist, remote, b"")

    def start_check(self, params: TransferParams, local_block_ids: tuple[int, ...]) -> PullHandle:
        """The check READ: one generation word per block; the request id is its completion notification."""
        pool, peer = self._pull_sides(params, local_block_ids)
        local = np.asarray(local_block_ids, dtype=np.int64)
        remote = np.asarray(params.block_ids, dtype=np.int64)
        return self._post_read(f"the generation READ from {peer.name!r}", params.request_id, peer,
                               pool.scratch_dlist, local, peer.generation_dlist, remote,
                               self._notification(params.request_id))

    def checked_generations(self, local_block_ids: tuple[int, ...]) -> tuple[int, ...]:
        return read_generation_words(self._registered().words, SCRATCH, local_block_ids)

    def generations(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        return read_generation_words(self._registered().words, GENERATIONS, block_ids)

    def bump_generations(self, block_ids: tuple[int, ...]) -> None:
        """A plain host store: a READ posted after this returns reads the new words."""
        bump_generation_words(self._registered().words, block_ids)

    def poll_pull(self, handle: PullHandle) -> PullState:
        assert isinstance(handle, _NixlPull)
        if handle.state is PullState.PENDING:
            try:
                with _nixl_errors("checking the READ"):
                    state = _XFER_STATES[self._agent.check_xfer_state(handle.xfer)]
            except KVTransferError as error:
                state, handle.error = PullState.FAILED, str(error)
            self._settle(handle, state)
        return handle.state

    def release_pull(self, handle: PullHandle) -> None:
        assert isinstance(handle, _NixlPull)
        self._release_xfer(handle)
        if handle.state is PullState.PENDING:
            handle.fail("released while in flight")
        peer = self._peers.get(handle.peer)
        if peer is not None:
            peer.pending.discard(handle)

    def take_notifications(self) -> list[str]:
        """Request ids of completed pulls from every consumer (NIXL keys them by sender name)."""
        with _nixl_errors("reading notifications"):
            notifications = self._open().get_new_notifs()
        return [message.decode() for messages in notifications.values() for message in messages]

    def close(self) -> None:
        """Abandon pending pulls, drop every peer, release descriptors, deregister the pool; idempotent."""
        if self._closed:
            return
        for name in list(self._peers):
            self.remove_peer(name)
        if self._pool is not None:
            with _nixl_errors("deregistering the KV pool"):
                self._pool.dlist.release()
                self._pool.scratch_dlist.release()
                for registration in self._pool.registrations:
                    self._agent.deregister_memory(registration)
            self._pool = None
        self._closed = True
        del self._agent

    # ---- internals -----------------------------------------------------------------------
    def _open(self) -> nixl_agent:
        if self._closed:
            raise KVTransferError(f"agent {self.agent_name!r} is closed")
        return self._agent

    def _registered(self) -> _LocalPool:
        self._open()
        if self._pool is None:
            raise KVTransferError(f"agent {self.agent_name!r} has no registered KV pool")
        return self._pool

    def _load_remote_agent(self, name: str, agent_metadata: bytes) -> None:
        with _nixl_errors(f"loading {name!r}'s agent metadata"):
            loaded = self._agent.add_remote_agent(agent_metadata)
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded  # NIXL 1.5 returns bytes
        if loaded != name:
            self._agent.remove_remote_agent(loaded)
            raise KVTransferError(f"peer metadata names agent {loaded!r}, the handshake said {name!r}")

    def _pull_sides(self, params: TransferParams, local_block_ids: tuple[int, ...]) -> tuple[_LocalPool, _Peer]:
        """Our pool and the producer's peer entry, after the checks every READ of a pull needs."""
        pool = self._registered()
        peer = self._peers.get(params.producer_id)
        if peer is None:
            raise KVTransferError(f"unknown peer {params.producer_id!r}: no handshake, or it was removed")
        check_layouts_match(pool.layout, params.layout, params.producer_id)
        check_pull_blocks(params, tuple(local_block_ids), pool.info.num_blocks, peer.num_blocks)
        return pool, peer

    def _post_read(self, what: str, request_id: str, peer: _Peer, local_dlist: nixl_prepped_dlist_handle,
                   local: np.ndarray, remote_dlist: nixl_prepped_dlist_handle, remote: np.ndarray,
                   notification: bytes) -> _NixlPull:
        """make_prepped_xfer + transfer of one READ (an empty notification sends none)."""
        with _nixl_errors(f"{request_id}: preparing {what}"):
            xfer = self._agent.make_prepped_xfer("READ", local_dlist, local, remote_dlist, remote,
                                                 notif_msg=notification)
        try:
            with _nixl_errors(f"{request_id}: posting {what}"):
                status = self._agent.transfer(xfer)
        except KVTransferError:
            xfer.release()
            raise
        return self._track(peer, _NixlPull(peer.name, xfer, _XFER_STATES[status]))

    def _notification(self, request_id: str) -> bytes:
        """The check READ's completion message: the request id, or nothing while dropping is asked for."""
        if self._drop_next:
            self._drop_next -= 1
            return b""
        return request_id.encode()

    def _track(self, peer: _Peer, pull: _NixlPull) -> _NixlPull:
        if pull.state is PullState.PENDING:
            peer.pending.add(pull)
        elif pull.state is PullState.FAILED:
            pull.error = f"NIXL refused to post the READ from {peer.name!r}"
        return pull

    def _settle(self, pull: _NixlPull, state: PullState) -> None:
        if state is PullState.PENDING:
            return
        pull.state = state
        if state is PullState.FAILED and pull.error is None:
            pull.error = f"NIXL reported an error reading from {pull.peer!r}"
        peer = self._peers.get(pull.peer)
        if peer is not None:
            peer.pending.discard(pull)

    def _release_xfer(self, pull: _NixlPull) -> None:
        """Free the NIXL request. Invariant: afterwards NIXL writes no more bytes for this pull.

        Releasing an in-flight request makes NIXL cancel it; where the backend cannot cancel
        (it raises), wait for the READ to settle and release again. On CPU every READ is done
        inside transfer(), so only GPU/RDMA pulls can reach the wait."""
        if pull.xfer is None:
            return
        try:
            pull.xfer.release()
        except Exception:  # noqa: BLE001 - nixl raises its own types; we retry below
            self._wait_settled(pull.xfer)
            with _nixl_errors("releasing a settled READ"):
                pull.xfer.release()
        pull.xfer = None

    def _wait_settled(self, xfer: nixl_xfer_handle) -> None:
        deadline = time.monotonic() + _SETTLE_TIMEOUT_S
        while self._agent.check_xfer_state(xfer) == "PROC":
            if time.monotonic() > deadline:
                raise KVTransferError(f"a READ neither cancelled nor finished within {_SETTLE_TIMEOUT_S}s; "
                                      "its local blocks must not be reused")
            time.sleep(0.001)
