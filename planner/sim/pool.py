"""A pool's replica lifecycle: scale up after a delay, scale down by draining.

- Asked-for replicas are STARTING and become ROUTABLE `scale_up_s` later.
- Shrinking cancels STARTING replicas first (newest first; they are gone at once), then drains
  the least loaded ROUTABLE ones: a draining replica takes no new request, finishes what it
  holds, and is GONE when idle. A replica holds a device from the moment it is asked for until
  it is GONE.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from splitserve.planner.sim.balance import LeastLoaded
from splitserve.planner.sim.events import EventQueue
from splitserve.planner.sim.workers import Worker, WorkerState


def is_routable(worker: Worker) -> bool:
    return worker.state == WorkerState.ROUTABLE


class ReplicaPool(ABC):
    """Invariants: `live` holds every worker not GONE, in creation order; `routable` exactly the
    ROUTABLE ones (in the order they became routable); `retired` the GONE ones."""

    def __init__(self, events: EventQueue, scale_up_s: float, new_worker: Callable[[int, float], Worker],
                 load_of: Callable[[Worker], int]) -> None:
        self.events = events
        self.scale_up_s = scale_up_s
        self._new_worker = new_worker
        self.load_of = load_of
        """Work a replica holds: the router's least-loaded key; the least loaded are drained first."""
        self.live: list = []
        self.routable: list = []
        self.retired: list = []
        self.balance = LeastLoaded(load_of, is_routable, lambda: self.routable)
        self.scaled_up = False
        """Whether an asked-for replica has become routable yet (the scale-up delay was observed)."""

    def start(self, count: int) -> None:
        """`count` replicas routable at time 0 (the initial deployment)."""
        for _ in range(count):
            worker = self._create(0.0)
            worker.state, worker.ready_s = WorkerState.ROUTABLE, 0.0
            self.routable.append(worker)
            self.balance.update(worker, self.load_of(worker))

    def resize(self, target: int, now: float) -> None:
        """Make routable + starting equal to target (>= 0); draining replicas do not count."""
        current = len(self.routable) + self.starting()
        for _ in range(target - current):
            self.events.push(now + self.scale_up_s, self._on_ready, self._create(now))
        if target < current:
            self._shrink(current - target, now)

    def starting(self) -> int:
        return sum(1 for w in self.live if w.state == WorkerState.STARTING)

    def draining(self) -> int:
        return sum(1 for w in self.live if w.state == WorkerState.DRAINING)

    @abstractmethod
    def on_routable(self, worker: Worker, now: float) -> None:
        """Hand waiting work to a replica that just became routable."""

    def retire_if_done(self, worker: Worker, now: float) -> None:
        """A draining replica is gone once it holds nothing."""
        if worker.state == WorkerState.DRAINING and worker.idle():
            self._retire(worker, now)

    def _create(self, now: float) -> Worker:
        worker = self._new_worker(len(self.live) + len(self.retired), now)
        self.live.append(worker)
        return worker

    def _on_ready(self, worker: Worker, _: object, now: float) -> None:
        if worker.state != WorkerState.STARTING:
            return
        worker.state, worker.ready_s = WorkerState.ROUTABLE, now
        self.routable.append(worker)
        self.balance.update(worker, self.load_of(worker))
        self.scaled_up = True
        self.on_routable(worker, now)

    def _shrink(self, count: int, now: float) -> None:
        starting = [w for w in self.live if w.state == WorkerState.STARTING]
        for worker in reversed(starting[len(starting) - min(count, len(starting)):]):
            self._retire(worker, now)
        drain = count - min(count, len(starting))
        for worker in sorted(self.routable, key=self.load_of)[:drain]:
            worker.state = WorkerState.DRAINING
            self.routable.remove(worker)
            self.retire_if_done(worker, now)

    def _retire(self, worker: Worker, now: float) -> None:
        worker.state, worker.gone_s = WorkerState.GONE, now
        self.live.remove(worker)
        self.retired.append(worker)
