"""The wire format of a decode worker's output stream: token deltas pushed to a router over a
TCP connection the router opens (Ray carries the control calls; the per-token path skips it).

A Ray actor call costs about 1 ms round trip on the development machines and a Ray streaming
generator about 0.6 ms per item; a frame on a socket costs tens of microseconds. So each router
holds one connection per decode worker and the worker writes every engine step's deltas for that
router as one frame the moment the step ends.

Handshake: the router connects and sends a hello (the worker's stream token and its router id);
the worker checks the token before it sends anything, so only a peer that learned the token
from the worker's own `open_output_stream` answer (a Ray call) gets a stream. The worker answers
a valid hello with one ACK byte once the stream is registered (a request submitted after the ACK
always has somewhere to stream to). Then the connection is one-way, worker -> router: frames of
`[u32 length][pickle of list[TokenDelta]]`.
The router unpickles only what comes from an address and token its worker gave it (the trust
model of Ray's own pickled calls); the worker never unpickles anything it reads.
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import struct
from dataclasses import dataclass

from splitserve.common.worker_messages import TokenDelta

_LENGTH = struct.Struct("!I")
MAX_ROUTER_ID_BYTES = 256
MAX_FRAME_BYTES = 64 << 20
"""A frame larger than this is a corrupt stream (a step's deltas for one router are kilobytes)."""
TOKEN_BYTES = 16
ACK = b"\x01"


class OutputStreamError(ConnectionError):
    """The peer broke the protocol: bad token, oversized or truncated frame."""


@dataclass(frozen=True)
class OutputStreamAddress:
    """Where a router connects for a decode worker's outputs, and the token that proves it asked."""

    host: str
    port: int
    token: bytes


def encode_hello(token: bytes, router_id: str) -> bytes:
    router = router_id.encode()
    if len(router) > MAX_ROUTER_ID_BYTES:
        raise ValueError(f"router id is {len(router)} bytes; at most {MAX_ROUTER_ID_BYTES}")
    return token + _LENGTH.pack(len(router)) + router


async def read_hello(reader: asyncio.StreamReader, token: bytes) -> str:
    """The router id of a peer that knows `token`; raises OutputStreamError for any other peer."""
    sent_token = await reader.readexactly(TOKEN_BYTES)
    if not hmac.compare_digest(sent_token, token):
        raise OutputStreamError("wrong output stream token")
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_ROUTER_ID_BYTES:
        raise OutputStreamError(f"router id of {length} bytes")
    return (await reader.readexactly(length)).decode()


async def read_ack(reader: asyncio.StreamReader) -> None:
    if await reader.readexactly(len(ACK)) != ACK:
        raise OutputStreamError("the worker did not acknowledge the hello")


def encode_batch(deltas: list[TokenDelta]) -> bytes:
    payload = pickle.dumps(deltas, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


async def read_batch(reader: asyncio.StreamReader) -> list[TokenDelta]:
    """The next frame's deltas; raises asyncio.IncompleteReadError at the end of the stream."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise OutputStreamError(f"output frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return pickle.loads(await reader.readexactly(length))
