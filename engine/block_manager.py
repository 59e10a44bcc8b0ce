"""KV block allocation, reference counting, prefix caching and LRU eviction.

Invariants:
- A block is in the free list iff its ref_count is 0.
- The free list is the eviction order: allocation takes blocks from its front.
  Freed blocks that carry a hash go to the back (most recently used, evicted last);
  freed blocks without a hash go to the front (nothing worth keeping).
- A free block keeps its hash (and its entry in the hash map) until it is reused,
  so a later request with the same prefix can revive it.
- The hash map points only at blocks whose contents match the hash, and a block carries a
  hash iff the map points at it.
- KV events (prefix caching only) mirror the hash map's keys: replaying every event recorded
  since construction (add stored, drop removed) gives exactly `cached_block_hashes()`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from splitserve.common.block_hash import BlockHash, BlockHasher
from splitserve.common.kv_events import BlocksRemoved, BlocksStored, KVEvent
from splitserve.engine.request import Request


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None


@dataclass(frozen=True)
class PrefixMatch:
    """Leading blocks of a request found in the prefix cache (not yet claimed)."""

    block_ids: tuple[int, ...]
    num_tokens: int


NO_PREFIX = PrefixMatch(block_ids=(), num_tokens=0)


@dataclass(frozen=True)
class BlockAllocation:
    """Result of a successful allocation; opaque to the scheduler beyond success."""

    new_block_ids: tuple[int, ...]
    reused_block_ids: tuple[int, ...]


class BlockManager:
    """Owns every KV block of one engine and the block table of every request."""

    def __init__(self, num_blocks: int, block_size: int, hasher: BlockHasher,
                 enable_prefix_caching: bool) -> None:
        if hasher.block_size != block_size:
            raise ValueError("hasher and block manager disagree on block_size")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.hasher = hasher
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}
        self._events: list[KVEvent] = []
        """Changes to the hash map's keys since the last take_events(), in order."""

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for block_id in self._free if self._blocks[block_id].block_hash is not None)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_order(self) -> list[int]:
        """Free block ids in eviction order (first is reused first)."""
        return list(self._free)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def owns_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def cached_block_id(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def cached_block_hashes(self) -> frozenset[BlockHash]:
        """Every hash the prefix cache holds (owned or cached-free blocks)."""
        return frozenset(self._cached)

    def take_events(self) -> list[KVEvent]:
        """The KV events recorded since the last call, oldest first (drains them)."""
        events, self._events = self._events, []
        return events

    # ---- prefix cache --------------------------------------------------------------------
    def match_prefix(self, request: Request) -> PrefixMatch:
        """Longest run of leading full blocks already cached.

        At least one token is always left to compute so the step produces logits.
        """
        if not self.enable_prefix_caching:
            return NO_PREFIX
        self.hasher.extend(request.block_hashes, request.all_token_ids)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return PrefixMatch(tuple(block_ids), len(block_ids) * self.block_size)

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's newly completed full blocks in the hash map.

        Records one BlocksStored per run of newly inserted blocks: a block whose hash is already
        cached (a duplicate) is skipped and ends the run, so each run's parent is exact."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request.request_id]
        num_full = request.num_computed_tokens // self.block_size
        self.hasher.extend(request.block_hashes, request.all_token_ids[: num_full * self.block_size])
        start = self._num_hashed.get(request.request_id, 0)
        run_start = start  # request.block_hashes[run_start:index] were inserted by this call
        for index in range(start, num_full):
            if not self._insert(self._blocks[table[index]], request.block_hashes[index]):
                self._record_stored(request.block_hashes, run_start, index)
                run_start = index + 1
        self._record_stored(request.block_hashes, run_start, num_full)
        self._num_hashed[request.request_id] = max(start, num_full)

    def _insert(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Give `block` its hash unless it has one or another block holds that hash already."""
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block.block_id
        return True

    def _record_stored(self, hashes: list[BlockHash], start: int, stop: int) -> None:
        """Record that hashes[start:stop] (a chain, possibly empty) entered the cache."""
        if start < stop:
            parent = hashes[start - 1] if start > 0 else None
            self._events.append(BlocksStored(tuple(hashes[start:stop]), parent))

    def _record_removed(self, hashes: tuple[BlockHash, ...]) -> None:
        """Record that `hashes` left the cache, merged into the previous event if it is a removal."""
        if not hashes:
            return
        if self._events and isinstance(self._events[-1], BlocksRemoved):
            hashes = self._events.pop().block_hashes + hashes
        self._events.append(BlocksRemoved(hashes))

    # ---- allocation ----------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int,
                 prefix: PrefixMatch = NO_PREFIX) -> BlockAllocation | None:
        """Make room for `num_new_tokens` after the request's computed tokens (and `prefix`).

        Returns None and changes nothing when there are not enough blocks.
        """
        table = self._tables.get(request.request_id, [])
        total_tokens = request.num_computed_tokens + prefix.num_tokens + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(table) - len(prefix.block_ids)
        revived = sum(1 for block_id in prefix.block_ids if self._blocks[block_id].ref_count == 0)
        if max(num_new_blocks, 0) + revived > len(self._free):
            return None
        for block_id in prefix.block_ids:
            self._claim(block_id)
        new_ids = tuple(self._pop_free() for _ in range(max(num_new_blocks, 0)))
        self._tables[request.request_id] = table + list(prefix.block_ids) + list(new_ids)
        if prefix.block_ids:
            self._num_hashed[request.request_id] = len(table) + len(prefix.block_ids)
        return BlockAllocation(new_block_ids=new_ids, reused_block_ids=prefix.block_ids)

    def free(self, request_id: str) -> None:
        """Release every block of the request; tail blocks become the first to be evicted."""
        table = self._tables.pop(request_id, [])
        self._num_hashed.pop(request_id, None)
        for block_id in reversed(table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Return the request's blocks past the first `num_tokens` tokens (a speculative step's
        rejected tail). They were allocated for tokens whose KV was never accepted, so they carry
        no hash and go to the front of the free list, as a freed unhashed block does."""
        table = self._tables[request_id]
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(table[keep:]):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)
        del table[keep:]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is owned."""
        if len(self._free) != self.num_blocks:
            return False
        self._record_removed(tuple(self._cached))
        self._cached.clear()
        for block in self._blocks:
            block.block_hash = None
        return True

    def _claim(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:  # evicted: the map points at this block (invariant)
            del self._cached[block.block_hash]
            self._record_removed((block.block_hash,))
            block.block_hash = None
        block.ref_count = 1
        return block_id
