"""Admission by count: how many requests the router takes at once, decided in O(1) before a
request's body is read, parsed or tokenized.

`AdmissionControl` is the one owner of that count (router.routing.max_in_flight_requests) and of
whether the router takes new requests at all (a drain stops it). `try_admit()` returns an
`Admission`, the request's slot, or a typed `AdmissionRejection`; a slot is held from the API's
first line to the end of the request's stream and `release()` frees it exactly once, however
often it is called, so every path (success, an error while parsing, a cancel, a disconnect, a
stream that never started) can call it without counting twice. `watch()` reports the free slots as they
change (the HTTP acceptor process refuses by them, router/acceptor_process.py), so every API releases a
request's slot before the answer that ends it goes out: a client may send its next request the moment it
has that answer. Pure: no I/O, no clock, no
asyncio; call it from one thread (the router's event loop). Orchestrator.admit is its adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from splitserve.common.validation import require

TOO_MANY_REQUESTS = "too_many_requests"
"""The rejection reason while the router holds max_in_flight_requests."""
DRAINING = "draining"
"""The rejection reason once a drain started."""
RETRY_AFTER_S = 1
"""What a RESOURCE_EXHAUSTED rejection tells a client to wait before retrying (HTTP Retry-After):
a slot frees when a request ends, typically within a second under load."""


@dataclass(frozen=True)
class AdmissionRejection:
    """Why a request was refused at the door."""

    reason: str
    """TOO_MANY_REQUESTS or DRAINING."""
    code: str
    """The gRPC status code name: RESOURCE_EXHAUSTED (retry later) or UNAVAILABLE (go elsewhere)."""
    message: str
    """For the client."""


class Admission:
    """One admitted request's slot."""

    def __init__(self, release: Callable[[], None]) -> None:
        self._release = release
        self.released = False

    def release(self) -> None:
        """Free the slot; later calls do nothing."""
        if not self.released:
            self.released = True
            self._release()


class AdmissionControl:
    """The requests a router holds (admitted, not yet released) and its limit."""

    def __init__(self, max_in_flight: int | None, on_idle: Callable[[], None] = lambda: None) -> None:
        """`max_in_flight` None: no limit. `on_idle()` runs whenever the last slot is released
        (a drain waits for it)."""
        require(max_in_flight is None or max_in_flight >= 1, f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._on_idle = on_idle
        self.in_flight = 0
        """Slots handed out and not released."""
        self.accepting = True
        """False once stop_accepting() ran: every later try_admit is a DRAINING rejection."""
        self._watchers: list[Callable[[int | None], None]] = []

    @property
    def free_slots(self) -> int | None:
        """Slots try_admit would still hand out; None while no capacity limit is in force (none configured, or
        a drain, which refuses every request for another reason)."""
        if not self.accepting or self.max_in_flight is None:
            return None
        return max(0, self.max_in_flight - self.in_flight)

    def watch(self, on_change: Callable[[int | None], None]) -> Callable[[], None]:
        """Run `on_change(free_slots)` now and after each admission, release and stop_accepting (the acceptor
        process refuses by it); returns what stops that."""
        self._watchers.append(on_change)
        on_change(self.free_slots)
        return lambda: self._watchers.remove(on_change)

    def capacity_rejection(self) -> AdmissionRejection:
        """The TOO_MANY_REQUESTS rejection of a router holding max_in_flight slots."""
        return AdmissionRejection(TOO_MANY_REQUESTS, "RESOURCE_EXHAUSTED",
                                  f"the router has {self.max_in_flight} requests in flight, its limit "
                                  "(router.routing.max_in_flight_requests); retry later")

    def stop_accepting(self) -> None:
        self.accepting = False
        self._notify()

    def try_admit(self) -> Admission | AdmissionRejection:
        """A slot, or why not (not counted anywhere: Orchestrator.admit counts)."""
        if not self.accepting:
            return AdmissionRejection(DRAINING, "UNAVAILABLE",
                                      "the router is draining (shutting down): it takes no new requests")
        if self.free_slots == 0:
            return self.capacity_rejection()
        self.in_flight += 1
        self._notify()
        return Admission(self._release)

    def _release(self) -> None:
        self.in_flight -= 1
        self._notify()
        if self.in_flight == 0:
            self._on_idle()

    def _notify(self) -> None:
        for on_change in list(self._watchers):
            on_change(self.free_slots)
