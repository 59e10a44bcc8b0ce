"""The simulated workers' mutable state (internal to the simulator; never crosses a boundary).

Plain classes with __slots__: the simulator touches them millions of times per run.
"""

from __future__ import annotations

from collections import deque
from enum import IntEnum


class WorkerState(IntEnum):
    """STARTING -> ROUTABLE -> DRAINING -> GONE; a STARTING worker may go straight to GONE (cancelled)."""

    STARTING = 0
    ROUTABLE = 1
    DRAINING = 2
    GONE = 3


class Worker:
    """Lifetime bookkeeping shared by both roles. Device time runs from asked_s to gone_s (None:
    still held; cluster.assemble counts it to the end of the run)."""

    __slots__ = ("wid", "state", "asked_s", "ready_s", "gone_s")

    def __init__(self, wid: int, asked_s: float) -> None:
        self.wid = wid
        self.state = WorkerState.STARTING
        self.asked_s = asked_s
        self.ready_s: float | None = None
        self.gone_s: float | None = None


class PrefillWorker(Worker):
    """A FIFO of requests computed in chunked steps of at most the token budget.

    Invariants: queued_tokens = the uncached tokens of every queued request not computed by a
    finished step (the step in flight still counts: the router's view of queued prefill work);
    head_left = the uncached tokens of queue[0] not computed by a finished step or in flight at
    the last step start (0 when the queue is empty); while busy, the step in flight computes
    step_tokens tokens: the rest of step_finishes requests from the queue's front, then
    step_partial tokens of the request after them."""

    __slots__ = ("queue", "queued_tokens", "head_left", "busy", "step_tokens", "step_finishes", "step_partial",
                 "prefixes")

    def __init__(self, wid: int, asked_s: float) -> None:
        super().__init__(wid, asked_s)
        self.queue: deque[int] = deque()
        self.queued_tokens = 0
        self.head_left = 0
        self.busy = False
        self.step_tokens = 0
        self.step_finishes = 0
        self.step_partial = 0
        self.prefixes: dict[int, None] = {}
        """LRU of cached prefix groups, least recently used first (dict insertion order)."""

    def touch_prefix(self, group: int, capacity: int) -> bool:
        """Whether `group` was cached; it is the most recently used one afterwards (the LRU one
        is evicted beyond `capacity`)."""
        prefixes = self.prefixes
        if group in prefixes:
            del prefixes[group]
            prefixes[group] = None
            return True
        prefixes[group] = None
        if len(prefixes) > capacity:
            del prefixes[next(iter(prefixes))]
        return False

    def idle(self) -> bool:
        return not self.busy and not self.queue


class DecodeWorker(Worker):
    """Continuous batching, advanced in macro-steps.

    Reference point: at time t_ref the worker is at a step boundary after k_ref steps, running
    `batch` requests whose contexts total `context` tokens; while batch > 0 it steps back to back,
    so boundary k_ref + m is at t_ref + steps_duration(first, growth, m). `finishing` is a heap of
    (boundary index at which the request's last token is out, request id). slots / kv_reserved
    count the requests admitted (transferring or running) and their full KV length (prompt +
    output), bounded by the batch limit and the KV capacity. The pending completion event (if any)
    targets boundary due_k (-1: none) at a time no later than that boundary's; `version` voids
    older events."""

    __slots__ = ("t_ref", "k_ref", "batch", "context", "finishing", "slots", "kv_reserved", "version", "due_k")

    def __init__(self, wid: int, asked_s: float) -> None:
        super().__init__(wid, asked_s)
        self.t_ref = asked_s
        self.k_ref = 0
        self.batch = 0
        self.context = 0
        self.finishing: list[tuple[int, int]] = []
        self.slots = 0
        self.kv_reserved = 0
        self.version = 0
        self.due_k = -1

    def idle(self) -> bool:
        return self.slots == 0
