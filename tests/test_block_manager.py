"""BlockManager and the chained block hash: exact block ids, ref counts and eviction order."""

from __future__ import annotations

import hashlib
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.factories import assert_pool_idle, make_block_manager, make_request
from splitserve.common.block_hash import BlockHasher, hash_block, root_hash, salted_root
from splitserve.common.kv_events import BlocksRemoved, BlocksStored
from splitserve.engine.block_manager import PrefixMatch


def computed(request, num_tokens: int):
    """Mark the first num_tokens of the request as computed (what the scheduler does after a step)."""
    request.num_computed_tokens = num_tokens
    return request


def prefilled(manager, request_id: str, token_ids: list[int]):
    """A request whose whole prompt was allocated, computed and published in the prefix cache."""
    request = make_request(request_id, token_ids)
    manager.allocate(request, len(token_ids))
    manager.cache_full_blocks(computed(request, len(token_ids)))
    return request


# ---- block hash ------------------------------------------------------------------------------
def test_hash_is_blake2b_of_parent_and_tokens():
    parent = root_hash(0)
    expected = hashlib.blake2b(parent.to_bytes(16, "little") + struct.pack("<4q", 1, 2, 3, 4), digest_size=16)
    assert hash_block(parent, [1, 2, 3, 4]) == int.from_bytes(expected.digest(), "little")
    assert root_hash(0) == int.from_bytes(
        hashlib.blake2b(b"splitserve-root" + struct.pack("<q", 0), digest_size=16).digest(), "little")


def test_hash_chains_parent_and_depends_on_seed():
    hasher = BlockHasher(block_size=2, seed=0)
    a = hasher.hash_prefix([1, 2, 3, 4, 5])
    b = hasher.hash_prefix([9, 9, 3, 4])
    assert len(a) == 2  # the trailing partial block [5] gets no hash
    assert a[1] != b[1]  # same tokens [3, 4], different parent
    assert a[0] == hash_block(hasher.root, [1, 2]) and a[1] == hash_block(a[0], [3, 4])
    assert BlockHasher(block_size=2, seed=1).hash_prefix([1, 2]) != a[:1]
    assert hasher.extend(list(a[:1]), [1, 2, 3, 4, 5]) == a


def test_a_salt_enters_the_first_blocks_parent_only():
    hasher = BlockHasher(block_size=2, seed=0)
    salted = hasher.hash_prefix([1, 2, 3, 4, 5], cache_salt="user-a")
    root = salted_root(hasher.root, "user-a")
    assert root == int.from_bytes(hashlib.blake2b(b"splitserve-salt" + root_hash(0).to_bytes(16, "little") + b"user-a",
                                                  digest_size=16).digest(), "little")
    assert salted == [hash_block(root, [1, 2]), hash_block(salted[0], [3, 4])]
    assert hasher.root_for("user-a") == root and hasher.root_for(None) == hasher.root
    assert hasher.extend(salted[:1], [1, 2, 3, 4, 5], cache_salt="user-a") == salted
    unsalted, other = hasher.hash_prefix([1, 2, 3, 4]), hasher.hash_prefix([1, 2, 3, 4], cache_salt="user-b")
    assert unsalted == [hash_block(hasher.root, [1, 2]), hash_block(unsalted[0], [3, 4])]  # as without salts
    assert len({salted[0], unsalted[0], other[0]}) == 3 and len({salted[1], unsalted[1], other[1]}) == 3
    lone_surrogate = salted_root(hasher.root, "\ud800")  # what JSON's "\ud800" decodes to: hashed, never an error
    assert lone_surrogate == int.from_bytes(hashlib.blake2b(
        b"splitserve-salt" + root_hash(0).to_bytes(16, "little") + b"\xed\xa0\x80", digest_size=16).digest(), "little")


