"""The router's own view of one pool of workers: what it assigned to each worker and has not seen
finish, so routing sees its own assignments before the workers' reports do."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.common.worker_api import WorkerAPI


class WorkerPool:
    """Worker clients of one role and what this router assigned to each and has not seen
    finish, so routing sees its own assignments before the workers' reports do."""

    def __init__(self, clients: Sequence[WorkerAPI]) -> None:
        self.clients = {client.worker_id: client for client in clients}
        self._requests = dict.fromkeys(self.clients, 0)
        self._prefill_tokens = dict.fromkeys(self.clients, 0)

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
        self._requests[assignment.client.worker_id] -= 1


@dataclass
class Assignment:
    """One request's claim on one worker, released exactly once when the request ends."""

    pool: WorkerPool
    client: WorkerAPI
    prefill_tokens: int
    """Uncached prompt tokens still to be prefilled there (0 once the first token is back)."""
