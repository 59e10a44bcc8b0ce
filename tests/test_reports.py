"""The router's WorkerMonitor: a worker that stops answering (or answers with something that
cannot be applied) is unroutable and purged until it answers again; then it resyncs."""

from __future__ import annotations

import asyncio
import time

from splitserve.common.kv_events import KVSnapshot
from splitserve.common.metrics import LOOP_LAG_BUCKETS
from splitserve.router.loop_lag import LoopLagMonitor
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.reports import WorkerMonitor
from splitserve.router.worker_link import WorkerLinkConfig
from tests.factories import ScriptedReporter, make_load_report, make_worker_report

SHORT_REPORT_TIMEOUT = WorkerLinkConfig(report_timeout_s=0.2)

HASHES = frozenset({11, 12, 13})


def _snapshot_report(epoch: str, running: int = 0):
    return make_worker_report("w", epoch, snapshot=KVSnapshot(epoch, 3, HASHES),
                              load=make_load_report(num_running=running))


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _never_lost(worker_id: str, reason: str) -> None:
    raise AssertionError(f"worker {worker_id} reported lost: {reason}")


def test_a_failing_worker_is_purged_and_resyncs_when_it_answers_again():
    worker = ScriptedReporter("w", [_snapshot_report("e1", running=1), RuntimeError("actor died"),
                                    _snapshot_report("e1", running=2)])

    async def scenario():
        index = PrefixIndex()
        monitor = WorkerMonitor([worker], index, on_restart=lambda worker_id: asyncio.sleep(0),
                                on_lost=lambda worker_id, reason: lost.append((worker_id, reason)),
                                loop_lag=LoopLagMonitor())
        await monitor.start()
        seen = [(monitor.load("w").num_running, index.num_blocks("w"))]
        await _until(lambda: monitor.load("w") is None)
        seen.append((None, index.num_blocks("w")))
        await _until(lambda: monitor.load("w") is not None)
        seen.append((monitor.load("w").num_running, index.num_blocks("w")))
        await monitor.stop()
        return seen, index.cursor("w")

    lost: list[tuple[str, str]] = []
    seen, cursor = asyncio.run(scenario())
    assert seen == [(1, 3), (None, 0), (2, 3)]
    assert cursor == ("e1", 3)
    assert lost == [("w", "its report poll failed: RuntimeError: actor died")]


def test_a_restart_keeps_the_worker_unroutable_until_its_new_identity_is_known():
    worker = ScriptedReporter("w", [_snapshot_report("e1"), _snapshot_report("e2")])
    restarts: list[str] = []

    async def on_restart(worker_id: str) -> None:
        restarts.append(worker_id)
        if len(restarts) == 1:
            raise RuntimeError("info unavailable")

    async def scenario():
        monitor = WorkerMonitor([worker], PrefixIndex(), on_restart, on_lost=_never_lost, loop_lag=LoopLagMonitor())
        await monitor.start()
        await _until(lambda: len(restarts) == 2 and monitor.load("w") is not None)
        await monitor.stop()
        return monitor

    asyncio.run(scenario())
    assert restarts == ["w", "w"]  # the first failure was retried, the task survived it


class _GatedReporter:
    """Answers its first poll at once and each later one when the test sets `pending`'s result."""

    def __init__(self, worker_id: str, first) -> None:
        self.worker_id = worker_id
        self._first = first
        self.pending: asyncio.Future | None = None

    async def report(self, epoch, after_seq: int, max_wait_s: float):
        if self._first is not None:
            first, self._first = self._first, None
            return first
        self.pending = asyncio.get_running_loop().create_future()
        return await self.pending


def test_stop_ends_polling_even_when_a_poll_answers_in_the_same_loop_turn():
    # Python 3.11's asyncio.wait_for returns the inner result when it completes in the turn the
    # cancellation arrives, swallowing the cancel: the watch loop then polled forever and stop() hung.
    worker = _GatedReporter("w", _snapshot_report("e1"))

    async def scenario():
        monitor = WorkerMonitor([worker], PrefixIndex(), on_restart=lambda worker_id: asyncio.sleep(0),
                                on_lost=_never_lost, loop_lag=LoopLagMonitor())
        await monitor.start()
        await _until(lambda: worker.pending is not None)
        worker.pending.set_result(_snapshot_report("e1"))
        await asyncio.wait_for(monitor.stop(), 2)

    asyncio.run(scenario())


def test_a_stalled_router_loop_does_not_make_an_answering_worker_lost():
    """A poll is out when the router's loop blocks for 1.5 s (five poll timeouts); the worker's
    answer is read 0.1 s after the stall (as a Ray reply waiting for the GIL would be): the poll's
    timeout was extended by the stall, so the worker stays routable."""
    worker = _GatedReporter("w", _snapshot_report("e1"))

    async def scenario():
        loop_lag = LoopLagMonitor()
        loop_lag.start()
        monitor = WorkerMonitor([worker], PrefixIndex(), on_restart=lambda worker_id: asyncio.sleep(0),
                                on_lost=_never_lost, loop_lag=loop_lag, link=SHORT_REPORT_TIMEOUT)
        await monitor.start()
        await _until(lambda: worker.pending is not None)
        stalled_before, answered = loop_lag.stalled_s(), worker.pending
        time.sleep(1.5)  # the loop is blocked (a long computation on it, or a thread holding the GIL)
        await asyncio.sleep(0.1)
        answered.set_result(_snapshot_report("e1"))
        await _until(lambda: worker.pending is not answered)  # the next poll: the answer was taken
        up, stalled = monitor.load("w") is not None, loop_lag.stalled_s() - stalled_before
        await monitor.stop()
        await loop_lag.stop()
        return up, stalled, loop_lag.stats()

    up, stalled, stats = asyncio.run(scenario())
    assert up and 1.4 < stalled < 1.7
    assert stats.count - stats.bucket_counts[LOOP_LAG_BUCKETS.index(1.0)] == 1  # the one beat later than 1 s


def test_a_silent_worker_is_still_lost_on_a_responsive_loop():
    worker = ScriptedReporter("w", [_snapshot_report("e1"), _snapshot_report("e1")], delay_s=0.0)
    lost: list[tuple[str, str]] = []

    async def scenario():
        loop_lag = LoopLagMonitor()
        loop_lag.start()
        monitor = WorkerMonitor([worker], PrefixIndex(), on_restart=lambda worker_id: asyncio.sleep(0),
                                on_lost=lambda worker_id, reason: lost.append((worker_id, reason)), loop_lag=loop_lag,
                                link=SHORT_REPORT_TIMEOUT)
        await monitor.start()
        worker._delay_s = 3600.0  # every later poll hangs
        await _until(lambda: lost)
        await monitor.stop()
        await loop_lag.stop()

    asyncio.run(scenario())
    assert lost == [("w", "its report poll failed: TimeoutError: no report within 0.2 s")]
