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
import dataclasses
import json
import logging
import os
import re
import shlex
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import ray  # noqa: E402
from ray._private import ray_constants  # noqa: E402

from splitserve.decode_worker.worker import DecodeWorker  # noqa: E402
from splitserve.deploy.cluster_config import ClusterConfig, PoolConfig  # noqa: E402
from splitserve.deploy.actor_states import ActorStateWatch, actor_id_of  # noqa: E402
from splitserve.deploy.router_actor import RouterActor, RouterReaper, watch_workers  # noqa: E402
from splitserve.deploy.router_app import BoundPorts, RouterServers, start_router  # noqa: E402
from splitserve.common.errors import StartupError  # noqa: E402
from splitserve.common.pooling import read_model_pooling  # noqa: E402
from splitserve.common.stats import WorkerSnapshot  # noqa: E402
from splitserve.engine.tiny_model import resolve_model_path  # noqa: E402
from splitserve.planner.core.types import Role  # noqa: E402
from splitserve.planner.observe import TrafficWindow  # noqa: E402
from splitserve.planner.ray_adapter import RayPlanner  # noqa: E402
from splitserve.prefill_worker.worker import PrefillWorker  # noqa: E402
from splitserve.router.auth import api_key_from_env  # noqa: E402
from splitserve.router.metrics_server import RouterMetrics  # noqa: E402
from splitserve.router.http_server import HttpServer  # noqa: E402
from splitserve.router.orchestrator import Orchestrator  # noqa: E402
from splitserve.router.tls import host_port, load_tls  # noqa: E402
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
    if config.router.replicas > 1:
        # Ray starts its worker processes at niceness 15 (RAY_worker_niceness). A router in the
        # serving process runs at 0; router actors at 15 lose the CPU to any busy process on the
        # machine (bench/admission_burst.py --routers 2 on a loaded 2-core VM: rejections' p50
        # 8.4 s at 15, 1.3 s at 0). The raylet reads the
        # variable when it starts, so it must be in this process's environment.
        os.environ.setdefault("RAY_worker_niceness", "0")
    actors = [(p.replicas, p.resources) for p in (config.prefill, config.decode)]
    if config.router.replicas > 1:
        actors.append((config.router.replicas, config.router.resources))
    num_cpus = max(os.cpu_count() or 1, sum(replicas * resources.num_cpus for replicas, resources in actors))
    num_gpus = sum(replicas * resources.num_gpus for replicas, resources in actors)
    ray.init(address="local", include_dashboard=False, num_cpus=int(num_cpus + 0.999), num_gpus=num_gpus,
             labels=config.local_node_labels, runtime_env={"env_vars": env_vars}, logging_level=logging.WARNING)