# ---- allocation ------------------------------------------------------------------------------
def test_fresh_allocation_takes_blocks_in_order():
    manager = make_block_manager(num_blocks=8, block_size=4)
    first, second = make_request("a", list(range(10))), make_request("b", list(range(100, 105)))
    assert manager.allocate(first, 10).new_block_ids == (0, 1, 2)
    assert manager.allocate(second, 5).new_block_ids == (3, 4)
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.free_block_order() == [5, 6, 7]
    computed(first, 10)
    assert manager.allocate(first, 2).new_block_ids == ()  # 12 tokens still fit in 3 blocks
    assert manager.allocate(first, 3).new_block_ids == (5,)
    manager.free("a")
    manager.free("b")
    assert_pool_idle(manager)


def test_allocation_failure_changes_nothing():
    manager = make_block_manager(num_blocks=4, block_size=4)
    manager.allocate(make_request("a", list(range(8))), 8)
    order_before = manager.free_block_order()
    assert manager.allocate(make_request("b", list(range(12))), 12) is None
    assert manager.free_block_order() == order_before == [2, 3]
    assert manager.block_table("b") == []
    manager.free("a")
    assert_pool_idle(manager)


def test_free_order_hashed_tail_first_unhashed_to_front():
    manager = make_block_manager(num_blocks=6, block_size=4)
    request = computed(make_request("a", list(range(10))), 0)
    manager.allocate(request, 10)  # blocks 0, 1, 2; block 2 is partial
    computed(request, 10)
    manager.cache_full_blocks(request)  # blocks 0 and 1 get hashes
    manager.free("a")
    # Unhashed partial block 2 goes to the front; hashed blocks to the back, tail (1) before head (0).
    assert manager.free_block_order() == [2, 3, 4, 5, 1, 0]
    assert manager.num_cached_free_blocks == 2
    assert_pool_idle(manager)


# ---- prefix cache ----------------------------------------------------------------------------
def test_prefix_match_revives_cached_free_blocks():
    manager = make_block_manager(num_blocks=8, block_size=4)
    first = prefilled(manager, "a", list(range(10)))
    manager.free("a")
    second = make_request("b", list(range(9)) + [77, 78])
    match = manager.match_prefix(second)
    assert match == PrefixMatch(block_ids=(0, 1), num_tokens=8)
    allocation = manager.allocate(second, 3, match)
    assert allocation.reused_block_ids == (0, 1) and allocation.new_block_ids == (2,)
    assert manager.block_table("b") == [0, 1, 2]
    assert [manager.ref_count(b) for b in (0, 1, 2)] == [1, 1, 1]
    assert manager.free_block_order() == [3, 4, 5, 6, 7]
    manager.free("b")
    assert_pool_idle(manager)


def test_prefix_hits_only_between_requests_of_the_same_salt():
    manager = make_block_manager(num_blocks=12, block_size=4)
    prefilled_salted = make_request("a", list(range(10)), cache_salt="user-a")
    manager.allocate(prefilled_salted, 10)
    manager.cache_full_blocks(computed(prefilled_salted, 10))
    manager.free("a")
    assert prefilled_salted.block_hashes == BlockHasher(4, 0).hash_prefix(list(range(10)), cache_salt="user-a")
    assert manager.cached_block_hashes() == frozenset(prefilled_salted.block_hashes)
    same = manager.match_prefix(make_request("b", list(range(10)), cache_salt="user-a"))
    assert same == PrefixMatch(block_ids=(0, 1), num_tokens=8)
    assert manager.match_prefix(make_request("c", list(range(10)), cache_salt="user-b")) == PrefixMatch((), 0)
    assert manager.match_prefix(make_request("d", list(range(10)))) == PrefixMatch((), 0)
    unsalted = prefilled(manager, "e", list(range(10)))  # a's partial block 2 first, then fresh ones
    assert manager.block_table("e") == [2, 3, 4]
    assert [manager.cached_block_id(h) for h in (*prefilled_salted.block_hashes, *unsalted.block_hashes)] == [0, 1, 2, 3]
    manager.free("e")
    assert_pool_idle(manager)


