"""The decode pool: admission by KV capacity, KV transfer, continuous batching in macro-steps.

- Admission: a request whose first token is out is admitted to the least loaded (fewest KV
  tokens reserved) of its candidate workers with room: a batch slot (max_batch_size) and KV for
  its whole prompt + output (reserved up front, so nothing is ever preempted). Pools of up to
  `scan_limit` routable workers are scanned whole; in larger ones the least loaded worker
  (balance.LeastLoaded) is the one candidate (when it has KV room but no batch slot, another
  worker with a slot is missed). With no room, or while older requests wait, it waits in the
  pool's FIFO backlog, served whenever a worker frees room.
- Transfer: admitted at time t, its KV arrives at t + latency + prompt tokens * bytes / bandwidth.
- Batching: it joins its worker's batch at the first step boundary at or after its KV arrives
  and needs output - 1 more steps (the first token came from prefill). Steps between two batch
  changes are summed in closed form (device.steps_duration); completions are the only events.
  A join is applied when the transfer starts (the worker's reference moves ahead to the join's
  boundary, settling the finishes before it at their exact times): exact, except that a
  request admitted to the same worker while an earlier one's KV is still in flight joins no
  earlier than that one (at most one step late), and room freed by those finishes is visible
  from the transfer's start (milliseconds early).
- Local prefill (conditional disaggregation): a prompt routed straight to a decode worker is
  computed in one step that also carries the running batch's decode, lasting the decode step plus
  DeviceModel.prefill_extra_s(prompt) (an idle worker: prefill_step_s(prompt)); its first token
  is out at that step's end, where it joins the batch.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from operator import attrgetter

from splitserve.planner.sim.device import DeviceModel, steps_duration, steps_to_reach
from splitserve.planner.sim.events import EventQueue, RequestTable
from splitserve.planner.sim.pool import ReplicaPool
from splitserve.planner.sim.window import WindowStats
from splitserve.planner.sim.workers import DecodeWorker, WorkerState


class DecodePool(ReplicaPool):
    """Invariant: a worker's slots / kv_reserved are the requests admitted to it and not finished."""

    def __init__(self, events: EventQueue, requests: RequestTable, device: DeviceModel, stats: WindowStats,
                 scale_up_s: float, kv_tokens: int, transfer_s_per_token: float, transfer_latency_s: float,
                 scan_limit: int, on_finish: Callable[[int, float], None]) -> None:
        super().__init__(events, scale_up_s, DecodeWorker, attrgetter("kv_reserved"))
        self.requests, self.device, self.stats = requests, device, stats
        self.max_batch, self.kv_tokens = device.profile.max_batch_size, kv_tokens
        profile = device.profile
        self._fixed_s, self._per_request_s = profile.decode_fixed_s, profile.decode_s_per_request
        self._per_context_s = profile.decode_s_per_context_token
        self.transfer_s_per_token, self.transfer_latency_s = transfer_s_per_token, transfer_latency_s
        self.scan_limit = scan_limit
        self.on_finish = on_finish
        self.backlog: deque[int] = deque()

    def accept(self, r: int, now: float) -> None:
        """r's first token is out of its prefill worker at `now`: it is finished if that was its
        only token; else admit it, or queue it."""
        requests = self.requests
        requests.first_token_s[r] = now
        if requests.output[r] == 1:
            self.on_finish(r, now)
            return
        worker = None if self.backlog else self._pick(r)
        if worker is None:
            self.backlog.append(r)
            return
        self._admit(worker, r, now)

    def prefill_locally(self, r: int, now: float) -> bool:
        """Prefill r on a decode worker with room; False when none has room (nothing changed)."""
        worker = None if self.backlog else self._pick(r)
        if worker is None:
            return False
        self._reserve(worker, r)
        self._advance(worker, now)
        self._local_step(worker, r)
        self._reschedule(worker)
        return True

    def on_routable(self, worker: DecodeWorker, now: float) -> None:
        self._serve_backlog(worker, now)

    def running_requests(self) -> int:
        return sum(w.slots for w in self.live)

    def _fits(self, worker: DecodeWorker, r: int) -> bool:
        need = self.requests.prompt[r] + self.requests.output[r]
        return worker.slots < self.max_batch and worker.kv_reserved + need <= self.kv_tokens

    def _pick(self, r: int) -> DecodeWorker | None:
        """The candidate with room and the fewest KV tokens reserved (the first on ties)."""
        routable = self.routable
        if len(routable) > self.scan_limit:
            worker = self.balance.least()
            return worker if worker is not None and self._fits(worker, r) else None
        need = self.requests.prompt[r] + self.requests.output[r]
        room, max_batch = self.kv_tokens - need, self.max_batch
        best = None
        for worker in routable:
            if worker.slots < max_batch and worker.kv_reserved <= room and (
                    best is None or worker.kv_reserved < best.kv_reserved):
                best = worker
        return best

    def _reserve(self, worker: DecodeWorker, r: int) -> None:
        """A batch slot and KV for r's prompt + output (a load increase: LeastLoaded needs no update)."""
        worker.slots += 1
        worker.kv_reserved += self.requests.prompt[r] + self.requests.output[r]

    def _admit(self, worker: DecodeWorker, r: int, at: float) -> None:
        """Reserve room on worker at time `at` and start the KV transfer."""
        requests, stats = self.requests, self.stats
        self._reserve(worker, r)
        transfer = self.transfer_latency_s + requests.prompt[r] * self.transfer_s_per_token
        stats.decode_queue_s.append(at - requests.first_token_s[r])
        stats.transfer_s.append(transfer)
        self._join_at(worker, r, at + transfer)

    def _serve_backlog(self, worker: DecodeWorker, at: float) -> None:
        backlog = self.backlog
        while backlog and worker.state == WorkerState.ROUTABLE and self._fits(worker, backlog[0]):
            self._admit(worker, backlog.popleft(), at)

    def _join_at(self, worker: DecodeWorker, r: int, kv_in_s: float) -> None:
        """r joins at the first boundary at or after its KV is in (kv_in_s), applied now rather than
        as an event of its own. A join only slows the steps down, so a pending completion event for a
        boundary at or before the next finish is early, never late: it stays (_on_done re-checks)."""
        self._advance(worker, kv_in_s)
        self._join(worker, r)
        if worker.due_k < 0 or worker.finishing[0][0] < worker.due_k:
            self._reschedule(worker)

    def _join(self, worker: DecodeWorker, r: int) -> None:
        """r starts decoding at the worker's reference boundary (its first token is out)."""
        requests = self.requests
        output = requests.output[r]
        if output == 1:
            self._release(worker, r)
            return
        worker.batch += 1
        worker.context += requests.prompt[r] + 1
        heapq.heappush(worker.finishing, (worker.k_ref + output - 1, r))

    def _first_step_s(self, worker: DecodeWorker) -> float:
        """Duration of the step starting at the reference boundary (batch and context as they are)."""
        return self._fixed_s + self._per_request_s * worker.batch + self._per_context_s * worker.context

    def _advance(self, worker: DecodeWorker, until: float) -> None:
        """Move the reference to the first step boundary at or after `until` (idle: to `until`,
        unless a committed step ends later), settling each request that finishes on the way at its
        own boundary (the batch, hence the step time, shrinks there)."""
        while until > worker.t_ref:
            if worker.batch == 0:
                worker.t_ref = until
                return
            first, growth = self._first_step_s(worker), self._per_context_s * worker.batch
            steps, seconds = steps_to_reach(first, growth, until - worker.t_ref)
            next_finish = worker.finishing[0][0] - worker.k_ref
            if next_finish < steps:
                steps, seconds = next_finish, steps_duration(first, growth, next_finish)
            worker.t_ref += seconds
            self._step(worker, steps)

    def _step(self, worker: DecodeWorker, steps: int) -> None:
        """`steps` more steps are done (t_ref already moved): contexts grow; the requests whose
        last token that was leave the batch and finish at t_ref."""
        worker.k_ref += steps
        worker.context += worker.batch * steps
        finishing, prompt, output = worker.finishing, self.requests.prompt, self.requests.output
        while finishing and finishing[0][0] <= worker.k_ref:
            r = heapq.heappop(finishing)[1]
            worker.batch -= 1
            worker.context -= prompt[r] + output[r]
            self._release(worker, r)

    def _release(self, worker: DecodeWorker, r: int) -> None:
        """r (out of the batch) finishes at t_ref: its slot and KV are free."""
        worker.slots -= 1
        worker.kv_reserved -= self.requests.prompt[r] + self.requests.output[r]
        if worker.state == WorkerState.ROUTABLE:
            self.balance.update(worker, worker.kv_reserved)
        self.on_finish(r, worker.t_ref)

    def _local_step(self, worker: DecodeWorker, r: int) -> None:
        """One step that prefills r (and decodes the running batch) starts at t_ref."""
        requests, device = self.requests, self.device
        prompt = requests.prompt[r]
        if worker.batch:
            seconds = self._first_step_s(worker) + device.prefill_extra_s(prompt)
        else:
            seconds = device.prefill_step_s(prompt)
        worker.t_ref += seconds
        self._step(worker, 1)
        requests.uncached[r] = prompt
        requests.first_token_s[r] = worker.t_ref
        self._join(worker, r)

    def _next_finish_s(self, worker: DecodeWorker) -> float:
        """When the next request finishes, from the reference (finishing not empty)."""
        first, growth = self._first_step_s(worker), self._per_context_s * worker.batch
        m = worker.finishing[0][0] - worker.k_ref
        return worker.t_ref + m * first + growth * m * (m - 1) * 0.5

    def _reschedule(self, worker: DecodeWorker) -> None:
        """Schedule the next completion (a fresh version voids the previous event)."""
        worker.version += 1
        if not worker.finishing:
            worker.due_k = -1
            self.retire_if_done(worker, worker.t_ref)
            return
        worker.due_k = worker.finishing[0][0]
        self.stats.decode_steps.append((worker.batch, worker.context, self._first_step_s(worker)))
        self.events.push(self._next_finish_s(worker), self._on_done, worker, worker.version)

    def _on_done(self, worker: DecodeWorker, version: int, now: float) -> None:
        if version != worker.version:
            return
        at = self._next_finish_s(worker)
        if at > now:  # joins since it was scheduled made it early
            worker.due_k = worker.finishing[0][0]
            self.events.push(at, self._on_done, worker, version)
            return
        steps = worker.finishing[0][0] - worker.k_ref
        worker.t_ref = now
        self._step(worker, steps)
        self._reschedule(worker)
        if self.backlog:
            self._serve_backlog(worker, now)
