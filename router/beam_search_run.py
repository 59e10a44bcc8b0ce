"""Runs a beam search (common/beam_search.py) on the cluster: each step's beams are ordinary
one-token requests through the orchestrator, so they are routed by prefix (a beam's prompt is the
previous step's prompt + one token: its blocks are cached), prefilled, transferred and decoded
like any request, under the request's deadline and cache salt.

Admission: the API request's own slot is held for the whole search and covers one beam of each
step; every other beam takes a slot of its own before the step starts, all or none (FanOut), so a
router that cannot hold a step whole refuses it with RESOURCE_EXHAUSTED. Cancelling the search
(the client went away) cancels the running step, which aborts its beams on the workers; a beam that
fails fails the search.
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


def step_inputs(base: GenerationInput, search: BeamSearch) -> tuple[GenerationInput, ...]:
    """One input per live beam, `<id>-beam-<step>-<beam>` (unique while the search runs)."""
    params = step_params(search)
    return tuple(dataclasses.replace(base, request_id=f"{base.request_id}-beam-{search.num_steps}-{index}",
                                     prompt_token_ids=prompt, sampling_params=params)
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


async def run_beam_search(orchestrator: Orchestrator, base: GenerationInput, search: BeamSearch) -> BeamSearchResult:
    """Step `search` until it is done; raises the first beam's error (RouterError, InvalidRequestError)."""
    num_cached = 0
    while not search.done:
        inputs = step_inputs(base, search)
        held = Admission(lambda: None)  # the request's own slot, which the caller holds and releases
        async with contextlib.aclosing(FanOut(orchestrator, inputs, 1, held).stream()) as stream:
            chunks = [item async for item in stream]
        if search.num_steps == 0:
            num_cached = cached_tokens(chunks)
        search = search.step(step_candidates(chunks, len(inputs)))
    return BeamSearchResult(search, num_cached)
