"""Collects decode workers' batched outputs and hands each delta to its request's stream.

One long-poll task per decode worker: `next_outputs(router_id)` returns everything produced
for this router since the last call, so the cost per token is a list entry, not an actor call.
If a worker stops answering, every stream routed to it gets an error delta (never a hang).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from splitserve.common.worker_messages import TokenDelta
from splitserve.router.worker_client import WorkerClient

logger = logging.getLogger(__name__)

LONG_POLL_S = 1.0
RETRY_AFTER_FAILURE_S = 0.5


class OutputDispatcher:
    def __init__(self, router_id: str, clients: Sequence[WorkerClient]) -> None:
        self.router_id = router_id
        self._clients = list(clients)
        self._streams: dict[str, asyncio.Queue[TokenDelta]] = {}
        self._routes: dict[str, str] = {}
        """request id -> decode worker id, for failing streams of a worker that stopped answering."""
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.get_running_loop().create_task(self._collect(client)) for client in self._clients]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def open(self, request_id: str) -> asyncio.Queue[TokenDelta]:
        """The queue a request's deltas arrive on (open it before the request reaches a worker)."""
        return self._streams.setdefault(request_id, asyncio.Queue())

    def route(self, request_id: str, worker_id: str) -> None:
        self._routes[request_id] = worker_id

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._routes.pop(request_id, None)

    async def _collect(self, client: WorkerClient) -> None:
        while True:
            try:
                deltas: list[TokenDelta] = await client.call("next_outputs", self.router_id, LONG_POLL_S)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                logger.error("decode worker %s stopped answering: %s", client.worker_id, error)
                self._fail_routed_to(client.worker_id, f"decode worker {client.worker_id} failed: {error}")
                await asyncio.sleep(RETRY_AFTER_FAILURE_S)
                continue
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.put_nowait(delta)

    def _fail_routed_to(self, worker_id: str, error: str) -> None:
        for request_id, routed_to in list(self._routes.items()):
            if routed_to == worker_id:
                self._streams[request_id].put_nowait(TokenDelta(request_id, (), (), "abort", None, 0, error=error))
