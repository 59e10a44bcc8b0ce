"""Parallel sampling and batched prompts: one API request (prompts x n sequences) becomes one
orchestrator request per sequence, their chunks merged into one stream tagged by choice index.

Choice i is sequence i % num_sequences of prompt i // num_sequences (vLLM's indexing across a
batch). A prompt's first sequence runs alone until its first chunk says which worker now holds
the prompt's KV; its siblings then start with that worker in `kv_cached_on`, so routing sends
them where their prompt's blocks are cached and they prefill only the last partial block. Seeds
follow vLLM's parallel sampling (SamplingParams.for_sequence, which the offline LLM's `n` uses too): a
seeded request's sequence i samples with seed + i (wrapped into the seed's range); unseeded
sequences draw independently.

Every path ends every sequence: a failing sequence fails the whole request (the others are
cancelled, which aborts them on the workers), and closing the merged stream (the client went
away) cancels all of them. Each sequence that runs is recorded as a request when it ends; a request
refused whole, before any sequence ran, is recorded once under the client's id (Orchestrator.fan_out).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass

from splitserve.router.admission import Admission
from splitserve.router.api_types import GenerationInput, StreamChunk, Usage
from splitserve.router.orchestrator import Orchestrator
from splitserve.router.request_ids import ReservedRequestId, sequence_request_id

@dataclass(frozen=True)
class IndexedChunk:
    """One sequence's chunk and its choice index."""

    index: int
    chunk: StreamChunk


@dataclass(frozen=True)
class _Ended:
    """A sequence's task is done: `error` is what ended it early, None when it finished."""

    error: BaseException | None


def sequence_inputs(base: GenerationInput, prompts: Sequence[tuple[int, ...]],
                    num_sequences: int) -> tuple[GenerationInput, ...]:
    """One input per choice (prompt-major); a lone sequence keeps the request's id, others get
    `<id>-<choice index>` (sequence_request_id: the ids Orchestrator.new_request_id reserves with the request's)."""
    if len(prompts) * num_sequences == 1:
        return (dataclasses.replace(base, prompt_token_ids=prompts[0]),)
    return tuple(dataclasses.replace(base, request_id=sequence_request_id(base.request_id, p * num_sequences + s),
                                     prompt_token_ids=prompt, sampling_params=base.sampling_params.for_sequence(s))
                 for p, prompt in enumerate(prompts) for s in range(num_sequences))


def by_choice(chunks: Sequence[IndexedChunk], num_choices: int) -> list[list[StreamChunk]]:
    """Each choice's chunks in arrival order, in choice order."""
    groups: list[list[StreamChunk]] = [[] for _ in range(num_choices)]
    for item in chunks:
        groups[item.index].append(item.chunk)
    return groups


def cumulative_logprob(chunks: Sequence[StreamChunk]) -> float:
    """The sum of a sequence's sampled tokens' logprobs (the chunks must carry logprobs)."""
    return sum(lp.logprob for chunk in chunks for lp in chunk.logprobs)


def best_of(sequences: Sequence[list[StreamChunk]], n: int, num_sequences: int) -> list[list[StreamChunk]]:
    """Per prompt (num_sequences sequences each, prompt-major), its n sequences of highest
    cumulative logprob, best first (vLLM's best_of); ties keep generation order."""
    chosen = []
    for first in range(0, len(sequences), num_sequences):
        group = sequences[first:first + num_sequences]
        chosen.extend(sorted(group, key=cumulative_logprob, reverse=True)[:n])
    return chosen


def merged_usage(usages: Sequence[Usage], num_sequences: int) -> Usage:
    """The request's usage from every sequence's (prompt-major): each prompt's tokens once (as
    vLLM counts them) and its first sequence's cache hit; every generated token, including
    those of sequences best_of dropped."""
    firsts = usages[::num_sequences]
    return Usage(sum(u.prompt_tokens for u in firsts), sum(u.cached_tokens for u in firsts),
                 sum(u.completion_tokens for u in usages))


