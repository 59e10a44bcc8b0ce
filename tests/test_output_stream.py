"""The decode worker's stream (common/output_stream.py, decode_worker/output_server.py): who gets
a stream, what each side receives, and when a router counts as gone."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.output_stream import (MAX_FRAME_BYTES, OutputStreamError, StreamAbort, encode_frame,
                                             encode_hello, read_frame)
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.worker_messages import DecodeRequest, TokenDelta
from splitserve.decode_worker.output_server import OutputServer
from splitserve.router.dispatcher import connect_output_stream


class _Worker:
    """Just the output-stream part of a decode worker."""

    worker_id = "decode-0"

    def __init__(self, max_buffered_bytes: int = 1 << 20) -> None:
        self.gone: list[str] = []
        self.frames: list[tuple[str, object]] = []
        self.server = OutputServer("127.0.0.1", lambda router_id, payload: self.frames.append((router_id, payload)),
                                   self.gone.append, max_buffered_bytes)

    async def open_output_stream(self, router_id: str):
        return await self.server.address()


def _delta(request_id: str, token: int, finish_reason: str | None = None) -> TokenDelta:
    return TokenDelta(request_id, (token,), (), finish_reason, None, 0)


async def _until(condition, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


def test_a_router_receives_each_send_as_one_frame_in_order():
    async def scenario():
        worker = _Worker()
        reader, writer = await connect_output_stream(worker, "router-a")
        assert worker.server.is_connected("router-a") and not worker.server.is_connected("router-b")
        worker.server.send("router-a", [_delta("r1", 5), _delta("r2", 6)])
        worker.server.send("router-b", [_delta("r3", 7)])  # not connected: dropped
        worker.server.send("router-a", [_delta("r1", 8, "length")])
        frames = [await read_frame(reader), await read_frame(reader)]
        writer.close()
        worker.server.close()
        return frames

    assert asyncio.run(scenario()) == [[_delta("r1", 5), _delta("r2", 6)], [_delta("r1", 8, "length")]]


def test_a_wrong_token_gets_no_stream_and_no_byte():
    async def scenario():
        worker = _Worker()
        address = await worker.server.address()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(encode_hello(bytes(len(address.token)), "router-a"))
        answer = await asyncio.wait_for(reader.read(), 5)  # the worker closes without a word
        writer.close()
        connected = worker.server.is_connected("router-a")
        worker.server.close()
        return answer, connected

    assert asyncio.run(scenario()) == (b"", False)


def test_a_closed_stream_and_an_unread_stream_are_routers_gone():
    async def scenario():
        worker = _Worker(max_buffered_bytes=1)
        _, closing = await connect_output_stream(worker, "router-closes")
        stalled_reader, stalled = await connect_output_stream(worker, "router-stalls")
        closing.close()
        await _until(lambda: worker.gone == ["router-closes"])
        # The stalled router reads nothing: once more than max_buffered_bytes wait, it is gone.
        stalled.transport.pause_reading()
        big = [_delta("r", token) for token in range(20_000)]
        await _until(lambda: worker.server.send("router-stalls", big) or "router-stalls" in worker.gone)
        connected = worker.server.is_connected("router-stalls")
        stalled.close()
        worker.server.close()
        return worker.gone, connected

    assert asyncio.run(scenario()) == (["router-closes", "router-stalls"], False)


def test_a_reconnect_replaces_the_routers_stream_and_ends_its_requests_once():
    async def scenario():
        worker = _Worker()
        old_reader, old = await connect_output_stream(worker, "router-a")
        new_reader, new = await connect_output_stream(worker, "router-a")
        worker.server.send("router-a", [_delta("r", 1)])
        frame = await read_frame(new_reader)
        ended = await asyncio.wait_for(old_reader.read(), 5)
        old.close()
        new.close()
        await _until(lambda: len(worker.gone) == 2)
        worker.server.close()
        return frame, ended, worker.gone

    assert asyncio.run(scenario()) == ([_delta("r", 1)], b"", ["router-a", "router-a"])


def test_an_oversized_frame_is_a_broken_stream():
    async def scenario():
        reader = asyncio.StreamReader()
        reader.feed_data((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
        with pytest.raises(OutputStreamError, match="output frame of 67108865 bytes"):
            await read_frame(reader)
        reader = asyncio.StreamReader()
        reader.feed_data(encode_frame([_delta("r", 3)]))
        return await read_frame(reader)

    assert asyncio.run(scenario()) == [_delta("r", 3)]


def test_a_routers_requests_and_aborts_reach_the_worker_in_order_and_anything_else_breaks_the_stream():
    request = DecodeRequest("r1", "router-a", (5, 6), (), SamplingParams(), 0, None, None)

    async def scenario():
        worker = _Worker()
        _, writer = await connect_output_stream(worker, "router-a")
        writer.write(encode_frame(request) + encode_frame(StreamAbort("r1")))
        await _until(lambda: len(worker.frames) == 2)
        writer.write(encode_frame([_delta("r1", 5)]))  # deltas go the other way
        await _until(lambda: worker.gone == ["router-a"])
        writer.close()
        worker.server.close()
        return worker.frames

    assert asyncio.run(scenario()) == [("router-a", request), ("router-a", StreamAbort("r1"))]
