"""Tool call parsers (router/tool_parsers.py) on exact strings: whole outputs, the same outputs
streamed piece by piece (one character at a time, and at every split point), malformed JSON."""

from __future__ import annotations

import itertools
import json

import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.router.tool_calling import FunctionTool, ToolCalling, ToolChoice, make_tool_call_id
from splitserve.router.tool_parsers import (AUTO_TOOL_CHOICE_OFF, CallsScanner, HermesParser, Llama3JsonParser,
                                            MalformedJson, NamedCallParser, OutputDelta, OutputParser, ParsedOutput,
                                            RequiredCallsParser, ToolCall, ToolCallDelta, ToolOutput, parse_output)


def ids():
    """Deterministic call ids: call-0, call-1, ..."""
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


def streamed(parser: OutputParser, pieces: list[str]) -> OutputDelta:
    delta = OutputDelta()
    for piece in pieces:
        delta += parser.feed(piece)
    return delta + parser.finish()


def accumulated(delta: OutputDelta) -> tuple[str, tuple[ToolCall, ...]]:
    """The deltas put together as the openai SDK does (by index; id and name from the first piece)."""
    calls: dict[int, list] = {}
    for piece in delta.tool_calls:
        if piece.id is not None:
            assert piece.index not in calls  # opened once
            calls[piece.index] = [piece.id, piece.name, ""]
        calls[piece.index][2] += piece.arguments
    return delta.content, tuple(ToolCall(*calls[i]) for i in sorted(calls))


HERMES_TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\u00eds", '
                    '"days": 1.50e1, "opts": [true, null, {"emoji": "\\ud83d\\ude00", "q": "a\\"b\\\\c\\n"}]}}\n'
                    '</tool_call>\n<tool_call>{"arguments":{},"name":"now"}</tool_call>\n')
HERMES_TWO_CALLS_PARSED = ParsedOutput("Let me check.\n", (
    ToolCall("call-0", "get_weather", '{"city": "París", "days": 15.0, "opts": [true, null, '
                                      '{"emoji": "😀", "q": "a\\"b\\\\c\\n"}]}'),
    ToolCall("call-1", "now", "{}")))


def test_hermes_whole_output():
    assert parse_output(HermesParser(new_id=ids()), HERMES_TWO_CALLS) == HERMES_TWO_CALLS_PARSED
    # the canonical arguments are what vLLM returns: json.dumps of the parsed value
    arguments = json.loads(HERMES_TWO_CALLS.split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]
    assert HERMES_TWO_CALLS_PARSED.tool_calls[0].arguments == json.dumps(arguments, ensure_ascii=False)


def test_hermes_character_by_character_streams_the_same_output():
    parser = HermesParser(new_id=ids())
    delta = streamed(parser, list(HERMES_TWO_CALLS))
    assert accumulated(delta) == ("Let me check.\n", HERMES_TWO_CALLS_PARSED.tool_calls)
    assert parser.called and not parser.malformed
    # the call opens with its name as soon as the name is read, then its arguments stream
    first = [piece for piece in delta.tool_calls if piece.index == 0]
    assert (first[0].id, first[0].name, first[0].arguments) == ("call-0", "get_weather", "")
    assert [piece.arguments for piece in first[1:6]] == ["{", '"', "c", "i", "t"]


@pytest.mark.parametrize("text", [HERMES_TWO_CALLS, 'a <tool_call>{"name": "f", "arguments": {"x": -0.5e-3}}',
                                  'x<tool_call>{"name":"f","arguments":{}}</tool_call> and more <tool_c'])
def test_hermes_every_split_point_gives_the_whole_result(text):
    whole = parse_output(HermesParser(new_id=ids()), text)
    for cut in range(len(text) + 1):
        content, calls = accumulated(streamed(HermesParser(new_id=ids()), [text[:cut], text[cut:]]))
        assert (content, calls) == (whole.content or "", whole.tool_calls), cut


