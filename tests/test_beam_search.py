"""The beam search core (common/beam_search.py) by exact replay: scripted candidate logprobs (multiples of
1/16, so every sum is exact) in, the exact beams kept, completed and returned out."""

from __future__ import annotations

import pytest

from splitserve.common.beam_search import (LENGTH, MAX_BEAM_WIDTH, STOP, Beam, BeamSearch, BeamSearchParams,
                                           Candidate, candidates_of, start)
from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import MAX_LOGPROBS

PROMPT = (1, 2, 3)
EOS = 0


def _options(*pairs: tuple[int, int]) -> tuple[Candidate, ...]:
    """Candidates from (token id, logprob in 16ths)."""
    return tuple(Candidate(token_id, sixteenths / 16) for token_id, sixteenths in pairs)


STEPS = (
    # step 1: the prompt's one beam; EOS (0) completes the empty beam at -8/16
    [_options((5, -1), (6, -4), (EOS, -8), (7, -16))],
    # step 2: beams (5,) -1/16 and (6,) -4/16
    [_options((8, -2), (EOS, -3), (9, -8), (10, -32)), _options((8, -1), (11, -6), (EOS, -10), (12, -32))],
    # step 3: beams (5, 8) -3/16 and (6, 8) -5/16
    [_options((1, -12), (2, -13), (EOS, -14), (3, -16)), _options((EOS, -1), (4, -4), (5, -48), (6, -64))],
)


def _replay(**params) -> BeamSearch:
    search = start(BeamSearchParams(beam_width=2, max_tokens=3, **params), PROMPT, EOS)
    for candidates in STEPS:
        search = search.step(candidates)
    return search


def test_each_step_keeps_the_best_beams_by_cumulative_logprob_and_completes_eos_candidates():
    search = start(BeamSearchParams(beam_width=2, max_tokens=3), PROMPT, EOS)
    assert search.step_prompts() == (PROMPT,)
    search = search.step(STEPS[0])
    assert search.beams == (Beam((5,), -1 / 16), Beam((6,), -4 / 16))
    assert search.completed == (Beam((), -8 / 16, STOP, EOS),)
    assert search.step_prompts() == ((1, 2, 3, 5), (1, 2, 3, 6))
    search = search.step(STEPS[1])
    assert search.beams == (Beam((5, 8), -3 / 16), Beam((6, 8), -5 / 16))
    assert search.completed[1:] == (Beam((5,), -4 / 16, STOP, EOS), Beam((6,), -14 / 16, STOP, EOS))
    search = search.step(STEPS[2])
    assert search.beams == (Beam((6, 8, 4), -9 / 16), Beam((5, 8, 1), -15 / 16))
    assert search.completed[3:] == (Beam((5, 8), -17 / 16, STOP, EOS), Beam((6, 8), -6 / 16, STOP, EOS))
    assert search.done and search.num_steps == 3
    with pytest.raises(ValueError, match="done"):
        search.step(STEPS[2])


@pytest.mark.parametrize("length_penalty, expected", [
    # score = cum_logprob / (3 prompt tokens + output tokens without EOS) ** length_penalty
    (1.0, [Beam((5,), -4 / 16, STOP, EOS), Beam((6, 8), -6 / 16, STOP, EOS)]),  # -1/16, -3/40
    (0.0, [Beam((5,), -4 / 16, STOP, EOS), Beam((6, 8), -6 / 16, STOP, EOS)]),  # cum_logprob alone
    # -3/200, then a tie at -1/64: completed (5,) before live (6, 8, 4)
    (2.0, [Beam((6, 8), -6 / 16, STOP, EOS), Beam((5,), -4 / 16, STOP, EOS)]),
    (-1.0, [Beam((5,), -4 / 16, STOP, EOS), Beam((), -8 / 16, STOP, EOS)]),  # -1, -3/2: shorter wins
])
def test_final_ranking_by_length_penalised_score(length_penalty, expected):
    assert list(_replay(length_penalty=length_penalty).best()) == expected


def test_a_long_penalty_returns_live_beams_with_finish_reason_length():
    search = _replay(length_penalty=2.0)
    assert search.score(Beam((6, 8, 4), -9 / 16)) == search.score(Beam((5,), -4 / 16, STOP, EOS)) == -1 / 64
    wide = BeamSearch(BeamSearchParams(beam_width=3, max_tokens=3, length_penalty=2.0), PROMPT, EOS, search.beams,
                      search.completed, search.num_steps)
    assert wide.best()[2] == Beam((6, 8, 4), -9 / 16, LENGTH)


def test_include_stop_str_in_output_keeps_eos_in_token_ids_but_not_in_seq_len():
    best = _replay(include_stop_str_in_output=True).best()
    assert best == (Beam((5, EOS), -4 / 16, STOP, EOS), Beam((6, 8, EOS), -6 / 16, STOP, EOS))


