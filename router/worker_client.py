"""The router's proxy for a worker that is a Ray actor: the worker protocols of
common/worker_api.py, each method one awaited actor call (never ray.get on the event loop).
In-process (tests), the router holds the worker objects themselves, which implement the same
protocols."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any, TypeVar

from splitserve.common.kv_events import WorkerReport
from splitserve.common.kv_transfer_types import AgentMetadata
from splitserve.common.output_stream import OutputStreamAddress
from splitserve.common.worker_api import WorkerLostError
from splitserve.common.worker_messages import LayerwiseProgress, PrefillRequest, PrefillResult, WorkerInfo, WorkerStats

T = TypeVar("T")


class RayWorker:
    """Implements PrefillWorkerAPI and DecodeWorkerAPI for an actor handle of either role."""

    def __init__(self, worker_id: str, handle: Any) -> None:
        self.worker_id = worker_id
        self._handle = handle

    @property
    def handle(self) -> Any:
        """The worker's Ray actor handle (for watching its actor's state)."""
        return self._handle

    async def info(self) -> WorkerInfo:
        return await self._call(self._handle.info.remote())

    async def abort(self, request_id: str) -> bool:
        return await self._call(self._handle.abort.remote(request_id))

    async def stats(self) -> WorkerStats:
        return await self._call(self._handle.stats.remote())

    async def report(self, epoch: str | None, after_seq: int, max_wait_s: float) -> WorkerReport:
        return await self._call(self._handle.report.remote(epoch, after_seq, max_wait_s))

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """A cancelled await cancels the actor task too, and the worker aborts the request when its task is
        cancelled. The router's abort alone could leave the prefill's KV held for nobody until its lease
        expires: an async actor need not run calls in the order they were sent, so that abort may run before
        the prefill it was meant to end."""
        reply = self._handle.prefill.remote(request)
        try:
            return await self._call(reply)
        except asyncio.CancelledError:
            _cancel(reply)
            raise

    async def prefill_layerwise(self, request: PrefillRequest) -> AsyncIterator[LayerwiseProgress | PrefillResult]:
        """One Ray streaming-generator call: each item is awaited as it comes (about 0.6 ms each)."""
        items = self._handle.prefill_layerwise.options(num_returns="streaming").remote(request)
        ended = False
        try:
            async for item in self._call_each(items):
                yield item
            ended = True
        finally:
            if not ended:  # closed early: cancelling the actor task aborts the request there
                _cancel(items)

    async def add_peer(self, peer: AgentMetadata) -> None:
        await self._call(self._handle.add_peer.remote(peer))

    async def remove_peer(self, agent_name: str) -> None:
        await self._call(self._handle.remove_peer.remote(agent_name))

    async def open_output_stream(self, router_id: str) -> OutputStreamAddress:
        return await self._call(self._handle.open_output_stream.remote(router_id))

    async def _call_each(self, items: Any) -> AsyncIterator[Any]:
        """A streaming call's items; raises WorkerLostError when the actor is gone."""
        with self._actor_loss_as_worker_lost():
            async for item in items:
                yield await item

    async def _call(self, reply: Awaitable[T]) -> T:
        """Raises WorkerLostError when the actor is gone, else what the method raised."""
        with self._actor_loss_as_worker_lost():
            return await reply

    @contextlib.contextmanager
    def _actor_loss_as_worker_lost(self) -> Iterator[None]:
        try:
            yield
        except Exception as error:
            if _is_actor_loss(error):
                raise WorkerLostError(self.worker_id, f"{type(error).__name__}: {error}") from error
            raise


def _cancel(call: Any) -> None:
    """Cancel an actor call's task (an ObjectRef, or a streaming call's generator); nothing if it already ended."""
    import ray

    ray.cancel(call)


def _is_actor_loss(error: Exception) -> bool:
    """Ray's errors for an actor that died or cannot be reached (an error the actor's method
    raised arrives as RayTaskError instead). Imported late: only Ray-backed workers need Ray."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(error, (RayActorError, ActorUnavailableError))