async def client_fan_out(orchestrator: Orchestrator, ids: ReservedRequestId, inputs: Sequence[GenerationInput],
                         num_sequences: int, admission: Admission, n: int | None = None
                         ) -> AsyncGenerator[IndexedChunk, None]:
    """A client's request (its ids `ids`, released when it ends) run as its sequences (`inputs`, prompt-major:
    sequence_inputs) and merged; `n`: the client's n (num_sequences per prompt when None; fewer with best_of).

    The request's admission slot goes to its first sequence, and every other sequence takes a slot of its own
    before any sequence starts (Orchestrator.fan_out): a request the router cannot hold whole is refused at once
    (RESOURCE_EXHAUSTED, an HTTP 429 before a streamed response starts) and recorded once, never after some
    sequences streamed."""
    client = dataclasses.replace(inputs[0], request_id=ids.request_id)
    num_prompt_tokens = sum(len(inp.prompt_token_ids) for inp in inputs[::num_sequences])
    try:
        with orchestrator.fan_out(client, num_prompt_tokens, len(inputs), n or num_sequences) as others:
            fan_out = FanOut(orchestrator, inputs, num_sequences, [admission, *others])
            async with contextlib.aclosing(fan_out.stream()) as stream:
                async for item in stream:
                    yield item
    finally:
        ids.release()


class FanOut:
    """Runs one request's sequences on the orchestrator and merges their chunks as they arrive.

    `inputs` are prompt-major (sequence_inputs); `admissions`: each sequence's slot, by choice index, taken
    by the caller (client_fan_out; a beam search holds its beams' slots for all its steps)."""

    def __init__(self, orchestrator: Orchestrator, inputs: Sequence[GenerationInput], num_sequences: int,
                 admissions: Sequence[Admission]) -> None:
        self.orchestrator = orchestrator
        self.inputs = tuple(inputs)
        self.num_sequences = num_sequences
        self._admissions = tuple(admissions)
        self._queue: asyncio.Queue[IndexedChunk | _Ended] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()

    async def stream(self) -> AsyncIterator[IndexedChunk]:
        """Every sequence's chunks until all finished; raises the first sequence error."""
        for first in range(0, len(self.inputs), self.num_sequences):
            self._start(first, ())
        running = len(self.inputs)
        try:
            while running:
                item = await self._queue.get()
                if isinstance(item, _Ended):
                    if item.error is not None:
                        raise item.error
                    running -= 1
                    continue
                yield item
        finally:
            await self._cancel_all()
            for admission in self._admissions:  # the slots of sequences that never started
                admission.release()

    def _start(self, index: int, kv_cached_on: tuple[str, ...]) -> None:
        inp = dataclasses.replace(self.inputs[index], kv_cached_on=kv_cached_on)
        task = asyncio.get_running_loop().create_task(self._run(index, inp, self._admissions[index]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, index: int, inp: GenerationInput, admission: Admission) -> None:
        """Feed the queue with one sequence's chunks; a prompt's first sequence starts its
        siblings once its first chunk names the worker holding the prompt's KV."""
        starts_siblings = index % self.num_sequences == 0 and self.num_sequences > 1
        try:
            async for chunk in self.orchestrator.generate(inp, admission):
                if starts_siblings:
                    starts_siblings = False
                    holder = () if chunk.kv_holder is None else (chunk.kv_holder,)
                    for sibling in range(index + 1, index + self.num_sequences):
                        self._start(sibling, holder)
                self._queue.put_nowait(IndexedChunk(index, dataclasses.replace(chunk, kv_holder=None)))
        except Exception as error:
            self._queue.put_nowait(_Ended(error))
            return
        finally:
            admission.release()  # generate() released it, unless cancelled before it started
        self._queue.put_nowait(_Ended(None))

    async def _cancel_all(self) -> None:
        """Cancel the sequences still running and wait until each has released its workers."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