@dataclass
class LocalCluster:
    """Owns the actors and the router it starts; stop() ends them all. With the planner enabled it
    also runs the planner, which grows and shrinks the pools through start_worker / stop_worker
    (this class is its planner.ray_adapter.ClusterControl)."""

    config: ClusterConfig
    api_key: str | None = field(default=None, repr=False)
    """The key both APIs require (`splitserve serve --api-key`); None: the one router.api_key_env
    names, if any."""
    router_id: str = field(default_factory=lambda: f"router-{uuid.uuid4().hex[:8]}")
    actors: dict[str, Any] = field(default_factory=dict)
    """Worker id ('prefill-0', 'decode-3', ...) -> its actor, for every worker started and not yet ended."""
    servers: RouterServers | None = None
    """The router in this process (router.replicas 1); None with several routers."""
    routers: dict[str, Any] = field(default_factory=dict)
    """With router.replicas > 1: router id -> its actor, for every router started and not yet ended."""
    router_ports: BoundPorts | None = None
    """Where the routers listen (router 0's metrics port with several)."""
    planner: RayPlanner | None = None
    """None unless config.planner.enabled."""
    _planner_task: asyncio.Task | None = None
    _watch: ActorStateWatch | None = None
    """Ray's actor states: the workers' for the router here, the router actors' with several."""
    _reaper: RouterReaper | None = None
    _model_dir: str = ""
    _next_index: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})

    @property
    def prefill_actors(self) -> list[Any]:
        return [actor for worker_id, actor in self.actors.items() if worker_id.startswith("prefill-")]

    @property
    def decode_actors(self) -> list[Any]:
        return [actor for worker_id, actor in self.actors.items() if worker_id.startswith("decode-")]

    @property
    def orchestrator(self) -> Orchestrator | None:
        """The router's orchestrator (router.replicas 1; None before start and with several)."""
        return None if self.servers is None else self.servers.orchestrator

    @property
    def metrics(self) -> RouterMetrics | None:
        """The router's metrics (router.replicas 1); None when router.metrics_port is None (disabled)."""
        return None if self.servers is None else self.servers.metrics

    @property
    def port(self) -> int:
        """The bound gRPC port."""
        return self.router_ports.grpc

    @property
    def http(self) -> HttpServer | None:
        """The OpenAI-compatible API of the router here (its `port` is the bound one); None when
        router.http_port is None or with several routers (then see router_ports)."""
        return None if self.servers is None else self.servers.http

    @property
    def metrics_port(self) -> int | None:
        """The bound /metrics port (router 0's with several); None when router.metrics_port is None."""
        return self.router_ports.metrics

    async def start(self) -> int:
        """Start everything; returns the gRPC port. On failure, whatever started is stopped."""
        try:
            return await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> int:
        config = self.config
        api_key = self.api_key
        if api_key is None and config.router.api_key_env is not None:
            api_key = api_key_from_env(config.router.api_key_env)
        if config.router.tls is not None:
            load_tls(config.router.tls)  # bad certificate files fail the start before any worker does
        self._model_dir = model_dir = str(resolve_model_path(config.model))
        start_ray(config)
        roles = ("prefill", "decode") if config.mode == "disaggregated" else ("decode",)
        clients = {role: [self._spawn(role) for _ in range(self._pool(role).replicas)] for role in roles}
        prefill, decode = clients.get("prefill", []), clients["decode"]
        await self._wait_started([*prefill, *decode])
        self._watch = ActorStateWatch()
        await self._watch.start()
        if config.router.replicas == 1:
            await self._start_router_here(prefill, decode, api_key)
        else:
            await self._start_router_actors(prefill, decode, api_key)
        replicas = config.router.replicas
        logger.info("serving %s on %s:%d (%s, %d prefill + %d decode workers, %d router%s%s)", config.model,
                    config.router.host, self.port, config.mode, len(prefill), len(decode), replicas,
                    "" if replicas == 1 else "s", ", planner on" if self.planner is not None else "")
        return self.port

    async def _start_router_here(self, prefill: list[RayWorker], decode: list[RayWorker], api_key: str | None) -> None:
        """The one router, in this process (with the planner, if enabled)."""
        config = self.config
        if config.planner.enabled:
            self.planner = RayPlanner(config.planner, self, TrafficWindow(
                config.planner.ttft_s, config.planner.itl_s, config.decode.engine.block_size))
        self.servers = await start_router(self.router_id, config, self._model_dir, prefill, decode, api_key,
                                          [self.planner.observe] if self.planner is not None else [])
        self.router_ports = self.servers.ports
        watch_workers(self._watch, self.servers.orchestrator, [*prefill, *decode])
        if self.planner is not None:
            if self.metrics is not None:
                self.metrics.watch_planner(self.planner.stats)
            self._planner_task = asyncio.get_running_loop().create_task(self.planner.run())

    async def _start_router_actors(self, prefill: list[RayWorker], decode: list[RayWorker],
                                   api_key: str | None) -> None:
        """router.replicas router actors on one address: router 0 binds the configured ports (0:
        free ones), the others the ports it bound. Router i serves its metrics on metrics_port + i
        on a private local Ray (one host); on a Ray cluster each router has a node of its own
        (router.resources), so all use metrics_port."""
        router = self.config.router
        self._reaper = RouterReaper(self._watch, self.actors)
        resources = router.resources
        actor_class = ray.remote(RouterActor).options(
            num_cpus=resources.num_cpus, num_gpus=resources.num_gpus, max_restarts=0, max_concurrency=1000,
            **({"label_selector": resources.label_selector} if resources.node_labels else {}))
        for index in range(router.replicas):
            shared = self.router_ports
            config = dataclasses.replace(self.config, router=dataclasses.replace(
                router, grpc_port=router.grpc_port if shared is None else shared.grpc,
                http_port=router.http_port if shared is None else shared.http,
                metrics_port=router.metrics_port and router.metrics_port + self._metrics_offset(index)))
            router_id = f"{self.router_id}-{index}"
            handle = self.routers[router_id] = actor_class.remote(router_id, config, self._model_dir, prefill,
                                                                  decode, api_key)
            self._reaper.watch(router_id, handle)
            ports = await handle.start.remote()
            self.router_ports = self.router_ports or ports

    def _metrics_offset(self, router_index: int) -> int:
        return router_index if self.config.ray_address is None else 0

    def _pool(self, role: str) -> PoolConfig:
        return self.config.prefill if role == "prefill" else self.config.decode

    def _spawn(self, role: str) -> RayWorker:
        """Create the next worker actor of the role (placed by its pool's resources and labels)."""
        pool = self._pool(role)
        placement = {"label_selector": pool.resources.label_selector} if pool.resources.node_labels else {}
        worker_class = _GUARDED_WORKERS[role]
        actor_class = ray.remote(worker_class).options(
            num_cpus=pool.resources.num_cpus, num_gpus=pool.resources.num_gpus, max_restarts=pool.max_restarts,
            max_concurrency=1000, **placement)
        extra: dict[str, Any] = ({"lease_ttl_s": self.config.router.lease_ttl_s,
                                  "layerwise": self.config.kv_transfer_layerwise} if role == "prefill" else
                                 {"transfer_failure_policy": self.config.kv_transfer_failure_policy})
        if pool.transfer_poll_s is not None:
            extra["transfer_poll_s"] = pool.transfer_poll_s
        worker_id = f"{role}-{self._next_index[role]}"
        self._next_index[role] += 1
        self.actors[worker_id] = actor_class.remote(self._model_dir, pool.engine, self.config.kv_transfer_backend,
                                                    worker_id=worker_id, tokenizer_dir=self.config.tokenizer_path,
                                                    **extra)
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
        watch_workers(self._watch, self.orchestrator, [client])
        return client.worker_id

    async def stop_worker(self, worker_id: str) -> None:
        """Drain the worker at the router (router.drain_timeout_s for its requests to finish, then
        they move), then shut it down and end its actor."""
        await self.orchestrator.retire_worker(worker_id, self.config.router.drain_timeout_s)
        await self._shutdown(worker_id, grace_s=2.0)

    async def _shutdown(self, worker_id: str, grace_s: float) -> None:
        try:
            await asyncio.wait_for(self.actors[worker_id].shutdown.remote(), grace_s)
        except ray.exceptions.RayActorError:
            pass  # already dead: nothing to shut down (why it died was reported when it died)
        except Exception as error:  # a stuck actor is killed below anyway
            logger.warning("worker %s shutdown failed: %s", worker_id, root_cause(error))
        self._end_actor(worker_id)

    def _end_actor(self, worker_id: str) -> None:
        actor = self.actors.pop(worker_id)
        if self._watch is not None:
            self._watch.unwatch(actor_id_of(actor))
        ray.kill(actor)

    async def _wait_started(self, clients: list[RayWorker]) -> None:
        """Every worker placed and answering, or one StartupError: the first failure's cause (every
        worker of a pool fails alike, so it is said once), or the workers still missing at the timeout."""
        calls = {asyncio.ensure_future(client.info()): client.worker_id for client in clients}
        try:
            done, pending = await asyncio.wait(calls, timeout=self.config.worker_start_timeout_s,
                                               return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for call in calls:  # those still waiting at the timeout, or when the start is cancelled
                call.cancel()
        failed = sorted((calls[call], call.exception()) for call in done if call.exception() is not None)
        if failed:
            worker_id, error = failed[0]
            raise StartupError(f"worker {worker_id} failed to start: {root_cause(error)}") from None
        if pending:
            missing = sorted(calls[call] for call in pending)
            raise StartupError(f"workers {missing} did not start within worker_start_timeout_s "
                               f"({self.config.worker_start_timeout_s:g} s): no Ray node has the resources and "
                               "node_labels they ask for, or their model is still loading")

    async def drain(self) -> int:
        """Refuse new requests and report NOT_SERVING (gRPC health, HTTP /health 503) on every
        router, then wait up to router.drain_timeout_s for the requests in flight; returns how many
        are left."""
        timeout_s = self.config.router.drain_timeout_s
        if self.servers is not None:
            return await self.servers.drain(timeout_s)
        return sum(await asyncio.gather(*(router.drain.remote(timeout_s) for router in self.routers.values())))

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.servers is not None:
            await self.servers.stop(grace_s)
        if self._planner_task is not None:
            self._planner_task.cancel()
            await asyncio.gather(self._planner_task, return_exceptions=True)
            await self.planner.stop()
        if self.servers is not None:
            await self.servers.orchestrator.stop()
            self.servers = None
        await self._stop_router_actors(grace_s)
        if self._watch is not None:
            await self._watch.stop()
            self._watch = None
        for worker_id in list(self.actors):
            await self._shutdown(worker_id, grace_s)

    async def _stop_router_actors(self, grace_s: float) -> None:
        """All routers at once: each one's grace runs beside the others' (one after another, N routers took N
        graces)."""
        await asyncio.gather(*(self._stop_router_actor(router_id, grace_s) for router_id in list(self.routers)))
        if self._reaper is not None:
            await self._reaper.stop()

    async def _stop_router_actor(self, router_id: str, grace_s: float) -> None:
        router = self.routers[router_id]
        self._watch.unwatch(actor_id_of(router))  # a router stopped on purpose needs no reaping
        try:
            await asyncio.wait_for(router.stop.remote(grace_s), grace_s + 2.0)
        except ray.exceptions.RayActorError:
            pass  # already dead: its requests were reaped when it died
        except Exception as error:
            logger.warning("router %s did not stop cleanly: %s", router_id, root_cause(error))
        ray.kill(self.routers.pop(router_id))

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


def _reports_start_failure(worker_class: type) -> type:
    """worker_class whose first start never fails in Ray's constructor: it keeps the error and
    raises it, as a one-line StartupError, from info() (the call the launcher waits on).

    A failed actor constructor makes Ray print the remote traceback on the driver's console, once
    per worker and again in every error that wraps it; the launcher reports the failure itself,
    once. A restarted actor (Ray's max_restarts) fails in its constructor as before: the router
    treats a worker whose restart failed as lost, and a live actor answering nothing would hang it."""

    class Guarded(worker_class):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._start_error: str | None = None
            try:
                super().__init__(*args, **kwargs)
            except Exception as error:
                if ray.get_runtime_context().was_current_actor_reconstructed:
                    raise
                self._start_error = f"{type(error).__name__}: {' '.join(str(error).split())}"

        async def info(self):
            if self._start_error is not None:
                raise StartupError(self._start_error)
            return await super().info()

        def shutdown(self) -> None:
            if self._start_error is None:
                super().shutdown()

    Guarded.__name__ = Guarded.__qualname__ = worker_class.__name__  # Ray's log prefix names the role
    return Guarded


_GUARDED_WORKERS = {"prefill": _reports_start_failure(PrefillWorker), "decode": _reports_start_failure(DecodeWorker)}


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_QUALIFIED_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?:Error|Exception)\b)")