@pytest.mark.parametrize(("text", "expected"), [
    ("Just text, no tags.", ParsedOutput("Just text, no tags.", ())),
    ("<tool_c", ParsedOutput("<tool_c", ())),  # a tag that never completed is text
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', ParsedOutput(None, (ToolCall("call-0", "f", '{"a": 1}'),))),
    ('<tool_call>{"name": "f", "arguments": 7}</tool_call>  \n', ParsedOutput(None, (ToolCall("call-0", "f", "7"),))),
    ('<tool_call>{"name": "f", "arguments": {}, "extra": [1]}</tool_call>Done.',
     ParsedOutput("Done.", (ToolCall("call-0", "f", "{}"),))),
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>',
     ParsedOutput(None, (ToolCall("call-0", "f", '{"s": "</tool_call>"}'),))),
])
def test_hermes_outputs(text, expected):
    assert parse_output(HermesParser(new_id=ids()), text) == expected


@pytest.mark.parametrize("text", [
    'Sure <tool_call>{"name": "f", "arguments": {"a": }}</tool_call>',  # bad JSON
    '<tool_call>{"name": "f", "arguments": {"a": 1}',  # cut short
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments
    '<tool_call>{"name": 5, "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}} trailing</tool_call>',
    '<tool_call>{"name": "f", "name": "g", "arguments": {}}</tool_call>',
    '<tool_call>["f"]</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": "line\nbreak"}}</tool_call>',  # a raw control character
    '<tool_call>{"name": "f", "arguments": {"a": 01}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call>',
    '<tool_call>{"name": "f\\ud800", "arguments": {}}</tool_call>',  # a name no UTF-8 response can carry
])
def test_malformed_hermes_output_is_all_content(text):
    parser = HermesParser(new_id=ids())
    assert parse_output(parser, text) == ParsedOutput(text, ())
    assert parser.malformed


def test_a_malformed_call_in_a_stream_keeps_what_was_sent_and_the_rest_is_content():
    text = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1, oops}}</tool_call> bye'
    parser = HermesParser(new_id=ids())
    delta = streamed(parser, list(text))
    assert accumulated(delta) == ('Hi <tool_call>{"name": "f", "arguments": {"a": 1, oops}}</tool_call> bye',
                                  (ToolCall("call-0", "f", '{"a": 1, '),))
    assert parser.malformed


def test_hermes_with_at_most_one_call_drops_the_others():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert parse_output(HermesParser(1, new_id=ids()), text) == ParsedOutput(None, (ToolCall("call-0", "f", "{}"),))


def test_whitespace_between_calls_is_not_content_but_text_is():
    text = '<tool_call>{"name":"f","arguments":{}}</tool_call>\n\n<tool_call>{"name":"g","arguments":{}}</tool_call>\n'
    assert parse_output(HermesParser(new_id=ids()), text).content is None
    assert parse_output(HermesParser(new_id=ids()), text + " ok").content == "\n ok"


def test_required_calls():
    text = '[{"name":"get_weather","parameters":{"city":"Oslo","unit":"c"}},{"name":"now","parameters":{}}]'
    expected = ParsedOutput("", (ToolCall("call-0", "get_weather", '{"city": "Oslo", "unit": "c"}'),
                                 ToolCall("call-1", "now", "{}")))
    assert parse_output(RequiredCallsParser(new_id=ids()), text) == expected
    assert accumulated(streamed(RequiredCallsParser(new_id=ids()), list(text))) == ("", expected.tool_calls)


def test_text_after_the_required_calls_is_whitespace_or_malformed():
    calls = '[{"name":"f","parameters":{}}]'
    assert accumulated(streamed(RequiredCallsParser(new_id=ids()), [calls, "\n", " "])) == (
        "", (ToolCall("call-0", "f", "{}"),))
    parser = RequiredCallsParser(new_id=ids())
    assert accumulated(streamed(parser, [calls, "\n", "x"])) == (calls + "\nx", (ToolCall("call-0", "f", "{}"),))
    assert parser.malformed


