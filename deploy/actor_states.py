"""Ray's actor states as events: a callback the moment Ray's GCS reports a watched actor
RESTARTING or DEAD.

Ray 2.60 has no public API for actor state changes. Its GCS publishes every actor's transitions
on a pubsub channel, which Ray's own dashboard reads with `GcsAioActorSubscriber`; this watch
reads the same channel the same way: one long-poll request outstanding, which the GCS answers
when it publishes (no polling interval, no dashboard). Measured on loopback: a SIGKILLed actor is
reported RESTARTING about 10 ms after the kill, whereas a call pending on it fails
(ActorUnavailableError) only about 1.3 s later, because Ray waits for the actor's death info
before failing calls in flight. The alternative on public API, a call held open on each watched
actor, is therefore 100x slower to tell; the subscriber is private API, pinned with ray in
constraints.txt and exercised by tests/test_routers.py.

Only transitions are published: an actor already dead when it is watched is not reported (its
calls fail, which the router handles as before).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import ray
from ray._private.gcs_pubsub import GcsAioActorSubscriber
from ray.core.generated import gcs_pb2

logger = logging.getLogger(__name__)

UNAVAILABLE_STATES = frozenset({"RESTARTING", "DEAD"})
"""Actor states in which calls cannot be served (queued while restarting, failed once dead)."""
RETRY_AFTER_ERROR_S = 0.5
"""Wait before polling the GCS again after a poll failed (the GCS restarting, say)."""
_BATCH = 1000


class ActorStateWatch:
    """Calls each watched actor's callback with the state's name ('RESTARTING' or 'DEAD') when Ray
    reports it so; runs on the event loop it was started on, and so do the callbacks (they must
    not block)."""

    def __init__(self) -> None:
        self._callbacks: dict[str, Callable[[str], None]] = {}
        """Ray actor id (hex) -> what to call when it becomes unavailable."""
        self._subscriber: GcsAioActorSubscriber | None = None
        self._task: asyncio.Task | None = None

    def watch(self, actor_id: str, on_unavailable: Callable[[str], None]) -> None:
        """Call on_unavailable(state) on every transition of the actor (hex id) to RESTARTING or
        DEAD from now on (a later watch of the same actor replaces it)."""
        self._callbacks[actor_id] = on_unavailable

    def unwatch(self, actor_id: str) -> None:
        self._callbacks.pop(actor_id, None)

    async def start(self) -> None:
        """Subscribe (transitions from now on are delivered), then read them in the background.
        Needs ray.init() done in this process."""
        self._subscriber = GcsAioActorSubscriber(address=ray.get_runtime_context().gcs_address)
        await self._subscriber.subscribe()
        self._task = asyncio.get_running_loop().create_task(self._read())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._subscriber is not None:
            await self._subscriber.close()
            self._subscriber = None

    async def _read(self) -> None:
        while True:
            try:
                messages = await self._subscriber.poll(batch_size=_BATCH)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                logger.warning("reading Ray's actor states failed: %s", error)
                messages = []
            if not messages:  # the poll ended without news: the GCS is unreachable or restarting
                await asyncio.sleep(RETRY_AFTER_ERROR_S)
            for actor_id, data in messages:
                self._deliver(actor_id.hex(), gcs_pb2.ActorTableData.ActorState.Name(data.state))

    def _deliver(self, actor_id: str, state: str) -> None:
        callback = self._callbacks.get(actor_id)
        if callback is None or state not in UNAVAILABLE_STATES:
            return
        try:
            callback(state)
        except Exception:  # one watcher's failure must not stop the others' events
            logger.exception("the callback for actor %s (%s) failed", actor_id, state)


def actor_id_of(handle: object) -> str:
    """The Ray actor id (hex) of an actor handle."""
    return handle._actor_id.hex()
