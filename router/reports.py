"""Keeps the router's view of every worker current: its load and its prefix cache.

One long-poll task per worker calls `report(epoch, after_seq, max_wait_s)`: the worker answers
at once when its prefix cache changed since the router's cursor (or the cursor cannot be
continued, with a snapshot), else after `max_wait_s` with its current load. Each report feeds
the `PrefixIndex`; a worker that stops answering is purged from the index until it answers
again (and then resyncs from a snapshot; the orchestrator hears of the loss through
`on_lost`), and a worker that answers with a new epoch has restarted, which the orchestrator
hears about through `on_restart`.

A poll's timeout counts only time the router's event loop was responsive: a stall of the loop
itself (measured by router/loop_lag.py) extends the timeout by its length, so a stalled monitor
never declares an answering worker lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from splitserve.common.kv_events import LoadReport, WorkerCounters, WorkerReport
from splitserve.router.loop_lag import LoopLagMonitor
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.worker_link import WorkerLinkConfig
from splitserve.common.worker_api import WorkerAPI

logger = logging.getLogger(__name__)



class WorkerMonitor:
    def __init__(self, clients: Sequence[WorkerAPI], index: PrefixIndex,
                 on_restart: Callable[[str], Awaitable[None]], on_lost: Callable[[str, str], None],
                 loop_lag: LoopLagMonitor, link: WorkerLinkConfig = WorkerLinkConfig(),
                 on_reporting_changed: Callable[[], None] = lambda: None) -> None:
        """`on_lost(worker_id, reason)` runs when a reporting worker's poll fails; `loop_lag`
        (running on the same loop) says how long the loop itself was stalled during a poll;
        `link` holds the polls' timings; `on_reporting_changed()` runs whenever a worker starts or
        stops answering (the set of workers with a load changed)."""
        self.index = index
        self._link = link
        self._loop_lag = loop_lag
        self._clients = list(clients)
        self._on_restart = on_restart
        self._on_lost = on_lost
        self._on_reporting_changed = on_reporting_changed
        self._reports: dict[str, WorkerReport] = {}
        """Each answering worker's latest report (a worker that stops answering has none)."""
        self._epochs: dict[str, str] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        """worker id -> its poll loop (once started)."""
        for client in self._clients:
            index.add_worker(client.worker_id)

    def load(self, worker_id: str) -> LoadReport | None:
        """The worker's latest load; None while it is not answering."""
        report = self._reports.get(worker_id)
        return None if report is None else report.load

    def counters(self, worker_id: str) -> WorkerCounters | None:
        """The worker's cumulative counters from its latest report; None while it is not answering."""
        report = self._reports.get(worker_id)
        return None if report is None else report.counters

    async def start(self) -> None:
        """Take every worker's first report (so routing starts informed), then keep polling."""
        reports = await asyncio.gather(*(self._poll(client, 0.0) for client in self._clients))
        for client, report in zip(self._clients, reports):
            await self._observe(client.worker_id, report)
        loop = asyncio.get_running_loop()
        self._tasks = {client.worker_id: loop.create_task(self._watch(client)) for client in self._clients}

    async def add(self, client: WorkerAPI) -> None:
        """Watch a worker that joined after start: routable once this returns (its first report
        is in). Raises what its first poll raised (the worker is then not watched)."""
        self.index.add_worker(client.worker_id)
        try:
            await self._observe(client.worker_id, await self._poll(client, 0.0))
        except BaseException:
            self.remove(client.worker_id)
            raise
        self._clients.append(client)
        self._tasks[client.worker_id] = asyncio.get_running_loop().create_task(self._watch(client))

    def remove(self, worker_id: str) -> None:
        """Stop watching a worker that left the pool: no load, no index entries, no poll."""
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
        self._clients = [client for client in self._clients if client.worker_id != worker_id]
        if self._reports.pop(worker_id, None) is not None:
            self._on_reporting_changed()
        self._epochs.pop(worker_id, None)
        self.index.remove_worker(worker_id)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def _poll(self, client: WorkerAPI, max_wait_s: float) -> WorkerReport:
        epoch, after_seq = self.index.cursor(client.worker_id)
        return await client.report(epoch, after_seq, max_wait_s)

    async def _watch(self, client: WorkerAPI) -> None:
        """Poll forever; any failure (an error, no answer within link.report_timeout_s, a report that
        cannot be applied) makes the worker unroutable until a later poll succeeds."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                report = await self._poll_attended(client)
                await self._observe(client.worker_id, report)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if self.forget(client.worker_id):
                    logger.warning("worker %s stopped reporting: %s", client.worker_id, error)
                    self._on_lost(client.worker_id, f"its report poll failed: {type(error).__name__}: {error}")
                await asyncio.sleep(self._link.retry_after_failure_s)
                continue
            await asyncio.sleep(max(0.0, self._link.min_poll_interval_s - (loop.time() - started)))

    async def _poll_attended(self, client: WorkerAPI) -> WorkerReport:
        """One poll; TimeoutError once it has gone unanswered for report_wait_s + report_timeout_s
        of time the loop was responsive (the deadline moves out by every stall of the loop meanwhile:
        an answer that arrived during a stall is only read after it)."""
        loop = asyncio.get_running_loop()
        started, stalled_at_start = loop.time(), self._loop_lag.stalled_s()

        link = self._link

        def deadline() -> float:
            return started + link.report_wait_s + link.report_timeout_s + self._loop_lag.stalled_s() - stalled_at_start

        poll = asyncio.ensure_future(self._poll(client, link.report_wait_s))
        try:
            while True:
                # asyncio.wait, not wait_for: Python 3.11's wait_for swallows a cancel that arrives
                # in the turn the poll answers, and stop() would then wait forever.
                done, _ = await asyncio.wait((poll,), timeout=max(0.0, deadline() - loop.time()))
                if done:
                    return poll.result()
                if loop.time() >= deadline():
                    raise TimeoutError(f"no report within {link.report_timeout_s:g} s")
        finally:
            poll.cancel()  # no-op when done

    async def _observe(self, worker_id: str, report: WorkerReport) -> None:
        """Apply the report; a new epoch means the worker restarted: it stays unroutable until
        on_restart has learnt its new identity (an exception here is retried on the next report)."""
        if not self.index.apply(worker_id, report):
            logger.debug("worker %s: report not applicable, resyncing from a snapshot", worker_id)
        previous = self._epochs.get(worker_id)
        if previous is not None and previous != report.epoch:
            logger.info("worker %s restarted (epoch %s -> %s)", worker_id, previous, report.epoch)
            self._reports.pop(worker_id, None)
            await self._on_restart(worker_id)
        self._epochs[worker_id] = report.epoch
        answering = worker_id in self._reports
        self._reports[worker_id] = report
        if not answering:
            self._on_reporting_changed()

    def forget(self, worker_id: str) -> bool:
        """Make the worker unroutable until its next report; True if it was routable."""
        self.index.add_worker(worker_id)  # purged; resyncs from a snapshot once it answers again
        answering = self._reports.pop(worker_id, None) is not None
        if answering:
            self._on_reporting_changed()
        return answering
