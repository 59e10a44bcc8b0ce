"""The router's prefix index replayed from KV events: exact entries, matching, epochs, gaps, resync."""

from __future__ import annotations

import pytest

from splitserve.common.block_hash import BlockHasher
from splitserve.common.kv_events import BlocksRemoved, BlocksStored, KVEventBatch, KVSnapshot
from splitserve.router.prefix_index import PrefixIndex, PrefixIndexStats
from tests.factories import make_worker_report

BLOCK_SIZE = 4
HASHER = BlockHasher(BLOCK_SIZE, seed=0)
PROMPT = list(range(10, 34))  # 24 tokens = 6 full blocks
H = HASHER.hash_prefix(PROMPT)  # H[i] covers PROMPT[4i:4i+4]
OTHER = HASHER.hash_prefix(list(range(100, 112)))  # 3 blocks of an unrelated prompt


def stored(first: int, last: int, hashes=H) -> BlocksStored:
    """BlocksStored for hashes[first:last] with its true parent."""
    return BlocksStored(tuple(hashes[first:last]), hashes[first - 1] if first else None)


def synced_index(*workers: str, epoch: str = "e1") -> PrefixIndex:
    """An index whose workers are synced to an empty snapshot at seq 0 of `epoch`."""
    index = PrefixIndex()
    for worker_id in workers:
        index.add_worker(worker_id)
        assert index.apply(worker_id, make_worker_report(worker_id, epoch, snapshot=KVSnapshot(epoch, 0, frozenset())))
    return index


def test_a_new_worker_needs_a_snapshot_and_ignores_events_until_then():
    index = PrefixIndex()
    index.add_worker("p0")
    assert index.cursor("p0") == (None, 0)
    assert not index.apply("p0", make_worker_report("p0", "e1", [KVEventBatch("e1", 1, (stored(0, 2),))]))
    assert index.num_blocks("p0") == 0
    assert index.matched_blocks(H) == {"p0": 0}


def test_stored_and_removed_events_update_entries_and_the_cursor():
    index = synced_index("p0")
    batches = [KVEventBatch("e1", 1, (stored(0, 3),)), KVEventBatch("e1", 2, (stored(3, 5), BlocksRemoved((H[4],))))]
    assert index.apply("p0", make_worker_report("p0", "e1", batches))
    assert index.cursor("p0") == ("e1", 2)
    assert index.num_blocks("p0") == 4
    assert index.matched_blocks(H) == {"p0": 4}
    # Removing a hash the worker does not hold changes nothing.
    assert index.apply("p0", make_worker_report("p0", "e1", [KVEventBatch("e1", 3, (BlocksRemoved((OTHER[0],)),))]))
    assert index.num_blocks("p0") == 4


def test_matching_counts_only_leading_consecutive_blocks_per_worker():
    index = synced_index("p0", "p1", "p2", "d0")
    reports = {
        "p0": [stored(0, 1), stored(2, 3)],  # blocks 0 and 2, not 1
        "p1": [stored(0, 6)],
        "p2": [stored(1, 6)],  # everything but the first block
        "d0": [BlocksStored(tuple(OTHER), None)],
    }
    for worker_id, events in reports.items():
        assert index.apply(worker_id, make_worker_report(worker_id, "e1", [KVEventBatch("e1", 1, tuple(events))]))
    assert index.matched_blocks(H) == {"p0": 1, "p1": 6, "p2": 0, "d0": 0}
    assert index.matched_blocks(H[:3]) == {"p0": 1, "p1": 3, "p2": 0, "d0": 0}
    assert index.matched_blocks(OTHER) == {"p0": 0, "p1": 0, "p2": 0, "d0": 3}
    assert index.matched_blocks([]) == {"p0": 0, "p1": 0, "p2": 0, "d0": 0}
    # A longer prompt sharing the first 6 blocks: p1 matches exactly those.
    longer = HASHER.hash_prefix(PROMPT + list(range(200, 208)))
    assert index.matched_blocks(longer)["p1"] == 6


def test_a_snapshot_replaces_the_workers_entries():
    index = synced_index("p0", "p1")
    index.apply("p0", make_worker_report("p0", "e1", [KVEventBatch("e1", 1, (stored(0, 6),))]))
    index.apply("p1", make_worker_report("p1", "e1", [KVEventBatch("e1", 1, (stored(0, 2),))]))
    snapshot = KVSnapshot("e1", 7, frozenset(OTHER) | {H[0]})
    assert index.apply("p0", make_worker_report("p0", "e1", snapshot=snapshot))
    assert index.cursor("p0") == ("e1", 7)
    assert index.num_blocks("p0") == 4
    assert index.matched_blocks(H) == {"p0": 1, "p1": 2}
    assert index.matched_blocks(OTHER) == {"p0": 3, "p1": 0}
    assert index.stats().num_hashes == 5  # H[0], H[1], OTHER[0:3]