def test_full_prompt_hit_leaves_one_token_to_compute():
    manager = make_block_manager(num_blocks=8, block_size=4)
    first = prefilled(manager, "a", list(range(8)))
    manager.free("a")
    match = manager.match_prefix(make_request("b", list(range(8))))
    assert match.num_tokens == 4 and match.block_ids == (0,)


def test_shared_prefix_between_live_requests_counts_references():
    manager = make_block_manager(num_blocks=8, block_size=4)
    first = prefilled(manager, "a", list(range(9)))
    second = make_request("b", list(range(8)) + [50, 51])
    match = manager.match_prefix(second)
    manager.allocate(second, 2, match)
    assert manager.block_table("b") == [0, 1, 3]
    assert [manager.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    manager.free("a")
    assert [manager.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    assert manager.free_block_order()[0] == 2  # a's unhashed partial block is reused first
    manager.free("b")
    assert_pool_idle(manager)


def test_eviction_reuses_least_recently_freed_and_forgets_its_hash():
    manager = make_block_manager(num_blocks=4, block_size=4)
    old = prefilled(manager, "old", list(range(4)))
    old_hash = old.block_hashes[0]
    manager.free("old")
    assert manager.cached_block_id(old_hash) == 0
    assert manager.free_block_order() == [1, 2, 3, 0]
    hog = make_request("hog", list(range(100, 116)))
    assert manager.allocate(hog, 16).new_block_ids == (1, 2, 3, 0)  # block 0 evicted last
    assert manager.cached_block_id(old_hash) is None
    manager.free("hog")
    assert manager.match_prefix(make_request("again", list(range(4)) + [1])).num_tokens == 0
    assert_pool_idle(manager)


def test_duplicate_content_is_not_hashed_twice():
    manager = make_block_manager(num_blocks=8, block_size=4)
    first, twin = make_request("a", list(range(5))), make_request("b", list(range(5)))
    manager.allocate(first, 5)
    manager.allocate(twin, 5)  # admitted in the same step: no match yet
    manager.cache_full_blocks(computed(first, 5))
    manager.cache_full_blocks(computed(twin, 5))
    assert manager.cached_block_id(first.block_hashes[0]) == 0
    manager.free("a")
    manager.free("b")
    # Only block 0 carries the hash; every unhashed block (b's 2 and 3, a's partial 1) is reused first.
    assert manager.free_block_order() == [2, 3, 1, 4, 5, 6, 7, 0]
    assert_pool_idle(manager)


def test_prefix_caching_disabled_never_matches():
    manager = make_block_manager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = prefilled(manager, "a", list(range(9)))
    manager.free("a")
    assert manager.match_prefix(make_request("b", list(range(9)))).num_tokens == 0
    assert manager.num_cached_free_blocks == 0
    assert_pool_idle(manager)


def test_reset_prefix_cache_only_when_idle():
    manager = make_block_manager(num_blocks=4, block_size=4)
    request = prefilled(manager, "a", list(range(5)))
    assert manager.reset_prefix_cache() is False
    manager.free("a")
    assert manager.reset_prefix_cache() is True
    assert manager.num_cached_free_blocks == 0
    assert manager.match_prefix(make_request("b", list(range(5)))).num_tokens == 0


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_usage_tracks_owned_blocks(block_size):
    manager = make_block_manager(num_blocks=10, block_size=block_size)
    manager.allocate(make_request("a", list(range(3 * block_size))), 3 * block_size)
    assert manager.usage == pytest.approx(0.3)
    manager.free("a")
    assert manager.usage == 0.0


# ---- KV events -------------------------------------------------------------------------------
def test_stored_events_chain_their_parents_across_chunks_and_prefix_hits():
    manager = make_block_manager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(13)))
    manager.allocate(request, 13)
    manager.cache_full_blocks(computed(request, 5))
    manager.cache_full_blocks(computed(request, 13))
    h = request.block_hashes
    assert manager.take_events() == [BlocksStored((h[0],), None), BlocksStored((h[1], h[2]), h[0])]
    assert manager.take_events() == []
    follower = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    manager.allocate(follower, 5, manager.match_prefix(follower))  # reuses a's blocks 0 and 1
    manager.cache_full_blocks(computed(follower, 13))
    assert manager.take_events() == [BlocksStored((follower.block_hashes[2],), h[1])]
    assert manager.cached_block_hashes() == {h[0], h[1], h[2], follower.block_hashes[2]}


