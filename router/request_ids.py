"""The ids the router knows client requests by, apart from the ids the clients gave them.

A client's id (OpenAI `request_id` / `X-Request-Id`, gRPC GenerateRequest.request_id) is what the client sees:
responses' `cmpl-<id>` / `chatcmpl-<id>`, gRPC responses' request_id. The router keys the request by its internal
id: in-flight bookkeeping, its sequences' ids (`<id>-<choice index>`, router/fanout.py), its beam search's step
ids, its records, metrics and access-log line. (Workers never see either: each attempt gets a worker-side id of its
own, Orchestrator._attempt.) Two requests may share a client id while both run, as vLLM serves them (each gets an
internal id of its own): a client built with a fixed X-Request-Id header, a gateway retrying a request under the
same id while the first still runs.

The internal id is the client's when that id and the request's sequence ids are all free, else the client's id
with the suffix `DUPLICATE_MARK<k>` for the smallest k >= 2 that frees them all (`abc #2`, sequences `abc #2-0`, ...).

Invariants: no two reservations, and no two requests in generate() or stepwise(), share an id; a suffixed id never
equals an id a client can send (client ids are printable ASCII without spaces, RequestLimits.check_request_id, and
the suffix has a space), nor any id derived from one. A beam search's step ids (`<id>-beam-<step>-<beam>`) are not
reserved: nothing keys them (a step's record names its request in step_of).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from splitserve.common.errors import InvalidRequestError

DUPLICATE_MARK = " #"
"""Between a client's id and the number that tells a duplicate's internal id apart (a space: no client id has one)."""


def sequence_request_id(request_id: str, index: int) -> str:
    """The id one sequence of a request of several runs under (choice `index`, router/fanout.py)."""
    return f"{request_id}-{index}"


class ReservedRequestId:
    """A client request's ids, reserved from parsing to its end: the caller releases them on every path
    (release is idempotent, so the request's stream and the API's error path may both call it)."""

    def __init__(self, client_request_id: str, request_id: str, ids: tuple[str, ...],
                 on_release: Callable[[tuple[str, ...]], None]) -> None:
        self.client_request_id = client_request_id
        """The id the client gave (or the router made for it): what its responses carry."""
        self.request_id = request_id
        """The id the router knows the request by (the client's unless that was taken)."""
        self.ids = ids
        """request_id and its sequences' ids (none for a request of one sequence)."""
        self._on_release = on_release
        self._released = False

    @property
    def renamed_from(self) -> str | None:
        """The client's id when the router knows the request by another (GenerationInput.client_request_id)."""
        return None if self.request_id == self.client_request_id else self.client_request_id

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._on_release(self.ids)


class RequestIds:
    """The ids reserved for client requests (reserve) and those of the requests running (start, stop)."""

    def __init__(self) -> None:
        self._reserved: set[str] = set()
        """Ids of the reservations not released yet (a request's own and its sequences')."""
        self._running: set[str] = set()
        """Ids of the requests in Orchestrator.generate() and stepwise() (their internal steps are not)."""

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_reserved(self) -> int:
        """Ids held by reservations not released yet (0 once every client request ended)."""
        return len(self._reserved)

    def reserve(self, client_request_id: str, num_sequences: int = 1) -> ReservedRequestId:
        """The client's request's internal id and its `num_sequences` sequences' ids (num_sequences > 1: each
        `sequence_request_id`), none of them taken."""
        ids = next(ids for ids in (_ids_of(candidate, num_sequences) for candidate in _candidates(client_request_id))
                   if not any(self._taken(request_id) for request_id in ids))
        self._reserved.update(ids)
        return ReservedRequestId(client_request_id, ids[0], ids, self._reserved.difference_update)

    def start(self, request_id: str) -> None:
        """A request starts running: its id reserved by its API (a client's request, or one of its sequences), or a
        library caller's own; InvalidRequestError for a library caller's id that a running request has."""
        if request_id in self._running:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in flight")
        self._running.add(request_id)

    def stop(self, request_id: str) -> None:
        self._running.discard(request_id)

    def _taken(self, request_id: str) -> bool:
        return request_id in self._reserved or request_id in self._running


def _candidates(client_request_id: str) -> Iterator[str]:
    """The client's id, then `<id> #2`, `<id> #3`, ... (endless: one of them is free)."""
    yield client_request_id
    for k in itertools.count(2):
        yield f"{client_request_id}{DUPLICATE_MARK}{k}"


def _ids_of(request_id: str, num_sequences: int) -> tuple[str, ...]:
    """A request's id and, when it runs as several sequences, theirs (router/fanout.py's sequence_inputs)."""
    return (request_id, *(sequence_request_id(request_id, i) for i in range(num_sequences) if num_sequences > 1))