def test_ignore_eos_extends_beams_with_eos_like_any_token():
    search = start(BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True), PROMPT, EOS).step(STEPS[0])
    assert search.beams == (Beam((5,), -1 / 16), Beam((6,), -4 / 16))
    assert search.completed == ()
    search = search.step(STEPS[1])
    assert search.beams == (Beam((5, 8), -3 / 16), Beam((5, EOS), -4 / 16))
    # a last token EOS is not counted in seq_len: -4/16 / 4 (not / 5)
    assert search.score(search.beams[1]) == -1 / 16
    assert search.best() == (Beam((5, 8), -3 / 16, LENGTH), Beam((5, EOS), -4 / 16, LENGTH))


def test_the_search_ends_when_every_candidate_is_eos():
    search = start(BeamSearchParams(beam_width=2, max_tokens=5), PROMPT, EOS).step([_options((EOS, -2))])
    assert search.done and search.beams == ()
    assert search.best() == (Beam((), -2 / 16, STOP, EOS),)


def test_beam_width_one_follows_the_best_token_but_an_early_eos_may_rank_first():
    search = start(BeamSearchParams(beam_width=1, max_tokens=2), PROMPT, EOS)
    search = search.step([_options((9, -1), (EOS, -2))]).step([_options((4, -3), (7, -5))])
    assert search.beams == (Beam((9, 4), -4 / 16),)
    assert search.best() == (Beam((), -2 / 16, STOP, EOS),)  # -2/16 / 3 beats -4/16 / 5


def test_candidates_put_the_sampled_token_first_as_vllm_logprobs_do():
    top = ((4, -0.5), (9, -1.5))
    assert candidates_of(Candidate(4, -0.5), top) == (Candidate(4, -0.5), Candidate(9, -1.5))
    assert candidates_of(Candidate(7, -6.0), top) == (Candidate(7, -6.0), Candidate(4, -0.5), Candidate(9, -1.5))


@pytest.mark.parametrize("fields, field", [
    (dict(beam_width=0, max_tokens=4), "n"),
    (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("inf")), "length_penalty"),
])
def test_params_are_validated_naming_the_request_field(fields, field):
    with pytest.raises(InvalidRequestError) as error:
        BeamSearchParams(**fields)
    assert error.value.field == field
    assert MAX_BEAM_WIDTH == 10


@pytest.mark.parametrize(("max_logprobs", "widest"), [(MAX_LOGPROBS, MAX_BEAM_WIDTH), (7, 3), (40, 20), (-1, 50)])
def test_the_widest_beam_search_is_the_logprobs_limits_half(max_logprobs, widest):
    """Each step asks for 2 x n logprobs: --max-logprobs (-1: the vocabulary, here 100) bounds n."""
    BeamSearchParams(widest, 4).check_logprobs_limit(max_logprobs, 100)
    with pytest.raises(InvalidRequestError) as caught:
        BeamSearchParams(widest + 1, 4).check_logprobs_limit(max_logprobs, 100)
    limit = 100 if max_logprobs == -1 else max_logprobs
    assert str(caught.value) == (f"n: is the beam width with use_beam_search: an integer in [1, {widest}] (each step "
                                 f"asks for 2 x n logprobs, at most {limit}), got {widest + 1}")


@pytest.mark.parametrize("length_penalty", [32.0001, -32.0001, 2**31, -2**31 - 1, pytest.param(10**400, id="10**400"), 1e308, float("nan")])
def test_a_length_penalty_beyond_32_is_refused(length_penalty):
    """seq_len ** length_penalty must stay a finite, non-zero float, or ranking the beams raises (OverflowError,
    ZeroDivisionError: a 500 after the search ran); within [-32, 32] it does for any seq_len below 2**31."""
    with pytest.raises(InvalidRequestError) as caught:
        BeamSearchParams(2, 4, length_penalty=length_penalty)
    assert caught.value.field == "length_penalty"
    assert str(caught.value).startswith("length_penalty: must be a number in [-32, 32], got ")


@pytest.mark.parametrize("length_penalty", [32, -32.0])
def test_the_widest_length_penalty_ranks_the_longest_sequences(length_penalty):
    search = BeamSearch(BeamSearchParams(2, 4, length_penalty=length_penalty), (1,) * 2**20, EOS,
                        (Beam((9,), -3.0), Beam((4,), -0.0)))
    assert search.best() == (Beam((4,), -0.0, LENGTH), Beam((9,), -3.0, LENGTH))


def test_step_needs_one_candidate_list_per_beam():
    with pytest.raises(ValueError, match="2 candidate lists for 1 beams"):
        start(BeamSearchParams(beam_width=2, max_tokens=3), PROMPT, EOS).step(STEPS[1])