def root_cause(error: BaseException) -> str:
    """The error a worker's constructor raised, as `Type: message` on one line. Ray delivers it as
    text only (an actor's death cause carries the remote traceback, not the exception), so this is
    the last unindented line of that text, the one a Python traceback ends with."""
    if isinstance(getattr(error, "cause", None), StartupError):  # raised by a Guarded worker's info()
        return str(error.cause)
    text = _ANSI_ESCAPE.sub("", str(error))
    lines = [line for line in text.splitlines() if line.strip() and not line[0].isspace()]
    last = lines[-1] if lines else type(error).__name__
    if len(lines) == 1 and not isinstance(error, ray.exceptions.RayError):
        return f"{type(error).__name__}: {last}"
    return _QUALIFIED_EXCEPTION.sub("", last)


def serve(config: ClusterConfig, api_key: str | None = None) -> int:
    """Run the cluster until SIGINT/SIGTERM, then stop every worker and Ray. Returns an exit code."""
    return asyncio.run(_serve(config, api_key))


def splitserve_command(argv0: str, python: str) -> str:
    """How the user can run splitserve again from the same shell: the script as they invoked it
    (`.venv/bin/splitserve` is not on PATH), else through the interpreter."""
    if Path(argv0).name == "splitserve":
        return shlex.quote(argv0)
    return f"{shlex.quote(python)} -m splitserve.deploy.cli"


