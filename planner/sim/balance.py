"""The least loaded member of a set of workers (a pool's routable workers, or those of them that
cache one prefix group), without scanning the set."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from splitserve.planner.sim.workers import Worker

STALE_FACTOR = 4
"""The heap is rebuilt from the members once it holds this many entries per member it had at the
last rebuild (and at least MIN_REBUILD)."""
MIN_REBUILD = 1024


class LeastLoaded:
    """A lazy min-heap of (load, sequence number, worker) with one floor per worker.

    Invariant: every member w has floor[w] <= its load now and an entry (floor[w], _, w) in the
    heap. Callers call update(w, load) whenever a member's load decreases and when a worker
    becomes a member (calls on increases are allowed, and cost nothing): it pushes only below the
    floor. least() drops entries that are superseded (load != floor) or of non-members, and
    re-pushes a surfacing member whose load grew since, so it is exact: the least load among the
    members (ties to the oldest entry), at O(log n) amortised per push."""

    __slots__ = ("_heap", "_seq", "_floor", "_load_of", "_is_member", "_members", "_limit")

    def __init__(self, load_of: Callable[[Worker], int], is_member: Callable[[Worker], bool],
                 members: Callable[[], list]) -> None:
        self._heap: list[tuple[int, int, Worker]] = []
        self._seq = itertools.count()
        self._floor: dict[Worker, int] = {}
        self._load_of, self._is_member, self._members = load_of, is_member, members
        self._limit = MIN_REBUILD

    def update(self, worker: Worker, load: int) -> None:
        """worker (a member) has `load` now (= load_of(worker))."""
        floor = self._floor.get(worker)
        if floor is None or load < floor:
            self._floor[worker] = load
            heapq.heappush(self._heap, (load, next(self._seq), worker))

    def least(self) -> Worker | None:
        if len(self._heap) > self._limit:
            self._rebuild()
        heap, floors = self._heap, self._floor
        while heap:
            load, _, worker = heap[0]
            if floors.get(worker) != load:
                heapq.heappop(heap)
            elif not self._is_member(worker):
                heapq.heappop(heap)
                del floors[worker]
            else:
                current = self._load_of(worker)
                if current == load:
                    return worker
                floors[worker] = current
                heapq.heapreplace(heap, (current, next(self._seq), worker))
        return None

    def _rebuild(self) -> None:
        members = self._members()
        self._floor = {w: self._load_of(w) for w in members}
        self._heap = [(self._floor[w], next(self._seq), w) for w in members]
        heapq.heapify(self._heap)
        self._limit = max(MIN_REBUILD, STALE_FACTOR * len(self._heap))
