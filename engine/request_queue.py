"""A queue of requests waiting their turn, ordered by the engine's scheduling policy (vLLM's
`scheduling_policy`).

- fcfs: arrival order; `push_front` puts a request back at the head (a preempted request, a
  failed pull: it was admitted before anything still waiting).
- priority: ascending `order_key` at all times (the scheduler's is (priority, arrival index):
  lower priority values first, ties by arrival), `push_front` included: a request put back
  takes its place by its key, as in vLLM's priority queue. Equal keys keep push order.

The head (`peek`) is always the request to admit next.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from splitserve.common.config import SCHEDULING_POLICIES

T = TypeVar("T")


class RequestQueue(Generic[T]):
    """Items in admission order under `policy` (one of SCHEDULING_POLICIES)."""

    def __init__(self, policy: str, order_key: Callable[[T], tuple[int, ...]]) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.policy = policy
        self._order_key = order_key
        """Used only under the priority policy."""
        self._fifo: deque[T] = deque()
        self._sorted: list[T] = []
        """priority: sorted by order_key, head first (inserting is O(n); queues here hold at most thousands)."""

    @property
    def _items(self) -> deque[T] | list[T]:
        return self._sorted if self.policy == "priority" else self._fifo

    def push(self, item: T) -> None:
        """A newly arrived item: at the back (fcfs), or after every item whose key is <= its own (priority)."""
        if self.policy == "priority":
            bisect.insort_right(self._sorted, item, key=self._order_key)
        else:
            self._fifo.append(item)

    def push_front(self, item: T) -> None:
        """An item put back: at the head (fcfs), or where its key places it (priority)."""
        if self.policy == "priority":
            bisect.insort_left(self._sorted, item, key=self._order_key)
        else:
            self._fifo.appendleft(item)

    def peek(self) -> T:
        """The head (IndexError when empty)."""
        return self._items[0]

    def pop(self) -> T:
        """Take the head (IndexError when empty)."""
        return self._sorted.pop(0) if self.policy == "priority" else self._fifo.popleft()

    def remove(self, item: T) -> None:
        """Take `item` out wherever it is (ValueError if absent)."""
        self._items.remove(item)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)
