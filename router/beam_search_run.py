"""Runs a beam search (common/beam_search.py) on the cluster: each step's beams are ordinary
one-token requests through the orchestrator, so they are routed by prefix (a beam's prompt is the
previous step's prompt + one token: its blocks are cached), prefilled, transferred and decoded
like any request, under the request's deadline and cache salt. They are internal steps of the client's
request (GenerationInput.step_of): the router records that request once (Orchestrator.stepwise, which the
API wraps around its searches), not each beam.

Admission: the search holds beam_width slots from its start to its end, all or none: the API
request's own (the caller's) and beam_width - 1 it takes before the first step, so a search the
router cannot hold whole is refused at once with RESOURCE_EXHAUSTED, before anything ran, and never
midway. Each step's beams run on those slots. Cancelling the search (the client went away) cancels
the running step, which aborts its beams on the workers; a beam that fails fails the search.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.common.beam_search import BeamSearch, Candidate, candidates_of
from splitserve.common.sampling_params import SamplingParams
from splitserve.router.admission import Admission
from splitserve.router.api_types import GenerationInput, Usage
from splitserve.router.fanout import FanOut, IndexedChunk
from splitserve.router.orchestrator import Orchestrator


@dataclass(frozen=True)
class BeamSearchResult:
    """A finished search and what its first step found cached."""

    search: BeamSearch
    num_cached_tokens: int
    """The prompt's tokens the first step found in a prefix cache."""


def step_params(search: BeamSearch) -> SamplingParams:
    """Each beam's request at each step: one token and its top 2 x beam_width logprobs."""
    return SamplingParams(max_tokens=1, temperature=search.params.temperature, logprobs=search.params.num_logprobs)


def step_inputs(base: GenerationInput, search: BeamSearch, step_of: str) -> tuple[GenerationInput, ...]:
    """One input per live beam, `<id>-beam-<step>-<beam>` (unique while the search runs), each an internal step
    of the client's request `step_of`."""
    params = step_params(search)
    return tuple(dataclasses.replace(base, request_id=f"{base.request_id}-beam-{search.num_steps}-{index}",
                                     prompt_token_ids=prompt, sampling_params=params, step_of=step_of)
                 for index, prompt in enumerate(search.step_prompts()))


def step_candidates(chunks: Sequence[IndexedChunk], num_beams: int) -> list[tuple[Candidate, ...]]:
    """Each beam's candidates from its request's chunks (the one with its token's logprobs)."""
    logprobs = {item.index: item.chunk.logprobs[0] for item in chunks if item.chunk.logprobs}
    return [candidates_of(Candidate(logprobs[i].token_id, logprobs[i].logprob), logprobs[i].top)
            for i in range(num_beams)]


def cached_tokens(chunks: Sequence[IndexedChunk]) -> int:
    """The prompt tokens the step's first beam found cached (its last chunk's usage)."""
    usages: list[Usage] = [item.chunk.usage for item in chunks if item.index == 0 and item.chunk.usage is not None]
    return usages[-1].cached_tokens if usages else 0


async def run_beam_search(orchestrator: Orchestrator, base: GenerationInput, search: BeamSearch,
                          step_of: str) -> BeamSearchResult:
    """Step `search` until it is done, on the caller's admission slot and beam_width - 1 more, its beams internal
    steps of the client's request `step_of`; raises the first beam's error (RouterError, InvalidRequestError)."""
    reserved = orchestrator.admit_all(search.params.beam_width - 1)
    num_cached = 0
    try:
        while not search.done:
            inputs = step_inputs(base, search, step_of)
            chunks = await _run_step(orchestrator, inputs)
            if search.num_steps == 0:
                num_cached = cached_tokens(chunks)
            search = search.step(step_candidates(chunks, len(inputs)))
    finally:
        for admission in reserved:
            admission.release()
    return BeamSearchResult(search, num_cached)


async def _run_step(orchestrator: Orchestrator, inputs: Sequence[GenerationInput]) -> list[IndexedChunk]:
    """One step's beams at once, on slots the search holds; closing it (a cancel) aborts them all."""
    fan_out = FanOut(orchestrator, inputs, 1, [_held() for _ in inputs])
    async with contextlib.aclosing(fan_out.stream()) as stream:
        return [item async for item in stream]


def _held() -> Admission:
    """A step's view of a slot the search holds: the beam's request ends without releasing it."""
    return Admission(lambda: None)
