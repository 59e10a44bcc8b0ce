"""GPT-OSS's "harmony" output format, read as it streams: the messages of an output and their headers.

An output is messages. Each is a header, `<|message|>`, a body, and an end marker: `<|end|>` (more
follows), `<|call|>` (a tool call: the turn stops) or `<|return|>` (the turn's last message); the
output may also just end (the engine drops the stop token's text, and max_tokens cuts anywhere).
A header is `<|start|>ROLE`, optionally ` to=RECIPIENT`, then `<|channel|>CHANNEL`, optionally
` to=RECIPIENT` there instead, and a content type (`json`, or `<|constrain|>json`). The output's
first message has no `<|start|>ROLE` of its own: the prompt ends with `<|start|>assistant`.

    <|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Hi.
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}

Text outside a message (after an end marker, before the next `<|start|>`) is "loose" text. A
header the output cut off before its `<|message|>` says nothing. A `<|start|>` inside a body ends
that message (the model left out its end marker) and opens the next.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.router.partial_tags import partial_tag_length

START = "<|start|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"
BODY_ENDS = (END, CALL, RETURN, START)
"""What ends a message's body (START: a next message the model opened without ending this one)."""
FUNCTIONS = "functions."
"""The recipient prefix of a call of a function the request's tools declare."""
ANALYSIS = "analysis"


@dataclass(frozen=True)
class Header:
    """A message's header as written (`text`, from `<|start|>` or the output's start through `<|message|>`)
    and what it says."""

    text: str
    channel: str | None
    recipient: str | None
    content_type: str | None

    @classmethod
    def parse(cls, text: str) -> Header:
        inner = text.removeprefix(START).removesuffix(MESSAGE)
        role_part, _, channel_part = inner.partition(CHANNEL)
        words = role_part.split() + channel_part.replace(CONSTRAIN, " ").split()
        recipient = next((word[3:] for word in words if word.startswith("to=")), None)
        channel_words = [word for word in channel_part.replace(CONSTRAIN, " ").split() if not word.startswith("to=")]
        channel = channel_words[0] if channel_words else None
        return cls(text, channel, recipient, " ".join(channel_words[1:]) or None)

    @property
    def function(self) -> str | None:
        """The function this message calls (its recipient is `functions.NAME`), None if it calls none."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS):] or None


@dataclass(frozen=True)
class Opened:
    """A message's header is complete; its body follows."""

    header: Header


@dataclass(frozen=True)
class Body:
    """A piece of the open message's body."""

    text: str


@dataclass(frozen=True)
class Closed:
    """The open message ended: `marker` is its end marker, "" when the output ended (or a `<|start|>`)
    before one came."""

    marker: str


@dataclass(frozen=True)
class Loose:
    """Text outside any message."""

    text: str


Event = Opened | Body | Closed | Loose


class HarmonyReader:
    """One output's messages, fed in pieces; `finish()` once after the last. A piece that may be the
    start of a marker is held until the next says."""

    def __init__(self, in_header: bool) -> None:
        """`in_header`: the text starts inside a header (a model's output: the prompt wrote `<|start|>assistant`);
        False: it starts outside any message (the openai_gptoss reasoning parser's content)."""
        self._state = "header" if in_header else "between"
        self._pending = ""
        self._header_searched = 0
        """In a header: how much of the held text holds no `<|message|>` start (a runaway header is read once)."""

    def feed(self, text: str) -> list[Event]:
        # Appended through a local that holds the only reference, so CPython grows the string in place: a
        # runaway header (held whole until its <|message|>) costs linear time, not quadratic.
        pending, self._pending = self._pending, ""
        pending += text
        self._pending = pending
        events: list[Event] = []
        while self._pending:
            step = self._step()
            if step is None:
                break
            events += step
        return events

    def finish(self) -> list[Event]:
        held, self._pending = self._pending, ""
        if self._state == "body":
            return [Body(held), Closed("")] if held else [Closed("")]
        return [Loose(held)] if self._state == "between" and held else []

    def _step(self) -> list[Event] | None:
        """Read on in the current state; None when the rest must wait for more text."""
        if self._state == "header":
            end = self._pending.find(MESSAGE, self._header_searched)
            if end < 0:
                self._header_searched = max(0, len(self._pending) - len(MESSAGE) + 1)
                return None
            header, self._pending = self._pending[:end + len(MESSAGE)], self._pending[end + len(MESSAGE):]
            self._state, self._header_searched = "body", 0
            return [Opened(Header.parse(header))]
        markers = BODY_ENDS if self._state == "body" else (START,)
        found = [(at, marker) for marker in markers if (at := self._pending.find(marker)) >= 0]
        if not found:
            held = max(partial_tag_length(self._pending, marker) for marker in markers)
            text, self._pending = self._pending[:len(self._pending) - held], self._pending[len(self._pending) - held:]
            return [self._text_event(text)] if text else None
        at, marker = min(found)
        text = self._pending[:at]
        events: list[Event] = [self._text_event(text)] if text else []
        if self._state == "body":
            events.append(Closed("" if marker == START else marker))
        if marker == START:
            self._pending, self._state = self._pending[at:], "header"  # the header keeps its <|start|>
        else:
            self._pending, self._state = self._pending[at + len(marker):], "between"
        return events

    def _text_event(self, text: str) -> Body | Loose:
        return Body(text) if self._state == "body" else Loose(text)
