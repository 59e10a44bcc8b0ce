"""KV block allocation, reference counting, prefix caching and LRU eviction.

Invariants:
- A block is in the free list iff its ref_count is 0.
- The free list is the eviction order: allocation takes blocks from its front.
  Freed blocks that carry a hash go to the back (most recently used, evicted last);
  freed blocks without a hash go to the front (nothing worth keeping).
- Blocks never allocated sit in the free list between those two groups, in id order, without
  objects of their own (`FreeBlockList`): a pool of millions of blocks costs nothing until used.
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


class FreeBlockList:
    """The free blocks in eviction order: `front` (most recently pushed first), then the ids never
    handed out (`next_fresh_id` up to `num_blocks`, ascending), then `back` (oldest first).

    Every operation is O(1). Fresh ids leave in ascending order, so the caller can keep one object
    per block ever handed out in a list indexed by block id."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.next_fresh_id = 0
        self._front: OrderedDict[int, None] = OrderedDict()
        self._back: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._front) + (self.num_blocks - self.next_fresh_id) + len(self._back)

    def order(self) -> list[int]:
        return [*self._front, *range(self.next_fresh_id, self.num_blocks), *self._back]

    def push_front(self, block_id: int) -> None:
        self._front[block_id] = None
        self._front.move_to_end(block_id, last=False)

    def push_back(self, block_id: int) -> None:
        self._back[block_id] = None

    def pop_first(self) -> int:
        """The first block in eviction order (KeyError when empty)."""
        if self._front:
            return self._front.popitem(last=False)[0]
        if self.next_fresh_id < self.num_blocks:
            self.next_fresh_id += 1
            return self.next_fresh_id - 1
        return self._back.popitem(last=False)[0]

    def remove(self, block_id: int) -> None:
        """Take a block that was handed out before out of the list, wherever it is."""
        if block_id in self._back:
            del self._back[block_id]
        else:
            del self._front[block_id]


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
        self._blocks: list[KVBlock] = []
        """Every block handed out at least once: `_blocks[i].block_id == i`."""
        self._free = FreeBlockList(num_blocks)
        self._num_cached_free = 0
        """Free blocks that carry a hash (kept up to date so stats never scan the pool)."""
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
        return self._num_cached_free

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_order(self) -> list[int]:
        """Free block ids in eviction order (first is reused first)."""
        return self._free.order()

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def owns_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block {block_id} is outside the pool of {self.num_blocks}")
        return self._blocks[block_id].ref_count if block_id < len(self._blocks) else 0

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
        self.hasher.extend(request.block_hashes, request.all_token_ids, request.cache_salt, request.lora_name)
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
        self.hasher.extend(request.block_hashes, request.all_token_ids[: num_full * self.block_size],
                           request.cache_salt, request.lora_name)
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
            self._release(block, evict_first=block.block_hash is None)

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Return the request's blocks past the first `num_tokens` tokens (a speculative step's
        rejected tail). They were allocated for tokens whose KV was never accepted, so they carry
        no hash and go to the front of the free list, as a freed unhashed block does."""
        table = self._tables[request_id]
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(table[keep:]):
            self._release(self._blocks[block_id], evict_first=True)
        del table[keep:]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is owned."""
        if len(self._free) != self.num_blocks:
            return False
        self._record_removed(tuple(self._cached))
        self._cached.clear()
        for block in self._blocks:
            block.block_hash = None
        self._num_cached_free = 0
        return True

    def _release(self, block: KVBlock, evict_first: bool) -> None:
        """Drop one reference; at zero the block joins the free list's front or back."""
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        if evict_first:
            self._free.push_front(block.block_id)
        else:
            self._free.push_back(block.block_id)
        if block.block_hash is not None:
            self._num_cached_free += 1

    def _claim(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            self._free.remove(block_id)
            if block.block_hash is not None:
                self._num_cached_free -= 1
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id = self._free.pop_first()
        if block_id == len(self._blocks):
            self._blocks.append(KVBlock(block_id))
        block = self._blocks[block_id]
        if block.block_hash is not None:  # evicted: the map points at this block (invariant)
            self._num_cached_free -= 1
            del self._cached[block.block_hash]
            self._record_removed((block.block_hash,))
            block.block_hash = None
        block.ref_count = 1
        return block_id
