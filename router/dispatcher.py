"""Collects decode workers' batched outputs and hands each delta to its request's stream.

One long-poll task per decode worker: `next_outputs(router_id)` returns everything produced
for this router since the last call, so the cost per token is a list entry, not an actor call.
If a worker stops answering, `on_lost` hears of it (the orchestrator moves that worker's
requests elsewhere or ends them); never a hang.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from splitserve.common.worker_messages import TokenDelta
from splitserve.router.worker_client import WorkerClient

logger = logging.getLogger(__name__)

LONG_POLL_S = 1.0
RETRY_AFTER_FAILURE_S = 0.5


class OutputDispatcher:
    def __init__(self, router_id: str, clients: Sequence[WorkerClient],
                 on_lost: Callable[[str, str], None]) -> None:
        """`on_lost(worker_id, reason)` runs on the event loop when a worker's poll fails."""
        self.router_id = router_id
        self._clients = list(clients)
        self._on_lost = on_lost
        self._streams: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.get_running_loop().create_task(self._collect(client)) for client in self._clients]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def open(self, request_id: str) -> asyncio.Queue:
        """The queue a request's deltas arrive on (open it before the request reaches a worker)."""
        return self._streams.setdefault(request_id, asyncio.Queue())

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def _collect(self, client: WorkerClient) -> None:
        answering = True
        while True:
            try:
                deltas: list[TokenDelta] = await client.call("next_outputs", self.router_id, LONG_POLL_S)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if answering:  # log an outage once, not every retry
                    logger.error("decode worker %s stopped answering: %s", client.worker_id, error)
                answering = False
                self._on_lost(client.worker_id, f"its output poll failed: {type(error).__name__}: {error}")
                await asyncio.sleep(RETRY_AFTER_FAILURE_S)
                continue
            answering = True
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.put_nowait(delta)
