"""vLLM's per-request `stream_interval`: a streamed response sends each sequence's tokens in
chunks of at least N instead of as every engine step makes them, as vLLM's OutputProcessor
holds its outputs: a sequence's first chunk goes at once, then one whenever at least N tokens
have waited since the last sent, and its finishing chunk always (with whatever waited).

The rule is pure (StreamIntervalBuffer, one per sequence); `every_interval` applies it to a
request's stream of choices (router/fanout.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator

from splitserve.router.api_types import StreamChunk
from splitserve.router.fanout import IndexedChunk


class StreamIntervalBuffer:
    """One sequence's chunks, held until they may be sent."""

    def __init__(self, interval: int) -> None:
        self._interval = interval
        self._held: StreamChunk | None = None
        """The chunks received and not sent yet, joined; None when none are waiting."""
        self._sent_any = False

    def add(self, chunk: StreamChunk) -> StreamChunk | None:
        """The chunk to send now (`chunk` joined after what waited), or None when it waits."""
        waiting = chunk if self._held is None else _joined(self._held, chunk)
        if self._sent_any and waiting.finish_reason is None and len(waiting.token_ids) < self._interval:
            self._held = waiting
            return None
        self._held, self._sent_any = None, True
        return waiting


def _joined(held: StreamChunk, chunk: StreamChunk) -> StreamChunk:
    """`held` then `chunk` as one chunk: tokens, text and logprobs joined; the finish, usage and timing are
    `chunk`'s (only a sequence's last chunk has them). kv_holder and prompt_logprobs are only on a
    sequence's first chunk, which is never held."""
    return dataclasses.replace(chunk, token_ids=held.token_ids + chunk.token_ids, text=held.text + chunk.text,
                               logprobs=held.logprobs + chunk.logprobs)


async def every_interval(stream: AsyncGenerator[IndexedChunk, None], interval: int) -> AsyncGenerator[IndexedChunk, None]:
    """`stream`'s chunks, each sequence's sent every `interval` tokens (StreamIntervalBuffer). Nothing
    stays held at the end: a sequence's stream ends with its finishing chunk, or `stream` raises.
    Closing this closes `stream`."""
    buffers: dict[int, StreamIntervalBuffer] = {}
    try:
        async for item in stream:
            chunk = buffers.setdefault(item.index, StreamIntervalBuffer(interval)).add(item.chunk)
            if chunk is not None:
                yield IndexedChunk(item.index, chunk)
    finally:
        await stream.aclose()
