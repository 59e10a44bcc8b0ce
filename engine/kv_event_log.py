"""The numbered log of one engine's KV events, from which routers follow its prefix cache.

Invariants:
- `epoch` is new for every log (every engine start), so a router never continues a cursor
  across a restart.
- Batch seq numbers are 1, 2, 3, ... with no gaps; `seq` is the last one (0: none yet).
- The log retains the last `max_batches` batches, i.e. exactly seqs
  max(1, seq - max_batches + 1) .. seq.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable, Sequence

from splitserve.common.block_hash import BlockHash
from splitserve.common.kv_events import KVEvent, KVEventBatch, KVSnapshot


class KVEventLog:
    def __init__(self, max_batches: int = 4096) -> None:
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        self.epoch = uuid.uuid4().hex
        self._seq = 0
        self._batches: deque[KVEventBatch] = deque(maxlen=max_batches)

    @property
    def seq(self) -> int:
        """The last batch's seq (0 before the first batch)."""
        return self._seq

    def append(self, events: Sequence[KVEvent]) -> KVEventBatch | None:
        """Number `events` as the next batch; no batch (None) when there are none."""
        if not events:
            return None
        self._seq += 1
        batch = KVEventBatch(self.epoch, self._seq, tuple(events))
        self._batches.append(batch)
        return batch

    def since(self, epoch: str | None, after_seq: int, snapshot_fn: Callable[[], frozenset[BlockHash]]
              ) -> tuple[tuple[KVEventBatch, ...], KVSnapshot | None]:
        """What a reader whose cursor is (epoch, after_seq) needs to catch up.

        The batches after `after_seq` when the cursor can be continued; otherwise no batches and
        a snapshot of `snapshot_fn()`, which must reflect exactly the events of batches 1..seq
        (the caller appends pending events first)."""
        if self._continues(epoch, after_seq):
            return tuple(b for b in self._batches if b.seq > after_seq), None
        return (), KVSnapshot(self.epoch, self._seq, snapshot_fn())

    def _continues(self, epoch: str | None, after_seq: int) -> bool:
        """Same epoch, not ahead of us, and every batch after the cursor still retained."""
        oldest_seq = self._batches[0].seq if self._batches else self._seq + 1
        return epoch == self.epoch and oldest_seq - 1 <= after_seq <= self._seq
