"""Measures the router's own event loop: how late a heartbeat that is due every BEAT_S runs.

A blocked loop (a long computation on it, a thread holding the GIL) delays every callback by the
same amount; the heartbeat sees that delay as its lag. Two uses: the lag histogram
(splitserve_event_loop_lag_seconds, from stats()), and `stalled_s()`, which lets a timeout that
ran while the loop was stalled be extended by the stall (router/reports.py: a stalled monitor is
not a dead worker).
"""

from __future__ import annotations

import asyncio
import bisect
import math

from splitserve.common.metrics import LOOP_LAG_BUCKETS
from splitserve.common.stats import LoopLagStats

BEAT_S = 0.1
"""Heartbeat period."""
STALL_FLOOR_S = 0.05
"""A beat later than this counts as a stall (below it: scheduling jitter and ordinary callbacks)."""


class LoopLagMonitor:
    """The heartbeat task and what it measured; every method runs on the monitored loop."""

    def __init__(self) -> None:
        self._task: asyncio.Task | None = None
        self._next_beat = math.inf
        """loop.time() the next beat is due (never, before start())."""
        self._stalled_s = 0.0
        """Sum of the lag of every beat later than STALL_FLOOR_S."""
        self._counts = [0] * (len(LOOP_LAG_BUCKETS) + 1)
        """Beats per bucket: counts[i] lagged at most LOOP_LAG_BUCKETS[i] (and more than the
        bound before it); the last one is +Inf."""
        self._sum_s = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._next_beat = loop.time() + BEAT_S
        self._task = loop.create_task(self._beat())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def stalled_s(self) -> float:
        """Seconds the loop has been stalled since start, the stall going on now included
        (non-decreasing but for a beat's jitter below STALL_FLOOR_S)."""
        overdue = asyncio.get_running_loop().time() - self._next_beat
        return self._stalled_s + (overdue if overdue > STALL_FLOOR_S else 0.0)

    def stats(self) -> LoopLagStats:
        cumulative, total = [], 0
        for count in self._counts[:-1]:
            total += count
            cumulative.append(total)
        return LoopLagStats(LOOP_LAG_BUCKETS, tuple(cumulative), total + self._counts[-1], self._sum_s)

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._next_beat - loop.time())
            now = loop.time()
            self._record(max(0.0, now - self._next_beat))
            self._next_beat = now + BEAT_S

    def _record(self, lag_s: float) -> None:
        self._counts[bisect.bisect_left(LOOP_LAG_BUCKETS, lag_s)] += 1
        self._sum_s += lag_s
        if lag_s > STALL_FLOOR_S:
            self._stalled_s += lag_s
