"""The simulator's clockwork: the event heap and the per-request table the pools share."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from splitserve.planner.sim.traces import Trace

Handler = Callable[[object, object, float], None]
"""An event's action: handler(a, b, now)."""


class EventQueue:
    """A min-heap of (time, sequence number, handler, a, b). The sequence number breaks ties in
    the order events were pushed, so a run is deterministic."""

    __slots__ = ("heap", "_seq")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Handler, object, object]] = []
        self._seq = itertools.count()

    def push(self, at_s: float, handler: Handler, a: object = None, b: object = None) -> None:
        heapq.heappush(self.heap, (at_s, next(self._seq), handler, a, b))


class RequestTable:
    """Per-request data as Python lists indexed by request id (the trace index): the trace's
    columns, and what the simulation fills in. first_token_s / finish_s are NaN until known."""

    __slots__ = ("arrival", "prompt", "output", "group", "shared", "uncached", "first_token_s", "finish_s")

    def __init__(self, trace: Trace) -> None:
        n = len(trace)
        self.arrival: list[float] = trace.arrival_s.tolist()
        self.prompt: list[int] = trace.prompt_tokens.tolist()
        self.output: list[int] = trace.output_tokens.tolist()
        self.group: list[int] = trace.prefix_group.tolist()
        self.shared: list[int] = trace.shared_tokens.tolist()
        self.uncached: list[int] = [0] * n
        """Prompt tokens its prefill worker computes (the whole prompt for a local prefill)."""
        self.first_token_s: list[float] = [math.nan] * n
        self.finish_s: list[float] = [math.nan] * n

    def __len__(self) -> int:
        return len(self.arrival)
