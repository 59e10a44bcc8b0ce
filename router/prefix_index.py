"""The router's prefix index: which workers' prefix caches hold which block hashes.

Kept exact from the workers' KV events (common/kv_events.py). Per worker the index tracks
the epoch and the last applied batch `seq` (its *cursor*); a report from another epoch or a
batch that skips a `seq` means the index missed something, so it drops everything it
believed about that worker and waits for a snapshot. A worker that needs a snapshot has no
entries, so the router never routes on a stale view: at worst it sees no cache hit.

Invariants:
- `_holders[h]` is never empty, and `w in _holders[h]` iff `h in _workers[w].hashes`.
- A worker whose `epoch` is None holds no hashes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from splitserve.common.block_hash import BlockHash
from splitserve.common.kv_events import BlocksStored, KVEventBatch, KVSnapshot, WorkerReport

_NOBODY: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PrefixIndexStats:
    """Counters for metrics; the counters only grow."""

    num_workers: int
    """Workers the index tracks (synced or waiting for a snapshot)."""
    num_hashes: int
    """Distinct block hashes held by at least one worker."""
    num_resyncs: int
    """Snapshots applied (a worker's first sync included)."""
    num_gaps: int
    """Batches that skipped a `seq`: the worker's entries were purged."""
    num_epoch_changes: int
    """Reports from an epoch other than the known one (a restarted worker): entries purged."""


@dataclass
class _WorkerState:
    epoch: str | None = None
    """The epoch `hashes` belong to; None: needs a snapshot (then `hashes` is empty)."""
    last_seq: int = 0
    """The last batch of `epoch` applied to `hashes`."""
    hashes: set[BlockHash] = field(default_factory=set)


class PrefixIndex:
    """block hash -> workers whose prefix cache holds it, kept exact from KV events."""

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerState] = {}
        self._holders: dict[BlockHash, set[str]] = {}
        self._num_resyncs = 0
        self._num_gaps = 0
        self._num_epoch_changes = 0

    def add_worker(self, worker_id: str) -> None:
        """Track a worker: known, empty, needing a snapshot. Re-adding a known worker resets it."""
        if worker_id in self._workers:
            self._purge(worker_id)
        self._workers[worker_id] = _WorkerState()

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker and every entry of it (no-op for an unknown worker)."""
        if worker_id in self._workers:
            self._purge(worker_id)
            del self._workers[worker_id]

    def apply(self, worker_id: str, report: WorkerReport) -> bool:
        """Apply a worker's poll answer; True iff the index is in sync with the worker afterwards.

        A snapshot replaces the worker's entries (epoch/seq from it). Otherwise a report from
        another epoch, or a batch whose seq is not last_seq + 1, purges the worker and makes it
        need a snapshot (False). Batches with seq <= last_seq were applied already: skipped.
        A report for an unknown worker (it left the pool while the poll was in flight) is
        ignored and returns False, so a late answer never brings a removed worker back.
        """
        state = self._workers.get(worker_id)
        if state is None:
            return False
        if report.snapshot is not None:
            self._apply_snapshot(worker_id, report.snapshot)
            return self._apply_batches(worker_id, report.kv_events)  # none expected; any must follow it
        if state.epoch is None:
            return False  # events cannot be applied without a base: the next poll asks for a snapshot
        if report.epoch != state.epoch:
            self._num_epoch_changes += 1
            self._mark_needs_snapshot(worker_id)
            return False
        return self._apply_batches(worker_id, report.kv_events)

    def cursor(self, worker_id: str) -> tuple[str | None, int]:
        """(epoch, last applied seq) to poll the worker with; (None, 0) when it needs a snapshot."""
        state = self._workers[worker_id]
        return state.epoch, state.last_seq

    def matched_blocks(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """For every known worker, how many LEADING consecutive `block_hashes` it holds (0 included).

        Walks the hashes once, shrinking the set of workers that still match every hash so far.
        """
        matched: dict[str, int] = {}
        remaining = set(self._workers)
        for depth, block_hash in enumerate(block_hashes):
            if not remaining:
                break
            holders = self._holders.get(block_hash, _NOBODY)
            for worker_id in remaining - holders:
                matched[worker_id] = depth  # holds block_hashes[0:depth], not block_hashes[depth]
            remaining &= holders
        for worker_id in remaining:
            matched[worker_id] = len(block_hashes)
        return {worker_id: matched[worker_id] for worker_id in self._workers}

    def num_blocks(self, worker_id: str) -> int:
        """Block hashes the index believes the worker holds."""
        return len(self._workers[worker_id].hashes)

    def block_hashes(self, worker_id: str) -> frozenset[BlockHash]:
        """The block hashes the index believes the worker holds (to compare with the worker's own)."""
        return frozenset(self._workers[worker_id].hashes)

    def stats(self) -> PrefixIndexStats:
        return PrefixIndexStats(num_workers=len(self._workers), num_hashes=len(self._holders),
                                num_resyncs=self._num_resyncs, num_gaps=self._num_gaps,
                                num_epoch_changes=self._num_epoch_changes)

    def _apply_snapshot(self, worker_id: str, snapshot: KVSnapshot) -> None:
        self._purge(worker_id)
        state = self._workers[worker_id]
        state.epoch, state.last_seq = snapshot.epoch, snapshot.seq
        self._store(worker_id, snapshot.block_hashes)
        self._num_resyncs += 1

    def _apply_batches(self, worker_id: str, batches: Sequence[KVEventBatch]) -> bool:
        state = self._workers[worker_id]
        for batch in batches:
            if batch.epoch != state.epoch:
                self._num_epoch_changes += 1
                self._mark_needs_snapshot(worker_id)
                return False
            if batch.seq <= state.last_seq:
                continue  # a duplicate: already applied
            if batch.seq != state.last_seq + 1:
                self._num_gaps += 1
                self._mark_needs_snapshot(worker_id)
                return False
            for event in batch.events:
                if isinstance(event, BlocksStored):
                    self._store(worker_id, event.block_hashes)
                else:
                    self._remove(worker_id, event.block_hashes)
            state.last_seq = batch.seq
        return True

    def _mark_needs_snapshot(self, worker_id: str) -> None:
        self._purge(worker_id)
        self._workers[worker_id].epoch = None
        self._workers[worker_id].last_seq = 0

    def _store(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        hashes = self._workers[worker_id].hashes
        for block_hash in block_hashes:
            hashes.add(block_hash)
            self._holders.setdefault(block_hash, set()).add(worker_id)

    def _remove(self, worker_id: str, block_hashes: Iterable[BlockHash]) -> None:
        hashes = self._workers[worker_id].hashes
        for block_hash in block_hashes:
            if block_hash in hashes:
                hashes.discard(block_hash)
                self._drop_holder(block_hash, worker_id)

    def _purge(self, worker_id: str) -> None:
        """Remove every entry of the worker: O(its blocks)."""
        hashes = self._workers[worker_id].hashes
        for block_hash in hashes:
            self._drop_holder(block_hash, worker_id)
        hashes.clear()

    def _drop_holder(self, block_hash: BlockHash, worker_id: str) -> None:
        holders = self._holders[block_hash]
        holders.discard(worker_id)
        if not holders:
            del self._holders[block_hash]
