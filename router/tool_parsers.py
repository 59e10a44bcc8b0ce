"""Tool calling at the OpenAI front, response side: a choice's output text split into content and
tool calls, as it streams (text in, typed deltas out) and whole.

Every parser is an OutputParser fed the choice's text as it is generated; `parse_output` runs the
same parser over a whole output, so a stream's deltas put together (the openai SDK's accumulation)
equal the non-streamed message for every well-formed output by construction. A malformed output
(JSON that does not parse, a call without a name) is, non-streamed, all content with no calls (as
vLLM); streamed, what was sent of the broken call stays and the rest of the output, from its
opening tag, arrives as content.
A forced choice's output (named, "required") follows its grammar, so one that ends early was cut
short (finish reason "length", a stop string): its calls are kept as far as they got, streamed and
whole alike.

Parsers:
- NamedCallParser (tool_choice naming a function): the whole output is that call's arguments,
  as generated (vLLM's).
- RequiredCallsParser (tool_choice "required"): the output is a JSON array of {"name", "parameters"};
  each element is a call.
- HermesParser (`--tool-call-parser hermes`, tool_choice "auto"): `<tool_call>{"name": ..,
  "arguments": ..}</tool_call>` blocks (Hermes 2 Pro, Qwen 2.5 / 3); the text around them is content.
- Llama3JsonParser (`--tool-call-parser llama3_json`): an output that starts (after an optional
  `<|python_tag|>`) with `{` is calls: `{"name": .., "parameters": ..}` objects separated by `;`
  ("arguments" in place of "parameters" too, as vLLM reads them).

Arguments of parsed calls (not NamedCallParser's) are the model's JSON re-written as Python's
`json.dumps(value, ensure_ascii=False)` writes it (what vLLM returns), token by token, so they can
stream before the call is complete. (A key the model repeats stays repeated; json.loads keeps its last value.)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.router import harmony
from splitserve.router.partial_tags import partial_tag_length
from splitserve.router.tool_calling import ToolCalling, ToolChoice, make_tool_call_id

AUTO_TOOL_CHOICE_OFF = ("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set "
                        "(router.enable_auto_tool_choice, router.tool_call_parser); tool_choice defaults to \"auto\" "
                        "when tools are sent")
"""vLLM's refusal of tool_choice "auto" on a server started without a tool call parser."""
HERMES_START = "<tool_call>"
HERMES_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ToolCall:
    """A call of a response message."""

    id: str
    name: str
    arguments: str
    """JSON text."""


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index` of a stream: its first piece has the id and name, every piece an
    arguments fragment (possibly empty)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass(frozen=True)
class OutputDelta:
    """What a piece of output adds to the message."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __add__(self, other: OutputDelta) -> OutputDelta:
        return OutputDelta(self.content + other.content, self.tool_calls + other.tool_calls)


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output: its content (None when it made calls and said nothing else) and its calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]


class OutputParser(ABC):
    """One choice's output, fed in pieces; `finish()` once after the last."""

    content_with_calls: str | None = None
    """A whole output's content when it made calls and said nothing else (vLLM's: null for auto)."""
    reads_special_tokens = False
    """Its format's tags may be special tokens, which the output text must then keep
    (skip_special_tokens off, whatever the request says)."""

    def __init__(self, new_id: Callable[[], str] = make_tool_call_id) -> None:
        self._new_id = new_id
        self.malformed = False
        """The output stopped following the format (see the module's docstring)."""
        self.cut_short = False
        """The output ended inside a call whose arguments are incomplete (its finish reason stays the engine's)."""
        self._calls_sent = 0

    @property
    def called(self) -> bool:
        """Whether a call was sent (its id and name)."""
        return self._calls_sent > 0

    @abstractmethod
    def feed(self, text: str) -> OutputDelta:
        """The delta of the next piece of output (parts of it may be held until more comes)."""

    @abstractmethod
    def finish(self) -> OutputDelta:
        """What is left once the output ended."""

    def feed_piece(self, text: str, last: bool) -> OutputDelta:
        """feed(text), then finish() when it is the output's last piece."""
        delta = self.feed(text)
        return delta + self.finish() if last else delta

    def _open_call(self, name: str, arguments: str) -> ToolCallDelta:
        self._calls_sent += 1
        return ToolCallDelta(self._calls_sent - 1, arguments, self._new_id(), name)


def parse_output(parser: OutputParser, text: str) -> ParsedOutput:
    """A whole output through `parser` (fresh): malformed, all of it is content."""
    delta = parser.feed_piece(text, last=True)
    if parser.malformed:
        return ParsedOutput(text, ())
    calls: list[list[str]] = []
    ids_and_names: list[tuple[str, str]] = []
    for piece in delta.tool_calls:
        if piece.id is not None:
            ids_and_names.append((piece.id, piece.name or ""))
            calls.append([])
        calls[piece.index].append(piece.arguments)
    tool_calls = tuple(ToolCall(call_id, name, "".join(args)) for (call_id, name), args in zip(ids_and_names, calls))
    return ParsedOutput(delta.content or (parser.content_with_calls if tool_calls else delta.content), tool_calls)


# ---- tool_choice naming a function ------------------------------------------------------------

class NamedCallParser(OutputParser):
    """The output is the named function's arguments (its grammar is the parameters schema)."""

    content_with_calls = ""

    def __init__(self, name: str, new_id: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(new_id)
        self._name = name

    def feed(self, text: str) -> OutputDelta:
        if not text:
            return OutputDelta()
        if not self.called:
            return OutputDelta(tool_calls=(self._open_call(self._name, text),))
        return OutputDelta(tool_calls=(ToolCallDelta(0, text),))

    def finish(self) -> OutputDelta:
        return self.feed("") if self.called else OutputDelta(tool_calls=(self._open_call(self._name, ""),))


# ---- JSON calls -------------------------------------------------------------------------------

class MalformedJson(Exception):
    """The text is not (the start of) the JSON the parser expects."""


@dataclass
class _Call:
    """A call being read (mutable, the scanner's own)."""

    name: str | None = None
    arguments: list[str] = field(default_factory=list)
    """Canonical JSON fragments of the arguments read so far."""
    keys: set[str] = field(default_factory=set)


_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("-+0123456789.eE")
_PLAIN_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_LITERALS = {"t": "true", "f": "false", "n": "null"}
_HEX = frozenset("0123456789abcdefABCDEF")
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\ud800-\udfff]')
"""Characters json.dumps(ensure_ascii=False) escapes, and surrogates (kept as escapes here)."""
_SURROGATE = re.compile("[\ud800-\udfff]")


def _canonical_char(char: str) -> str:
    """`char` inside a JSON string as json.dumps(ensure_ascii=False) writes it; a lone surrogate
    (which has no UTF-8 form) stays an escape."""
    if 0xD800 <= ord(char) <= 0xDFFF:
        return f"\\u{ord(char):04x}"
    return json.dumps(char, ensure_ascii=False)[1:-1]


def _canonical_number(number: str) -> str:
    """A JSON number (matching _NUMBER) as json.dumps(json.loads(number)) writes it, or as written
    where that has no JSON form (a float too large: Infinity) or json.loads refuses it (an integer of
    over 4300 digits, int()'s limit)."""
    if number.lstrip("-").isdigit():  # an integer: written as is (no leading zeros), but for -0
        return "0" if number == "-0" else number
    canonical = json.dumps(float(number))
    return number if canonical.endswith("Infinity") else canonical


class CallsScanner:
    """Reads one JSON value as it arrives and re-writes it canonically (json.dumps' separators and
    escapes, token by token), collecting the calls in it: each object at `call_depth` (0: the value
    itself, 1: each element of an array) is a call with a string `name` and one of `arguments_keys`
    member. Raises MalformedJson as soon as the text cannot be such a value."""

    def __init__(self, call_depth: int, *arguments_keys: str) -> None:
        self.call_depth = call_depth
        self.arguments_keys = frozenset(arguments_keys)
        """The member names a call's arguments may have (a call has exactly one of them)."""
        self.calls: list[_Call] = []
        self.done = False
        """The value is complete; text after it is not read."""
        self._text = ""
        self._pos = 0
        self._stack: list[list[str]] = []
        """Open containers: [kind ("{" or "["), what comes next, the current key (objects)]."""
        self._string: list[str] | None = None
        """The decoded characters of the string being read; None outside strings."""
        self._string_is_key = False
        self._target: list[str] | None = None
        """Where canonical text goes: the current call's arguments while inside them."""
        self._capture_name = False

    @property
    def unread(self) -> str:
        """Text fed and not read yet (after a MalformedJson: from where the value went wrong)."""
        return self._text[self._pos:]

    def feed(self, text: str) -> int:
        """Read `text`; returns how many of its characters belong to the value (all of them unless it
        completed; none once it had)."""
        if self.done:
            return 0
        start = len(self._text) - self._pos
        self._text = self._text[self._pos:] + text
        self._pos = 0
        self._run(at_end=False)
        return self._pos - start if self.done else len(text)

    def finish(self) -> None:
        """The input ended: a trailing number completes the value; MalformedJson if it is incomplete."""
        self._run(at_end=True)
        if not self.done:
            raise MalformedJson("the JSON ended early")

    # ---- the state machine ------------------------------------------------------------------
    def _run(self, at_end: bool) -> None:
        while not self.done and self._pos < len(self._text):
            if self._string is not None:
                if not self._string_step():
                    return
                continue
            char = self._text[self._pos]
            if char in _WHITESPACE:
                self._pos += 1
            elif not self._structural(char) and not self._scalar(char, at_end):
                return

    def _expecting(self) -> str:
        return self._stack[-1][1] if self._stack else "value"

    def _structural(self, char: str) -> bool:
        """Handle a structural character; False if `char` is not one where it stands."""
        expecting = self._expecting()
        if char in "{[" and expecting in ("value", "value_or_end"):
            self._begin_value("object" if char == "{" else "array")
            self._emit(char)
            self._stack.append([char, "key_or_end" if char == "{" else "value_or_end", ""])
        elif (char == "}" and expecting in ("key_or_end", "comma_or_end") and self._stack[-1][0] == "{") or \
                (char == "]" and expecting in ("value_or_end", "comma_or_end") and self._stack[-1][0] == "["):
            self._close_container(char)
        elif char == "," and expecting == "comma_or_end":
            self._emit(", ")
            self._stack[-1][1] = "key" if self._stack[-1][0] == "{" else "value"
        elif char == ":" and expecting == "colon":
            self._emit(": ")
            self._stack[-1][1] = "value"
        elif char == '"' and expecting in ("key_or_end", "key", "value", "value_or_end"):
            self._string_is_key = expecting.startswith("key")
            if not self._string_is_key:
                self._begin_value("string")
            self._emit('"')
            self._string = []
        else:
            return False
        self._pos += 1
        return True

    def _close_container(self, char: str) -> None:
        if char == "}" and len(self._stack) == self.call_depth + 1:
            call = self.calls[-1]
            if call.name is None or not call.keys & self.arguments_keys:
                raise MalformedJson(f"a call without a name or {' / '.join(sorted(self.arguments_keys))}")
        self._emit(char)
        self._stack.pop()
        self._end_value()

    def _scalar(self, char: str, at_end: bool) -> bool:
        """A number or literal at the cursor; False when it needs more text (or raises)."""
        if self._expecting() not in ("value", "value_or_end"):
            raise MalformedJson(f"unexpected {char!r}")
        if char in _LITERALS:
            word = _LITERALS[char]
            got = self._text[self._pos:self._pos + len(word)]
            if got != word:
                if len(got) < len(word) and word.startswith(got) and not at_end:
                    return False
                raise MalformedJson(f"unexpected {got!r}")
            self._pos += len(word)
            self._scalar_value(word, "literal")
            return True
        end = self._pos
        while end < len(self._text) and self._text[end] in _NUMBER_CHARS:
            end += 1
        if end == len(self._text) and not at_end:
            return False  # more digits may come
        number = self._text[self._pos:end]
        if not _NUMBER.fullmatch(number):
            raise MalformedJson(f"unexpected {number or char!r}")
        self._pos = end
        self._scalar_value(_canonical_number(number), "number")
        return True

    def _scalar_value(self, text: str, kind: str) -> None:
        self._begin_value(kind)
        self._emit(text)
        self._end_value()

    def _string_step(self) -> bool:
        """Read on in the open string; False when it needs more text."""
        text, pos = self._text, self._pos
        run = _PLAIN_STRING_RUN.match(text, pos)
        if run:
            self._string_chars(run.group())
            self._pos = run.end()
            return True
        char = text[pos]
        if char == '"':
            self._pos += 1
            self._end_string()
            return True
        if char != "\\":
            raise MalformedJson("a control character in a string")
        decoded, length = self._escape(text, pos)
        if length == 0:
            return False
        self._pos += length
        self._string_chars(decoded)
        return True

    @staticmethod
    def _escape(text: str, pos: int) -> tuple[str, int]:
        """The character(s) of the escape at `pos` and its length; length 0: it is not complete yet."""
        if pos + 1 >= len(text):
            return "", 0
        kind = text[pos + 1]
        if kind in _ESCAPES:
            return _ESCAPES[kind], 2
        if kind != "u":
            raise MalformedJson(f"bad escape \\{kind}")
        digits = text[pos + 2:pos + 6]
        if len(digits) < 4 or not _HEX.issuperset(digits):
            if len(digits) < 4 and _HEX.issuperset(digits):
                return "", 0
            raise MalformedJson(f"bad escape \\u{digits}")
        code = int(digits, 16)
        if not 0xD800 <= code <= 0xDBFF:
            return chr(code), 6
        low = text[pos + 6:pos + 12]
        if len(low) < 6 and "\\u".startswith(low[:2]) and _HEX.issuperset(low[2:]):
            return "", 0  # a low surrogate may follow
        if low[:2] == "\\u" and _HEX.issuperset(low[2:]) and 0xDC00 <= int(low[2:], 16) <= 0xDFFF:
            return chr(0x10000 + ((code - 0xD800) << 10) + (int(low[2:], 16) - 0xDC00)), 12
        return chr(code), 6  # a lone high surrogate

    def _string_chars(self, chars: str) -> None:
        self._string.append(chars)
        if self._target is not None:
            self._target.append("".join(map(_canonical_char, chars)) if _NEEDS_ESCAPE.search(chars) else chars)

    def _end_string(self) -> None:
        value = "".join(self._string)
        self._string = None
        self._emit('"')
        if not self._string_is_key:
            if self._capture_name:
                if _SURROGATE.search(value):  # no UTF-8 form: the response could not be written
                    raise MalformedJson("a name with a lone surrogate")
                self.calls[-1].name = value
            self._end_value()
            return
        frame = self._stack[-1]
        frame[1], frame[2] = "colon", value
        if len(self._stack) == self.call_depth + 1:
            call = self.calls[-1]
            if (value == "name" and value in call.keys) or (value in self.arguments_keys and
                                                            call.keys & self.arguments_keys):
                raise MalformedJson(f"{value!r} twice in a call, or its arguments under two names")
            call.keys.add(value)

    # ---- where values go ----------------------------------------------------------------------
    def _begin_value(self, kind: str) -> None:
        """A value of `kind` starts at the cursor: a call, a call's member, or something inside one."""
        depth = len(self._stack)
        if depth == self.call_depth:
            if kind != "object":
                raise MalformedJson(f"a call must be an object, got a {kind}")
            self.calls.append(_Call())
        elif depth < self.call_depth and kind != "array":
            raise MalformedJson(f"expected an array of calls, got a {kind}")
        elif depth == self.call_depth + 1:
            key = self._stack[-1][2]
            self._capture_name = key == "name"
            if self._capture_name and kind != "string":
                raise MalformedJson(f"a call's name must be a string, got a {kind}")
            self._target = self.calls[-1].arguments if key in self.arguments_keys else None

    def _end_value(self) -> None:
        if not self._stack:
            self.done = True
            return
        self._stack[-1][1] = "comma_or_end"
        if len(self._stack) == self.call_depth + 1:
            self._target = None
            self._capture_name = False

    def _emit(self, text: str) -> None:
        if self._target is not None:
            self._target.append(text)


class ArgumentsScanner(CallsScanner):
    """One JSON object that is a call's arguments as a whole (a harmony call's body), re-written
    canonically into `arguments` as it arrives."""

    def __init__(self) -> None:
        super().__init__(-1)  # no depth holds calls: the value itself is the arguments
        self.arguments: list[str] = []

    def _begin_value(self, kind: str) -> None:
        if not self._stack:
            if kind != "object":
                raise MalformedJson(f"a call's arguments must be an object, got a {kind}")
            self._target = self.arguments


class _CallsStreamer:
    """Turns a CallsScanner's calls into deltas: a call opens (id, name, the arguments so far) once
    its name is known, then sends each new arguments fragment."""

    def __init__(self, scanner: CallsScanner, open_call: Callable[[str, str], ToolCallDelta], first_index: int,
                 max_calls: int | None) -> None:
        self.scanner = scanner
        self._open_call = open_call
        self._first_index = first_index
        self._max_calls = max_calls
        self._sent: list[int] = []
        """Arguments fragments sent, per call opened."""

    def deltas(self) -> tuple[ToolCallDelta, ...]:
        out = []
        for number, call in enumerate(self.scanner.calls):
            if self._max_calls is not None and self._first_index + number >= self._max_calls:
                break
            if number == len(self._sent):
                if call.name is None:
                    break
                self._sent.append(len(call.arguments))
                out.append(self._open_call(call.name, "".join(call.arguments)))
            elif len(call.arguments) > self._sent[number]:
                out.append(ToolCallDelta(self._first_index + number, "".join(call.arguments[self._sent[number]:])))
                self._sent[number] = len(call.arguments)
        return tuple(out)


class RequiredCallsParser(OutputParser):
    """tool_choice "required": the output is a JSON array of {"name", "parameters"} calls."""

    content_with_calls = ""

    def __init__(self, new_id: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(new_id)
        self._calls = _CallsStreamer(CallsScanner(1, "parameters"), self._open_call, 0, None)
        self._text = ""

    def feed(self, text: str) -> OutputDelta:
        if self.malformed:
            return OutputDelta(text)
        self._text += text
        try:
            used = self._calls.scanner.feed(text)
            if self._calls.scanner.done and text[used:].strip(_WHITESPACE):
                raise MalformedJson("text after the calls")
        except MalformedJson:
            return self._fail()
        return OutputDelta(tool_calls=self._calls.deltas())

    def finish(self) -> OutputDelta:
        """An array that ended early was cut short (max_tokens, a stop string; its grammar allows nothing
        else): its calls stay as far as they got, as a named call's arguments do, and the finish reason
        says so; the text is not sent again as content."""
        if self.malformed:
            return OutputDelta()
        try:
            self._calls.scanner.finish()
        except MalformedJson:
            pass
        return OutputDelta(tool_calls=self._calls.deltas())

    def _fail(self) -> OutputDelta:
        self.malformed = True
        return OutputDelta(self._text)


# ---- auto: calls in free text ---------------------------------------------------------------

class HermesParser(OutputParser):
    """`<tool_call>{"name": .., "arguments": ..}</tool_call>` blocks in the output. Content is the
    text before the first call and any text between or after calls that is not only whitespace. A
    call whose closing tag never came is still a call if its JSON is complete (as vLLM)."""

    reads_special_tokens = True  # some models mark <tool_call> special (why vLLM's hermes parser keeps them)

    def __init__(self, max_calls: int | None = None, new_id: Callable[[], str] = make_tool_call_id) -> None:
        """`max_calls`: calls sent at most (1 for parallel_tool_calls false; later ones are dropped)."""
        super().__init__(new_id)
        self._max_calls = max_calls
        self._pending = ""
        """Text not handled yet: a possible start of a tag, whitespace after a call."""
        self._call: _CallsStreamer | None = None
        self._call_text = ""
        """The open call's text from its opening tag (content if it turns out malformed)."""
        self._after_json = False
        """The open call's JSON is complete; its closing tag is awaited."""
        self._after_call = False

    def feed(self, text: str) -> OutputDelta:
        if self.malformed:
            return OutputDelta(text)
        self._pending += text
        out = OutputDelta()
        while self._pending and not self.malformed:
            step = self._in_call() if self._call is not None else self._in_content()
            if step is None:
                break
            out += step
        return out

    def finish(self) -> OutputDelta:
        if self.malformed:
            return OutputDelta()
        if self._call is None:
            held, self._pending = self._pending, ""
            if self._after_call and not held.strip(_WHITESPACE):
                held = ""  # whitespace after the last call is not content
            return OutputDelta(held)
        if self._pending.strip(_WHITESPACE) and not HERMES_END.startswith(self._pending.strip(_WHITESPACE)):
            return self._fail()
        try:
            self._call.scanner.finish()
        except MalformedJson:
            return self._fail()
        return OutputDelta(tool_calls=self._call.deltas())

    def _in_content(self) -> OutputDelta | None:
        """Content up to a call's opening tag; None when the rest must wait for more text."""
        start = self._pending.find(HERMES_START)
        if start < 0:
            held = partial_tag_length(self._pending, HERMES_START)
            text, self._pending = self._pending[:len(self._pending) - held], self._pending[len(self._pending) - held:]
            if self._after_call and not text.strip(_WHITESPACE):
                self._pending = text + self._pending  # whitespace after a call waits for something else
                return None
            self._after_call = False
            return OutputDelta(text) if text else None
        text = self._pending[:start]
        keep = not (self._after_call and not text.strip(_WHITESPACE))
        self._pending = self._pending[start + len(HERMES_START):]
        self._call_text = HERMES_START
        self._after_json = False
        self._call = _CallsStreamer(CallsScanner(0, "arguments"), self._open_call, self._calls_sent, self._max_calls)
        return OutputDelta(text if keep else "")

    def _in_call(self) -> OutputDelta | None:
        if not self._after_json:
            text, self._pending = self._pending, ""
            try:
                used = self._call.scanner.feed(text)
            except MalformedJson:
                self._call_text += text
                return self._fail()
            self._call_text += text[:used]
            self._pending = text[used:]
            self._after_json = self._call.scanner.done
            return OutputDelta(tool_calls=self._call.deltas())
        rest = self._pending.lstrip(_WHITESPACE)
        if rest.startswith(HERMES_END):
            self._pending = rest[len(HERMES_END):]
            self._call, self._after_call = None, True
            return OutputDelta()
        if HERMES_END.startswith(rest):
            return None
        self._call_text += self._pending
        self._pending = ""
        return self._fail()

    def _fail(self) -> OutputDelta:
        """Malformed: the broken call's text and everything after it is content from here on."""
        self.malformed = True
        text, self._pending = self._call_text + self._pending, ""
        return OutputDelta(text)


class Llama3JsonParser(OutputParser):
    """Llama 3.1+ JSON tool calls: an output that starts (after whitespace and an optional
    `<|python_tag|>`) with `{` is one or more `{"name": .., "parameters": ..}` objects separated by
    `;`, with no content; any other output is all content. A call's arguments may be named
    "arguments" instead (vLLM reads either; models write either), not both."""

    def __init__(self, max_calls: int | None = None, new_id: Callable[[], str] = make_tool_call_id) -> None:
        super().__init__(new_id)
        self._max_calls = max_calls
        self._text = ""
        self._mode = "undecided"
        """"undecided" (only whitespace or a start of the tag so far), "content" or "calls"."""
        self._call: _CallsStreamer | None = None
        self._between = ""
        """Text after a complete call: whitespace and one ";" may come before the next."""

    def feed(self, text: str) -> OutputDelta:
        self._text += text
        if self._mode == "content" or self.malformed:
            return OutputDelta(text)
        if self._mode == "undecided":
            head = self._text.lstrip(_WHITESPACE)
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip(_WHITESPACE)
            elif PYTHON_TAG.startswith(head):
                return OutputDelta()
            if not head:
                return OutputDelta()
            if not head.startswith("{"):
                self._mode = "content"
                return OutputDelta(self._text)
            self._mode = "calls"
            return self._read(head)
        return self._read(text)

    def finish(self) -> OutputDelta:
        if self._mode == "undecided":
            self._mode = "content"
            return OutputDelta(self._text)
        if self._mode == "content" or self.malformed:
            return OutputDelta()
        if self._between.strip(_WHITESPACE + ";"):
            return self._fail()
        try:
            if self._call is not None and not self._call.scanner.done:
                self._call.scanner.finish()
        except MalformedJson:
            return self._fail()
        return OutputDelta(tool_calls=self._call.deltas() if self._call is not None else ())

    def _read(self, text: str) -> OutputDelta:
        calls: tuple[ToolCallDelta, ...] = ()
        try:
            while text:
                if self._call is None or self._call.scanner.done:
                    text = self._next_call(text)
                    if text is None:
                        break
                used = self._call.scanner.feed(text)
                calls += self._call.deltas()
                text = text[used:] if self._call.scanner.done else ""
        except MalformedJson:
            return self._fail()
        return OutputDelta(tool_calls=calls)

    def _next_call(self, text: str) -> str | None:
        """The text from the next call's `{` (a new call started), or None while only separators came."""
        self._between += text
        rest = self._between.lstrip(_WHITESPACE)
        if self._call is not None:
            if not rest:
                return None
            if not rest.startswith(";"):
                raise MalformedJson("calls must be separated by ';'")
            rest = rest[1:].lstrip(_WHITESPACE)
        if not rest:
            return None
        if not rest.startswith("{"):
            raise MalformedJson("expected a call")
        self._between = ""
        self._call = _CallsStreamer(CallsScanner(0, "parameters", "arguments"), self._open_call, self._calls_sent,
                                    self._max_calls)
        return rest

    def _fail(self) -> OutputDelta:
        self.malformed = True
        return OutputDelta(self._text)


class HarmonyToolParser(OutputParser):
    """GPT-OSS's harmony output (router/harmony.py): a message to `functions.NAME` (either channel) is a
    call of NAME, its body the arguments; the final channel's messages, commentary without a recipient
    (preambles) and text outside messages are content; analysis messages are dropped (the reasoning: the
    openai_gptoss reasoning parser returns them). JSON arguments (no content type, or one naming json)
    are re-written canonically as they stream, and text after the complete value is dropped (the arguments
    stay valid JSON); from where they stop being JSON on, and for any other content type, they are passed
    as written (vLLM's non-streamed path passes such a body whole). A
    call the output cut before its JSON completed is kept as far as it got, with the engine's finish
    reason. Never malformed: the special tokens mark every message."""

    reads_special_tokens = True

    def __init__(self, max_calls: int | None = None, in_header: bool = True,
                 new_id: Callable[[], str] = make_tool_call_id) -> None:
        """`in_header`: the text is the model's output (False: the openai_gptoss reasoning parser's content)."""
        super().__init__(new_id)
        self._max_calls = max_calls
        self._reader = harmony.HarmonyReader(in_header)
        self._body_is = "content"
        """What the open message's body is: "content", "dropped" (analysis, a call past max_calls), "json"
        (a call's arguments, re-written) or "raw" (a call's arguments, as written)."""
        self._arguments = ArgumentsScanner()
        """The open (or last) call's JSON arguments."""
        self._sent = 0
        """Canonical fragments of the open call's arguments sent."""

    def feed(self, text: str) -> OutputDelta:
        return self._deltas(self._reader.feed(text))

    def finish(self) -> OutputDelta:
        return self._deltas(self._reader.finish())

    def _deltas(self, events: list[harmony.Event]) -> OutputDelta:
        out = OutputDelta()
        for event in events:
            out += self._delta(event)
        return out

    def _delta(self, event: harmony.Event) -> OutputDelta:
        if isinstance(event, harmony.Loose):
            return OutputDelta(event.text)
        if isinstance(event, harmony.Opened):
            return self._opened(event.header)
        if isinstance(event, harmony.Body):
            return self._body(event.text)
        return self._closed(event.marker)

    def _opened(self, header: harmony.Header) -> OutputDelta:
        name = header.function
        if name is None:
            self._body_is = "dropped" if header.channel == harmony.ANALYSIS else "content"
            return OutputDelta()
        if self._max_calls is not None and self._calls_sent >= self._max_calls:
            self._body_is = "dropped"
            return OutputDelta()
        self._body_is = "raw" if header.content_type is not None and "json" not in header.content_type else "json"
        self._arguments, self._sent = ArgumentsScanner(), 0
        return OutputDelta(tool_calls=(self._open_call(name, ""),))

    def _body(self, text: str) -> OutputDelta:
        if self._body_is in ("content", "dropped"):
            return OutputDelta(text if self._body_is == "content" else "")
        if self._body_is == "raw":
            return OutputDelta(tool_calls=(ToolCallDelta(self._calls_sent - 1, text),))
        try:
            self._arguments.feed(text)
        except MalformedJson:
            self._body_is = "raw"
            return self._arguments_delta(self._arguments.unread)
        return self._arguments_delta("")

    def _arguments_delta(self, raw: str) -> OutputDelta:
        """The open call's canonical arguments not sent yet, then `raw` text as written."""
        fragments = self._arguments.arguments[self._sent:]
        self._sent = len(self._arguments.arguments)
        text = "".join(fragments) + raw
        return OutputDelta(tool_calls=(ToolCallDelta(self._calls_sent - 1, text),)) if text else OutputDelta()

    def _closed(self, marker: str) -> OutputDelta:
        reading_json, self._body_is = self._body_is == "json" and not self._arguments.done, "content"
        if not reading_json:
            return OutputDelta()
        try:
            self._arguments.finish()  # a trailing number completes the value
        except MalformedJson:
            self.cut_short = not marker  # ended early; a call the model ended itself keeps "tool_calls"
        return self._arguments_delta("")


TOOL_CALL_PARSERS: dict[str, type[HermesParser | Llama3JsonParser | HarmonyToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "openai": HarmonyToolParser,
}
"""--tool-call-parser's choices: each parser class, for tool_choice "auto", is made with the most
calls to send (None: any number)."""


@dataclass(frozen=True)
class ToolOutput:
    """How a request's choices are read: a parser per choice, and the finish reason it leads to."""

    choice: ToolChoice
    new_parser: Callable[[], OutputParser]
    keeps_special_tokens: bool = False
    """The parser reads tags that may be special tokens: the request runs with skip_special_tokens off."""

    @classmethod
    def for_request(cls, calling: ToolCalling, auto_parser: str | None,
                    after_harmony_reasoning: bool = False) -> ToolOutput | None:
        """None for tool_choice "none"; `auto_parser` is the server's --tool-call-parser (None: auto
        tool choice is off), which "auto" needs (InvalidRequestError otherwise, vLLM's message).
        `after_harmony_reasoning`: the parser reads the openai_gptoss reasoning parser's content."""
        if calling.choice == ToolChoice.NAMED:
            return cls(calling.choice, functools.partial(NamedCallParser, calling.function_name))
        if calling.choice == ToolChoice.REQUIRED:
            return cls(calling.choice, RequiredCallsParser)
        if calling.choice == ToolChoice.AUTO:
            if auto_parser is None:
                raise InvalidRequestError("tool_choice", AUTO_TOOL_CHOICE_OFF)
            max_calls = None if calling.parallel_tool_calls else 1
            parser = TOOL_CALL_PARSERS[auto_parser]
            if parser is HarmonyToolParser:
                return cls(calling.choice, functools.partial(HarmonyToolParser, max_calls, not after_harmony_reasoning),
                           True)
            return cls(calling.choice, functools.partial(parser, max_calls), parser.reads_special_tokens)
        return None

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling as this output's parser needs it."""
        return dataclasses.replace(params, skip_special_tokens=False) if self.keeps_special_tokens else params

    def finish_reason(self, engine_reason: str | None, parser: OutputParser) -> str | None:
        """vLLM's: "tool_calls" when "auto" made calls, or "required" made them and stopped on its
        own; a named call keeps the engine's reason (OpenAI's "stop")."""
        if engine_reason is None or parser.malformed or parser.cut_short or not parser.called:
            return engine_reason
        if self.choice == ToolChoice.AUTO or (self.choice == ToolChoice.REQUIRED and engine_reason == "stop"):
            return "tool_calls"
        return engine_reason
