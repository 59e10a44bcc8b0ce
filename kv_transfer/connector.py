"""Per-request transfer state machines on both sides of a KV transfer.

Producer (prefill worker), one lease per request:
    HELD --notification--> PULLED     (the consumer's check READ completed)
    HELD --TTL-----------> EXPIRED    (clock() > hold time + lease_ttl_s, the producer's clock)
    HELD --release()-----> FREED      (cancelled by the caller)
Consumer (decode worker), one pull per request:
    WAITING --start-------> PULLING    (data READ in flight)
    WAITING --refused-----> FAILED     (unknown peer, backend refusal)
    PULLING --READ done---> VERIFYING  (check READ of the blocks' generations in flight)
    VERIFYING --match-----> DONE       (every generation read equals the snapshot)
    PULLING | VERIFYING --> FAILED     (generations changed, a READ failed, or still pending
                                        lease_ttl_s after start on the consumer's clock)
A layer-wise pull (start(..., layerwise=True)) reads its layers in announced ranges, one data READ
per range, and checks once after the last:
    WAITING --start-------------------> AWAITING_LAYER  (no layer announced yet)
    AWAITING_LAYER --announcement-----> PULLING         (READ of the announced layers not yet read)
    PULLING --READ done, next ready---> PULLING         (READ of the layers announced meanwhile)
    PULLING --READ done, none ready---> AWAITING_LAYER
    PULLING --READ done, all layers---> VERIFYING
    AWAITING_LAYER --TTL--------------> FAILED
Ordering invariant (asserted in _read_layers): layer l is READ only after l and every layer below
it were announced. A layer-wise hold snapshots the generations before the final chunk writes the
blocks: those writes are the only ones not preceded by a bump, and each layer's happen before its
announcement (the producer never writes a held block afterwards: it does not decode). So a READ
never sees a layer the final chunk has not written, and the generation check after the last layer
proves, as for a whole-request pull, that no block was reclaimed meanwhile.

The connectors never touch the engine: they report which requests ended and the worker frees
or admits blocks. Each side reads only its own injected clock (monotonic by default) and never
compares it with the other side's: no clock value crosses the wire, only durations.

Why a pull that reports DONE read intact blocks, whatever the clocks say (a seqlock over
one-sided READs):
- Each producer block has a generation (an int64 word next to the KV pool, readable by peers)
  that only grows. hold() snapshots the blocks' generations into TransferParams.
- Before a block can go back to the engine, the producer bumps its generation: _end() bumps the
  blocks of the ending lease that no other HELD lease holds (prefix-cached blocks are shared by
  leases; the engine frees a block only when its last holder lets go), then reports the
  ReleasedLease (or returns from release()), and only then does the worker free the blocks.
  So a block's bytes change only after a bump that follows every snapshot of those bytes.
- The consumer posts the check READ of the generations only after its data READ completed. If
  the check reads the snapshot, no bump had happened when the check read the words, so none had
  happened while the data READ ran either: the bytes were the held ones. If any generation
  differs the pull FAILS (RECLAIMED_ERROR), whatever the bytes are, and the worker never uses them.
- The producer's PULLED notification rides on the check READ, so a successful pull cannot make
  the producer bump (and free) between the data READ and the check. (Were a notification ever
  delivered before its READ read the words, the check would see the bump and fail: a spurious
  failure, never a wrong DONE.)
- Generations never decrease, so a block reclaimed and re-held (ABA) cannot look unchanged.
Clock skew can only move *when* the two sides give up: the producer expires a lease lease_ttl_s
after hold() on its monotonic clock; the consumer abandons a pull pending lease_ttl_s after
start() on its own (by then the producer has reclaimed the blocks, in any case the generation
check decides). Memory assumption: the bump is a host store made before the engine may reuse the
block, and a READ posted after another completed reads memory no older than that completion.
"""

from __future__ import annotations

