"""Per-request transfer state machines on both sides of a KV transfer.

Producer (prefill worker), one lease per request:
    HELD --notification--> PULLED     (the consumer's pull completed)
    HELD --deadline------> EXPIRED    (clock() > lease_expires_at)
    HELD --release()-----> FREED      (cancelled by the caller)
Consumer (decode worker), one pull per request:
    WAITING --start_pull--> PULLING --> DONE | FAILED
    WAITING --refused-----> FAILED     (lease nearly over, unknown peer, backend refusal)

The connectors never touch the engine: they report which requests ended and the worker frees
or admits blocks. Time comes from an injected clock (wall clock by default, because a lease
deadline crosses processes; both sides must share it, up to `min_lease_margin_s`).

Why a late pull fails: the producer frees a lease's blocks once clock() > lease_expires_at and
may reuse them, so bytes whose pull was seen complete after the deadline cannot be trusted.
With one clock this is safe: the consumer reports DONE only if it saw completion at a time
<= the deadline, and the producer frees only at a time > the deadline.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from splitserve.common.kv_transfer_types import KVLayout, TransferParams
from splitserve.kv_transfer.base import KVTransferError, PullHandle, PullState, TransferBackend

Clock = Callable[[], float]
LATE_PULL_ERROR = "lease expired before the pull completed"


class InvalidTransitionError(RuntimeError):
    """A state machine was driven along an edge it does not have (a bug in the caller)."""


class LeaseState(enum.Enum):
    HELD = "held"
    PULLED = "pulled"
    FREED = "freed"
    EXPIRED = "expired"


class PullStatus(enum.Enum):
    WAITING = "waiting"
    PULLING = "pulling"
    DONE = "done"
    FAILED = "failed"


_LEASE_EDGES = {LeaseState.HELD: {LeaseState.PULLED, LeaseState.FREED, LeaseState.EXPIRED}}
_PULL_EDGES = {PullStatus.WAITING: {PullStatus.PULLING, PullStatus.FAILED},
               PullStatus.PULLING: {PullStatus.DONE, PullStatus.FAILED}}


def _check_edge(edges: dict, current: enum.Enum, new: enum.Enum, request_id: str) -> None:
    if new not in edges.get(current, ()):
        raise InvalidTransitionError(f"request {request_id!r}: no transition {current.name} -> {new.name}")


# ---- producer ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReleasedLease:
    """A lease that ended (PULLED or EXPIRED): the worker frees its blocks now."""

    request_id: str
    block_ids: tuple[int, ...]
    state: LeaseState


@dataclass(frozen=True)
class ProducerStats:
    num_held: int
    """Leases currently HELD."""
    num_pulled: int
    """Since start: leases ended by a pull notification."""
    num_expired: int
    num_released: int
    """Since start: leases cancelled with release() (FREED)."""
    num_late_notifications: int
    """Since start: notifications for requests holding no lease (expired, released or unknown)."""


@dataclass
class _Lease:
    request_id: str
    block_ids: tuple[int, ...]
    expires_at: float
    state: LeaseState = LeaseState.HELD

    def advance(self, new: LeaseState) -> None:
        _check_edge(_LEASE_EDGES, self.state, new, self.request_id)
        self.state = new


class ProducerConnector:
    """Holds prefilled requests' blocks under leases until pulled, expired or released.

    Invariant: every lease that poll() reports is ended exactly once and forgotten; a request id
    holds at most one lease at a time.
    """

    def __init__(self, backend: TransferBackend, layout: KVLayout, lease_ttl_s: float, clock: Clock = time.time):
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self._backend = backend
        self._layout = layout
        self._ttl = lease_ttl_s
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._ended: Counter[LeaseState] = Counter()
        self._late = 0

    def hold(self, request_id: str, block_ids: Iterable[int], num_tokens: int) -> TransferParams:
        """HELD until clock() + lease_ttl_s; the blocks must cover num_tokens (0 < n <= blocks * block_size)."""
        if request_id in self._leases:
            raise InvalidTransitionError(f"request {request_id!r}: no transition HELD -> HELD")
        block_ids = tuple(block_ids)
        if not 0 < num_tokens <= len(block_ids) * self._layout.block_size:
            raise ValueError(f"request {request_id!r}: {len(block_ids)} blocks of {self._layout.block_size} "
                             f"tokens cannot hold {num_tokens} tokens")
        lease = _Lease(request_id, block_ids, self._clock() + self._ttl)
        self._leases[request_id] = lease
        return TransferParams(request_id, self._backend.agent_name, block_ids, num_tokens, self._layout,
                              lease.expires_at)

    def poll(self) -> list[ReleasedLease]:
        """Leases that ended since the last poll: pulled ones (notification order), then expired ones.

        Notifications are taken before the deadline check, so a pull notified by now counts as
        PULLED even if its deadline has also passed."""
        ended = [self._end(request_id, LeaseState.PULLED) for request_id in self._pulled_request_ids()]
        now = self._clock()
        expired = [lease.request_id for lease in self._leases.values() if now > lease.expires_at]
        return ended + [self._end(request_id, LeaseState.EXPIRED) for request_id in expired]

    def release(self, request_id: str) -> bool:
        """Cancel (HELD -> FREED): the caller frees the blocks now. False if it holds no lease."""
        if request_id not in self._leases:
            return False
        self._end(request_id, LeaseState.FREED)
        return True

    def stats(self) -> ProducerStats:
        return ProducerStats(len(self._leases), self._ended[LeaseState.PULLED], self._ended[LeaseState.EXPIRED],
                             self._ended[LeaseState.FREED], self._late)

    def _pulled_request_ids(self) -> list[str]:
        """Notified request ids that still hold a lease (each once); counts the rest as late."""
        pulled: list[str] = []
        for request_id in self._backend.take_notifications():
            if request_id in self._leases and request_id not in pulled:
                pulled.append(request_id)
            else:
                self._late += 1
        return pulled

    def _end(self, request_id: str, state: LeaseState) -> ReleasedLease:
        lease = self._leases.pop(request_id)
        lease.advance(state)
        self._ended[state] += 1
        return ReleasedLease(request_id, lease.block_ids, state)


# ---- consumer ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PullOutcome:
    """How one pull ended; reported once by ConsumerConnector.poll()."""

    request_id: str
    state: PullStatus
    """DONE or FAILED."""
    error: str | None
    """Why it failed (None when DONE)."""
    num_bytes: int
    """Bytes pulled into the local pool (0 when FAILED)."""
    seconds: float
    """From start() to the clock reading at which the outcome was decided."""


@dataclass(frozen=True)
class ConsumerStats:
    num_pulling: int
    """Pulls started and not yet reported by poll() (nor aborted)."""
    num_done: int
    num_failed: int
    num_aborted: int
    bytes_pulled: int


@dataclass
class _Pull:
    params: TransferParams
    local_block_ids: tuple[int, ...]
    started_at: float
    status: PullStatus = PullStatus.WAITING
    handle: PullHandle | None = None
    """Held only while PULLING; released as soon as the pull ends."""
    error: str | None = None
    finished_at: float | None = None

    def advance(self, new: PullStatus, now: float | None = None, error: str | None = None) -> None:
        _check_edge(_PULL_EDGES, self.status, new, self.params.request_id)
        self.status, self.error = new, error
        if new in (PullStatus.DONE, PullStatus.FAILED):
            self.finished_at = now

    @property
    def num_bytes(self) -> int:
        layout = self.params.layout
        return len(self.params.block_ids) * layout.num_layers * layout.bytes_per_block_per_layer


class ConsumerConnector:
    """Pulls requests' KV blocks and reports each pull's outcome exactly once (unless aborted).

    start() never raises for conditions a healthy cluster meets (lease nearly over, unknown or
    removed peer, backend refusal): the pull is FAILED and the next poll() reports it. It raises
    only for caller bugs (a request already pulling, mismatched block counts).
    """

    def __init__(self, backend: TransferBackend, clock: Clock = time.time, min_lease_margin_s: float = 0.05):
        if min_lease_margin_s < 0:
            raise ValueError(f"min_lease_margin_s must be >= 0, got {min_lease_margin_s}")
        self._backend = backend
        self._clock = clock
        self._margin = min_lease_margin_s
        self._pulls: dict[str, _Pull] = {}
        """Started and not yet reported, in start order."""
        self._done = self._failed = self._aborted = self._bytes = 0

    def start(self, params: TransferParams, local_block_ids: Iterable[int]) -> PullStatus:
        """WAITING -> PULLING (or DONE/FAILED already, for backends that finish or refuse at once)."""
        if params.request_id in self._pulls:
            raise InvalidTransitionError(f"request {params.request_id!r} is already pulling")
        local_block_ids = tuple(local_block_ids)
        if len(local_block_ids) != len(params.block_ids):
            raise ValueError(f"request {params.request_id!r}: {len(local_block_ids)} local blocks for "
                             f"{len(params.block_ids)} remote blocks")
        now = self._clock()
        pull = _Pull(params, local_block_ids, now)
        refusal = self._refusal(params, now)
        if refusal is None:
            try:
                pull.handle = self._backend.start_pull(params, local_block_ids)
            except KVTransferError as error:
                refusal = str(error)
        self._pulls[params.request_id] = pull  # not before: a caller bug raised above leaves no trace
        if refusal is not None:
            pull.advance(PullStatus.FAILED, now, refusal)
            return pull.status
        pull.advance(PullStatus.PULLING)
        self._check(pull)  # a CPU/in-process pull is usually complete inside start_pull
        return pull.status

    def poll(self) -> list[PullOutcome]:
        """Pulls that ended since the last poll, in start order; a pending pull whose lease has
        passed is abandoned (released) and FAILED, so no pull waits forever."""
        outcomes = []
        for pull in list(self._pulls.values()):
            if pull.status is PullStatus.PULLING:
                self._check(pull)
            if pull.status in (PullStatus.DONE, PullStatus.FAILED):
                outcomes.append(self._report(pull))
        return outcomes

    def abort(self, request_id: str) -> bool:
        """Forget a pull without reporting it, releasing its handle (after which the backend writes
        no more bytes, so the caller may free the local blocks). False if unknown."""
        pull = self._pulls.pop(request_id, None)
        if pull is None:
            return False
        if pull.handle is not None:
            self._backend.release_pull(pull.handle)
        self._aborted += 1
        return True

    def status(self, request_id: str) -> PullStatus | None:
        """Status of a pull not yet reported by poll() (None if unknown, reported or aborted)."""
        pull = self._pulls.get(request_id)
        return pull.status if pull is not None else None

    def stats(self) -> ConsumerStats:
        return ConsumerStats(len(self._pulls), self._done, self._failed, self._aborted, self._bytes)

    def _refusal(self, params: TransferParams, now: float) -> str | None:
        left = params.lease_expires_at - now
        if left <= 0:
            return f"the lease expired {-left:.3f}s before the pull could start"
        if left < self._margin:
            return f"lease has {left:.3f}s left, less than the {self._margin:.3f}s margin a pull needs"
        if not self._backend.has_peer(params.producer_id):
            return f"unknown producer {params.producer_id!r}: no handshake, or it was removed"
        return None

    def _check(self, pull: _Pull) -> None:
        """PULLING -> DONE | FAILED when the backend says so or the lease has passed."""
        state = self._backend.poll_pull(pull.handle)
        now = self._clock()
        late = now > pull.params.lease_expires_at
        if state is PullState.PENDING and not late:
            return
        if state is PullState.DONE and not late:
            pull.advance(PullStatus.DONE, now)
        elif state is PullState.FAILED:
            pull.advance(PullStatus.FAILED, now, pull.handle.error or "the transfer backend reported a failed pull")
        else:  # DONE or still PENDING after the deadline: the producer may have reused the blocks
            pull.advance(PullStatus.FAILED, now, LATE_PULL_ERROR)
        self._backend.release_pull(pull.handle)
        pull.handle = None

    def _report(self, pull: _Pull) -> PullOutcome:
        del self._pulls[pull.params.request_id]
        seconds = pull.finished_at - pull.started_at
        if pull.status is PullStatus.DONE:
            self._done += 1
            self._bytes += pull.num_bytes
            return PullOutcome(pull.params.request_id, PullStatus.DONE, None, pull.num_bytes, seconds)
        self._failed += 1
        return PullOutcome(pull.params.request_id, PullStatus.FAILED, pull.error, 0, seconds)
