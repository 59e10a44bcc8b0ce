"""A whole splitserve cluster on this machine: Ray (loopback only), the worker actors, the
router's gRPC and OpenAI-compatible HTTP servers on this process's event loop, and its
Prometheus /metrics endpoint.

Ray resolves "127.0.0.1" to the machine's external address and then listens on every
interface; with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 its node address stays the loopback one
and every Ray listener binds 127.0.0.1. The variable must be set before `ray` is imported, so
this module sets it at import unless the caller set it. UCX (under NIXL) opens its own
listener on every network device unless UCX_NET_DEVICES says otherwise; a local cluster sets
it to `lo`. tests/test_cluster.py checks every listening socket of the cluster's processes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402

from splitserve.decode_worker.worker import DecodeWorker  # noqa: E402
from splitserve.deploy.cluster_config import ClusterConfig, PoolConfig  # noqa: E402
from splitserve.deploy.router_app import RouterServers, build_orchestrator, each_of, start_servers  # noqa: E402
from splitserve.common.stats import WorkerSnapshot  # noqa: E402
from splitserve.engine.tiny_model import resolve_model_path  # noqa: E402
from splitserve.planner.core.types import Role  # noqa: E402
from splitserve.planner.observe import TrafficWindow  # noqa: E402
from splitserve.planner.ray_adapter import RayPlanner  # noqa: E402
from splitserve.prefill_worker.worker import PrefillWorker  # noqa: E402
from splitserve.router.access_log import log_access  # noqa: E402
from splitserve.router.auth import api_key_from_env  # noqa: E402
from splitserve.router.metrics_server import RouterMetrics  # noqa: E402
from splitserve.router.openai_server import HttpServer  # noqa: E402
from splitserve.router.orchestrator import Orchestrator  # noqa: E402
from splitserve.router.tls import load_tls  # noqa: E402
from splitserve.router.tokenizer import RouterTokenizer  # noqa: E402
from splitserve.router.worker_client import RayWorker  # noqa: E402

logger = logging.getLogger(__name__)

_WORKER_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "NIXL_LOG_LEVEL", "SPLITSERVE_CACHE_DIR", "UCX_TLS",
               "UCX_NET_DEVICES")


def start_ray(config: ClusterConfig) -> None:
    """Join config.ray_address, or start a private local Ray with enough logical CPUs for the pools."""
    if ray.is_initialized():
        return
    env_vars = {name: os.environ[name] for name in _WORKER_ENV if name in os.environ}
    if config.ray_address is not None:
        ray.init(address=config.ray_address, runtime_env={"env_vars": env_vars}, logging_level=logging.WARNING)
        return
    # If ray was imported before this module, the environment variable came too late for the
    # driver: the flag it sets is read at call time, so set it directly as well.
    ray_constants.ENABLE_RAY_CLUSTER = False
    # A local cluster never leaves this machine: keep UCX (NIXL's transport) on loopback too.
    env_vars.setdefault("UCX_NET_DEVICES", "lo")
    pools = [config.prefill, config.decode]
    num_cpus = max(os.cpu_count() or 1, sum(p.replicas * p.resources.num_cpus for p in pools))
    num_gpus = sum(p.replicas * p.resources.num_gpus for p in pools)
    ray.init(address="local", include_dashboard=False, num_cpus=int(num_cpus + 0.999), num_gpus=num_gpus,
             labels=config.local_node_labels, runtime_env={"env_vars": env_vars}, logging_level=logging.WARNING)


@dataclass
class LocalCluster:
    """Owns the actors and the router it starts; stop() ends them all. With the planner enabled it
    also runs the planner, which grows and shrinks the pools through start_worker / stop_worker
    (this class is its planner.ray_adapter.ClusterControl)."""

    config: ClusterConfig
    router_id: str = field(default_factory=lambda: f"router-{uuid.uuid4().hex[:8]}")
    actors: dict[str, Any] = field(default_factory=dict)
    """Worker id ('prefill-0', 'decode-3', ...) -> its actor, for every worker started and not yet ended."""
    orchestrator: Orchestrator | None = None
    metrics: RouterMetrics | None = None
    """The router's metrics; None when router.metrics_port is None (disabled)."""
    servers: RouterServers | None = None
    planner: RayPlanner | None = None
    """None unless config.planner.enabled."""
    _planner_task: asyncio.Task | None = None
    _model_dir: str = ""
    _next_index: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})

    @property
    def prefill_actors(self) -> list[Any]:
        return [actor for worker_id, actor in self.actors.items() if worker_id.startswith("prefill-")]

    @property
    def decode_actors(self) -> list[Any]:
        return [actor for worker_id, actor in self.actors.items() if worker_id.startswith("decode-")]

    @property
    def port(self) -> int:
        """The bound gRPC port."""
        return self.servers.grpc.port

    @property
    def http(self) -> HttpServer | None:
        """The OpenAI-compatible API (its `port` is the bound one); None when router.http_port is None."""
        return self.servers.http

    @property
    def metrics_port(self) -> int | None:
        """The bound /metrics port; None when router.metrics_port is None (disabled)."""
        return self.servers.metrics_port

    async def start(self) -> int:
        """Start everything; returns the gRPC port. On failure, whatever started is stopped."""
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> int:
        config = self.config
        api_key = api_key_from_env(config.router.api_key_env) if config.router.api_key_env is not None else None
        if config.router.tls is not None:
            load_tls(config.router.tls)  # bad certificate files fail the start before any worker does
        self._model_dir = model_dir = str(resolve_model_path(config.model))
        start_ray(config)
        roles = ("prefill", "decode") if config.mode == "disaggregated" else ("decode",)
        clients = {role: [self._spawn(role) for _ in range(self._pool(role).replicas)] for role in roles}
        prefill, decode = clients.get("prefill", []), clients["decode"]
        await self._wait_started([*prefill, *decode])
        tokenizer = await asyncio.to_thread(RouterTokenizer.from_model_dir, model_dir)
        if config.router.metrics_port is not None:
            self.metrics = RouterMetrics(config.router.slo)
        if config.planner.enabled:
            self.planner = RayPlanner(config.planner, self, TrafficWindow(
                config.planner.ttft_s, config.planner.itl_s, config.decode.engine.block_size))
        observers = [observer.observe for observer in (self.metrics, self.planner) if observer is not None]
        if config.router.access_log:
            observers.append(log_access)
        self.orchestrator = build_orchestrator(self.router_id, config.router, config.mode, prefill, decode, tokenizer,
                                               each_of(observers))
        await self.orchestrator.start()
        self.servers = await start_servers(self.orchestrator, tokenizer, config.router, config.model, self.metrics,
                                           api_key)
        if self.planner is not None:
            if self.metrics is not None:
                self.metrics.watch_planner(self.planner.stats)
            self._planner_task = asyncio.get_running_loop().create_task(self.planner.run())
        logger.info("serving %s on %s:%d (%s, %d prefill + %d decode workers%s)", config.model, config.router.host,
                    self.port, config.mode, len(prefill), len(decode),
                    ", planner on" if self.planner is not None else "")
        return self.port

    def _pool(self, role: str) -> PoolConfig:
        return self.config.prefill if role == "prefill" else self.config.decode

    def _spawn(self, role: str) -> RayWorker:
        """Create the next worker actor of the role (placed by its pool's resources and labels)."""
        pool = self._pool(role)
        placement = {"label_selector": pool.resources.label_selector} if pool.resources.node_labels else {}
        worker_class = PrefillWorker if role == "prefill" else DecodeWorker
        actor_class = ray.remote(worker_class).options(
            num_cpus=pool.resources.num_cpus, num_gpus=pool.resources.num_gpus, max_restarts=pool.max_restarts,
            max_concurrency=1000, **placement)
        extra: dict[str, Any] = ({"lease_ttl_s": self.config.router.lease_ttl_s} if role == "prefill" else
                                 {"transfer_failure_policy": self.config.kv_transfer_failure_policy})
        if pool.transfer_poll_s is not None:
            extra["transfer_poll_s"] = pool.transfer_poll_s
        worker_id = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        self.actors[worker_id] = actor_class.remote(self._model_dir, pool.engine, self.config.kv_transfer_backend,
                                                    worker_id=worker_id, **extra)
        return RayWorker(worker_id, self.actors[worker_id])

    # ---- planner.ray_adapter.ClusterControl ----------------------------------------------
    def workers(self, role: Role) -> list[str]:
        return self.orchestrator.pool(role.value).routable()

    def requests_on(self, worker_id: str) -> int:
        return self.orchestrator.pool_of(worker_id).num_requests(worker_id)

    def num_in_flight(self) -> int:
        return self.orchestrator.num_in_flight

    def snapshots(self) -> Sequence[WorkerSnapshot]:
        return self.orchestrator.worker_snapshots()

    def worker_bundle(self, role: Role) -> dict[str, float]:
        resources = self._pool(role.value).resources
        return {"CPU": resources.num_cpus, **({"GPU": resources.num_gpus} if resources.num_gpus else {})}

    async def start_worker(self, role: Role) -> str:
        """Start a worker of the role and add it to the router's pool; on failure it is ended."""
        client = self._spawn(role.value)
        try:
            await self._wait_started([client])
            await self.orchestrator.add_worker(role.value, client)
        except BaseException:
            self._end_actor(client.worker_id)
            raise
        return client.worker_id

    async def stop_worker(self, worker_id: str) -> None:
        """Drain the worker at the router (router.drain_timeout_s for its requests to finish, then
        they move), then shut it down and end its actor."""
        await self.orchestrator.retire_worker(worker_id, self.config.router.drain_timeout_s)
        await self._shutdown(worker_id, grace_s=2.0)

    async def _shutdown(self, worker_id: str, grace_s: float) -> None:
        try:
            await asyncio.wait_for(self.actors[worker_id].shutdown.remote(), grace_s)
        except Exception as error:  # a dead or stuck actor is killed below anyway
            logger.warning("worker %s shutdown failed: %s", worker_id, error)
        self._end_actor(worker_id)

    def _end_actor(self, worker_id: str) -> None:
        ray.kill(self.actors.pop(worker_id))

    async def _wait_started(self, clients: list[RayWorker]) -> None:
        """Every worker placed and answering, or an error naming those that are not."""
        calls = {asyncio.ensure_future(client.info()): client.worker_id for client in clients}
        done, pending = await asyncio.wait(calls, timeout=self.config.worker_start_timeout_s)
        for call in pending:
            call.cancel()
        if pending:
            missing = sorted(calls[call] for call in pending)
            raise RuntimeError(f"workers {missing} did not start within worker_start_timeout_s "
                               f"({self.config.worker_start_timeout_s:g} s): no Ray node has the resources and "
                               "node_labels they ask for, or their model is still loading")
        for call in done:
            call.result()  # a worker that failed to start raises its error here

    async def drain(self) -> int:
        """Refuse new requests and report NOT_SERVING (gRPC health, HTTP /health 503), then wait
        up to router.drain_timeout_s for the requests in flight; returns how many are left."""
        return await self.servers.drain(self.config.router.drain_timeout_s)

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.servers is not None:
            await self.servers.stop(grace_s)
            self.servers = None
        if self._planner_task is not None:
            self._planner_task.cancel()
            await asyncio.gather(self._planner_task, return_exceptions=True)
            await self.planner.stop()
        if self.orchestrator is not None:
            await self.orchestrator.stop()
        for worker_id in list(self.actors):
            await self._shutdown(worker_id, grace_s)

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until every live worker reports no request, lease, transfer or owned block (tests;
        a dead worker holds nothing)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            stats = await asyncio.gather(*(a.stats.remote() for a in [*self.prefill_actors, *self.decode_actors]),
                                         return_exceptions=True)
            stats = [s for s in stats if not isinstance(s, ray.exceptions.RayActorError)]
            if all(s.is_idle for s in stats):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"workers not idle after {timeout_s} s: {stats}")
            await asyncio.sleep(0.05)