def test_a_duplicate_block_splits_the_stored_chain():
    manager = make_block_manager(num_blocks=10, block_size=4)
    prompt = list(range(12))
    first, second, third = (make_request(rid, prompt) for rid in ("w", "z", "y"))
    for request in (first, second, third):  # admitted together: no prefix hits, blocks 0-2, 3-5, 6-8
        manager.allocate(request, 12)
    manager.cache_full_blocks(computed(first, 4))  # h0 on block 0
    manager.cache_full_blocks(computed(second, 8))  # h0 is a duplicate: only h1, on block 4
    manager.free("w")  # free order [1, 2, 9, 0]
    manager.allocate(make_request("hog", list(range(100, 116))), 16)  # evicts block 0 and h0 with it
    manager.cache_full_blocks(computed(third, 12))  # h0 new again, h1 duplicate, h2 new
    h = third.block_hashes
    assert manager.take_events() == [BlocksStored((h[0],), None), BlocksStored((h[1],), h[0]),
                                     BlocksRemoved((h[0],)),
                                     BlocksStored((h[0],), None), BlocksStored((h[2],), h[1])]
    assert manager.cached_block_hashes() == {h[0], h[1], h[2]}
    assert (manager.cached_block_id(h[0]), manager.cached_block_id(h[1]), manager.cached_block_id(h[2])) == (6, 4, 8)


def test_evictions_in_one_allocation_are_one_removed_event_in_eviction_order():
    manager = make_block_manager(num_blocks=4, block_size=4)
    old = prefilled(manager, "old", list(range(8)))
    manager.free("old")
    assert manager.free_block_order() == [2, 3, 1, 0]
    manager.take_events()
    manager.allocate(make_request("hog", list(range(100, 116))), 16)
    assert manager.take_events() == [BlocksRemoved((old.block_hashes[1], old.block_hashes[0]))]
    assert manager.cached_block_hashes() == frozenset()


def test_reviving_a_cached_free_block_is_no_event():
    manager = make_block_manager(num_blocks=8, block_size=4)
    prefilled(manager, "a", list(range(8)))
    manager.free("a")
    manager.take_events()
    again = make_request("b", list(range(9)))
    manager.allocate(again, 1, manager.match_prefix(again))
    manager.free("b")
    assert manager.take_events() == []


def test_reset_prefix_cache_removes_every_hash():
    manager = make_block_manager(num_blocks=8, block_size=4)
    first, second = prefilled(manager, "a", list(range(9))), prefilled(manager, "b", [60, 61, 62, 63])
    manager.free("a")
    manager.free("b")
    manager.take_events()
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [BlocksRemoved((*first.block_hashes, *second.block_hashes))]
    assert manager.cached_block_hashes() == frozenset()


def test_prefix_caching_disabled_records_no_events():
    manager = make_block_manager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    prefilled(manager, "a", list(range(8)))
    manager.free("a")
    manager.allocate(make_request("hog", list(range(100, 116))), 16)
    manager.free("hog")
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [] and manager.cached_block_hashes() == frozenset()


