"""The prefill pool: prefix-aware routing and chunked prefill under a token budget.

Routing (the router's prefix-aware policy): the cost of a worker is its queued uncached tokens
plus this prompt's uncached tokens there (the shared prefix is free where the worker's LRU holds
the prompt's prefix group); the lowest cost wins. Pools of up to `scan_limit` routable workers
are scanned whole (ties to the first). In larger ones the candidates are the least loaded worker
and the least loaded worker caching the prompt's group (balance.LeastLoaded, one per group):
the cheapest of those two is the cheapest of all (ties aside), without a scan.

A worker runs steps back to back while it has work: each step takes up to `budget` tokens from
the front of its FIFO (several short prompts share a step, a long one spans several) and lasts
DeviceModel.prefill_step_s(tokens). A request's first token is out at the end of the step that
computes its last prompt token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from operator import attrgetter

from splitserve.planner.sim.balance import LeastLoaded
from splitserve.planner.sim.device import DeviceModel
from splitserve.planner.sim.events import EventQueue, RequestTable
from splitserve.planner.sim.pool import ReplicaPool
from splitserve.planner.sim.traces import NO_PREFIX
from splitserve.planner.sim.window import WindowStats
from splitserve.planner.sim.workers import PrefillWorker, WorkerState


class PrefillPool(ReplicaPool):
    """Requests with no routable worker wait in `backlog` (FIFO) until one becomes routable."""

    def __init__(self, events: EventQueue, requests: RequestTable, device: DeviceModel, stats: WindowStats,
                 scale_up_s: float, prefix_capacity: int, scan_limit: int,
                 on_first_token: Callable[[int, float], None]) -> None:
        super().__init__(events, scale_up_s, PrefillWorker, attrgetter("queued_tokens"))
        self.requests, self.device, self.stats = requests, device, stats
        self.budget = device.profile.prefill_token_budget
        self.prefix_capacity, self.scan_limit = prefix_capacity, scan_limit
        self.on_first_token = on_first_token
        self.backlog: deque[int] = deque()
        self.groups: dict[int, LeastLoaded] = {}
        """Per prefix group: its routable holders by load."""
        self.waiting = 0
        """Requests in workers' queues whose prefill has not started (the backlog is apart)."""

    def route(self, r: int, now: float) -> None:
        if not self.routable:
            self.backlog.append(r)
            return
        requests = self.requests
        group, prompt = requests.group[r], requests.prompt[r]
        worker = self._pick(group, prompt, prompt - requests.shared[r])
        hit = group != NO_PREFIX and worker.touch_prefix(group, self.prefix_capacity)
        tokens = prompt - requests.shared[r] if hit else prompt
        stats = self.stats
        stats.routed += 1
        stats.prompt_tokens += prompt
        stats.hit_tokens += prompt - tokens
        self._enqueue(worker, r, tokens, now)
        if group != NO_PREFIX and not hit:  # a new holder of the group
            self._holders(group).update(worker, worker.queued_tokens)

    def on_routable(self, worker: PrefillWorker, now: float) -> None:
        backlog, self.backlog = self.backlog, deque()
        for r in backlog:
            self.route(r, now)

    def queued_requests(self) -> int:
        """Requests held by prefill workers or the backlog, started or not."""
        return len(self.backlog) + sum(len(w.queue) for w in self.live)

    def _pick(self, group: int, prompt: int, unshared: int) -> PrefillWorker:
        if len(self.routable) <= self.scan_limit:
            candidates = self.routable
        elif group == NO_PREFIX:
            return self.balance.least()
        else:
            holder = self._holders(group).least()
            candidates = (self.balance.least(),) if holder is None else (self.balance.least(), holder)
        best, best_cost = None, 0
        for worker in candidates:
            cost = worker.queued_tokens + (unshared if group in worker.prefixes else prompt)
            if best is None or cost < best_cost:
                best, best_cost = worker, cost
        return best

    def _holders(self, group: int) -> LeastLoaded:
        holders = self.groups.get(group)
        if holders is None:
            holders = self.groups[group] = LeastLoaded(
                self.load_of, lambda w: w.state == WorkerState.ROUTABLE and group in w.prefixes,
                lambda: [w for w in self.routable if group in w.prefixes])
        return holders

    def _enqueue(self, worker: PrefillWorker, r: int, tokens: int, now: float) -> None:
        self.requests.uncached[r] = tokens
        worker.queue.append(r)
        worker.queued_tokens += tokens  # an increase: LeastLoaded needs no update
        if len(worker.queue) == 1:
            worker.head_left = tokens
        self.waiting += 1
        if not worker.busy:
            self._start_step(worker, now)

    def _start_step(self, worker: PrefillWorker, now: float) -> None:
        """Take up to `budget` tokens from the queue's front; record the queue time of every
        request this step touches for the first time."""
        requests, budget = self.requests, self.budget
        tokens, finishes, partial = 0, 0, 0
        for index, r in enumerate(worker.queue):
            need = worker.head_left if index == 0 else requests.uncached[r]
            if need == requests.uncached[r]:
                self.stats.prefill_queue_s.append(now - requests.arrival[r])
                self.waiting -= 1
            if tokens + need > budget:
                partial = budget - tokens
                tokens = budget
                break
            tokens += need
            finishes += 1
            if tokens == budget:
                break
        seconds = self.device.prefill_step_s(tokens)
        self.stats.prefill_steps.append((tokens, seconds))
        worker.busy, worker.step_tokens, worker.step_finishes, worker.step_partial = True, tokens, finishes, partial
        self.events.push(now + seconds, self._on_step, worker)

    def _on_step(self, worker: PrefillWorker, _: object, now: float) -> None:
        worker.queued_tokens -= worker.step_tokens
        if worker.state == WorkerState.ROUTABLE:
            load = worker.queued_tokens
            self.balance.update(worker, load)
            for group in worker.prefixes:
                self.groups[group].update(worker, load)
        queue, on_first_token = worker.queue, self.on_first_token
        for _ in range(worker.step_finishes):
            on_first_token(queue.popleft(), now)
        if queue:
            head = self.requests.uncached[queue[0]] if worker.step_finishes else worker.head_left
            worker.head_left = head - worker.step_partial
            self._start_step(worker, now)
            return
        worker.busy, worker.head_left = False, 0
        self.retire_if_done(worker, now)
