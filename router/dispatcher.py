"""The router's end of the decode workers' streams: sends each request (and abort) to its worker
and hands each delta that comes back to its request's queue.

One connection per decode worker (common/output_stream.py): a request is one frame out, each
engine step's deltas for this router one frame in, so neither a request nor a token costs an
actor call. A closed or broken stream means the worker is gone: `on_lost` hears of it at once
(the orchestrator moves that worker's requests elsewhere or ends them), and the dispatcher
reconnects once the worker answers again (a restarted worker has a new address).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from splitserve.common.output_stream import (OutputStreamError, RouterFrame, StreamAbort, encode_frame, encode_hello,
                                             read_ack, read_frame)
from splitserve.common.worker_api import DecodeWorkerAPI, WorkerLostError
from splitserve.common.worker_messages import DecodeRequest, LayerwiseProgress, PrefillFirstToken
from splitserve.router.worker_link import WorkerLinkConfig

logger = logging.getLogger(__name__)


class OutputDispatcher:
    def __init__(self, router_id: str, workers: Sequence[DecodeWorkerAPI],
                 on_lost: Callable[[str, str], None], link: WorkerLinkConfig = WorkerLinkConfig()) -> None:
        """`on_lost(worker_id, reason)` runs on the event loop when a worker's stream ends."""
        self.router_id = router_id
        self._link = link
        self._workers_at_start = list(workers)
        self._on_lost = on_lost
        self._streams: dict[str, asyncio.Queue] = {}
        self._writers: dict[str, asyncio.StreamWriter] = {}
        """worker id -> its open stream (while it is open)."""
        self._tasks: dict[str, asyncio.Task] = {}
        """worker id -> the task that keeps its stream open and reads it."""

    async def start(self) -> None:
        """Open every worker's stream (a worker that cannot be reached is reported lost and
        retried in the background), then keep reading them."""
        await asyncio.gather(*(self.add(worker) for worker in self._workers_at_start))

    async def add(self, worker: DecodeWorkerAPI) -> None:
        """Open the worker's stream and keep reading it; returns after the first connection try
        (on failure the worker is reported lost and the connection retried in the background)."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        self._tasks[worker.worker_id] = loop.create_task(self._collect(worker, ready))
        await ready

    async def remove(self, worker_id: str) -> None:
        """Close the stream of a worker that left the pool (it ends whatever this router still
        had there) and stop reading it."""
        task = self._tasks.pop(worker_id, None)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    def open(self, request_id: str) -> asyncio.Queue:
        """The queue a request's deltas arrive on (open it before the request reaches a worker)."""
        return self._streams.setdefault(request_id, asyncio.Queue())

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def submit(self, worker_id: str, request: DecodeRequest) -> None:
        """Send the request to the worker (its deltas come to `open(request.request_id)`'s queue);
        raises WorkerLostError while the worker's stream is not open."""
        self._send(worker_id, request)

    def relay(self, worker_id: str, message: LayerwiseProgress | PrefillFirstToken) -> None:
        """Send a layer-wise request's progress or first token to the worker it was submitted to
        (after its DecodeRequest, on the same stream: the worker sees them in this order); raises
        WorkerLostError while the worker's stream is not open."""
        self._send(worker_id, message)

    def abort(self, worker_id: str, request_id: str) -> None:
        """End the request on the worker; nothing to do when its stream is closed (the worker
        ended this router's requests when it closed)."""
        if worker_id in self._writers:
            self._send(worker_id, StreamAbort(request_id))

    def _send(self, worker_id: str, payload: RouterFrame) -> None:
        writer = self._writers.get(worker_id)
        if writer is None:
            raise WorkerLostError(worker_id, "its stream is not open")
        writer.write(encode_frame(payload))

    async def _collect(self, worker: DecodeWorkerAPI, ready: asyncio.Future) -> None:
        """Invariant: `ready` resolves after the first connection try, whatever its outcome."""
        answering = True
        while True:
            try:
                reader, writer = await connect_output_stream(worker, self.router_id,
                                                             self._link.stream_connect_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                self._lost(worker, f"its output stream could not be opened: {type(error).__name__}: {error}",
                           ready, log=answering)
                answering = False
                await asyncio.sleep(self._link.stream_reconnect_s)
                continue
            answering = True
            self._writers[worker.worker_id] = writer
            if not ready.done():
                ready.set_result(None)
            try:
                await self._read(reader)
            except asyncio.IncompleteReadError:
                self._lost(worker, "its output stream closed (its process ended or the connection broke)", ready)
            except (ConnectionError, OutputStreamError) as error:
                self._lost(worker, f"its output stream broke: {type(error).__name__}: {error}", ready)
            finally:
                del self._writers[worker.worker_id]
                writer.close()

    def _lost(self, worker: DecodeWorkerAPI, reason: str, ready: asyncio.Future, log: bool = True) -> None:
        """`log`: once per outage, not on every retry."""
        if log:
            logger.error("decode worker %s: %s", worker.worker_id, reason)
        if not ready.done():
            ready.set_result(None)
        self._on_lost(worker.worker_id, reason)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            deltas = await read_frame(reader)
            if not isinstance(deltas, list):
                raise OutputStreamError(f"unexpected {type(deltas).__name__} frame from a worker")
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if stream is not None:
                    stream.put_nowait(delta)


async def connect_output_stream(worker: DecodeWorkerAPI, router_id: str, timeout_s: float = 10.0
                                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open `router_id`'s stream on the worker; returns once the worker acknowledged it (then
    write requests and read deltas with common.output_stream's encode_frame / read_frame)."""
    async with asyncio.timeout(timeout_s):
        address = await worker.open_output_stream(router_id)
        reader, writer = await asyncio.open_connection(address.host, address.port)
        try:
            writer.write(encode_hello(address.token, router_id))
            await read_ack(reader)
        except BaseException:
            writer.close()
            raise
    return reader, writer
