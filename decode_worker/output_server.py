"""A decode worker's end of the streams: one TCP server, one connection per router.

Lives on the worker's event loop. Each router's requests, aborts and relayed layer-wise
progress arrive as frames and go to
`on_frame(router_id, payload)` in order. The engine thread hands each step's deltas over once
(`loop.call_soon_threadsafe(server.send, ...)`); `send` writes them as one frame without
waiting. A router whose connection closes, breaks the protocol, or stops reading until
`max_buffered_bytes` pile up is gone: `on_router_gone(router_id)` ends its requests (their KV
blocks are not held for streams nobody reads).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

from splitserve.common.output_stream import (ACK, TOKEN_BYTES, OutputStreamAddress,
                                             OutputStreamError, RouterFrame, encode_frame, read_frame, read_hello)
from splitserve.common.worker_messages import TokenDelta

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
"""A connection that has not said hello by then is closed."""


class OutputServer:
    def __init__(self, host: str, on_frame: Callable[[str, RouterFrame], None],
                 on_router_gone: Callable[[str], None], max_buffered_bytes: int) -> None:
        self._host = host
        self._on_frame = on_frame
        self._on_router_gone = on_router_gone
        self._max_buffered_bytes = max_buffered_bytes
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._server: asyncio.Server | None = None
        self._outboxes: dict[str, asyncio.StreamWriter] = {}
        """router id -> its open connection (event loop only)."""

    async def address(self) -> OutputStreamAddress:
        """Start listening on first use (it needs the running loop); the same address after."""
        if self._server is None:
            self._server = await asyncio.start_server(self._accept, self._host, 0)
        port = self._server.sockets[0].getsockname()[1]
        return OutputStreamAddress(self._host, port, self._token)

    def is_connected(self, router_id: str) -> bool:
        return router_id in self._outboxes

    def send(self, router_id: str, deltas: list[TokenDelta]) -> None:
        """Event loop: queue one frame for the router; drops it when the router is not connected
        (it is gone, and its requests are being ended)."""
        writer = self._outboxes.get(router_id)
        if writer is None:
            return
        if writer.transport.get_write_buffer_size() > self._max_buffered_bytes:
            logger.warning("router %s is not reading its outputs (%d bytes queued): dropping it", router_id,
                           writer.transport.get_write_buffer_size())
            self._drop(router_id, writer)
            return
        writer.write(encode_frame(deltas))

    def close(self) -> None:
        """Close the server and every stream (the routers see the worker gone)."""
        for router_id, writer in list(self._outboxes.items()):
            self._outboxes.pop(router_id, None)
            writer.close()
        if self._server is not None:
            self._server.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                router_id = await read_hello(reader, self._token)
        except (OutputStreamError, asyncio.IncompleteReadError, TimeoutError, ConnectionError, UnicodeDecodeError) as error:
            logger.warning("refused an output stream connection from %s: %s",
                           writer.get_extra_info("peername"), error)
            writer.close()
            return
        previous = self._outboxes.get(router_id)
        if previous is not None:  # a reconnect: the old connection's requests were already ended
            self._drop(router_id, previous)
        self._outboxes[router_id] = writer
        writer.write(ACK)
        await self._serve(router_id, reader, writer)

    async def _serve(self, router_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Hand the router's frames on until it closes the stream or breaks the protocol."""
        try:
            while True:
                payload = await read_frame(reader)
                if not isinstance(payload, RouterFrame):
                    raise OutputStreamError(f"unexpected {type(payload).__name__} frame from a router")
                self._on_frame(router_id, payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except OutputStreamError as error:
            logger.warning("router %s broke its stream: %s", router_id, error)
        if self._outboxes.get(router_id) is writer:
            self._drop(router_id, writer)

    def _drop(self, router_id: str, writer: asyncio.StreamWriter) -> None:
        if self._outboxes.get(router_id) is writer:
            del self._outboxes[router_id]
            self._on_router_gone(router_id)
        writer.close()
