"""What a router may ask of a worker: one protocol per role.

The workers implement them (prefill_worker.PrefillWorker, decode_worker.DecodeWorker), the
router's Ray proxy (router.worker_client.RayWorker) forwards them to an actor, and the tests'
fault-injecting double wraps a worker behind the same methods; the router only ever holds
these. A lost worker surfaces as WorkerLostError from any method.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from splitserve.common.kv_events import WorkerReport
from splitserve.common.kv_transfer_types import AgentMetadata
from splitserve.common.output_stream import OutputStreamAddress
from splitserve.common.worker_messages import LayerwiseProgress, PrefillRequest, PrefillResult, WorkerInfo, WorkerStats


class WorkerLostError(Exception):
    """The worker is gone: its process died or it cannot be reached. Raised instead of the
    transport's own error so the router can tell a lost worker from a failed request."""

    def __init__(self, worker_id: str, reason: str) -> None:
        super().__init__(f"worker {worker_id} was lost: {reason}")
        self.worker_id = worker_id
        self.reason = reason


class WorkerAPI(Protocol):
    """What every worker answers."""

    worker_id: str

    async def info(self) -> WorkerInfo:
        """Limits, KV layout and transfer-agent metadata (new on every worker start)."""

    async def abort(self, request_id: str) -> bool:
        """End a request in any state; False when the worker does not know it."""

    async def stats(self) -> WorkerStats: ...

    async def report(self, epoch: str | None, after_seq: int, max_wait_s: float) -> WorkerReport:
        """Load and KV events after the cursor (or a snapshot); waits up to max_wait_s for events."""


class PrefillWorkerAPI(WorkerAPI, Protocol):
    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Returns once the prompt's first token exists; its KV waits under a lease for a pull."""

    def prefill_layerwise(self, request: PrefillRequest) -> AsyncIterator[LayerwiseProgress | PrefillResult]:
        """A layer-wise prefill worker (WorkerInfo.layerwise): the request's LayerwiseProgress as the
        forward of its final chunk writes each layer, then its PrefillResult, which ends the stream.
        Closing the stream before its result aborts the request there."""


class DecodeWorkerAPI(WorkerAPI, Protocol):
    async def add_peer(self, peer: AgentMetadata) -> None:
        """Handshake with a prefill worker's transfer agent (KVLayoutMismatchError if incompatible)."""

    async def remove_peer(self, agent_name: str) -> None: ...

    async def open_output_stream(self, router_id: str) -> OutputStreamAddress:
        """Where the router connects to send its requests and receive their token deltas
        (common/output_stream.py: requests travel on that stream, not through this API)."""
