"""vLLM's per-request stream_interval (router/stream_interval.py): each sequence's first chunk at
once, then one whenever at least N tokens waited, and its finishing chunk always."""

from __future__ import annotations

import asyncio

from splitserve.common.token_logprobs import TokenLogprobs
from splitserve.router.api_types import StreamChunk, Usage
from splitserve.router.fanout import IndexedChunk
from splitserve.router.stream_interval import StreamIntervalBuffer, every_interval

USAGE = Usage(prompt_tokens=4, cached_tokens=0, completion_tokens=8)


def _chunk(*token_ids: int, finish: str | None = None) -> StreamChunk:
    """A chunk whose text spells its ids ("<5>") and whose logprobs name them; a finishing one has usage."""
    logprobs = tuple(TokenLogprobs(token_id, -0.5, 1, ()) for token_id in token_ids)
    return StreamChunk("r", tuple(token_ids), "".join(f"<{t}>" for t in token_ids), logprobs, finish,
                       None, USAGE if finish else None)


def _sent(interval: int, chunks: list[StreamChunk]) -> list[tuple[tuple[int, ...], str, str | None]]:
    buffer = StreamIntervalBuffer(interval)
    sent = [buffer.add(chunk) for chunk in chunks]
    return [None if s is None else (s.token_ids, s.text, s.finish_reason) for s in sent]


def test_one_token_steps_go_first_alone_then_every_interval_then_the_finish():
    """vLLM's OutputProcessor: max_tokens 8, stream_interval 3 -> chunks of 1, 3, 3 and the last 1."""
    steps = [_chunk(t) for t in range(1, 8)] + [_chunk(8, finish="length")]
    assert _sent(3, steps) == [((1,), "<1>", None), None, None, ((2, 3, 4), "<2><3><4>", None), None, None,
                               ((5, 6, 7), "<5><6><7>", None), ((8,), "<8>", "length")]


def test_multi_token_steps_are_sent_once_at_least_the_interval_waited():
    """A speculating decode worker's steps carry several tokens: a chunk may hold more than the interval."""
    steps = [_chunk(1), _chunk(2, 3), _chunk(4, 5), _chunk(6), _chunk(7, 8, 9, finish="stop")]
    assert _sent(3, steps) == [((1,), "<1>", None), None, ((2, 3, 4, 5), "<2><3><4><5>", None), None,
                               ((6, 7, 8, 9), "<6><7><8><9>", "stop")]


def test_the_finishing_chunk_carries_what_waited_with_its_usage_and_logprobs():
    buffer = StreamIntervalBuffer(5)
    assert [buffer.add(_chunk(1)).token_ids, buffer.add(_chunk(2))] == [(1,), None]
    last = buffer.add(_chunk(3, finish="stop"))
    assert (last.token_ids, last.text, last.finish_reason, last.usage) == ((2, 3), "<2><3>", "stop", USAGE)
    assert [logprob.token_id for logprob in last.logprobs] == [2, 3]


def test_an_interval_of_one_sends_every_chunk_as_it_is():
    steps = [_chunk(1), _chunk(2, 3), _chunk(4, finish="length")]
    buffer = StreamIntervalBuffer(1)
    assert [buffer.add(chunk) for chunk in steps] == steps


def test_every_interval_buffers_each_choice_apart_and_closes_the_stream():
    closed = []

    async def choices():
        try:
            for index, chunk in [(0, _chunk(1)), (1, _chunk(11)), (0, _chunk(2)), (1, _chunk(12)),
                                 (0, _chunk(3, finish="length")), (1, _chunk(13)), (1, _chunk(14, finish="stop"))]:
                yield IndexedChunk(index, chunk)
        finally:
            closed.append(True)

    async def scenario():
        return [(item.index, item.chunk.token_ids) async for item in every_interval(choices(), 2)]

    assert asyncio.run(scenario()) == [(0, (1,)), (1, (11,)), (0, (2, 3)), (1, (12, 13)), (1, (14,))]
    assert closed == [True]


def test_closing_every_interval_closes_the_stream_it_reads():
    closed = []

    async def choices():
        try:
            for token_id in range(1, 100):
                yield IndexedChunk(0, _chunk(token_id))
        finally:
            closed.append(True)

    async def scenario():
        chunks = every_interval(choices(), 4)
        first = await anext(chunks)
        await chunks.aclose()
        return first.chunk.token_ids

    assert (asyncio.run(scenario()), closed) == ((1,), [True])