def serve(config: ClusterConfig) -> int:
    """Run the cluster until SIGINT/SIGTERM, then stop every worker and Ray. Returns an exit code."""
    return asyncio.run(_serve(config))


async def _serve(config: ClusterConfig) -> int:
    import signal

    stop = asyncio.Event()
    cluster = LocalCluster(config)
    try:
        port = await cluster.start()
        # After start: ray.init installs its own SIGTERM handler, which would abort the process.
        for signum in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(signum, stop.set)
        metrics = (f"  metrics: http://{config.router.host}:{cluster.metrics_port}/metrics\n"
                   if cluster.metrics_port is not None else "")
        scheme, tls_flag = ("http", "") if config.router.tls is None else ("https", " --tls-ca CA_FILE")
        api = (f"  OpenAI API: {scheme}://{config.router.host}:{cluster.http.port}/v1\n" if cluster.http is not None
               else "")
        print(f"splitserve: serving {config.model} ({config.mode}) on {config.router.host}:{port}\n{api}{metrics}"
              f"  try: splitserve generate --target {config.router.host}:{port}{tls_flag} "
              "\"Tell me about the river.\"\n"
              "  Ctrl-C stops the cluster.", flush=True)
        await stop.wait()
        stop.clear()
        print(f"splitserve: draining (up to {config.router.drain_timeout_s:g} s; signal again to stop now)",
              flush=True)
        draining, second_signal = asyncio.ensure_future(cluster.drain()), asyncio.ensure_future(stop.wait())
        await asyncio.wait([draining, second_signal], return_when=asyncio.FIRST_COMPLETED)
        left = draining.result() if draining.done() else cluster.orchestrator.num_in_flight
        draining.cancel()
        second_signal.cancel()
        print(f"splitserve: shutting down ({left} requests still in flight are cancelled)", flush=True)
    finally:
        await cluster.stop()
        if config.ray_address is None and ray.is_initialized():
            ray.shutdown()
    return 0