def serving_banner(config: ClusterConfig, ports: BoundPorts, command: str, needs_key: bool) -> str:
    """What `splitserve serve` prints once it serves: its endpoints and commands that work as printed (a curl
    line for the OpenAI API, and a generate line for gRPC; a pooling server's curl embeds, or scores a pair on a
    sequence-classification model, and it has no generate line, since its gRPC Generate API refuses every
    request)."""
    host, tls = config.router.host, config.router.tls is not None
    pools = config.runner == "pooling"
    classifies = pools and read_model_pooling(resolve_model_path(config.model)).classifier is not None
    grpc_target = host_port(host, ports.grpc)  # an IPv6 host in brackets, in the URLs too
    lines = [f"splitserve: serving {config.model} as {config.served_model_names[0]!r} ({config.mode}) on "
             f"{grpc_target} (gRPC)"]
    auth = " -H 'Authorization: Bearer <your API key>'" if needs_key else ""
    if ports.http is not None:
        api_url = f"{'https' if tls else 'http'}://{host_port(host, ports.http)}/v1"
        path, body = _banner_request(config.served_model_names[0], pools, classifies)
        lines += [f"  OpenAI API: {api_url}",
                  f"  try: curl {'--cacert CA_FILE ' if tls else ''}{api_url}/{path} "
                  f"-H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}"]
    if ports.metrics is not None:
        lines.append(f"  metrics: http://{host_port(host, ports.metrics)}/metrics")
    key_flag = f" --api-key-env {config.router.api_key_env or 'VARIABLE_HOLDING_THE_KEY'}" if needs_key else ""
    if not pools:
        lines.append(f"  or: {command} generate --target {grpc_target}{' --tls-ca CA_FILE' if tls else ''}{key_flag} "
                     "\"Tell me about the river.\"")
    lines.append("  Ctrl-C stops the cluster.")
    return "\n".join(lines)


