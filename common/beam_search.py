"""Beam search above the engine, as vLLM serves it: a pure decision core (no I/O, no clock).

Each step every live beam is run as a prompt (the request's prompt + the beam's tokens) for one token
whose top `2 * beam_width` logprobs (the raw model distribution) are the beam's candidates; the
caller feeds them to `BeamSearch.step`. A candidate that is the tokenizer's EOS (unless ignore_eos)
completes its beam; the other candidates of all beams are ranked by cumulative logprob and the best
`beam_width` become the next step's beams. The search ends after `max_tokens` steps or when no beam
is left; `BeamSearch.best` ranks the completed and the live beams by
`cum_logprob / seq_len ** length_penalty` (seq_len counts the prompt's tokens too, and not a final
EOS) and returns the best `beam_width`.

Matches vLLM 0.32's online beam search (vllm/entrypoints/openai/.../beam_search: the order of
candidates, what ends a beam, the score) so a request gives vLLM's beams. Ties (equal floats) keep
the order candidates were given in: beam order, then each beam's candidate order (vLLM's partial
sort leaves such ties unspecified).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from splitserve.common.errors import InvalidRequestError, json_excerpt
from splitserve.common.sampling_params import MAX_LOGPROBS

CANDIDATES_PER_BEAM = 2
"""Each beam's step asks for this many times beam_width top logprobs (vLLM's, after transformers)."""
MAX_BEAM_WIDTH = MAX_LOGPROBS // CANDIDATES_PER_BEAM
"""The widest search whose steps' logprobs stay within vLLM's default --max-logprobs (MAX_LOGPROBS);
a server's limit allows max_logprobs // CANDIDATES_PER_BEAM (BeamSearchParams.check_logprobs_limit)."""
MAX_LENGTH_PENALTY = 32
"""The largest |length_penalty|: the ranking's seq_len ** length_penalty stays a finite, non-zero float for any
seq_len below 2**31 (32 * ln(2**31) is about 688, within ln of the largest float, about 709.8). vLLM takes any
float and fails the request (a 500) once that power overflows or underflows to 0."""
STOP = "stop"
LENGTH = "length"


@dataclass(frozen=True)
class BeamSearchParams:
    """What a beam search request asks for (vLLM's BeamSearchParams)."""

    beam_width: int
    """Beams kept per step, and beams returned (a request's `n`)."""
    max_tokens: int
    """Steps at most: each adds one token to every live beam."""
    ignore_eos: bool = False
    """EOS is a token like any other: it completes no beam."""
    temperature: float = 0.0
    """Of each step's one-token request: it only picks the token that request samples, which the search
    discards (the candidates are the raw distribution's top logprobs), as in vLLM."""
    length_penalty: float = 1.0
    """The final ranking's exponent on the sequence length: above 0 favours longer beams."""
    include_stop_str_in_output: bool = False
    """A beam completed by EOS keeps the EOS token in its token ids (never in its text)."""

    def __post_init__(self) -> None:
        # The widest allowed is the server's logprobs limit's (check_logprobs_limit), not the parameters' own.
        _require(_is_int(self.beam_width) and self.beam_width >= 1, "n",
                 f"is the beam width with use_beam_search: an integer >= 1, got {self.beam_width!r}")
        _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                 f"must be an integer >= 1 with use_beam_search, got {self.max_tokens!r}")
        _require(_is_number(self.temperature) and self.temperature >= 0, "temperature",
                 f"must be a number >= 0, got {self.temperature!r}")
        # A bound, not math.isfinite (which raises on an int too large for a float); nan and inf fail it
        _require(_is_number(self.length_penalty) and abs(self.length_penalty) <= MAX_LENGTH_PENALTY, "length_penalty",
                 f"must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], got "
                 f"{json_excerpt(self.length_penalty)}")

    @property
    def num_logprobs(self) -> int:
        """Top logprobs each step's request asks for."""
        return CANDIDATES_PER_BEAM * self.beam_width

    def check_logprobs_limit(self, max_logprobs: int, vocab_size: int) -> None:
        """InvalidRequestError naming `n` when a step's num_logprobs exceed `max_logprobs` (--max-logprobs;
        -1: the vocabulary's size), as SamplingParams.check_logprobs_limit for a plain request."""
        limit = vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)
        _require(self.num_logprobs <= limit, "n",
                 f"is the beam width with use_beam_search: an integer in [1, {limit // CANDIDATES_PER_BEAM}] (each "
                 f"step asks for {CANDIDATES_PER_BEAM} x n logprobs, at most {limit}), got {self.beam_width!r}")