@pytest.mark.parametrize("text", ['[]x', '{"name":"f","parameters":{}}', '[{"name":"f","parameters":{}}] x', '["f"]'])
def test_malformed_required_output_is_content(text):
    assert parse_output(RequiredCallsParser(new_id=ids()), text) == ParsedOutput(text, ())


@pytest.mark.parametrize(("text", "expected"), [
    ('[{"name":"f","parameters":{"a":1}},{"name":"g","parameters":{"b":"x', ParsedOutput("", (
        ToolCall("call-0", "f", '{"a": 1}'), ToolCall("call-1", "g", '{"b": "x')))),
    ('[{"name":"f","parameters":{"a":', ParsedOutput("", (ToolCall("call-0", "f", '{"a": '),))),
    ('[{"name":"f', ParsedOutput("", ())),
])
def test_required_output_cut_short_keeps_its_calls_as_far_as_they_got(text, expected):
    """max_tokens ended the array: streamed and whole give the same calls, and no content (the
    stream used to send every call, then the whole array again as content)."""
    assert parse_output(RequiredCallsParser(new_id=ids()), text) == expected
    assert accumulated(streamed(RequiredCallsParser(new_id=ids()), list(text))) == ("", expected.tool_calls)


def test_named_call_is_the_whole_output_as_generated():
    parser = NamedCallParser("f", new_id=ids())
    assert parse_output(parser, '{"a":1}') == ParsedOutput("", (ToolCall("call-0", "f", '{"a":1}'),))
    delta = streamed(NamedCallParser("f", new_id=ids()), ['{"a"', ":1}"])
    assert delta.tool_calls == (ToolCallDelta(0, '{"a"', "call-0", "f"), ToolCallDelta(0, ":1}"))
    assert parse_output(NamedCallParser("f", new_id=ids()), "").tool_calls == (ToolCall("call-0", "f", ""),)


