"""How the router calls a worker: through a Ray actor handle, or directly on an in-process
worker object (tests). Both are awaited on the router's event loop; neither blocks it."""

from __future__ import annotations

from typing import Any, Protocol


class WorkerLostError(Exception):
    """The worker is gone: its process died or it cannot be reached. Calls raise this instead of
    the transport's own error so the router can tell a lost worker from a failed request."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id} was lost: {reason}")
        self.worker_id = worker_id
        self.reason = reason


class WorkerClient(Protocol):
    worker_id: str

    async def call(self, method: str, *args: Any) -> Any:
        """Raises WorkerLostError when the worker is gone, else what the method raised."""


class RayWorkerClient:
    """Awaits ObjectRefs (never ray.get inside the event loop)."""

    def __init__(self, worker_id: str, handle: Any) -> None:
        self.worker_id = worker_id
        self.handle = handle

    async def call(self, method: str, *args: Any) -> Any:
        try:
            return await getattr(self.handle, method).remote(*args)
        except Exception as error:
            if _is_actor_loss(error):
                raise WorkerLostError(self.worker_id, f"{type(error).__name__}: {error}") from error
            raise


def _is_actor_loss(error: Exception) -> bool:
    """Ray's errors for an actor that died or cannot be reached (an error the actor's method
    raised arrives as RayTaskError instead). Imported late: only Ray-backed clients need Ray."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(error, (RayActorError, ActorUnavailableError))


class LocalWorkerClient:
    """Calls a worker object living in the router's own process (same event loop)."""

    def __init__(self, worker_id: str, worker: Any) -> None:
        self.worker_id = worker_id
        self.worker = worker

    async def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        return await result if hasattr(result, "__await__") else result