@dataclass(frozen=True)
class Beam:
    """One hypothesis: the tokens it added to the prompt and their summed logprob."""

    token_ids: tuple[int, ...]
    """Generated tokens; a beam completed by EOS holds the EOS only with include_stop_str_in_output."""
    cum_logprob: float
    finish_reason: str | None = None
    """STOP once EOS completed it; None while live (LENGTH once returned live)."""
    stop_reason: int | None = None
    """The EOS id that completed it."""


@dataclass(frozen=True)
class Candidate:
    """One of a step's top tokens for a beam."""

    token_id: int
    logprob: float


@dataclass(frozen=True)
class BeamSearch:
    """One prompt's search state: immutable; step() returns the next state."""

    params: BeamSearchParams
    prompt_token_ids: tuple[int, ...]
    eos_token_id: int | None
    """The tokenizer's EOS (vLLM's tokenizer.eos_token_id); None: no token completes a beam."""
    beams: tuple[Beam, ...] = (Beam((), 0.0),)
    """Live beams, best first; the next step extends each of them."""
    completed: tuple[Beam, ...] = ()
    """Beams EOS completed, in the order they completed."""
    num_steps: int = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.num_steps >= self.params.max_tokens

    def step_prompts(self) -> tuple[tuple[int, ...], ...]:
        """What each live beam runs as this step's prompt."""
        return tuple(self.prompt_token_ids + beam.token_ids for beam in self.beams)

    def step(self, candidates: Sequence[Sequence[Candidate]]) -> BeamSearch:
        """The state after one step; `candidates[i]`: live beam i's top tokens (the order ties keep)."""
        if self.done:
            raise ValueError("the search is done: no step is left")
        if len(candidates) != len(self.beams):
            raise ValueError(f"{len(candidates)} candidate lists for {len(self.beams)} beams")
        completed = list(self.completed)
        extended: list[Beam] = []
        for beam, options in zip(self.beams, candidates):
            for option in options:
                cum_logprob = beam.cum_logprob + option.logprob
                if option.token_id == self.eos_token_id and not self.params.ignore_eos:
                    completed.append(self._completed(beam, cum_logprob))
                else:
                    extended.append(Beam(beam.token_ids + (option.token_id,), cum_logprob))
        kept = sorted(extended, key=lambda b: b.cum_logprob, reverse=True)[:self.params.beam_width]  # stable
        return BeamSearch(self.params, self.prompt_token_ids, self.eos_token_id, tuple(kept), tuple(completed),
                          self.num_steps + 1)

    def _completed(self, beam: Beam, cum_logprob: float) -> Beam:
        eos = (self.eos_token_id,) if self.params.include_stop_str_in_output else ()
        return Beam(beam.token_ids + eos, cum_logprob, STOP, self.eos_token_id)

    def score(self, beam: Beam) -> float:
        """vLLM's get_beam_search_score: cum_logprob / seq_len ** length_penalty, where seq_len is the
        prompt's and the beam's tokens, less one when the last of them is EOS."""
        tokens = self.prompt_token_ids + beam.token_ids
        seq_len = len(tokens) - (1 if tokens[-1] == self.eos_token_id else 0)
        return beam.cum_logprob / (seq_len ** self.params.length_penalty)

    def best(self) -> tuple[Beam, ...]:
        """The result: the best beam_width of the completed and the live beams by score, best first (ties:
        completed before live, each in its order); a live beam's finish_reason is LENGTH."""
        live = (Beam(b.token_ids, b.cum_logprob, LENGTH) for b in self.beams)
        ranked = sorted((*self.completed, *live), key=self.score, reverse=True)
        return tuple(ranked[:self.params.beam_width])


def start(params: BeamSearchParams, prompt_token_ids: Sequence[int], eos_token_id: int | None) -> BeamSearch:
    """A search before its first step: one empty beam on the prompt."""
    if not prompt_token_ids:
        raise InvalidRequestError("prompt", "must not be empty")
    return BeamSearch(params, tuple(prompt_token_ids), eos_token_id)


def candidates_of(sampled: Candidate, top: Sequence[tuple[int, float]]) -> tuple[Candidate, ...]:
    """A step's candidates in vLLM's logprobs order: the sampled token, then the top alternatives (best
    first) but the sampled one."""
    return (sampled, *(Candidate(token_id, logprob) for token_id, logprob in top if token_id != sampled.token_id))


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(field, message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
