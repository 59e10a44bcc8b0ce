"""Incremental detokenization: exact text, split multi-byte characters, exact stop-string cuts."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tests.factories import tiny_tokenizer
from splitserve.common.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello world, the river runs by the old mill.",
    "naïve café 😀 日本語のテキスト 🚀🚀",
    "😀",
    "日本語",
    "a  b\n\n c\t",
    "emoji👩‍👩‍👧 flag🇯🇵 end",
]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer(vocab_size=512, seed=0)


@dataclass
class Streamed:
    detokenizer: IncrementalDetokenizer
    deltas: list[str]
    """take_delta(False) after every append (finished=True on a stop match), then one take_delta(True)."""
    matched: str | None
    num_consumed: int
    """Tokens appended, including the one that completed the stop string."""

    @property
    def streamed_before_finish(self) -> str:
        return "".join(self.deltas[:-1])


def stream(tokenizer, token_ids: list[int], stop=(), prompt=(1, 2, 3), skip_special_tokens=True,
           include_stop=False) -> Streamed:
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, list(prompt), tuple(stop), skip_special_tokens,
                                         include_stop)
    deltas, matched, consumed = [], None, 0
    for token_id in token_ids:
        matched = detokenizer.append(token_id)
        consumed += 1
        deltas.append(detokenizer.take_delta(finished=matched is not None))
        if matched is not None:
            break
    deltas.append(detokenizer.take_delta(finished=True))
    return Streamed(detokenizer, deltas, matched, consumed)


# ---- exact text --------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [(), (1, 2, 3), (80, 67, 130)])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tokenizer, text, prompt):
    ids = tokenizer.encode(text)
    result = stream(tokenizer, ids, prompt=prompt)
    assert result.detokenizer.output_text == tokenizer.decode(ids) == text
    assert "".join(result.deltas) == text
    assert all("\ufffd" not in delta for delta in result.deltas)
    assert result.deltas[-1] == ""  # nothing is held back without stop strings


def test_multibyte_characters_really_are_split_across_tokens(tokenizer):
    ids = tokenizer.encode("😀")
    assert len(ids) > 1 and all(tokenizer.decode([i]) == "\ufffd" for i in ids)
    # Nothing appears until the last byte completes the character.
    assert stream(tokenizer, ids).deltas == [""] * (len(ids) - 1) + ["😀", ""]


def test_output_text_never_holds_a_partial_character(tokenizer):
    text = "naïve café 😀 日本語のテキスト 🚀🚀"
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, [], (), True)
    for token_id in tokenizer.encode(text):
        detokenizer.append(token_id)
        assert "\ufffd" not in detokenizer.output_text
        assert text.startswith(detokenizer.output_text)
    assert detokenizer.output_text == text


def test_each_step_streams_exactly_the_new_complete_text(tokenizer):
    ids = tokenizer.encode("the river runs by the old mill")
    pieces = [tokenizer.decode([i]) for i in ids]  # ASCII: every token is whole characters
    assert len(ids) > 5 and "".join(pieces) == "the river runs by the old mill"
    assert stream(tokenizer, ids).deltas == pieces + [""]


# ---- special tokens ----------------------------------------------------------------------------

def test_skip_special_tokens_hides_them(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hi, there = tokenizer.encode("hi"), tokenizer.encode(" there")
    hi_pieces, there_pieces = [tokenizer.decode([i]) for i in hi], [tokenizer.decode([i]) for i in there]
    ids = hi + [im_end] + there
    hidden = stream(tokenizer, ids, skip_special_tokens=True)
    assert hidden.deltas == hi_pieces + [""] + there_pieces + [""]
    assert hidden.detokenizer.output_text == "hi there"
    shown = stream(tokenizer, ids, skip_special_tokens=False)
    assert shown.deltas == hi_pieces + ["<|im_end|>"] + there_pieces + [""]
    assert shown.detokenizer.output_text == "hi<|im_end|> there"


def test_special_tokens_in_the_prompt_context_are_skipped(tokenizer):
    prompt = [tokenizer.convert_tokens_to_ids("<|im_start|>")] + tokenizer.encode("user")
    ids = tokenizer.encode(" river")
    assert stream(tokenizer, ids, prompt=prompt).detokenizer.output_text == " river"


def test_stop_string_may_be_a_shown_special_token(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.encode("hi") + [im_end] + tokenizer.encode(" there")
    result = stream(tokenizer, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert (result.matched, result.num_consumed) == ("<|im_end|>", len(tokenizer.encode("hi")) + 1)
    assert result.detokenizer.output_text == "hi"
    hidden = stream(tokenizer, ids, stop=["<|im_end|>"], skip_special_tokens=True)
    assert (hidden.matched, hidden.detokenizer.output_text) == (None, "hi there")


# ---- stop strings ------------------------------------------------------------------------------

def test_stop_string_spanning_tokens_cuts_exactly_before_it(tokenizer):
    text = "the river runs by the old mill and the old mill again"
    ids = tokenizer.encode(text)
    stop = "old mill"
    completing = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    assert stop not in tokenizer.decode([ids[completing - 1]])  # so it is spread over several tokens
    result = stream(tokenizer, ids, stop=[stop])
    assert result.matched == stop
    assert result.num_consumed == completing  # matched on the token completing it
    assert result.detokenizer.output_text == "the river runs by the "
    assert "".join(result.deltas) == "the river runs by the "


def test_stop_string_inside_multibyte_characters(tokenizer):
    result = stream(tokenizer, tokenizer.encode("日本語のテキスト"), stop=["語の"])
    assert (result.matched, result.detokenizer.output_text, "".join(result.deltas)) == ("語の", "日本", "日本")
    assert all("\ufffd" not in delta for delta in result.deltas)


def test_stop_string_at_the_very_start_gives_empty_text(tokenizer):
    ids = tokenizer.encode("the river")
    result = stream(tokenizer, ids, stop=["the r"])
    assert (result.matched, result.detokenizer.output_text) == ("the r", "")
    assert result.deltas == [""] * (result.num_consumed + 1)
    assert result.num_consumed == next(k for k in range(1, len(ids) + 1) if "the r" in tokenizer.decode(ids[:k]))


def test_earliest_completed_stop_string_wins(tokenizer):
    result = stream(tokenizer, tokenizer.encode("alpha beta gamma delta"), stop=["delta", "beta"])
    assert (result.matched, result.detokenizer.output_text) == ("beta", "alpha ")


@pytest.mark.parametrize("text, stops, expected", [
    ("ab😀cd", ("😀", "b😀", "😀c"), "a"),
    ("x日本語のテキスト", ("語", "本語", "日本語の"), "x日"),
])
def test_earliest_start_wins_when_several_complete_on_one_token(tokenizer, text, stops, expected):
    # A multi-byte character appears all at once, so every stop ending with it completes on the same
    # token; the first listed is not the earliest in the text.
    result = stream(tokenizer, tokenizer.encode(text), stop=stops)
    assert (result.matched, result.detokenizer.output_text, "".join(result.deltas)) == (stops[1], expected, expected)


def test_stop_string_is_searched_in_the_output_only(tokenizer):
    prompt = tokenizer.encode("by the ol")
    result = stream(tokenizer, tokenizer.encode("d mill"), stop=["old"], prompt=prompt)
    assert (result.matched, result.detokenizer.output_text) == (None, "d mill")


def test_streamed_deltas_never_contain_any_part_of_the_stop_string(tokenizer):
    text = "the river runs by the old mill and more"
    result = stream(tokenizer, tokenizer.encode(text), stop=["d mi"])  # starts inside a word
    assert result.detokenizer.output_text == "the river runs by the ol"
    streamed = ""
    for delta in result.deltas:
        streamed += delta
        assert "the river runs by the ol".startswith(streamed)  # so never a 'd', 'd ', 'd m', ...
    assert streamed == "the river runs by the ol"


def test_hold_back_is_exactly_the_longest_stop_minus_one(tokenizer):
    text = "the river runs by the old m"  # ends in a prefix of the stop string that never completes
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, [], ("x", "old mill"), True)
    streamed = ""
    for k, token_id in enumerate(ids, start=1):
        assert detokenizer.append(token_id) is None
        streamed += detokenizer.take_delta(finished=False)
        so_far = tokenizer.decode(ids[:k])
        assert streamed == so_far[: max(0, len(so_far) - 7)]
    assert detokenizer.take_delta(finished=True) == "e old m"  # the flush returns exactly the rest
    assert detokenizer.take_delta(finished=True) == ""
    assert streamed + "e old m" == text == detokenizer.output_text


@pytest.mark.parametrize("text, stops, expected", [
    ("the river runs by the old mill and the old mill again", ("old mill",), "the river runs by the old mill"),
    ("ab😀cd", ("😀", "b😀", "😀c"), "ab😀"),
    ("alpha beta gamma delta", ("delta", "beta"), "alpha beta"),
])
def test_include_stop_keeps_the_stop_string_and_cuts_what_follows_it(tokenizer, text, stops, expected):
    result = stream(tokenizer, tokenizer.encode(text), stop=stops, include_stop=True)
    assert (result.detokenizer.output_text, "".join(result.deltas)) == (expected, expected)
    assert result.matched is not None and expected.endswith(result.matched)
    # nothing held back: each step streams all the text it decoded (up to the stop)
    before_match = "".join(result.deltas[:result.num_consumed - 1])
    assert before_match == stream(tokenizer, tokenizer.encode(text)[:result.num_consumed - 1]).detokenizer.output_text


def test_take_delta_without_new_text_is_empty(tokenizer):
    token_id = tokenizer.encode("the")[0]
    piece = tokenizer.decode([token_id])
    stop = "#" * (len(piece) + 1)  # holds back len(piece) characters: all of it
    detokenizer = IncrementalDetokenizer(tokenizer.backend_tokenizer, [], (stop,), True)
    assert detokenizer.append(token_id) is None
    assert detokenizer.take_delta(finished=False) == ""
    assert detokenizer.take_delta(finished=False) == ""
    assert detokenizer.take_delta(finished=True) == piece
    assert detokenizer.take_delta(finished=False) == ""
