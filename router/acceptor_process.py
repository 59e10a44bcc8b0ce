"""The HTTP API's acceptor: a process of its own that accepts every connection and refuses what a full
router would refuse itself, so that a burst of thousands of requests does not queue on the router's event
loop (bench/admission_burst.py: one Python event loop needs 0.1-0.35 ms a connection, and the 2,500th
rejection waited for all those before it).

Two halves joined by one AF_UNIX SOCK_SEQPACKET socket pair (each message one datagram, its first byte its
kind; sockets ride as SCM_RIGHTS):

- `Acceptor`, in the child (`python -m splitserve.router.acceptor_process <fd> <router pid>`, standard library
  only): an epoll loop over the listening socket, the control socket and the connections whose request it
  is waiting for. It peeks at each new connection's bytes as they come (router/busy_refusal.decide): a
  gated request (one the admission gate would admit or refuse for capacity) is handed to the router while
  the router has a free slot, and refused here (the router's 429, then closed) while it has none; anything
  else is handed off at once, nothing consumed; a request not all there after HEAD_WAIT_S or MAX_PEEKS
  reads is handed off too (a slow client is the loop's to serve, as ever). With no capacity limit in force (a drain)
  every connection is handed off unread. It never blocks on the router: what the control socket cannot
  take yet waits in an outbox, so a router whose loop stalls does not stop the refusals. On STOP it stops
  accepting, sends what it still holds (for at most STOP_SEND_S) and ends; if the router goes away it just
  ends.
- `AcceptorProcess`, in the router: starts the child, sends it the listening socket and the rules, reports
  the free slots (AdmissionControl.watch), takes the slot of each gated request handed to it the moment it
  arrives (so the slots it reports already count them), and serves what comes back: each connection goes to
  uvicorn's protocol on the loop, each batch of refusals is counted and logged there (after their answers
  went out). If the child ends unexpectedly, the router accepts on the listening socket itself (`on_exit`).

The slots the acceptor may still hand out: the router's last report of free slots, less the gated requests
it handed off since that report's count of them (SLOTS carries how many the router has taken in). Another
API (gRPC) taking a slot meanwhile can make the router's attempt fail: that request's connection is served
without a slot and refused by the loop's admission gate, as before. A refusal just as a slot freed is the
429 a request arriving a moment earlier would have got.

Messages, router -> acceptor: RULES (+ the listening socket; first, once), SLOTS, STOP.
Acceptor -> router: CONNECTIONS (+ sockets, nothing read), GATED (+ sockets, each holding one gated request;
their count, so that any the router could not take are still counted), REFUSED (JSON: [[path, request id
or null], ...]), UNLOGGED (a count of refusals the acceptor held no record of: MAX_HELD_REFUSALS).
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import json
import logging
import os
import resource
import select
import socket
import struct
import subprocess
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.common.log_escape import MAX_LOGGED_CHARS
from splitserve.router.busy_refusal import MAX_PEEK_BYTES, NEED_MORE, GatedRequest, RefusalRules, answer, decide
from splitserve.router.child_process import follow_router

if TYPE_CHECKING:  # the child imports only the standard library
    from splitserve.router.admission import Admission

logger = logging.getLogger(__name__)

RULES, SLOTS, STOP = b"R", b"L", b"Q"
CONNECTIONS, GATED, REFUSED, UNLOGGED = b"C", b"G", b"X", b"U"
_SLOTS = struct.Struct("=cqq")
"""SLOTS, free slots (-1: no capacity limit in force), gated requests the router has taken in."""
_COUNT = struct.Struct("=q")
"""A GATED message's payload: how many sockets it carries (the router counts them even if some were lost); an
UNLOGGED message's: how many refusals it stands for."""
NO_LIMIT = -1
MAX_FDS_PER_MESSAGE = 128
"""Sockets per CONNECTIONS / GATED message (Linux takes at most 253 in one SCM_RIGHTS message)."""
MAX_REFUSALS_PER_MESSAGE = 32
"""Refusals per REFUSED message: each a gated path, an id cut at MAX_LOGGED_CHARS (at most ~1.6 KB as JSON) and an
Anthropic `req_<hex>` id or null."""
MAX_HELD_REFUSALS = 20_000
"""Refusal records the acceptor holds for a router that does not read them (its loop stalled): about 100 bytes each,
at most about 1.6 KB (an id of MAX_LOGGED_CHARS escaped as JSON), so at most about 32 MB. Past this many a refusal
is only counted, and the router hears the count (UNLOGGED) once it reads again: its rejection count and one warning
instead of the access log's lines. A router that reads keeps far fewer: records go out every MAX_PENDING_REFUSALS."""
MAX_PENDING_REFUSALS = 4096
"""Refusals the acceptor answers before it sends their records even though more connections are waiting: the
router accounts for them (a log line and a count each) on its loop, which a burst's answers should not wait for,
so they go when the acceptor is idle, or at this many."""
STOP_SEND_S = 2.0
"""How long a stopping acceptor waits for the router to take what it still has to send."""
MAX_MESSAGES_PER_WAKE = 16
"""Messages the router handles per turn of its loop (a backlog of refusal batches must not hold it)."""
MAX_MESSAGE_BYTES = 64 << 10
"""The largest message either side sends after RULES (a few KB): a REFUSED batch."""
HEAD_WAIT_S = 5.0
"""How long the acceptor waits for a new connection's request to arrive whole before handing it off."""
MAX_PEEKS = 8
"""How often the acceptor reads a connection's first bytes before handing it off anyway: each read copies all of
them again, so a head sent a few bytes at a time would cost it quadratic copying (the loop's parser takes
bytes as they come)."""
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
_DONTWAIT = int(socket.MSG_DONTWAIT)
_LAST_SEND = int(socket.MSG_MORE)
"""A refusal's send flag: the answer waits in the send queue until close(), which puts the FIN on the same segment.
One segment and one ACK a refusal instead of two and two: on loopback the kernel does the client's receiving
too, in the acceptor's time, and that packet work is most of a refusal's cost (bench/admission_burst.py:
rejections' p99 about halved on 2 cores)."""
ACCEPT_RETRY_S = 1.0
"""How long the acceptor stops accepting after accept() ran out of a resource, as asyncio's loop does."""
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""accept() errors that pause accepting (asyncio's list); any other is the one connection's, and skipped."""
ACCEPTS_PER_WAKE = 256
"""Connections accepted before the acceptor looks at its other sockets again."""


@dataclass(frozen=True)
class RefusedRequest:
    """A request the acceptor answered 429, for the router's access log and rejection count."""

    path: str
    request_id: str | None
    """The X-Request-Id its answer carried, else the request's own (busy_refusal.Answer.request_id), cut at
    MAX_LOGGED_CHARS as the refused line cuts it."""
    anthropic_request_id: str | None
    """The Anthropic `request-id` its answer carried (busy_refusal.Answer.anthropic_request_id)."""

    @staticmethod
    def batch_to_wire(batch: list[tuple[str, str | None, str | None]]) -> bytes:
        """(path, request_id, anthropic_request_id) triples as a REFUSED message's payload (the acceptor keeps
        tuples: it makes thousands)."""
        return json.dumps(batch).encode()

    @staticmethod
    def batch_from_wire(data: bytes) -> list[RefusedRequest]:
        return [RefusedRequest(*fields) for fields in json.loads(data)]


# ---- the child: accept, then hand off or refuse ----------------------------------------------------

@dataclass
class _Waiting:
    """A connection the acceptor waits on for its request: from its accept until the request is whole."""

    sock: socket.socket
    deadline: float
    """When to stop waiting and hand it off (monotonic seconds)."""
    peeks: int = 0
    """How often its first bytes were read."""


class Acceptor:
    """The child's loop. Owns each accepted connection until it is handed off (the router then holds its own
    descriptor; this process closes its copy) or refused (closed here)."""

    def __init__(self, control: socket.socket, listening: socket.socket, rules: RefusalRules,
                 max_held_refusals: int = MAX_HELD_REFUSALS) -> None:
        self._control = control
        self._listening = listening
        self._rules = rules
        self._free: int | None = None
        """The router's last report of free slots; None: no capacity limit in force (hand everything off)."""
        self._gated_sent = 0
        self._gated_seen = 0
        """Gated requests handed off, and how many of them the router had taken in at its last report."""
        self._waiting: OrderedDict[int, _Waiting] = OrderedDict()
        """fd -> a connection whose request is not all there yet, oldest first: every connection waits HEAD_WAIT_S,
        so the first entry is the next to expire."""
        self._handoffs: list[socket.socket] = []
        self._gated: list[socket.socket] = []
        self._refused: list[tuple[str, str | None, str | None]] = []
        """RefusedRequest's fields of each refusal not yet sent to the router."""
        self._outbox: deque[tuple[bytes, list[socket.socket], int]] = deque()
        """Messages (and the sockets they carry, and how many refusal records) the control socket has not taken yet:
        the acceptor never blocks on the router, so a router whose loop stalls does not stop it answering."""
        self._max_held_refusals = max_held_refusals
        self._held_refusals = 0
        """Refusal records in self._refused and the outbox (at most max_held_refusals)."""
        self._unlogged = 0
        """Refusals past max_held_refusals not yet reported (sent as UNLOGGED once the outbox is empty)."""
        self._waiting_to_send = False
        """The control socket is watched for room (EPOLLOUT) because the outbox is not empty."""
        self._epoll = select.epoll()
        self._accept_resumes: float | None = None
        """When to accept again after accept() failed; None while accepting."""
        self._date = (0, b"")
        self._control_fd, self._listening_fd = control.fileno(), listening.fileno()
        control.setblocking(False)
        listening.setblocking(False)
        self._epoll.register(self._control_fd, select.EPOLLIN)
        self._epoll.register(self._listening_fd, select.EPOLLIN)

    def run(self) -> None:
        """Until the router sends STOP (then what is left to send goes first, for at most STOP_SEND_S) or goes
        away."""
        try:
            self._serve()
            self._post_refusals()
            self._control.settimeout(STOP_SEND_S)
            while self._send_next():
                pass
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass  # the router is gone or does not read: nobody to hand anything to
        finally:
            self._close()

    def _serve(self) -> None:
        """The loop. The router's reports are read before the connections that became ready with them: a slot
        freed before a client had its answer is free for that client's next request."""
        while True:
            events = self._epoll.poll(0 if self._refused else self._poll_timeout())
            if not events and self._refused:  # idle: now the router may account for the refusals
                self._post_refusals()
                self._send_outbox()
                continue
            if not self._read_control():
                return
            for fd, _ in events:
                if fd == self._listening_fd:
                    self._accept()
                elif fd in self._waiting:
                    self._consider(self._waiting[fd])
            self._expire(time.monotonic())
            self._resume_accepting(time.monotonic())
            self._post_handoffs()
            if len(self._refused) >= MAX_PENDING_REFUSALS:
                self._post_refusals()
            self._send_outbox()

    def _poll_timeout(self) -> float:
        """Seconds until the next wait expires or accepting resumes; -1 (no timeout) when neither is due."""
        deadlines = [] if self._accept_resumes is None else [self._accept_resumes]
        if self._waiting:
            deadlines.append(self._waiting[next(iter(self._waiting))].deadline)
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else -1

    def _read_control(self) -> bool:
        """Apply the router's reports; False once it said STOP or went away."""
        while True:
            try:
                message = self._control.recv(MAX_MESSAGE_BYTES, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            if not message or message[:1] == STOP:
                return False
            if message[:1] == SLOTS:
                _, free, self._gated_seen = _SLOTS.unpack(message)
                self._free = None if free == NO_LIMIT else free

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, _ = self._listening.accept()
            except BlockingIOError:
                return
            except OSError as error:
                if error.errno not in RESOURCE_ERRNOS:  # the one connection failed (ECONNABORTED, ...): go on
                    continue
                print(f"acceptor: accept() failed ({error}); accepting again in {ACCEPT_RETRY_S:g} s", file=sys.stderr)
                self._epoll.unregister(self._listening_fd)
                self._accept_resumes = time.monotonic() + ACCEPT_RETRY_S  # the connections wait in the backlog
                return
            if self._free is None:
                self._handoffs.append(self._release(sock, waiting=False))
            else:  # edge-triggered: a request already there is reported at once. Not read here: in a burst the
                # connections come before their requests, and a read finding nothing costs a refusal's time later
                self._waiting[sock.fileno()] = _Waiting(sock, time.monotonic() + HEAD_WAIT_S)
                self._epoll.register(sock.fileno(), select.EPOLLIN | select.EPOLLET)

    def _resume_accepting(self, now: float) -> None:
        if self._accept_resumes is not None and now >= self._accept_resumes:
            self._accept_resumes = None
            self._epoll.register(self._listening_fd, select.EPOLLIN)

    def _consider(self, entry: _Waiting) -> None:
        """Hand a waited-for connection off (with its slot, or without), refuse its request, or wait for more of
        it (handed off after MAX_PEEKS reads)."""
        sock = entry.sock
        try:
            peeked = sock.recv(MAX_PEEK_BYTES, _PEEK)
        except BlockingIOError:  # nothing yet
            peeked = None
        except OSError:  # reset by the client: nothing to answer
            self._drop(sock)
            return
        else:
            if not peeked:  # closed before it sent anything: nothing to answer
                self._drop(sock)
                return
        entry.peeks += 1
        decision = NEED_MORE if peeked is None else decide(peeked, self._rules)
        if isinstance(decision, GatedRequest) and self._free is not None:
            if self._free - (self._gated_sent - self._gated_seen) > 0:
                self._gated_sent += 1
                self._gated.append(self._release(sock, waiting=True))
            else:
                self._refuse(sock, decision)
        elif decision is not NEED_MORE or entry.peeks >= MAX_PEEKS:
            self._handoffs.append(self._release(sock, waiting=True))

    def _release(self, sock: socket.socket, waiting: bool) -> socket.socket:
        """`sock`, no longer waited for, to hand off: the router's loop serves it (without Nagle's delay, as
        asyncio's own accepts are: router/http_server.listening_socket). It leaves the epoll set here,
        which would otherwise keep watching it through the router's descriptor."""
        if waiting:
            del self._waiting[sock.fileno()]
            self._epoll.unregister(sock.fileno())
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _drop(self, sock: socket.socket) -> None:
        """Close a waited-for connection handed to no one (closing its only descriptor also takes it out of the epoll
        set)."""
        del self._waiting[sock.fileno()]
        sock.close()

    def _refuse(self, sock: socket.socket, request: GatedRequest) -> None:
        reply = answer(request, self._rules, self._http_date())
        try:
            sock.recv(MAX_PEEK_BYTES, _DONTWAIT)  # the request, and any bytes sent after it since the peek: closing
            # with unread bytes would reset the connection, and the answer held for the FIN (_LAST_SEND) with it
            sock.send(reply.data, _LAST_SEND)  # a few hundred bytes into a fresh connection's empty send buffer
        except OSError:
            pass  # the client went away: nobody to answer, still a refusal
        self._drop(sock)
        if self._held_refusals < self._max_held_refusals:
            self._held_refusals += 1
            request_id = None if reply.request_id is None else reply.request_id[:MAX_LOGGED_CHARS]
            self._refused.append((request.path, request_id, reply.anthropic_request_id))
        else:
            self._unlogged += 1

    def _http_date(self) -> bytes:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, email.utils.formatdate(now, usegmt=True).encode())
        return self._date[1]

    def _expire(self, now: float) -> None:
        while self._waiting:
            entry = self._waiting[next(iter(self._waiting))]
            if entry.deadline > now:
                return
            self._handoffs.append(self._release(entry.sock, waiting=True))

    def _post_handoffs(self) -> None:
        """Queue for the router the connections this round handed off."""
        for kind, socks in ((GATED, self._gated), (CONNECTIONS, self._handoffs)):
            for start in range(0, len(socks), MAX_FDS_PER_MESSAGE):
                batch = socks[start:start + MAX_FDS_PER_MESSAGE]
                self._outbox.append((GATED + _COUNT.pack(len(batch)) if kind == GATED else kind, batch, 0))
            socks.clear()

    def _post_refusals(self) -> None:
        """Queue for the router the refusals answered so far, for its access log and rejection count."""
        for start in range(0, len(self._refused), MAX_REFUSALS_PER_MESSAGE):
            batch = self._refused[start:start + MAX_REFUSALS_PER_MESSAGE]
            self._outbox.append((REFUSED + RefusedRequest.batch_to_wire(batch), [], len(batch)))
        self._refused.clear()

    def _send_outbox(self) -> None:
        """Send what the control socket takes now; watch it for room while anything is left."""
        try:
            while self._send_next():
                pass
        except BlockingIOError:
            if not self._waiting_to_send:
                self._epoll.modify(self._control_fd, select.EPOLLIN | select.EPOLLOUT)
                self._waiting_to_send = True
            return
        if self._waiting_to_send:
            self._epoll.modify(self._control_fd, select.EPOLLIN)
            self._waiting_to_send = False

    def _send_next(self) -> bool:
        """Send the outbox's first message, else the count of refusals held no record of; False: nothing to send."""
        if self._outbox:
            message, socks, refusals = self._outbox[0]
            self._send(message, socks)
            self._outbox.popleft()
            self._held_refusals -= refusals
        elif self._unlogged:
            self._control.send(UNLOGGED + _COUNT.pack(self._unlogged))
            self._unlogged = 0
        else:
            return False
        return True

    def _send(self, message: bytes, socks: list[socket.socket]) -> None:
        """One message; the sockets it carries are the router's once it is sent (this process closes its own)."""
        if socks:
            socket.send_fds(self._control, [message], [sock.fileno() for sock in socks])
            for sock in socks:
                sock.close()
        else:
            self._control.send(message)

    def _close(self) -> None:
        for entry in self._waiting.values():
            entry.sock.close()
        for sock in [*self._gated, *self._handoffs, *(sock for _, socks, _ in self._outbox for sock in socks)]:
            sock.close()
        self._listening.close()
        self._epoll.close()
        self._control.close()


def main(argv: list[str]) -> None:
    """`python -m splitserve.router.acceptor_process <control fd> <router pid>`."""
    control = socket.socket(fileno=int(argv[1]))
    follow_router(int(argv[2]))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a burst's connections each hold one while waiting
    message, fds, _, _ = socket.recv_fds(control, 1 << 20, 1)
    if not message.startswith(RULES) or len(fds) != 1:
        raise SystemExit(f"acceptor: expected the rules and the listening socket first, got {message[:1]!r}")
    Acceptor(control, socket.socket(fileno=fds[0]), RefusalRules.from_wire(message[1:])).run()


# ---- the router's half ------------------------------------------------------------------------------

class AcceptorProcess:
    """The router's side: the child process and the control socket. Call from the event loop's thread."""

    def __init__(self, listening: socket.socket, rules: RefusalRules, take_slot: Callable[[], Admission | None],
                 on_connection: Callable[[socket.socket, Admission | None], None],
                 on_refused: Callable[[list[RefusedRequest], int], None], on_exit: Callable[[], None]) -> None:
        """`take_slot()`: a gated request's admission slot, None when there is none. `on_connection(sock, slot)`:
        serve a handed-off connection, its first request holding `slot` when one was taken. `on_refused(requests,
        unlogged)`: account for refusals already answered, `requests` with their records and `unlogged` more
        without (MAX_HELD_REFUSALS). `on_exit()`: the child ended without being told to."""
        self._listening = listening
        self._rules = rules
        self._take_slot = take_slot
        self._on_connection = on_connection
        self._on_refused = on_refused
        self._on_exit = on_exit
        self._control: socket.socket | None = None
        self._process: subprocess.Popen | None = None
        self._free: int | None = None
        self._gated_seen = 0
        """Gated requests handed over whose slot the router has tried to take (the child's count of them, less
        the ones still in transit, is what it may still hand out)."""
        self._closing = False
        self._ended_event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Start the child and give it the listening socket; connections queued meanwhile wait in its backlog."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "splitserve.router.acceptor_process", str(theirs.fileno()), str(os.getpid())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            socket.send_fds(ours, [RULES + self._rules.to_wire()], [self._listening.fileno()])
        except BaseException:
            ours.close()
            if self._process is not None:
                self._process.kill()
                self._process.wait()
                self._process = None
            raise
        finally:
            theirs.close()
        self.attach(ours)

    def attach(self, control: socket.socket) -> None:
        """Talk to the acceptor over `control` (start() passes its end of the pair) from the running loop."""
        control.setblocking(False)
        self._control = control
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(control.fileno(), self._read)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def report_free_slots(self, free: int | None) -> None:
        """AdmissionControl's free slots changed (None: no capacity limit in force). Sent at once, so that a slot
        released before its request's answer went out is known to the acceptor before that client can send
        its next request (which the acceptor reads after any report waiting: Acceptor.run)."""
        self._free = free
        self._report()

    def _report(self) -> None:
        if self._control is None:
            return
        try:
            self._control.send(_SLOTS.pack(SLOTS, NO_LIMIT if self._free is None else self._free, self._gated_seen))
        except BlockingIOError:  # the child is behind on reading: retry once the socket takes it
            self._loop.add_writer(self._control.fileno(), self._retry_report)
        except OSError:  # the child is gone: _read sees the end
            pass

    def _retry_report(self) -> None:
        if self._control is not None:
            self._loop.remove_writer(self._control.fileno())
        self._report()

    def _read(self) -> None:
        """The child's messages, at most MAX_MESSAGES_PER_WAKE a turn (the reader fires again for the rest)."""
        for _ in range(MAX_MESSAGES_PER_WAKE):
            if self._control is None:
                return
            try:
                message, fds, flags, _ = socket.recv_fds(self._control, MAX_MESSAGE_BYTES, MAX_FDS_PER_MESSAGE)
            except BlockingIOError:
                return
            except OSError:
                message, fds, flags = b"", [], 0
            if flags & socket.MSG_CTRUNC:  # out of descriptors: those clients' connections are lost
                logger.error("the router could not take connections the HTTP acceptor handed over (out of file "
                             "descriptors?); their clients see the connection closed")
            if not message:
                self._ended()
                return
            self._apply(message, fds)

    def _apply(self, message: bytes, fds: list[int]) -> None:
        kind = message[:1]
        if kind == GATED:
            handed, = _COUNT.unpack(message[1:])
            self._gated_seen += handed - len(fds)  # any lost in transit (MSG_CTRUNC) are seen, without a slot
            for fd in fds:
                self._gated_seen += 1  # before the take, whose report must count this one as taken in
                self._on_connection(socket.socket(fileno=fd), self._take_slot())
        elif kind == CONNECTIONS:
            for fd in fds:
                self._on_connection(socket.socket(fileno=fd), None)
        elif kind == REFUSED:
            self._on_refused(RefusedRequest.batch_from_wire(message[1:]), 0)
        elif kind == UNLOGGED:
            self._on_refused([], _COUNT.unpack(message[1:])[0])

    def _ended(self) -> None:
        self._detach()
        self._ended_event.set()
        if not self._closing:
            self._loop.create_task(self._reap_unexpected_end())

    async def _reap_unexpected_end(self) -> None:
        process, self._process = self._process, None
        code = None if process is None else await self._loop.run_in_executor(None, process.wait)
        logger.error("the HTTP acceptor process ended (exit code %s); the router accepts connections itself", code)
        self._on_exit()

    def _detach(self) -> None:
        if self._control is not None:
            self._loop.remove_reader(self._control.fileno())
            self._loop.remove_writer(self._control.fileno())
            self._control.close()
            self._control = None

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop the child: it stops accepting, sends what it still holds (refusals to count and log) and ends;
        read until then, and wait for it (killed if it does not end within timeout_s)."""
        self._closing = True
        if self._control is not None:
            try:
                self._control.send(STOP)
                await asyncio.wait_for(self._ended_event.wait(), timeout_s)
            except (OSError, asyncio.TimeoutError):
                pass
        self._detach()
        process, self._process = self._process, None
        if process is None:
            return
        try:
            await self._loop.run_in_executor(None, process.wait, timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            await self._loop.run_in_executor(None, process.wait)


if __name__ == "__main__":
    main(sys.argv)
