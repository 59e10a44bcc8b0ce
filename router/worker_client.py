"""How the router calls a worker: through a Ray actor handle, or directly on an in-process
worker object (tests). Both are awaited on the router's event loop; neither blocks it."""

from __future__ import annotations

from typing import Any, Protocol


class WorkerClient(Protocol):
    worker_id: str

    async def call(self, method: str, *args: Any) -> Any: ...


class RayWorkerClient:
    """Awaits ObjectRefs (never ray.get inside the event loop)."""

    def __init__(self, worker_id: str, handle: Any) -> None:
        self.worker_id = worker_id
        self.handle = handle

    async def call(self, method: str, *args: Any) -> Any:
        return await getattr(self.handle, method).remote(*args)


class LocalWorkerClient:
    """Calls a worker object living in the router's own process (same event loop)."""

    def __init__(self, worker_id: str, worker: Any) -> None:
        self.worker_id = worker_id
        self.worker = worker

    async def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        return await result if hasattr(result, "__await__") else result
