"""Routers as Ray actors (router.replicas > 1), and what ties routers and workers to Ray's actor
states.

Each router actor is a whole router (deploy/router_app.start_router) in its own process: its own
event loop, prefix index (fed by every worker's reports, like a lone router's), admission slots
and output streams, over the same workers. They listen on the same gRPC and HTTP ports with
SO_REUSEPORT, so the kernel spreads new connections over them; router i serves /metrics on
metrics_port + i.

Two watches on Ray's actor states (deploy/actor_states.py):
- every router watches its workers: one Ray reports restarting or dead is unroutable at once and
  its requests move (`watch_workers`);
- the launcher watches the router actors: when one dies, every worker ends that router's requests
  at once (`RouterReaper`): its output streams' close tells decode workers as well, but nothing
  tells a prefill worker, whose queued prompts and held KV would otherwise wait for the lease TTL.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from splitserve.deploy.actor_states import ActorStateWatch, actor_id_of
from splitserve.deploy.cluster_config import ClusterConfig
from splitserve.deploy.router_app import BoundPorts, RouterServers, start_router
from splitserve.router.orchestrator import Orchestrator
from splitserve.router.worker_client import RayWorker

logger = logging.getLogger(__name__)


def watch_workers(watch: ActorStateWatch, orchestrator: Orchestrator, workers: Sequence[RayWorker]) -> None:
    """Make each worker unroutable (its requests move) the moment Ray reports its actor
    restarting or dead."""
    for worker in workers:
        watch.watch(actor_id_of(worker.handle), lambda state, worker_id=worker.worker_id:
                    orchestrator.worker_unavailable(worker_id, f"Ray reports its actor {state}"))


class RouterActor:
    """One of several routers; deploy/local.py wraps it with ray.remote (max_restarts 0: a dead
    router's clients reconnect to the others through the shared port)."""

    def __init__(self, router_id: str, config: ClusterConfig, model_dir: str, prefill: list[RayWorker],
                 decode: list[RayWorker], api_key: str | None) -> None:
        """`config.router` holds this router's ports (the shared gRPC and HTTP ports, its own
        metrics port)."""
        self._router_id = router_id
        self._config = config
        self._model_dir = model_dir
        self._prefill = prefill
        self._decode = decode
        self._api_key = api_key
        self._servers: RouterServers | None = None
        self._watch = ActorStateWatch()

    async def start(self) -> BoundPorts:
        """Serve; returns where."""
        await self._watch.start()
        self._servers = await start_router(self._router_id, self._config, self._model_dir, self._prefill,
                                           self._decode, self._api_key, reuse_port=True)
        watch_workers(self._watch, self._servers.orchestrator, [*self._prefill, *self._decode])
        logger.info("router %s serving on %s", self._router_id, self._servers.ports)
        return self._servers.ports

    async def num_in_flight(self) -> int:
        """Requests this router is serving (admitted and streaming)."""
        return self._servers.orchestrator.num_in_flight

    async def routable_workers(self) -> list[str]:
        """The workers this router would route a request to now (in a pool and answering)."""
        orchestrator = self._servers.orchestrator
        return [worker_id for pool in (orchestrator.prefill_pool, orchestrator.decode_pool)
                for worker_id in pool.routable() if orchestrator.monitor.load(worker_id) is not None]

    async def index_hashes(self) -> dict[str, frozenset[int]]:
        """worker id -> the block hashes this router's prefix index holds for it."""
        orchestrator = self._servers.orchestrator
        return {worker_id: orchestrator.index.block_hashes(worker_id)
                for worker_id in [*orchestrator.prefill_pool.clients, *orchestrator.decode_pool.clients]}

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests, report NOT_SERVING, wait up to timeout_s; returns how many are left."""
        return await self._servers.drain(timeout_s)

    async def stop(self, grace_s: float) -> None:
        if self._servers is not None:
            await self._servers.stop(grace_s)
            await self._servers.orchestrator.stop()
            self._servers = None
        await self._watch.stop()


class RouterReaper:
    """The launcher's watch on its router actors: when Ray reports one restarting or dead, every
    worker ends that router's requests (`abort_router`) at once."""

    def __init__(self, watch: ActorStateWatch, workers: dict[str, Any]) -> None:
        """`workers`: worker id -> actor handle, the launcher's live table (read when a router dies)."""
        self._watch = watch
        self._workers = workers
        self._tasks: set[asyncio.Task] = set()

    def watch(self, router_id: str, handle: Any) -> None:
        self._watch.watch(actor_id_of(handle), lambda state: self._router_gone(router_id, state))

    def _router_gone(self, router_id: str, state: str) -> None:
        logger.warning("router %s is gone (Ray reports its actor %s): ending its requests on every worker",
                       router_id, state)
        task = asyncio.get_running_loop().create_task(self._abort_everywhere(router_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _abort_everywhere(self, router_id: str) -> None:
        calls = {worker_id: actor.abort_router.remote(router_id) for worker_id, actor in self._workers.items()}
        outcomes = await asyncio.gather(*calls.values(), return_exceptions=True)
        for worker_id, outcome in zip(calls, outcomes):
            if isinstance(outcome, Exception):
                logger.warning("worker %s could not end router %s's requests: %s", worker_id, router_id, outcome)

    async def stop(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)