import enum
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from splitserve.common.kv_transfer_types import KVLayout, LayerAnnouncement, TransferParams
from splitserve.kv_transfer.base import KVTransferError, PullHandle, PullState, TransferBackend

Clock = Callable[[], float]
RECLAIMED_ERROR = "the producer reclaimed the blocks before the pull completed"
PULL_TIMEOUT_ERROR = "the pull did not complete within the lease's {ttl:g} s TTL (measured on the consumer's clock)"


class InvalidTransitionError(RuntimeError):
    """A state machine was driven along an edge it does not have (a bug in the caller)."""


class LeaseState(enum.Enum):
    HELD = "held"
    PULLED = "pulled"
    FREED = "freed"
    EXPIRED = "expired"


class PullStatus(enum.Enum):
    WAITING = "waiting"
    AWAITING_LAYER = "awaiting_layer"
    """Layer-wise only: no READ in flight, layers remain, the next one is not announced yet."""
    PULLING = "pulling"
    VERIFYING = "verifying"
    DONE = "done"
    FAILED = "failed"


_LEASE_EDGES = {LeaseState.HELD: {LeaseState.PULLED, LeaseState.FREED, LeaseState.EXPIRED}}
_PULL_EDGES = {PullStatus.WAITING: {PullStatus.PULLING, PullStatus.AWAITING_LAYER, PullStatus.FAILED},
               PullStatus.AWAITING_LAYER: {PullStatus.PULLING, PullStatus.FAILED},
               PullStatus.PULLING: {PullStatus.PULLING, PullStatus.AWAITING_LAYER, PullStatus.VERIFYING,
                                    PullStatus.FAILED},
               PullStatus.VERIFYING: {PullStatus.DONE, PullStatus.FAILED}}


def _check_edge(edges: dict, current: enum.Enum, new: enum.Enum, request_id: str) -> None:
    if new not in edges.get(current, ()):
        raise InvalidTransitionError(f"request {request_id!r}: no transition {current.name} -> {new.name}")


# ---- producer ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReleasedLease:
    """A lease that ended (PULLED, EXPIRED or FREED): the worker frees its blocks now (the
    generations were bumped before this was made)."""

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
    """On the producer's clock only (never sent: the consumer gets lease_ttl_s)."""
    layers_written: int
    """Layers [0, layers_written) of the blocks are written: all of them for a whole-request hold;
    a layer-wise hold starts at 0 and announce() counts up."""
    state: LeaseState = LeaseState.HELD

    def advance(self, new: LeaseState) -> None:
        _check_edge(_LEASE_EDGES, self.state, new, self.request_id)
        self.state = new


