"""The router's own view of one pool of workers: what it assigned to each worker and has not seen
finish, so routing sees its own assignments before the workers' reports do."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.common.worker_api import WorkerAPI


class WorkerPool:
    """Worker clients of one role and what this router assigned to each and has not seen
    finish, so routing sees its own assignments before the workers' reports do.

    Membership changes at run time (the planner): a worker added takes requests at once; a
    retiring worker takes no new request and is removed once no assignment on it is left.
    Invariant: every worker in `clients` has a count; a removed worker has no assignment."""

    def __init__(self, clients: Sequence[WorkerAPI]) -> None:
        self.clients: dict[str, WorkerAPI] = {}
        self._requests: dict[str, int] = {}
        self._prefill_tokens: dict[str, int] = {}
        self._retiring: set[str] = set()
        self._released: dict[str, asyncio.Event] = {}
        """Retiring worker id -> set once it holds no assignment."""
        for client in clients:
            self.add(client)

    def add(self, client: WorkerAPI) -> None:
        if client.worker_id in self.clients:
            raise ValueError(f"worker {client.worker_id} is already in the pool")
        self.clients[client.worker_id] = client
        self._requests[client.worker_id] = 0
        self._prefill_tokens[client.worker_id] = 0

    def routable(self) -> list[str]:
        """Workers that may take new requests (not retiring), in the order they joined."""
        return [worker_id for worker_id in self.clients if worker_id not in self._retiring]

    def retire(self, worker_id: str) -> asyncio.Event:
        """Take no new request on the worker; the event is set once it holds no assignment."""
        self._retiring.add(worker_id)
        released = self._released.setdefault(worker_id, asyncio.Event())
        if self._requests[worker_id] == 0:
            released.set()
        return released

    def remove(self, worker_id: str) -> None:
        """Forget a retired worker that holds no assignment."""
        if self._requests[worker_id]:
            raise ValueError(f"worker {worker_id} still holds {self._requests[worker_id]} assignments")
        for table in (self.clients, self._requests, self._prefill_tokens, self._released):
            table.pop(worker_id, None)
        self._retiring.discard(worker_id)

    def num_requests(self, worker_id: str) -> int:
        return self._requests[worker_id]

    def num_prefill_tokens(self, worker_id: str) -> int:
        """Prompt tokens this router sent to the worker that it has not yet seen prefilled."""
        return self._prefill_tokens[worker_id]

    def assign(self, worker_id: str, prefill_tokens: int) -> Assignment:
        self._requests[worker_id] += 1
        self._prefill_tokens[worker_id] += prefill_tokens
        return Assignment(self, self.clients[worker_id], prefill_tokens)

    def prefilled(self, assignment: Assignment) -> None:
        self._prefill_tokens[assignment.client.worker_id] -= assignment.prefill_tokens
        assignment.prefill_tokens = 0

    def release(self, assignment: Assignment) -> None:
        self.prefilled(assignment)
        worker_id = assignment.client.worker_id
        self._requests[worker_id] -= 1
        if self._requests[worker_id] == 0 and worker_id in self._released:
            self._released[worker_id].set()


@dataclass
class Assignment:
    """One request's claim on one worker, released exactly once when the request ends."""

    pool: WorkerPool
    client: WorkerAPI
    prefill_tokens: int
    """Uncached prompt tokens still to be prefilled there (0 once the first token is back)."""
