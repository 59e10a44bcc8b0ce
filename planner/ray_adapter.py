"""Applies the planner's decisions to a running cluster on Ray.

Each tick: observe (planner.observe.TrafficWindow over the router's records and the workers'
reports), decide (planner.core.planner.Planner), apply. Growing a pool starts workers (the cluster
places their actors by the pool's Ray resources and node labels) and, when the pools outgrow the
Ray cluster, asks Ray's autoscaler for the nodes (`ray.autoscaler.sdk.request_resources` with one
bundle per wanted worker). Shrinking a pool drains the workers with the fewest requests: the router
stops routing to each, lets its requests finish (or move, after the drain grace), forgets it, and
only then is the actor ended, so no request is lost and its KV is released with the engine.

The adapter owns the pools' membership states (starting, routable, draining); the router learns
each change through its membership calls (Orchestrator.add_worker / retire_worker), the same path a
restarted worker takes back into routing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol

from splitserve.common.stats import PlannerStats, RequestRecord, WorkerSnapshot
from splitserve.planner.core.planner import Planner
from splitserve.planner.core.types import Decision, Observation, PlannerConfig, PoolTarget, Role
from splitserve.planner.observe import PoolMembers, TrafficWindow

logger = logging.getLogger(__name__)
SCALE_UP_EMA = 0.5
"""Weight of the newest measured start time in the scale-up estimate the planner plans ahead by."""


class ClusterControl(Protocol):
    """The running cluster as the planner drives it (deploy/local.py's LocalCluster implements it)."""

    def workers(self, role: Role) -> list[str]:
        """Ids of the role's workers the router routes to, in the order they joined."""

    def requests_on(self, worker_id: str) -> int:
        """Requests the router has on the worker now."""

    def num_in_flight(self) -> int:
        """Requests in flight at the router."""

    def snapshots(self) -> Sequence[WorkerSnapshot]:
        """Every worker's latest report."""

    def worker_bundle(self, role: Role) -> dict[str, float]:
        """The Ray resources one worker of the role asks for."""

    async def start_worker(self, role: Role) -> str:
        """Start one worker; returns its id once the router routes to it. Raises when it cannot start."""

    async def stop_worker(self, worker_id: str) -> None:
        """Drain the worker at the router (no request lost), then end it."""


class RayPlanner:
    """The planner's loop on a live cluster. Invariant: a worker id is in at most one of
    `_draining` and the cluster's routable list; `_starts` holds exactly the starts not yet ended."""

    def __init__(self, config: PlannerConfig, cluster: ClusterControl, window: TrafficWindow,
                 clock: Callable[[], float] = time.monotonic,
                 request_resources: Callable[[list[dict[str, float]]], None] | None = None,
                 decide: Callable[[Observation], Decision] | None = None) -> None:
        """`request_resources(bundles)`: asks the autoscaler for capacity (default: Ray's);
        `decide`: the decision core (default: planner.core's Planner on `config`)."""
        self.config = config
        self.cluster = cluster
        self.window = window
        self._decide = decide or Planner(config).decide
        self._clock = clock
        self._request_resources = request_resources or _ray_request_resources
        self._starts: dict[Role, list[asyncio.Task]] = {role: [] for role in Role}
        """Per pool, the starts in progress (oldest first); a task removes itself when it ends."""
        self._draining: dict[str, Role] = {}
        self._scale_up_s: float | None = None
        self._tasks: set[asyncio.Task] = set()
        self._decisions: Counter[tuple[str, str]] = Counter()
        self._failed_starts = 0
        self._device_seconds = 0.0
        self._last_tick_s = clock()
        self.last_decision: Decision | None = None

    def observe(self, record: RequestRecord) -> None:
        """The router's request observer: one ended request (event loop)."""
        self.window.record(self._clock(), record)

    async def run(self) -> None:
        """Tick every config.tick_s until cancelled; cancelling leaves started workers running and
        lets drains in progress finish in the background until stop()."""
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                self.tick()
            except Exception:  # a bad tick must not end autoscaling
                logger.exception("planner tick failed")

    async def stop(self) -> None:
        """Cancel starts and drains in progress (the cluster's own stop ends their workers)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def tick(self) -> Decision:
        now, members = self._clock(), self.members()
        self._device_seconds += (now - self._last_tick_s) * sum(
            pool.routable + pool.starting + pool.draining for pool in members.values())
        self._last_tick_s = now
        observation = self.window.observation(now, self.config.tick_s, self.cluster.num_in_flight(),
                                              self.cluster.snapshots(), members, self._scale_up_s)
        decision = self._decide(observation)
        self.last_decision = decision
        for target in (decision.prefill, decision.decode):
            self._decisions[(target.role.value, target.reason.split(":", 1)[0].split(" ", 1)[0])] += 1
            self._apply(target)
        self._ask_for_capacity(decision)
        return decision

    def members(self) -> Mapping[Role, PoolMembers]:
        return {role: PoolMembers(len(self.cluster.workers(role)), len(self._starts[role]),
                                  sum(r is role for r in self._draining.values())) for role in Role}

    def _apply(self, target: PoolTarget) -> None:
        """Start the missing workers; for a smaller target, first cancel starts not yet serving
        (newest first), then drain the least loaded serving workers."""
        starts = self._starts[target.role]
        provisioned = len(self.cluster.workers(target.role)) + len(starts)
        for _ in range(target.replicas - provisioned):
            start = self._in_background(self._start(target.role))
            starts.append(start)
            start.add_done_callback(starts.remove)  # also when cancelled before it ran
        excess = max(0, provisioned - target.replicas)
        for start in starts[len(starts) - min(excess, len(starts)):]:
            start.cancel()
        for worker_id in self._drain_order(target.role)[:excess - min(excess, len(starts))]:
            self._draining[worker_id] = target.role
            self._in_background(self._stop(worker_id))

    def _drain_order(self, role: Role) -> list[str]:
        """Routable workers, fewest requests first (ties: the newest first)."""
        workers = [w for w in self.cluster.workers(role) if w not in self._draining]
        return sorted(reversed(workers), key=self.cluster.requests_on)

    async def _start(self, role: Role) -> None:
        started = self._clock()
        try:
            worker_id = await self.cluster.start_worker(role)
        except Exception as error:
            self._failed_starts += 1
            logger.error("planner: a %s worker did not start: %s", role.value, error)
            return
        seconds = self._clock() - started
        self._scale_up_s = seconds if self._scale_up_s is None else (
            self._scale_up_s + SCALE_UP_EMA * (seconds - self._scale_up_s))
        logger.info("planner: %s worker %s serving after %.1f s", role.value, worker_id, seconds)

    async def _stop(self, worker_id: str) -> None:
        try:
            await self.cluster.stop_worker(worker_id)
        except Exception as error:
            logger.error("planner: worker %s did not stop cleanly: %s", worker_id, error)
        finally:
            self._draining.pop(worker_id, None)

    def _ask_for_capacity(self, decision: Decision) -> None:
        """One bundle per wanted worker: the autoscaler keeps at least that much capacity."""
        bundles = [self.cluster.worker_bundle(target.role) for target in (decision.prefill, decision.decode)
                   for _ in range(target.replicas)]
        try:
            self._request_resources(bundles)
        except Exception as error:  # no autoscaler (a local Ray): the pools fit or starts fail visibly
            logger.debug("planner: request_resources failed: %s", error)

    def _in_background(self, coroutine: Coroutine[Any, Any, None]) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def stats(self) -> PlannerStats:
        decision, members = self.last_decision, self.members()
        return PlannerStats(
            replicas=tuple((role.value, state, getattr(members[role], state)) for role in Role
                           for state in ("routable", "starting", "draining")),
            targets=() if decision is None else ((Role.PREFILL.value, decision.prefill.replicas),
                                                 (Role.DECODE.value, decision.decode.replicas)),
            predicted_ttft_p99_s=None if decision is None else decision.predicted.ttft_p99_s,
            predicted_itl_p99_s=None if decision is None else decision.predicted.itl_p99_s,
            decisions=tuple((role, reason, count) for (role, reason), count in sorted(self._decisions.items())),
            failed_starts=self._failed_starts, device_seconds=self._device_seconds)


def _ray_request_resources(bundles: list[dict[str, float]]) -> None:
    from ray.autoscaler.sdk import request_resources

    request_resources(bundles=bundles)