class ProducerConnector:
    """Holds prefilled requests' blocks under leases until pulled, expired or released.

    Invariants: every lease that poll() reports is ended exactly once and forgotten; a request id
    holds at most one lease at a time; a block's generation is bumped when the last HELD lease
    holding it ends, before that end is reported (see the module docstring).
    """

    def __init__(self, backend: TransferBackend, layout: KVLayout, lease_ttl_s: float,
                 clock: Clock = time.monotonic):
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self._backend = backend
        self._layout = layout
        self._ttl = lease_ttl_s
        self._clock = clock
        self._leases: dict[str, _Lease] = {}
        self._holders: Counter[int] = Counter()
        """block id -> HELD leases holding it (only ids with at least one)."""
        self._ended: Counter[LeaseState] = Counter()
        self._late = 0

    def hold(self, request_id: str, block_ids: Iterable[int], num_tokens: int,
             layerwise: bool = False) -> TransferParams:
        """HELD for lease_ttl_s from now on clock(); the blocks must cover num_tokens (0 < n <= blocks * block_size).

        layerwise: the blocks' final prefill chunk is about to run; announce() each layer once the
        forward wrote it (the consumer READs only announced layers). Otherwise every layer is written."""
        if request_id in self._leases:
            raise InvalidTransitionError(f"request {request_id!r}: no transition HELD -> HELD")
        block_ids = tuple(block_ids)
        if not 0 < num_tokens <= len(block_ids) * self._layout.block_size:
            raise ValueError(f"request {request_id!r}: {len(block_ids)} blocks of {self._layout.block_size} "
                             f"tokens cannot hold {num_tokens} tokens")
        self._leases[request_id] = _Lease(request_id, block_ids, self._clock() + self._ttl,
                                          0 if layerwise else self._layout.num_layers)
        self._holders.update(block_ids)
        return TransferParams(request_id, self._backend.agent_name, block_ids, num_tokens, self._layout, self._ttl,
                              self._backend.generations(block_ids))

    def poll(self) -> list[ReleasedLease]:
        """Leases that ended since the last poll: pulled ones (notification order), then expired ones.

        Notifications are taken before the expiry check, so a pull notified by now counts as
        PULLED even if its TTL has also passed."""
        ended = [self._end(request_id, LeaseState.PULLED) for request_id in self._pulled_request_ids()]
        now = self._clock()
        expired = [lease.request_id for lease in self._leases.values() if now > lease.expires_at]
        return ended + [self._end(request_id, LeaseState.EXPIRED) for request_id in expired]

    def announce(self, request_id: str, layer: int) -> LayerAnnouncement:
        """Layer `layer` of a layer-wise lease is written: the announcement to deliver to the consumer.

        Invariant: a lease's layers are announced in order, each once, while it is HELD
        (InvalidTransitionError otherwise: the forward runs its layers in order)."""
        lease = self._leases.get(request_id)
        if lease is None:
            raise InvalidTransitionError(f"request {request_id!r}: no HELD lease to announce layer {layer} of")
        if layer != lease.layers_written or layer >= self._layout.num_layers:
            raise InvalidTransitionError(f"request {request_id!r}: layer {layer} announced after layers "
                                         f"[0, {lease.layers_written}) of {self._layout.num_layers}")
        lease.layers_written += 1
        return LayerAnnouncement(request_id, self._backend.agent_name, layer)

    def release(self, request_id: str) -> bool:
        """Cancel (HELD -> FREED): the caller frees the blocks once this returns. False if it holds no lease."""
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
        """End a lease; its blocks that no other lease holds get a new generation first."""
        lease = self._leases.pop(request_id)
        lease.advance(state)
        self._holders.subtract(lease.block_ids)
        last_held = tuple(block for block in lease.block_ids if self._holders[block] == 0)
        for block in last_held:
            del self._holders[block]
        if last_held:
            self._backend.bump_generations(last_held)
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
    num_unmatched_announcements: int = 0
    """Since start: layer announcements no layer-wise pull in flight was waiting for (see announce())."""
    num_layerwise_done: int = 0
    """Of num_done: the layer-wise pulls (each READ only announced layers)."""


