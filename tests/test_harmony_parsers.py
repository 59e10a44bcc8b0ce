"""GPT-OSS's harmony output (router/harmony.py) through the `openai_gptoss` reasoning parser and the `openai`
tool call parser: headers, whole outputs (analysis then final, analysis then calls, several calls, a
preamble, outputs cut by max_tokens in a header, a body or a call's arguments), exact streamed deltas
for GPT-OSS-like token pieces, every cut of a stream into three pieces (markers split anywhere) equal
to the whole, reasoning token counts, and what a request's sampling and finish reason become."""

from __future__ import annotations

import itertools

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import StructuredOutput, StructuredOutputKind
from splitserve.router.harmony import Header
from splitserve.router.reasoning_parsers import (HarmonyParser, HarmonyTokens, ParsedReasoning, ReasoningDelta,
                                                 ReasoningFormat, parse_reasoning)
from splitserve.router.tool_calling import ToolCalling, ToolChoice
from splitserve.router.tool_parsers import (HarmonyToolParser, OutputDelta, ParsedOutput, ToolCall, ToolCallDelta,
                                            ToolOutput, parse_output)

CHANNEL, MESSAGE, ANALYSIS, END, CALL, RETURN, START = 200005, 200008, 35644, 200007, 200012, 200002, 200006
"""o200k_harmony's ids of the harmony tokens and of the word `analysis`."""
VOCAB = {"<|channel|>": CHANNEL, "<|message|>": MESSAGE, "analysis": ANALYSIS, "<|end|>": END, "<|call|>": CALL,
         "<|return|>": RETURN, "<|start|>": START}
TOKENS = HarmonyTokens(CHANNEL, MESSAGE, ANALYSIS, START, frozenset({END, CALL, RETURN, START}))

THOUGHT_THEN_ANSWER = ("<|channel|>analysis<|message|>User asks 2+2.<|end|>"
                       "<|start|>assistant<|channel|>final<|message|>It is 4.")
CALL_WEATHER = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city":"Paris","days":2}')
THOUGHT_THEN_CALL = "<|channel|>analysis<|message|>Need weather.<|end|>" + CALL_WEATHER
TWO_CALLS = (THOUGHT_THEN_CALL + "<|call|>"  # (when <|call|> is no stop token, the turn goes on)
             '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "Europe/Paris"}')
WEATHER_ARGUMENTS = '{"city": "Paris", "days": 2}'


def ids():
    return iter(f"call_{n}" for n in itertools.count()).__next__


def reasoning_then_calls(text: str, max_calls: int | None = None) -> tuple[ParsedReasoning, ParsedOutput]:
    """`text` as the server reads it with both parsers: the reasoning parser's content through the tool parser."""
    split = parse_reasoning(HarmonyParser(TOKENS, False), text)
    return split, parse_output(HarmonyToolParser(max_calls, False, ids()), split.content or "")


@pytest.mark.parametrize(("text", "expected"), [
    ("<|channel|>analysis<|message|>", Header("<|channel|>analysis<|message|>", "analysis", None, None)),
    ("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
     Header("<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
            "commentary", "functions.get_weather", "json")),
    (" to=functions.f<|channel|>commentary json<|message|>",
     Header(" to=functions.f<|channel|>commentary json<|message|>", "commentary", "functions.f", "json")),
    ("<|start|>assistant<|channel|>analysis to=browser.search<|message|>",
     Header("<|start|>assistant<|channel|>analysis to=browser.search<|message|>", "analysis", "browser.search", None)),
])
def test_a_header_names_its_channel_recipient_and_content_type(text, expected):
    assert Header.parse(text) == expected
    assert expected.function == {"functions.get_weather": "get_weather", "functions.f": "f"}.get(expected.recipient)


@pytest.mark.parametrize(("text", "reasoning", "content"), [
    (THOUGHT_THEN_ANSWER, "User asks 2+2.", "It is 4."),
    (THOUGHT_THEN_ANSWER + "<|return|>", "User asks 2+2.", "It is 4."),
    ("<|channel|>final<|message|>Hi.", None, "Hi."),
    ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>C.", "A.\nB.", "C."),
    ("<|channel|>analysis<|message|>cut by max_tok", "cut by max_tok", None),
    ("<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>fin", "Done.", None),  # a cut header
    ("<|channel|>commentary<|message|>Let me look.<|end|>", None, "Let me look."),  # a preamble is content
    (THOUGHT_THEN_CALL, "Need weather.", CALL_WEATHER),  # the call stays harmony, for the tool parser
    ('<|channel|>commentary to=functions.f json<|message|>{}<|call|>', None,
     '<|start|>assistant<|channel|>commentary to=functions.f json<|message|>{}<|call|>'),
    (' to=functions.f<|channel|>commentary json<|message|>{"a"', None,
     '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a"'),  # cut: no end marker added
    ("", None, None),
])
def test_the_reasoning_parser_splits_a_whole_output_by_channel(text, reasoning, content):
    assert parse_reasoning(HarmonyParser(TOKENS, False), text) == ParsedReasoning(reasoning, content)


