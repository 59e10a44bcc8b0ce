"""The reasoning parsers (router/reasoning_parsers.py): where an output starts, the split of whole
outputs, streams cut at every position (a tag split across pieces, or a piece with text on both
sides of a tag) equal to the whole, reasoning token counts, and what a request's sampling becomes."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import StructuredOutput, StructuredOutputKind
from splitserve.router.reasoning_parsers import (DeepSeekR1Parser, ParsedReasoning, Qwen3Parser, ReasoningDelta,
                                                 ReasoningFormat, ThinkTags, parse_reasoning)

START, END, BOUNDARY = 510, 511, 3
TAGS = ThinkTags("<think>", "</think>", START, END, frozenset({BOUNDARY}))
PARSERS = (DeepSeekR1Parser, Qwen3Parser)


def streamed(parser, pieces: list[str]) -> ReasoningDelta:
    delta = ReasoningDelta()
    for piece in pieces:
        delta += parser.feed(piece)
    return delta + parser.finish()


def reference(text: str, in_reasoning: bool) -> tuple[str, str]:
    """The module's rules, read off the whole text at once: in reasoning, the leftmost tag next; a
    start tag dropped, the first end tag ends it; the rest is content as written."""
    reasoning = []
    while in_reasoning:
        tag = re.search("<think>|</think>", text)
        if tag is None:
            reasoning.append(text)
            text = ""
            break
        reasoning.append(text[:tag.start()])
        text = text[tag.end():]
        in_reasoning = tag.group() != "</think>"
    return "".join(reasoning), text


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize(("text", "expected"), [
    ("<think>\nThe user asks.\n</think>\n\nIt is 4.", ParsedReasoning("\nThe user asks.\n", "\n\nIt is 4.")),
    ("The user asks.</think>It is 4.", ParsedReasoning("The user asks.", "It is 4.")),  # the template wrote <think>
    ("<think>cut short by max_tokens", ParsedReasoning("cut short by max_tokens", None)),
    ("<think></think>It is 4.", ParsedReasoning(None, "It is 4.")),
    ("Done.</think>", ParsedReasoning("Done.", None)),
    ("a <thi", ParsedReasoning("a <thi", None)),  # a tag's start that never completed is text
    ("", ParsedReasoning(None, None)),
])
def test_a_whole_output_is_split_at_the_first_end_tag(parser, text, expected):
    assert parse_reasoning(parser(TAGS, True), text) == expected


@pytest.mark.parametrize("parser", PARSERS)
def test_after_the_reasoning_the_text_is_content_as_written(parser):
    """As vLLM streams it (its non-streamed qwen3 path alone drops the repeated end tag)."""
    text = "why</think>\n\nIt</think> is <think>4.</thi"
    assert parse_reasoning(parser(TAGS, True), text) == ParsedReasoning("why", "\n\nIt</think> is <think>4.</thi")


@pytest.mark.parametrize("parser", PARSERS)
def test_an_output_that_starts_after_the_reasoning_is_content(parser):
    assert parse_reasoning(parser(TAGS, False), "It is <think>4.") == ParsedReasoning(None, "It is <think>4.")


TEXT = "<think>Let me think.</think>\n\nIt is 4 degrees."


@pytest.mark.parametrize("parser", PARSERS)
def test_every_cut_of_a_stream_into_two_or_three_pieces_equals_the_whole(parser):
    """Tags split at every position across pieces, and pieces holding text on both sides of a tag."""
    whole = ReasoningDelta("Let me think.", "\n\nIt is 4 degrees.")
    for first in range(len(TEXT) + 1):
        for second in range(first, len(TEXT) + 1):
            pieces = [TEXT[:first], TEXT[first:second], TEXT[second:]]
            assert streamed(parser(TAGS, True), pieces) == whole, pieces


@pytest.mark.parametrize("parser", PARSERS)
def test_a_piece_holds_text_back_only_while_it_may_start_a_tag(parser):
    stream = parser(TAGS, True)
    assert [stream.feed(piece) for piece in ("Hm <", "/thi", "nk", "> Yes <", "b")] == [
        ReasoningDelta("Hm "), ReasoningDelta(), ReasoningDelta(), ReasoningDelta(content=" Yes <"),
        ReasoningDelta(content="b")]


PIECES = ["<think>", "</think>", "<", "/", "think", ">", "a", " ", "\n", "é", "<th", "k>"]
"""What the random outputs are made of: the tags, their parts, and text."""


@settings(max_examples=300, deadline=None)
@given(text=st.lists(st.sampled_from(PIECES), max_size=14).map("".join),
       cuts=st.lists(st.integers(0, 200), max_size=6), in_reasoning=st.booleans(),
       parser=st.sampled_from(PARSERS))
def test_any_stream_equals_the_whole_and_the_reference(text, cuts, in_reasoning, parser):
    points = sorted({min(cut, len(text)) for cut in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    reasoning, content = reference(text, in_reasoning)
    assert streamed(parser(TAGS, in_reasoning), pieces) == ReasoningDelta(reasoning, content)


def test_reasoning_tokens_are_those_before_the_end_tag_without_the_tags():
    parser = Qwen3Parser(TAGS, True)
    for token_ids in ([START, 7, 8], [9, END, 12], [13, END]):
        parser.feed("x", token_ids)
    assert parser.reasoning_tokens == 3
    assert Qwen3Parser(TAGS, False).feed("x", [7, END, 8]) == ReasoningDelta(content="x")
    never_ended = DeepSeekR1Parser(TAGS, True)
    never_ended.feed("x", [7, 8, 9])
    assert never_ended.reasoning_tokens == 3


@pytest.mark.parametrize(("prompt", "kwargs", "deepseek_r1", "qwen3"), [
    ([1, 2, BOUNDARY, 4], {}, True, True),  # no tag: the model opens the reasoning itself
    ([1, BOUNDARY, 4, START, 5], {}, True, True),  # the template opened it (DeepSeek-R1)
    ([BOUNDARY, 4, START, 5, END, 6], {}, False, False),  # the template closed it (enable_thinking false)
    ([START, 5, END, BOUNDARY, 4], {}, False, True),  # an earlier turn's block: qwen3 reads the last turn only
    ([BOUNDARY, 4], {"enable_thinking": False}, True, False),
])
def test_where_the_output_starts(prompt, kwargs, deepseek_r1, qwen3):
    assert (DeepSeekR1Parser.starts_in_reasoning(TAGS, prompt, kwargs),
            Qwen3Parser.starts_in_reasoning(TAGS, prompt, kwargs)) == (deepseek_r1, qwen3)


VOCAB = {"<think>": START, "</think>": END, "<|im_start|>": BOUNDARY, "<|im_end|>": 4}


def test_the_format_takes_the_tags_ids_from_the_tokenizer_and_refuses_one_without_them():
    assert ReasoningFormat.for_tokenizer("qwen3", VOCAB.get) == ReasoningFormat(
        "qwen3", ThinkTags("<think>", "</think>", START, END, frozenset({BOUNDARY, 4})))
    assert ReasoningFormat.for_tokenizer("deepseek_r1", VOCAB.get).tags.turn_boundary_ids == frozenset()
    with pytest.raises(ValueError, match=r"^--reasoning-parser qwen3 needs the tokenizer to have the token </think>$"):
        ReasoningFormat.for_tokenizer("qwen3", {"<think>": 1}.get)
    with pytest.raises(ValueError, match="must be one of deepseek_r1, qwen3, openai_gptoss, got 'granite'"):
        ReasoningFormat.for_tokenizer("granite", VOCAB.get)


REGEX = StructuredOutput(StructuredOutputKind.REGEX, "[0-9]+")


@pytest.mark.parametrize(("name", "prompt", "include_reasoning", "skip_special_tokens", "constraint"), [
    ("qwen3", [BOUNDARY, 4], True, False, REGEX.after_token(END)),  # the grammar starts after the reasoning
    ("deepseek_r1", [BOUNDARY, 4], True, True, REGEX.after_token(END)),
    ("qwen3", [BOUNDARY, 4, START, END], True, False, REGEX),  # the prompt ended the reasoning
    ("qwen3", [BOUNDARY, 4], False, False, REGEX),  # reasoning not returned: constrained from the start (vLLM)
])
def test_a_requests_sampling_keeps_what_the_parser_reads(name, prompt, include_reasoning, skip_special_tokens,
                                                         constraint):
    output = ReasoningFormat.for_tokenizer(name, VOCAB.get).for_request(prompt, {}, include_reasoning)
    sampling = output.sampling(SamplingParams(structured_output=REGEX))
    assert (sampling.skip_special_tokens, sampling.structured_output) == (skip_special_tokens, constraint)
    assert constraint.grammar() == REGEX.grammar()