@dataclass
class _Pull:
    params: TransferParams
    local_block_ids: tuple[int, ...]
    started_at: float
    layerwise: bool
    ready: int
    """Layers [0, ready) are announced (all of them for a whole-request pull)."""
    status: PullStatus = PullStatus.WAITING
    handle: PullHandle | None = None
    """The READ in flight: the data READ while PULLING, the check READ while VERIFYING; None otherwise."""
    layers_read: int = 0
    """Layers [0, layers_read) are READ or being READ; layers_read <= ready."""
    announced_above: set[int] = field(default_factory=set)
    """Layers announced out of order (each > ready): they join `ready` once the gap below them fills."""
    error: str | None = None
    finished_at: float | None = None

    def note_announced(self, layer: int) -> bool:
        """Record an announced layer; False if it was announced before."""
        if not 0 <= layer < self.params.layout.num_layers:
            raise ValueError(f"request {self.params.request_id!r}: layer {layer} outside "
                             f"[0, {self.params.layout.num_layers})")
        if layer < self.ready or layer in self.announced_above:
            return False
        self.announced_above.add(layer)
        while self.ready in self.announced_above:
            self.announced_above.remove(self.ready)
            self.ready += 1
        return True

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

    start() never raises for conditions a healthy cluster meets (unknown or removed peer, backend
    refusal): the pull is FAILED and the next poll() reports it. It raises only for caller bugs
    (a request already pulling, mismatched block counts).
    """

    def __init__(self, backend: TransferBackend, clock: Clock = time.monotonic):
        self._backend = backend
        self._clock = clock
        self._pulls: dict[str, _Pull] = {}
        """Started and not yet reported, in start order."""
        self._done = self._failed = self._aborted = self._bytes = self._unmatched = self._layerwise_done = 0

    def start(self, params: TransferParams, local_block_ids: Iterable[int], layerwise: bool = False) -> PullStatus:
        """WAITING -> PULLING (or further already, for backends that finish or refuse at once).

        layerwise: the producer announces the layers (announce()); until the first one it is
        AWAITING_LAYER. Deliver a request's TransferParams (this call) before its announcements:
        an announcement for a pull not started is dropped."""
        if params.request_id in self._pulls:
            raise InvalidTransitionError(f"request {params.request_id!r} is already pulling")
        local_block_ids = tuple(local_block_ids)
        if len(local_block_ids) != len(params.block_ids):
            raise ValueError(f"request {params.request_id!r}: {len(local_block_ids)} local blocks for "
                             f"{len(params.block_ids)} remote blocks")
        now = self._clock()
        pull = _Pull(params, local_block_ids, now, layerwise, 0 if layerwise else params.layout.num_layers)
        refusal = self._refusal(params)
        self._pulls[params.request_id] = pull
        if refusal is not None:
            pull.advance(PullStatus.FAILED, now, refusal)
            return pull.status
        try:
            self._read_ready_layers(pull, now)  # a CPU/in-process READ is usually complete inside its start call
        except ValueError:  # a caller bug (local ids outside the pool) leaves no trace
            del self._pulls[params.request_id]
            raise
        return pull.status

    def announce(self, announcement: LayerAnnouncement) -> bool:
        """A layer of a layer-wise pull is written on the producer: READ every layer now ready.

        False (counted in stats) for an announcement no layer-wise pull in flight waits for: an
        unknown, aborted or ended request, a whole-request pull, another producer incarnation
        (producer_id is the epoch), or a layer announced before. ValueError for a layer outside
        the layout."""
        pull = self._pulls.get(announcement.request_id)
        if (pull is None or not pull.layerwise or pull.params.producer_id != announcement.producer_id
                or pull.status in (PullStatus.DONE, PullStatus.FAILED) or not pull.note_announced(announcement.layer)):
            self._unmatched += 1
            return False
        if pull.status is PullStatus.AWAITING_LAYER:
            self._read_ready_layers(pull, self._clock())
        return True  # a READ in flight: the newly ready layers follow once it completes (poll)

    def poll(self) -> list[PullOutcome]:
        """Pulls that ended since the last poll, in start order; a pull still pending lease_ttl_s
        after its start is abandoned (released) and FAILED, so no pull waits forever."""
        outcomes = []
        for pull in list(self._pulls.values()):
            if pull.status in (PullStatus.AWAITING_LAYER, PullStatus.PULLING, PullStatus.VERIFYING):
                self._progress(pull)
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

    def layers_read(self, request_id: str) -> int | None:
        """How many layers of a pull not yet reported are READ or being READ (None if unknown)."""
        pull = self._pulls.get(request_id)
        return pull.layers_read if pull is not None else None

    def stats(self) -> ConsumerStats:
        return ConsumerStats(len(self._pulls), self._done, self._failed, self._aborted, self._bytes, self._unmatched,
                             self._layerwise_done)

    def _refusal(self, params: TransferParams) -> str | None:
        if not self._backend.has_peer(params.producer_id):
            return f"unknown producer {params.producer_id!r}: no handshake, or it was removed"
        return None

    def _progress(self, pull: _Pull) -> None:
        """Move an AWAITING_LAYER, PULLING or VERIFYING pull on as far as its READ allows."""
        if pull.status is PullStatus.AWAITING_LAYER:
            self._check_patience(pull, self._clock())
            return
        state = self._backend.poll_pull(pull.handle)
        now = self._clock()
        if state is PullState.FAILED:
            error = pull.handle.error or "the transfer backend reported a failed pull"
            self._finish(pull, PullStatus.FAILED, now, error)
        elif state is PullState.PENDING:
            self._check_patience(pull, now)
        elif pull.status is PullStatus.PULLING:
            self._backend.release_pull(pull.handle)
            pull.handle = None
            self._read_ready_layers(pull, now)
        elif self._backend.checked_generations(pull.local_block_ids) == pull.params.block_generations:
            self._finish(pull, PullStatus.DONE, now)
        else:
            self._finish(pull, PullStatus.FAILED, now, RECLAIMED_ERROR)

    def _check_patience(self, pull: _Pull, now: float) -> None:
        """FAILED once a pull is still unfinished lease_ttl_s after its start (consumer's clock)."""
        if now - pull.started_at > pull.params.lease_ttl_s:
            self._finish(pull, PullStatus.FAILED, now, PULL_TIMEOUT_ERROR.format(ttl=pull.params.lease_ttl_s))

    def _read_ready_layers(self, pull: _Pull, now: float) -> None:
        """No READ in flight: READ the announced layers not yet read, else wait for the next
        announcement, else (every layer read) start the check."""
        if pull.layers_read == pull.params.layout.num_layers:
            self._start_check(pull, now)
        elif pull.ready > pull.layers_read:
            self._read_layers(pull, range(pull.layers_read, pull.ready), now)
        elif pull.status is not PullStatus.AWAITING_LAYER:
            pull.advance(PullStatus.AWAITING_LAYER)

    def _read_layers(self, pull: _Pull, layers: range, now: float) -> None:
        """Post the data READ of `layers` (-> PULLING). The ordering invariant is checked here."""
        if layers.start != pull.layers_read or layers.stop > pull.ready:
            raise InvalidTransitionError(f"request {pull.params.request_id!r}: READ of layers [{layers.start}, "
                                         f"{layers.stop}) with [0, {pull.layers_read}) read and [0, {pull.ready}) "
                                         f"announced")
        try:
            pull.handle = self._backend.start_pull(pull.params, pull.local_block_ids, layers)
        except KVTransferError as error:
            pull.advance(PullStatus.FAILED, now, str(error))
            return
        pull.layers_read = layers.stop
        pull.advance(PullStatus.PULLING)
        self._progress(pull)

    def _start_check(self, pull: _Pull, now: float) -> None:
        """PULLING -> VERIFYING: every data READ completed, so the check READ may start."""
        try:
            pull.handle = self._backend.start_check(pull.params, pull.local_block_ids)
        except KVTransferError as error:
            pull.advance(PullStatus.FAILED, now, str(error))
            return
        pull.advance(PullStatus.VERIFYING)
        self._progress(pull)

    def _finish(self, pull: _Pull, status: PullStatus, now: float, error: str | None = None) -> None:
        if pull.handle is not None:
            self._backend.release_pull(pull.handle)
        pull.handle = None
        pull.advance(status, now, error)

    def _report(self, pull: _Pull) -> PullOutcome:
        del self._pulls[pull.params.request_id]
        seconds = pull.finished_at - pull.started_at
        if pull.status is PullStatus.DONE:
            self._done += 1
            self._layerwise_done += pull.layerwise
            self._bytes += pull.num_bytes
            return PullOutcome(pull.params.request_id, PullStatus.DONE, None, pull.num_bytes, seconds)
        self._failed += 1
        return PullOutcome(pull.params.request_id, PullStatus.FAILED, pull.error, 0, seconds)
