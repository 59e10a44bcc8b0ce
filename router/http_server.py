"""The HTTP API's server on the router's event loop: uvicorn, fed either by its own listener or by the acceptor
process (router/acceptor_process.py), which hands it each connection the router is to serve, a gated request's
with its admission slot already taken (TakenSlot)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import uvicorn
from starlette.types import ASGIApp

from splitserve.router.acceptor_process import AcceptorProcess, RefusedRequest
from splitserve.router.admission import Admission, AdmissionControl
from splitserve.router.busy_refusal import RefusalRules
from splitserve.router.http_options import UVICORN_LOG_LEVEL_NUMBERS
from splitserve.router.tls import TlsConfig, load_tls

logger = logging.getLogger(__name__)


TAKEN_SLOT_STATE_KEY = "splitserve.taken_slot"
"""The key of a handed-over connection's TakenSlot in its requests' scope state."""


class TakenSlot:
    """The slot the router took for a connection the acceptor process handed over with a gated request in it:
    that request (the connection's first through _AdmissionGate) runs on it; if the connection ends before it
    got there, the slot is released (SlotReleasingProtocol)."""

    def __init__(self, admission: Admission) -> None:
        self._admission: Admission | None = admission

    def take(self) -> Admission | None:
        admission, self._admission = self._admission, None
        return admission

    def release_unused(self) -> None:
        admission = self.take()
        if admission is not None:
            admission.release()


class SlotReleasingProtocol(asyncio.Protocol):
    """uvicorn's protocol for a connection with a TakenSlot, which it releases when the connection is lost (a
    no-op once its request took it)."""

    def __init__(self, inner: asyncio.Protocol, taken: TakenSlot) -> None:
        self._inner = inner
        self._taken = taken

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        try:
            self._inner.connection_lost(exc)
        finally:
            self._taken.release_unused()


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn inside a process that owns its signals: SIGINT/SIGTERM stay with the caller
    (`splitserve serve` stops the whole cluster), and stop() ends serving."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass(frozen=True)
class AcceptorSetup:
    """What HttpServer needs to accept through an acceptor process (router/acceptor_process.py)."""

    rules: RefusalRules
    """What the acceptor may refuse and how (busy_refusal_rules)."""
    admission: AdmissionControl
    """Whose free slots the acceptor refuses by (watch)."""
    take_slot: Callable[[], Admission | None]
    """A slot for a gated request the acceptor hands over, None when there is none (Orchestrator.take_free_slot)."""
    on_refused: Callable[[list[RefusedRequest], int], None]
    """Accounts for refusals the acceptor answered: those with their records and a count of those without
    (account_busy_refusals)."""


class HttpServer:
    """Serves an ASGI app on the running event loop until stop()."""

    def __init__(self, app: ASGIApp, grace_s: float = 2.0, tls: TlsConfig | None = None,
                 on_stop: Callable[[], None] | None = None, root_path: str = "", log_level: str = "info",
                 acceptor: AcceptorSetup | None = None) -> None:
        """With `tls`, HTTPS only (the gRPC server's certificate; client certificates required when
        it has a client CA). `on_stop` releases what the app holds, once it stopped serving.
        `root_path`: the path prefix a proxy in front serves the API under (--root-path); `log_level`:
        uvicorn's loggers' level (--uvicorn-log-level). `acceptor`: accept connections in an acceptor
        process that refuses a full router's requests itself (never with `tls`: it would have to do the
        handshake)."""
        if acceptor is not None and tls is not None:
            raise ValueError("an acceptor process cannot accept TLS connections: it would have to do the handshake")
        self._on_stop = on_stop
        cert_file = key_file = client_ca_file = None
        if tls is not None:
            load_tls(tls)  # a bad file fails here with its name, not inside uvicorn's startup
            cert_file, key_file, client_ca_file = tls.cert_file, tls.key_file, tls.client_ca_file
        self._server = _EmbeddedUvicorn(uvicorn.Config(
            app, http="httptools", lifespan="off", log_config=None, access_log=False, ws="none", root_path=root_path,
            timeout_graceful_shutdown=int(grace_s),
            ssl_certfile=cert_file, ssl_keyfile=key_file, ssl_ca_certs=client_ca_file,
            ssl_cert_reqs=ssl.CERT_NONE if client_ca_file is None else ssl.CERT_REQUIRED))
        # uvicorn.Config's log_level would set uvicorn.access's level too, letting its access lines through
        # wherever that logger has a handler: splitserve.access is the access log.
        for name in ("uvicorn.error", "uvicorn.asgi"):
            logging.getLogger(name).setLevel(UVICORN_LOG_LEVEL_NUMBERS[log_level])
        self._acceptor_setup = acceptor
        self._task: asyncio.Task | None = None
        self._listening: socket.socket | None = None
        """The listening socket, while an acceptor process (or, after it ended, self._fallback) accepts on it."""
        self._acceptor: AcceptorProcess | None = None
        self._unwatch: Callable[[], None] = lambda: None
        self._fallback: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        """Handed-over connections' transports being made, the fallback listener being started."""
        self.port = 0

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Listen on host:port (0 picks a free port); returns the bound port. `reuse_port`: share
        the port with other routers' listeners (SO_REUSEPORT; the kernel spreads connections)."""
        await anyio.sleep(0)  # loads anyio's asyncio backend, which Starlette streams answers through: on the
        # first request it was 27 ms of that request's time to first token
        sock = listening_socket(host, port, reuse_port)
        self.port = sock.getsockname()[1]
        # With an acceptor, uvicorn serves only the connections handed to it (no listener of its own).
        sockets = [sock] if self._acceptor_setup is None else []
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=sockets))
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises why it could not start
                raise OSError(f"the HTTP server on {host}:{port} stopped during startup")
            await asyncio.sleep(0.01)
        if self._acceptor_setup is not None:
            self._listening = sock
            try:
                self._start_acceptor(sock, self._acceptor_setup)
            except BaseException:
                await self.stop()
                raise
        return self.port

    def _start_acceptor(self, sock: socket.socket, setup: AcceptorSetup) -> None:
        rules = dataclasses.replace(setup.rules, uvicorn_headers=tuple(self._server.config.encoded_headers))
        self._acceptor = AcceptorProcess(sock, rules, setup.take_slot, self._serve_connection, setup.on_refused,
                                         self._accept_here)
        self._acceptor.start()
        self._unwatch = setup.admission.watch(self._acceptor.report_free_slots)

    def _protocol(self, extra_state: dict[str, Any] | None = None) -> asyncio.Protocol:
        """What uvicorn's own listener would make for a connection it accepted; `extra_state` joins what each of
        its requests' scopes carry as `state`."""
        config = self._server.config
        return config.http_protocol_class(config=config, server_state=self._server.server_state,
                                          app_state={**self._server.lifespan.state, **(extra_state or {})})

    def _serve_connection(self, sock: socket.socket, slot: Admission | None) -> None:
        """A connection the acceptor process handed over: uvicorn serves it as one it accepted itself. With
        `slot`, its first request (the gated one the acceptor saw) runs on that slot (_AdmissionGate)."""
        taken = None if slot is None else TakenSlot(slot)
        if taken is None:
            make_protocol = self._protocol
        else:
            make_protocol = lambda: SlotReleasingProtocol(self._protocol({TAKEN_SLOT_STATE_KEY: taken}), taken)  # noqa: E731
        task = asyncio.get_running_loop().create_task(
            asyncio.get_running_loop().connect_accepted_socket(make_protocol, sock))
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._connection_served, sock, taken))

    def _connection_served(self, sock: socket.socket, taken: TakenSlot | None, task: asyncio.Task) -> None:
        """A handed-over connection's transport is up, or could not be made: then nobody else closes the socket
        or releases its slot."""
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is not None:
            logger.warning("a connection the acceptor handed over could not be served: %s",
                           "cancelled" if task.cancelled() else task.exception())
            sock.close()
            if taken is not None:
                taken.release_unused()

    def _accept_here(self) -> None:
        """The acceptor process ended on its own: the loop accepts on the listening socket from now on."""
        self._stop_watching()
        self._acceptor = None
        if self._listening is not None:
            task = asyncio.get_running_loop().create_task(self._listen(self._listening))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _listen(self, listening: socket.socket) -> None:
        self._fallback = await asyncio.get_running_loop().create_server(self._protocol, sock=listening,
                                                                        backlog=socket.SOMAXCONN)

    async def stop(self) -> None:
        """Stop accepting, give open responses the grace period, then cancel them."""
        if self._task is None:
            return
        await self._stop_accepting()
        self._server.should_exit = True
        try:
            await self._task
        finally:
            self._task = None
            if self._on_stop is not None:
                self._on_stop()

    def _stop_watching(self) -> None:
        unwatch, self._unwatch = self._unwatch, lambda: None
        unwatch()

    async def _stop_accepting(self) -> None:
        """End the acceptor process (or the fallback listener) and close the listening socket; connections
        handed over before stay uvicorn's to finish."""
        self._stop_watching()
        acceptor, self._acceptor = self._acceptor, None
        if acceptor is not None:
            await acceptor.close()
        if self._tasks:  # handed-over connections being set up, the fallback listener being started
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._fallback is not None:
            self._fallback.close()
            self._fallback = None
        if self._listening is not None:
            self._listening.close()
            self._listening = None


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP listening socket whose accepted connections get TCP_NODELAY.

    asyncio turns Nagle's algorithm off only on sockets whose proto is IPPROTO_TCP, and
    socket.create_server() makes proto 0: a streamed response's small writes then wait for the
    client's delayed ACK, 40 ms on Linux, before reaching it (aiperf saw a 19 ms TTFT as 60 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock
