"""The wire format of a decode worker's stream: one TCP connection per router that the router
opens, carrying its requests to the worker and the token deltas back (Ray carries the control
calls; a request's own path skips it).

A Ray actor call costs about 1 ms round trip on the development machines (and about 2 ms to
deliver while the worker's engine computes), a Ray streaming generator about 0.6 ms per item; a
frame on a socket costs tens of microseconds. So each router holds one connection per decode
worker, sends each request (and abort) as one frame, and the worker writes every engine step's
deltas for that router as one frame the moment the step ends.

Handshake: the router connects and sends a hello (the worker's stream token and its router id);
the worker checks the token before it sends anything, so only a peer that learned the token
from the worker's own `open_output_stream` answer (a Ray call) gets a stream. The worker answers
a valid hello with one ACK byte once the stream is registered (a request submitted after the ACK
always has somewhere to stream to). Then both ways carry frames of `[u32 length][pickle]`:
router -> worker a `DecodeRequest` (submit), a `StreamAbort`, or, for a layer-wise request, its
`LayerwiseProgress` and `PrefillFirstToken` (relayed from its prefill worker), in the order the
router sent them; worker -> router a `list[TokenDelta]` per step. Each side unpickles only what comes from a
peer that proved the token (the router: the address and token its worker gave it over Ray; the
worker: a peer whose hello carried its token) — the trust model of Ray's own pickled calls.
"""

from __future__ import annotations

import asyncio
import hmac
import pickle
import struct
from dataclasses import dataclass

from splitserve.common.worker_messages import DecodeRequest, LayerwiseProgress, PrefillFirstToken, TokenDelta

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


@dataclass(frozen=True)
class StreamAbort:
    """Router -> worker: end this request (sent after its DecodeRequest on the same stream)."""

    request_id: str


RouterFrame = DecodeRequest | StreamAbort | LayerwiseProgress | PrefillFirstToken
"""What a router sends a decode worker on its stream."""


def encode_frame(payload: list[TokenDelta] | RouterFrame) -> bytes:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


async def read_frame(reader: asyncio.StreamReader) -> list[TokenDelta] | RouterFrame:
    """The next frame's payload; raises asyncio.IncompleteReadError at the end of the stream."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise OutputStreamError(f"output frame of {length} bytes (at most {MAX_FRAME_BYTES})")
    return pickle.loads(await reader.readexactly(length))
