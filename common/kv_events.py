"""What a worker tells routers about its prefix cache and its load (torch-free, typed).

KV events describe which block hashes a worker's prefix cache holds. They are numbered per
worker *epoch* (a new random id on every engine start): batch `seq` numbers are consecutive
within an epoch, starting at 1. A router that sees a new epoch or a gap in `seq` cannot
trust its view of that worker and resyncs from a `KVSnapshot`.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.block_hash import BlockHash


@dataclass(frozen=True)
class BlocksStored:
    """A chain of full blocks entered the prefix cache."""

    block_hashes: tuple[BlockHash, ...]
    """In prefix order: block_hashes[i] is the parent of block_hashes[i + 1]."""
    parent_hash: BlockHash | None
    """Parent of block_hashes[0]; None when the first block starts a sequence."""


@dataclass(frozen=True)
class BlocksRemoved:
    """These blocks left the prefix cache (their KV block was reused for other tokens)."""

    block_hashes: tuple[BlockHash, ...]


KVEvent = BlocksStored | BlocksRemoved


@dataclass(frozen=True)
class KVEventBatch:
    """The events of one engine step, in the order they happened (a report taken between steps
    also publishes the events since the last step, e.g. evictions for a pulled request's blocks,
    as a batch of their own)."""

    epoch: str
    seq: int
    """1 for an epoch's first batch, then +1 per batch."""
    events: tuple[KVEvent, ...]


@dataclass(frozen=True)
class KVSnapshot:
    """Every block hash a worker's prefix cache holds after batch `seq` of `epoch`."""

    epoch: str
    seq: int
    """The last batch reflected in `block_hashes` (0: none yet)."""
    block_hashes: frozenset[BlockHash]


@dataclass(frozen=True)
class LoraLoad:
    """The LoRA adapters a worker's unfinished requests run with (what vLLM's lora_requests_info gauge reports).

    Invariant: each tuple is sorted and without repeats; the base model (no adapter) is never named."""

    max_loras: int
    """The engine's max_loras: the most distinct adapters one running batch holds."""
    running: tuple[str, ...]
    """Adapter names of the running requests."""
    waiting: tuple[str, ...]
    """Adapter names of the requests admitted but not running (an adapter may be in both)."""


@dataclass(frozen=True)
class LoadReport:
    """A worker's load, as its engine sees it."""

    num_running: int
    num_waiting: int
    """Requests admitted but not yet scheduled (or waiting for remote KV)."""
    num_queued_prefill_tokens: int
    """Prompt tokens of unfinished requests that still have to be computed."""
    num_kv_blocks: int
    num_free_kv_blocks: int
    """Blocks with no owner (cached-free blocks count: they are evictable)."""
    prefill_s_per_token: float | None
    """Recent cost of one prompt token (moving average over prefill-heavy steps); None until
    the engine has run one."""
    decode_step_s: float | None
    """Recent duration of a step with decodes only (moving average); None until one ran."""
    lora: LoraLoad | None = None
    """The adapters in use; None when LoRA is not enabled on the worker."""

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks owned by requests, in [0, 1]."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks if self.num_kv_blocks else 1.0


@dataclass(frozen=True)
class WorkerCounters:
    """A worker's cumulative counters since its engine started (a restart resets them to 0, which
    Prometheus' rate() treats as a counter reset). The router exports them per worker."""

    prompt_tokens: int
    """Prompt tokens of the requests this worker's engine prefilled (cached ones included); a
    prompt whose KV was pulled from a prefill worker counts there, not here."""
    generation_tokens: int
    """Tokens this worker's engine sampled (a prefill worker samples each request's first)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int
    """Prompt tokens found in the prefix cache."""
    num_preemptions: int
    """Requests preempted (KV freed, recomputed later)."""
    kv_leases_expired: int
    """Prefill workers: KV leases that expired before a decode worker pulled them (0 on decode)."""
    spec_decode_num_drafts: int = 0
    """Speculative decoding (decode workers that speculate; else 0): verifications, one per
    speculating request per step."""
    spec_decode_num_draft_tokens: int = 0
    """Draft tokens verified."""
    spec_decode_num_accepted_tokens: int = 0
    """Draft tokens accepted."""
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    """Entry j: verifications that accepted draft j + 1 (empty when the worker does not speculate)."""


@dataclass(frozen=True)
class WorkerReport:
    """A worker's answer to a router's poll: its load and what changed in its prefix cache."""

    worker_id: str
    epoch: str
    load: LoadReport
    kv_events: tuple[KVEventBatch, ...]
    """Batches after the router's cursor, oldest first (empty when `snapshot` is set)."""
    snapshot: KVSnapshot | None
    """Set when the router's cursor cannot be continued: another epoch, or batches it missed
    are no longer retained."""
    counters: WorkerCounters
    """Cumulative counters for metrics, taken with `load`."""