@pytest.mark.parametrize(("text", "expected"), [
    ('<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     ParsedOutput(None, (ToolCall("call-0", "f", '{"a": 1}'), ToolCall("call-1", "g", "{}")))),
    ('  {"name": "f", "parameters": {"x": [1, 2]}}', ParsedOutput(None, (ToolCall("call-0", "f", '{"x": [1, 2]}'),))),
    ("The answer is 4.", ParsedOutput("The answer is 4.", ())),
    ('{"name": "f", "parameters": {}} and text', ParsedOutput('{"name": "f", "parameters": {}} and text', ())),
    ('{"name": "f"', ParsedOutput('{"name": "f"', ())),
    # vLLM's llama3_json reads "arguments" as "parameters" (models write either); a call with both is ambiguous
    ('{"name": "f", "arguments": {"a": 1}}; {"parameters": {}, "name": "g"}',
     ParsedOutput(None, (ToolCall("call-0", "f", '{"a": 1}'), ToolCall("call-1", "g", "{}")))),
    ('{"name": "f", "parameters": {}, "arguments": {}}',
     ParsedOutput('{"name": "f", "parameters": {}, "arguments": {}}', ())),
])
def test_llama3_json(text, expected):
    assert parse_output(Llama3JsonParser(new_id=ids()), text) == expected
    for cut in range(len(text) + 1):
        content, calls = accumulated(streamed(Llama3JsonParser(new_id=ids()), [text[:cut], text[cut:]]))
        # a stream that turns out not to be calls sends all of the output as content
        assert (content, calls if expected.tool_calls else ()) == (expected.content or "", expected.tool_calls), cut



def test_an_integer_longer_than_int_reads_stays_as_written():
    """A model can run on writing digits: past 4300 of them int() (hence json.loads) refuses the
    number with a ValueError, which was a 500 (a stream's error event); the call keeps it as written."""
    digits = "7" * 5000
    text = f'<tool_call>{{"name": "f", "arguments": {{"a": -{digits}, "b": -0}}}}</tool_call>'
    expected = ParsedOutput(None, (ToolCall("call-0", "f", f'{{"a": -{digits}, "b": 0}}'),))
    assert parse_output(HermesParser(new_id=ids()), text) == expected
    assert accumulated(streamed(HermesParser(new_id=ids()), [text[:2000], text[2000:]])) == (
        "", expected.tool_calls)

def test_the_scanner_canonicalizes_numbers_and_escapes_like_json_dumps():
    value = '{"name": "f", "arguments": {"n": [1E2, -0, 1.0, 12345678901234567890, 1e400], "s": "\\/\\u0001\\ud800x"}}'
    scanner = CallsScanner(0, "arguments")
    assert scanner.feed(value + "rest") == len(value) and scanner.done
    # as json.dumps(json.loads(...)) writes them, except a number too large for a float and a lone
    # surrogate, which stay valid JSON (json.dumps would write Infinity and an unencodable character)
    assert "".join(scanner.calls[0].arguments) == '{"n": [100.0, 0, 1.0, 12345678901234567890, 1e400], ' \
                                                  '"s": "/\\u0001\\ud800x"}'
    with pytest.raises(MalformedJson):
        CallsScanner(0, "arguments").feed("[")


def test_finish_reasons_follow_vllm():
    tools = (FunctionTool("f", None, {"type": "function", "function": {"name": "f"}}),)
    called, plain = HermesParser(new_id=ids()), HermesParser(new_id=ids())
    parse_output(called, '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    parse_output(plain, "no call")
    auto = ToolOutput.for_request(ToolCalling(tools, ToolChoice.AUTO), "hermes")
    assert [auto.finish_reason(r, p) for r, p in [("stop", called), ("length", called), ("stop", plain)]] == \
        ["tool_calls", "tool_calls", "stop"]
    required = ToolOutput.for_request(ToolCalling(tools, ToolChoice.REQUIRED), None)
    done = RequiredCallsParser(new_id=ids())
    parse_output(done, '[{"name":"f","parameters":{}}]')
    assert [required.finish_reason(r, done) for r in ("stop", "length")] == ["tool_calls", "length"]
    named = ToolOutput.for_request(ToolCalling(tools, ToolChoice.NAMED, "f"), None)
    assert named.finish_reason("stop", NamedCallParser("f")) == "stop"
    assert ToolOutput.for_request(ToolCalling(tools, ToolChoice.NONE), None) is None
    with pytest.raises(InvalidRequestError, match="requires --enable-auto-tool-choice") as error:
        ToolOutput.for_request(ToolCalling(tools, ToolChoice.AUTO), None)
    assert (error.value.field, str(error.value)) == ("tool_choice", f"tool_choice: {AUTO_TOOL_CHOICE_OFF}")


def test_call_ids_look_like_vllms():
    call_id = make_tool_call_id()
    assert call_id.startswith("chatcmpl-tool-") and len(call_id) == 46 and int(call_id[14:], 16) >= 0
    assert make_tool_call_id() != call_id


def test_auto_reads_with_the_servers_parser_and_honours_parallel_tool_calls():
    tools = (FunctionTool("f", None, {"type": "function", "function": {"name": "f"}}),)
    text = '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'
    one = ToolOutput.for_request(ToolCalling(tools, ToolChoice.AUTO, parallel_tool_calls=False), "llama3_json")
    many = ToolOutput.for_request(ToolCalling(tools, ToolChoice.AUTO), "llama3_json")
    assert [call.name for call in parse_output(one.new_parser(), text).tool_calls] == ["f"]
    assert [call.name for call in parse_output(many.new_parser(), text).tool_calls] == ["f", "g"]
    assert isinstance(ToolOutput.for_request(ToolCalling(tools, ToolChoice.AUTO), "hermes").new_parser(), HermesParser)