def test_a_new_epoch_purges_the_worker_until_its_snapshot():
    index = synced_index("p0", "p1")
    for worker_id in ("p0", "p1"):
        index.apply(worker_id, make_worker_report(worker_id, "e1", [KVEventBatch("e1", 1, (stored(0, 4),))]))
    # p0 restarted: its report carries the new epoch (with batches the index cannot place).
    restarted = make_worker_report("p0", "e2", [KVEventBatch("e2", 1, (stored(0, 1),))])
    assert not index.apply("p0", restarted)
    assert index.cursor("p0") == (None, 0)
    assert index.matched_blocks(H) == {"p0": 0, "p1": 4}
    assert index.stats().num_epoch_changes == 1
    assert index.apply("p0", make_worker_report("p0", "e2", snapshot=KVSnapshot("e2", 1, frozenset(H[:1]))))
    assert index.cursor("p0") == ("e2", 1)
    assert index.matched_blocks(H) == {"p0": 1, "p1": 4}


def test_a_batch_from_another_epoch_inside_a_report_purges_the_worker():
    index = synced_index("p0")
    report = make_worker_report("p0", "e1", [KVEventBatch("e1", 1, (stored(0, 2),)),
                                             KVEventBatch("e2", 2, (stored(2, 3),))])
    assert not index.apply("p0", report)
    assert index.cursor("p0") == (None, 0)
    assert index.num_blocks("p0") == 0
    assert index.stats().num_epoch_changes == 1


def test_a_gap_in_seq_purges_the_worker_and_asks_for_a_snapshot():
    index = synced_index("p0", "p1")
    index.apply("p0", make_worker_report("p0", "e1", [KVEventBatch("e1", 1, (stored(0, 3),))]))
    index.apply("p1", make_worker_report("p1", "e1", [KVEventBatch("e1", 1, (stored(0, 2),))]))
    # Batch 2 was lost; batch 3 must not be applied on top of a view missing it.
    gap = make_worker_report("p0", "e1", [KVEventBatch("e1", 3, (stored(3, 6),))])
    assert not index.apply("p0", gap)
    assert index.cursor("p0") == (None, 0)
    assert index.num_blocks("p0") == 0
    assert index.matched_blocks(H) == {"p0": 0, "p1": 2}
    assert index.stats() == PrefixIndexStats(num_workers=2, num_hashes=2, num_resyncs=2, num_gaps=1,
                                             num_epoch_changes=0)
    assert index.apply("p0", make_worker_report("p0", "e1", snapshot=KVSnapshot("e1", 3, frozenset(H))))
    assert index.matched_blocks(H) == {"p0": 6, "p1": 2}
    assert index.stats().num_resyncs == 3


def test_duplicate_batches_are_skipped():
    index = synced_index("p0")
    first = KVEventBatch("e1", 1, (stored(0, 3),))
    second = KVEventBatch("e1", 2, (BlocksRemoved((H[2],)),))
    assert index.apply("p0", make_worker_report("p0", "e1", [first, second]))
    # A retried poll answers batches 1-3: 1 and 2 again (re-storing H[2] would be wrong), then 3.
    third = KVEventBatch("e1", 3, (BlocksStored(tuple(OTHER[:1]), None),))
    assert index.apply("p0", make_worker_report("p0", "e1", [first, second, third]))
    assert index.cursor("p0") == ("e1", 3)
    assert index.matched_blocks(H) == {"p0": 2}
    assert index.num_blocks("p0") == 3
    assert index.stats().num_gaps == 0


def test_remove_worker_purges_every_entry_and_ignores_late_reports():
    index = synced_index("p0", "p1")
    index.apply("p0", make_worker_report("p0", "e1", [KVEventBatch("e1", 1, (stored(0, 6),))]))
    index.apply("p1", make_worker_report("p1", "e1", [KVEventBatch("e1", 1, (stored(0, 3),))]))
    index.remove_worker("p0")
    assert index.matched_blocks(H) == {"p1": 3}
    assert index.stats().num_hashes == 3
    # A poll answer that was in flight when the worker left does not bring it back.
    assert not index.apply("p0", make_worker_report("p0", "e1", [KVEventBatch("e1", 2, (stored(0, 6),))]))
    assert index.matched_blocks(H) == {"p1": 3}
    with pytest.raises(KeyError):
        index.cursor("p0")
    index.remove_worker("p0")  # idempotent
    assert index.stats().num_workers == 1


def test_re_adding_a_worker_resets_it():
    index = synced_index("p0")
    index.apply("p0", make_worker_report("p0", "e1", [KVEventBatch("e1", 1, (stored(0, 6),))]))
    index.add_worker("p0")
    assert index.cursor("p0") == (None, 0)
    assert index.matched_blocks(H) == {"p0": 0}
    assert index.stats().num_hashes == 0


def test_stats_count_workers_hashes_and_every_resync_cause():
    index = synced_index("p0", "p1", "p2")
    index.apply("p0", make_worker_report("p0", "e1", [KVEventBatch("e1", 1, (stored(0, 4),))]))
    index.apply("p1", make_worker_report("p1", "e1", [KVEventBatch("e1", 1, (stored(0, 2),
                                                                           BlocksStored(tuple(OTHER), None)))]))
    index.apply("p2", make_worker_report("p2", "e9"))  # restarted
    index.apply("p1", make_worker_report("p1", "e1", [KVEventBatch("e1", 5, ())]))  # gap
    index.apply("p2", make_worker_report("p2", "e9", snapshot=KVSnapshot("e9", 0, frozenset())))
    assert index.stats() == PrefixIndexStats(num_workers=3, num_hashes=4, num_resyncs=4, num_gaps=1,
                                             num_epoch_changes=1)