# ---- pool size -------------------------------------------------------------------------------
def test_a_pool_of_any_size_costs_nothing_until_its_blocks_are_used():
    num_blocks = 1 << 40  # a Python object per block would need hundreds of terabytes
    manager = make_block_manager(num_blocks=num_blocks, block_size=4)
    request = prefilled(manager, "a", list(range(10)))
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.num_free_blocks == num_blocks - 3 and manager.ref_count(num_blocks - 1) == 0
    with pytest.raises(IndexError, match="outside the pool"):
        manager.ref_count(num_blocks)
    manager.free(request.request_id)
    assert (manager.num_free_blocks, manager.num_cached_free_blocks) == (num_blocks, 2)
    assert manager.allocate(make_request("b", [1]), 1).new_block_ids == (2,)  # the unhashed partial block


# ---- random operations against a plain list of the free order ----------------------------------
class _FreeOrderModel:
    """The eviction order the module docstring states, kept as one plain list (the oracle)."""

    def __init__(self, num_blocks: int) -> None:
        self.order = list(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def allocate(self, num_blocks: int) -> tuple[int, ...]:
        """Blocks for new tokens: the first of the free order."""
        new_ids = tuple(self.order[:num_blocks])
        for block_id in new_ids:
            self.take(block_id)
        return new_ids

    def take(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            self.order.remove(block_id)
        self.ref_counts[block_id] += 1

    def release(self, block_id: int, to_front: bool) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.order.insert(0, block_id) if to_front else self.order.append(block_id)


def _hashed_blocks(manager) -> set[int]:
    return {manager.cached_block_id(block_hash) for block_hash in manager.cached_block_hashes()}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "grow", "reserve", "truncate", "free"]), st.integers(0, 3),
                          st.integers(1, 9)), max_size=40))
def test_random_operations_keep_the_stated_eviction_order(operations):
    num_blocks, block_size = 12, 2
    manager, model = make_block_manager(num_blocks=num_blocks, block_size=block_size), _FreeOrderModel(num_blocks)
    live = {}
    for operation, slot, num_tokens in operations:
        request_id = f"r{slot}"
        request = live.get(request_id)
        if operation == "admit" and request is None:
            # prompts share their first tokens across slots, so prefix hits revive cached-free blocks
            request = make_request(request_id, [t % 5 for t in range(num_tokens)] + [slot])
            match = manager.match_prefix(request)
            allocation = manager.allocate(request, request.num_tokens - match.num_tokens, match)
            if allocation is not None:
                for block_id in allocation.reused_block_ids:
                    model.take(block_id)
                assert allocation.new_block_ids == model.allocate(len(allocation.new_block_ids))
                manager.cache_full_blocks(computed(request, request.num_tokens))
                live[request_id] = request
        elif operation in ("grow", "reserve") and request is not None:
            allocation = manager.allocate(request, num_tokens)
            if allocation is not None:
                assert allocation.new_block_ids == model.allocate(len(allocation.new_block_ids))
            if allocation is not None and operation == "grow":
                request.all_token_ids.extend([7] * num_tokens)
                manager.cache_full_blocks(computed(request, request.num_computed_tokens + num_tokens))
        elif operation == "free" and request is not None:
            hashed = _hashed_blocks(manager)
            for block_id in reversed(manager.block_table(request_id)):
                model.release(block_id, to_front=block_id not in hashed)
            manager.free(request_id)
            del live[request_id]
        elif operation == "truncate" and request is not None:  # a speculative step's reserved tail
            keep = request.num_computed_tokens
            for block_id in reversed(manager.block_table(request_id)[manager.blocks_needed(keep):]):
                model.release(block_id, to_front=True)
            manager.truncate(request_id, keep)
        free_order = manager.free_block_order()
        assert free_order == model.order
        assert [manager.ref_count(b) for b in range(num_blocks)] == model.ref_counts
        assert manager.num_free_blocks == len(free_order)
        assert manager.num_cached_free_blocks == len(_hashed_blocks(manager) & set(free_order))