@pytest.mark.parametrize(("text", "content", "calls"), [
    (THOUGHT_THEN_ANSWER, "It is 4.", ()),
    (THOUGHT_THEN_CALL, None, (ToolCall("call_0", "get_weather", WEATHER_ARGUMENTS),)),
    (TWO_CALLS, None, (ToolCall("call_0", "get_weather", WEATHER_ARGUMENTS),
                       ToolCall("call_1", "get_time", '{"tz": "Europe/Paris"}'))),
    ("<|channel|>commentary<|message|>Checking.<|end|>" + CALL_WEATHER, "Checking.",
     (ToolCall("call_0", "get_weather", WEATHER_ARGUMENTS),)),
    ('<|channel|>commentary to=functions.run <|constrain|>python<|message|>print(1)', None,
     (ToolCall("call_0", "run", "print(1)"),)),  # not JSON: as written
    ('<|channel|>commentary to=functions.f json<|message|>{"a": [1, 2}, "b": 3}', None,
     (ToolCall("call_0", "f", '{"a": [1, 2' + '}, "b": 3}'),)),  # canonical until it broke, then as written
    ('<|channel|>commentary to=functions.f json<|message|>{"a":1} trailing', None,
     (ToolCall("call_0", "f", '{"a": 1}'),)),  # text after the value is dropped
    (' to=functions.f<|channel|>commentary json<|message|>{"a":[]}', None,
     (ToolCall("call_0", "f", '{"a": []}'),)),  # the recipient after the prompt's role
])
def test_both_parsers_return_the_final_channel_and_the_calls(text, content, calls):
    assert reasoning_then_calls(text)[1] == ParsedOutput(content, calls)


def test_the_tool_parser_alone_reads_the_models_output_and_drops_the_analysis():
    assert parse_output(HarmonyToolParser(None, True, ids()), TWO_CALLS) == ParsedOutput(None, (
        ToolCall("call_0", "get_weather", WEATHER_ARGUMENTS), ToolCall("call_1", "get_time", '{"tz": "Europe/Paris"}')))
    assert parse_output(HarmonyToolParser(None, True, ids()), THOUGHT_THEN_ANSWER) == ParsedOutput("It is 4.", ())


def test_with_parallel_tool_calls_false_later_calls_are_dropped():
    assert reasoning_then_calls(TWO_CALLS, max_calls=1)[1] == ParsedOutput(
        None, (ToolCall("call_0", "get_weather", WEATHER_ARGUMENTS),))


def test_a_call_cut_by_max_tokens_keeps_its_arguments_so_far_and_the_engines_finish_reason():
    parser = HarmonyToolParser(None, False, ids())
    cut = parse_reasoning(HarmonyParser(TOKENS, False), THOUGHT_THEN_CALL[:-9]).content
    assert parse_output(parser, cut) == ParsedOutput(None, (ToolCall("call_0", "get_weather", '{"city": "Paris", '),))
    output = ToolOutput(ToolChoice.AUTO, lambda: parser)
    assert (parser.cut_short, output.finish_reason("length", parser)) == (True, "length")
    whole = HarmonyToolParser(None, False, ids())
    parse_output(whole, parse_reasoning(HarmonyParser(TOKENS, False), THOUGHT_THEN_CALL).content)
    assert (whole.cut_short, output.finish_reason("stop", whole)) == (False, "tool_calls")


STREAM_PIECES = ["<|channel|>", "analysis", "<|message|>", "Need", " weather", ".", "<|end|>", "<|start|>",
                 "assistant", "<|channel|>", "comment", "ary", " to", "=", "functions", ".get", "_weather", " ",
                 "<|constrain|>", "json", "<|message|>", '{"', "city", '":"', "Paris", '","', "days", '":', "2", "}"]
"""THOUGHT_THEN_CALL as GPT-OSS's tokenizer splits it (a piece a token)."""


def test_a_token_by_token_stream_sends_these_deltas():
    reasoner, caller = HarmonyParser(TOKENS, False), HarmonyToolParser(None, False, ids())
    sent = []
    for number, piece in enumerate(STREAM_PIECES):
        split = reasoner.feed_piece(piece, (), last=number == len(STREAM_PIECES) - 1)
        sent.append((split.reasoning, caller.feed_piece(split.content, last=number == len(STREAM_PIECES) - 1)))
    none = ("", OutputDelta())
    assert sent == [none, none, none, ("Need", OutputDelta()), (" weather", OutputDelta()), (".", OutputDelta()),
                    *[none] * 14,
                    ("", OutputDelta(tool_calls=(ToolCallDelta(0, "", "call_0", "get_weather"),))),
                    ("", OutputDelta(tool_calls=(ToolCallDelta(0, '{"'),))),
                    ("", OutputDelta(tool_calls=(ToolCallDelta(0, 'city'),))),
                    ("", OutputDelta(tool_calls=(ToolCallDelta(0, '": "'),))),
                    ("", OutputDelta(tool_calls=(ToolCallDelta(0, 'Paris'),))),
                    ("", OutputDelta(tool_calls=(ToolCallDelta(0, '", "'),))),
                    ("", OutputDelta(tool_calls=(ToolCallDelta(0, 'days'),))),
                    ("", OutputDelta(tool_calls=(ToolCallDelta(0, '": '),))),
                    none,  # a number may go on
                    ("", OutputDelta(tool_calls=(ToolCallDelta(0, '2}'),)))]