def _banner_request(model_name: str, pools: bool, classifies: bool) -> tuple[str, str]:
    """The banner's curl request: (path under /v1, JSON body); a classification model has no embeddings."""
    if classifies:
        return "score", json.dumps({"model": model_name, "text_1": "Where does the river run?",
                                    "text_2": "The river runs to the sea."})
    if pools:
        return "embeddings", json.dumps({"model": model_name, "input": "Tell me about the river."})
    return "completions", json.dumps({"model": model_name, "prompt": "Tell me about the river.", "max_tokens": 32})


def _stop_on_signals(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set `stop`, whether the cluster is starting or serving."""
    import signal

    for signum in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signum, stop.set)


async def _start_unless_stopped(cluster: LocalCluster, stop: asyncio.Event) -> bool:
    """Start the cluster; False if `stop` was set first (the start is cancelled, and stops what it
    started). A failed start raises its error."""
    starting, stopped = asyncio.ensure_future(cluster.start()), asyncio.ensure_future(stop.wait())
    await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if starting.done():
        starting.result()
        return True
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)
    return False


async def _serve(config: ClusterConfig, api_key: str | None) -> int:
    stop = asyncio.Event()
    _stop_on_signals(stop)
    cluster = LocalCluster(config, api_key)
    try:
        try:
            start_ray(config)
        except SystemExit:  # ray.init's own SIGTERM handler, which it installs for the time it starts Ray
            stop.set()
        # Again: ray.init leaves a SIGTERM handler that would abort the process.
        _stop_on_signals(stop)
        if stop.is_set() or not await _start_unless_stopped(cluster, stop):
            print("splitserve: stopped before serving", flush=True)
            return 0
        ports = cluster.router_ports
        needs_key = api_key is not None or config.router.api_key_env is not None
        print(serving_banner(config, ports, splitserve_command(sys.argv[0], sys.executable), needs_key), flush=True)
        await stop.wait()
        stop.clear()
        print(f"splitserve: draining (up to {config.router.drain_timeout_s:g} s; signal again to stop now)",
              flush=True)
        draining, second_signal = asyncio.ensure_future(cluster.drain()), asyncio.ensure_future(stop.wait())
        await asyncio.wait([draining, second_signal], return_when=asyncio.FIRST_COMPLETED)
        # With several routers, only a finished drain knows how many requests were left.
        left = (draining.result() if draining.done()
                else cluster.orchestrator.num_in_flight if cluster.orchestrator is not None else "the")
        draining.cancel()
        second_signal.cancel()
        print(f"splitserve: shutting down ({left} requests still in flight end with UNAVAILABLE)", flush=True)
    finally:
        await cluster.stop()
        if config.ray_address is None:
            ray.shutdown()  # also the processes of a Ray start that a signal interrupted
    return 0
