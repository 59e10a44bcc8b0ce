"""Typed data that crosses the prefill -> decode boundary (torch-free).

`KVLayout` describes one worker's KV pool; two workers may exchange blocks only when
their layouts match exactly. `TransferParams` is what a prefill worker hands back for a
request whose prompt KV it holds under a lease.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

KV_POOL_LAYOUT = "layer[num_blocks, 2, block_size, num_kv_heads, row_width]"
"""The only pool layout so far: one tensor per layer, keys then values inside each block; a row is
head_dim elements, plus a quantized pool's scale (see KVLayout.scales)."""
MEMORY_KINDS = ("DRAM", "VRAM")
"""Where a pool lives, in NIXL's names: host memory (a CPU pool) or GPU memory (a CUDA pool)."""
KV_SCALES_NONE = "none"
"""KVLayout.scales of a plain pool: elements are the values themselves."""
KV_SCALES_PER_TOKEN_HEAD = "bfloat16 per token per kv head, after its head_dim codes"
"""KVLayout.scales of a quantized pool (int8 / float8_e4m3fn codes): row_width = head_dim + 2 elements."""
SCALE_BYTES = {KV_SCALES_NONE: 0, KV_SCALES_PER_TOKEN_HEAD: 2}
"""Elements (bytes) a row's scale adds after its head_dim codes."""
TRANSFER_FAILURE_POLICIES = ("recompute", "fail")
"""What a decode worker does when a pull fails: recompute the prompt locally, or fail the request."""


class KVTransferError(RuntimeError):
    """A transfer could not be set up or did not complete."""


class KVLayoutMismatchError(KVTransferError):
    """The handshake found two workers whose KV layouts differ (the router tells this apart from a
    peer that is gone)."""


@dataclass(frozen=True)
class KVLayout:
    """Everything that must agree before one worker may read another's KV blocks."""

    model_id: str
    """Fingerprint of the model (architecture + weights' config), not just its path."""
    dtype: str
    """KV element type in the pool, torch's name: 'float32', 'bfloat16', or the codes of a quantized
    pool, 'int8' or 'float8_e4m3fn'."""
    block_size: int
    """Tokens per block."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hash_seed: int
    """Seed of the chained block hash (prefix-cache identities must agree)."""
    layout: str = KV_POOL_LAYOUT
    """How a block's bytes are arranged in the pool tensors."""
    memory_kind: str = "DRAM"
    """Where the pool lives (MEMORY_KINDS): peers must agree, so a decode pool on GPUs never pulls from a prefill
    pool in host memory by accident (a READ across kinds would stage through host copies at a fraction of the
    RDMA/NVLink bandwidth the deployment was sized for)."""
    scales: str = KV_SCALES_NONE
    """Where a quantized pool keeps its scales (KV_SCALES_PER_TOKEN_HEAD); KV_SCALES_NONE for a plain one."""

    def __post_init__(self) -> None:
        if self.memory_kind not in MEMORY_KINDS:
            raise ValueError(f"memory_kind must be one of {MEMORY_KINDS}, got {self.memory_kind!r}")
        if self.dtype not in _ELEMENT_BYTES:
            raise ValueError(f"KV layout dtype must be one of {tuple(_ELEMENT_BYTES)}, got {self.dtype!r}")
        if self.scales not in SCALE_BYTES:
            raise ValueError(f"KV layout scales must be one of {tuple(SCALE_BYTES)}, got {self.scales!r}")

    @property
    def row_width(self) -> int:
        """Pool elements of one (token, KV head) row: head_dim, plus the scale's when quantized."""
        return self.head_dim + SCALE_BYTES[self.scales]

    @property
    def bytes_per_block_per_layer(self) -> int:
        """Bytes of one block of one layer, keys and values (and their scales)."""
        return 2 * self.block_size * self.num_kv_heads * self.row_width * _ELEMENT_BYTES[self.dtype]

    @property
    def kv_cache_dtype(self) -> str:
        """The pool's element type as EngineConfig.kv_cache_dtype spells it ('fp8_e4m3' for float8_e4m3fn codes),
        else the dtype itself ('float32', 'bfloat16', 'int8')."""
        return "fp8_e4m3" if self.dtype == "float8_e4m3fn" else self.dtype

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers: what a pull moves per prompt token (full blocks)."""
        return self.bytes_per_block_per_layer * self.num_layers // self.block_size

    def mismatches(self, other: KVLayout) -> list[str]:
        """Human-readable differences, empty when the two layouts are compatible."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]


_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class TransferParams:
    """Where a request's prompt KV lives on its prefill worker, and what it looked like when held.

    Invariant: block_ids[i] holds tokens [i * block_size, (i + 1) * block_size) of the
    prompt; the last block may be partial. The blocks stay pinned on the producer until the
    consumer's pull completes or `lease_ttl_s` passes on the producer's own monotonic clock,
    whichever comes first. No field is a clock reading: nothing here assumes that the two
    machines' clocks agree.
    """

    request_id: str
    producer_id: str
    """Transfer-agent name of the prefill worker (new on every worker start)."""
    block_ids: tuple[int, ...]
    num_tokens: int
    """Prompt tokens whose KV the blocks hold (all of the prompt)."""
    layout: KVLayout
    lease_ttl_s: float
    """How long the producer holds the blocks, measured from hold() on its monotonic clock. The
    consumer uses it only as its own patience (a pull pending longer is abandoned)."""
    block_generations: tuple[int, ...]
    """block_generations[i]: the producer's generation of block_ids[i] at hold(). A pull is
    valid only if the generations read after its data are still these (see kv_transfer.connector)."""

    def __post_init__(self) -> None:
        if len(self.block_generations) != len(self.block_ids):
            raise ValueError(f"{self.request_id}: {len(self.block_generations)} block generations for "
                             f"{len(self.block_ids)} blocks")
        if not self.lease_ttl_s > 0:
            raise ValueError(f"{self.request_id}: lease_ttl_s must be > 0, got {self.lease_ttl_s}")

    @property
    def num_bytes(self) -> int:
        """KV bytes a pull of these blocks moves: blocks x bytes per block per layer x layers."""
        return len(self.block_ids) * self.layout.bytes_per_block_per_layer * self.layout.num_layers


@dataclass(frozen=True)
class LayerAnnouncement:
    """Layer-wise transfer: the producer has written `layer` of a request's held blocks.

    A request held before its final prefill chunk runs (ProducerConnector.hold(..., layerwise=True))
    is announced layer by layer as that chunk's forward writes it; the consumer READs a layer only
    once it and every layer below it were announced. Layers of earlier chunks were complete
    before the hold, so the final chunk's forward is the only thing an announcement waits for.
    """

    request_id: str
    producer_id: str
    """Transfer-agent name of the producer, new on every start: the announcement's epoch (one from a
    previous incarnation of the producer never matches a pull of the current one)."""
    layer: int
    """In [0, num_layers): this layer's keys and values are in place in every held block."""

    def __post_init__(self) -> None:
        if self.layer < 0:
            raise ValueError(f"{self.request_id}: layer must be >= 0, got {self.layer}")


@dataclass(frozen=True)
class AgentMetadata:
    """What a worker publishes so peers can read from it (exchanged once per worker pair)."""

    agent_name: str
    layout: KVLayout
    backend_metadata: bytes
    """Opaque to everything but the backend (NIXL agent metadata, or empty in-process)."""