def test_a_final_message_streams_its_text_as_it_comes():
    reasoner = HarmonyParser(TOKENS, False)
    pieces = ["<|channel|>", "analysis", "<|message|>", "Hm", "<|end|>", "<|start|>", "assistant", "<|channel|>",
              "final", "<|message|>", "It", " is", " 4", "."]
    assert [reasoner.feed(piece) for piece in pieces] + [reasoner.finish()] == [
        ReasoningDelta(), ReasoningDelta(), ReasoningDelta(), ReasoningDelta("Hm"), *[ReasoningDelta()] * 6,
        ReasoningDelta(content="It"), ReasoningDelta(content=" is"), ReasoningDelta(content=" 4"),
        ReasoningDelta(content="."), ReasoningDelta()]


def collect(text: str, cuts: tuple[int, int]) -> tuple[str, str, tuple[ToolCallDelta, ...]]:
    """`text` streamed in three pieces through both parsers: the reasoning, content and call deltas sent."""
    pieces = [text[:cuts[0]], text[cuts[0]:cuts[1]], text[cuts[1]:]]
    reasoner, caller = HarmonyParser(TOKENS, False), HarmonyToolParser(None, False, ids())
    reasoning, out = "", OutputDelta()
    for number, piece in enumerate(pieces):
        split = reasoner.feed_piece(piece, (), last=number == 2)
        reasoning += split.reasoning
        out += caller.feed_piece(split.content, last=number == 2)
    return reasoning, out.content, out.tool_calls


@pytest.mark.parametrize("text", [THOUGHT_THEN_ANSWER, TWO_CALLS])
def test_every_cut_of_a_stream_into_three_pieces_equals_the_whole(text):
    """Markers (<|channel|>, <|message|>, <|call|>...) split at every position across pieces."""
    split, whole = reasoning_then_calls(text)
    for first in range(0, len(text) + 1, 1):
        for second in range(first, len(text) + 1, 7):
            reasoning, content, calls = collect(text, (first, second))
            assert (reasoning or None, content or None) == (split.reasoning, whole.content), (first, second)
            assert tuple(ToolCall(f"call_{n}", c.name, "".join(d.arguments for d in calls if d.index == n))
                         for n, c in enumerate(d for d in calls if d.id is not None)) == whole.tool_calls


def test_reasoning_tokens_are_the_analysis_bodies_tokens():
    parser = HarmonyParser(TOKENS, False)
    for token_ids in ([CHANNEL, ANALYSIS, MESSAGE, 7, CHANNEL], [9, END, START, 10, CHANNEL], [11, MESSAGE, 12],
                      [END, 14, START, 10, CHANNEL, ANALYSIS, MESSAGE, 13]):
        parser.feed("", token_ids)
    assert parser.reasoning_tokens == 4  # 7, <|channel|> (body text), 9 and 13; 12 is another channel's, 14 loose


def test_the_format_takes_the_harmony_ids_from_the_tokenizer_and_refuses_one_without_them():
    assert ReasoningFormat.for_tokenizer("openai_gptoss", VOCAB.get) == ReasoningFormat("openai_gptoss", TOKENS)
    with pytest.raises(ValueError, match=r"^--reasoning-parser openai_gptoss needs the tokenizer to have the token "
                                         r"<\|call\|>$"):
        ReasoningFormat.for_tokenizer("openai_gptoss", {k: v for k, v in VOCAB.items() if k != "<|call|>"}.get)


def test_a_requests_sampling_keeps_special_tokens_and_refuses_structured_output():
    output = ReasoningFormat.for_tokenizer("openai_gptoss", VOCAB.get).for_request([1, START, 2], {}, True)
    assert (output.starts_in_reasoning, output.sampling(SamplingParams()).skip_special_tokens) == (False, False)
    with pytest.raises(InvalidRequestError) as error:
        output.sampling(SamplingParams(structured_output=StructuredOutput(StructuredOutputKind.JSON_OBJECT, "")))
    assert (error.value.field, error.value.message) == (
        "response_format", "structured output (response_format, structured_outputs, a named or \"required\" "
        "tool_choice) is not supported with this server's --reasoning-parser openai_gptoss")


def test_auto_tool_choice_with_the_openai_parser_reads_special_tokens_after_the_reasoning_parser_or_not():
    calling = ToolCalling((), ToolChoice.AUTO)
    for after_reasoning, starts_in_header in ((True, False), (False, True)):
        output = ToolOutput.for_request(calling, "openai", after_reasoning)
        assert output.sampling(SamplingParams()).skip_special_tokens is False
        parser = output.new_parser()
        assert (type(parser), parser.feed("<|channel|>final<|message|>x").content) == (
            HarmonyToolParser, "x" if starts_in_header else "<|channel|>final<|message|>x")
