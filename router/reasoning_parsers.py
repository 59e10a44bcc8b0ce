"""Reasoning at the OpenAI front: a choice's output split into its reasoning (a `<think>...</think>`
block the model writes before answering) and its content, as it streams (text in, typed deltas out)
and whole, as vLLM's `--reasoning-parser` does.

Every parser is a ReasoningParser fed the choice's text and token ids as they are generated;
`parse_reasoning` runs the same parser over a whole output, so a stream's deltas put together equal
the non-streamed message by construction. The split is made on the text (a tag split across deltas,
or a delta holding text on both sides of a tag, splits where the tag is); reasoning tokens are
counted on the token ids (the tags' own tokens, which the server requires the tokenizer to have, as
vLLM does at startup).

Where the output starts (vLLM 0.32's rules, applied alike to streamed and non-streamed output;
vLLM's non-streamed deepseek_r1 path ignores the prompt):
- deepseek_r1: in reasoning unless the prompt's last tag is `</think>` (a template that closed
  the block itself, e.g. for enable_thinking false); the output's `<think>` is optional (DeepSeek-R1's
  template puts it in the prompt).
- qwen3: in reasoning unless chat_template_kwargs.enable_thinking is false, or the prompt's last
  tag in the final turn (after its last `<|im_start|>` / `<|im_end|>`) is `</think>`.
In reasoning, every `<think>` is dropped and the first `</think>` ends the reasoning; an output that
never writes it (cut by max_tokens, say) is all reasoning and has no content. After the reasoning,
the text is content as written (as vLLM streams it; its non-streamed qwen3 path alone drops a
repeated `</think>`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.structured_output import StructuredOutput
from splitserve.router import harmony
from splitserve.router.partial_tags import partial_tag_length

THINK_START = "<think>"
THINK_END = "</think>"
QWEN3_TURN_BOUNDARIES = ("<|im_start|>", "<|im_end|>")


@dataclass(frozen=True)
class ThinkTags:
    """The tags around reasoning and their token ids in the served model's tokenizer."""

    start: str
    end: str
    start_id: int
    end_id: int
    turn_boundary_ids: frozenset[int] = frozenset()
    """Tokens that open or close a chat turn (qwen3 reads the prompt's last turn only)."""


@dataclass(frozen=True)
class ReasoningDelta:
    """What a piece of output adds to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: ReasoningDelta) -> ReasoningDelta:
        return ReasoningDelta(self.reasoning + other.reasoning, self.content + other.content)


@dataclass(frozen=True)
class ParsedReasoning:
    """A whole output: its reasoning and content (None when empty, as vLLM returns them)."""

    reasoning: str | None
    content: str | None


class ReasoningParser(ABC):
    """One choice's output, fed in pieces; `finish()` once after the last."""

    applies_structured_output = True
    """A structured output constraint can start where the reasoning ends (at its end tag's token)."""

    def __init__(self, tags: ThinkTags, in_reasoning: bool) -> None:
        self.tags = tags
        self.in_reasoning = in_reasoning
        """The text read so far ends inside the reasoning."""
        self.reasoning_tokens = 0
        """Output tokens before the end tag's token, start tags excluded (0 when the prompt ended
        the reasoning)."""
        self._counting = in_reasoning
        self._pending = ""
        """Text held back: a possible start of a tag."""

    @classmethod
    @abstractmethod
    def starts_in_reasoning(cls, tags: ThinkTags, prompt_token_ids: Sequence[int],
                            template_kwargs: Mapping[str, Any]) -> bool:
        """Whether the output starts inside the reasoning, given the rendered prompt."""

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ReasoningDelta:
        """The delta of the next piece of output (a possible start of a tag is held until more comes)."""
        self._count(token_ids)
        self._pending += text
        out = ReasoningDelta()
        while self._pending and self.in_reasoning:
            step = self._reasoning_step()
            if step is None:
                break
            out += step
        if not self.in_reasoning:
            out += ReasoningDelta(content=self._pending)
            self._pending = ""
        return out

    def finish(self) -> ReasoningDelta:
        """What is held once the output ended: a tag's start that never completed is text."""
        held, self._pending = self._pending, ""
        return ReasoningDelta(reasoning=held) if self.in_reasoning else ReasoningDelta(content=held)

    def feed_piece(self, text: str, token_ids: Sequence[int], last: bool) -> ReasoningDelta:
        """feed(text, token_ids), then finish() when it is the output's last piece."""
        delta = self.feed(text, token_ids)
        return delta + self.finish() if last else delta

    def _count(self, token_ids: Sequence[int]) -> None:
        for token_id in token_ids:
            if not self._counting:
                return
            if token_id == self.tags.end_id:
                self._counting = False
            elif token_id != self.tags.start_id:
                self.reasoning_tokens += 1

    def _reasoning_step(self) -> ReasoningDelta | None:
        """Reasoning up to the next tag (a start tag is dropped, an end tag ends the reasoning);
        None when the rest must wait for more text."""
        start, end = self._pending.find(self.tags.start), self._pending.find(self.tags.end)
        if start < 0 and end < 0:
            held = max(partial_tag_length(self._pending, tag) for tag in (self.tags.start, self.tags.end))
            text, self._pending = self._pending[:len(self._pending) - held], self._pending[len(self._pending) - held:]
            return ReasoningDelta(reasoning=text) if text else None
        if end < 0 or 0 <= start < end:
            text, self._pending = self._pending[:start], self._pending[start + len(self.tags.start):]
            return ReasoningDelta(reasoning=text)
        text, self._pending = self._pending[:end], self._pending[end + len(self.tags.end):]
        self.in_reasoning = False
        return ReasoningDelta(reasoning=text)


def _last_tag(tags: ThinkTags, token_ids: Sequence[int], stop_at: frozenset[int]) -> int | None:
    """The last start or end tag id of `token_ids` after the last of `stop_at`; None if there is none."""
    for token_id in reversed(token_ids):
        if token_id in (tags.start_id, tags.end_id):
            return token_id
        if token_id in stop_at:
            return None
    return None


class DeepSeekR1Parser(ReasoningParser):
    """DeepSeek-R1: `<think>` (optional: the template may have written it) reasoning `</think>` content."""

    @classmethod
    def starts_in_reasoning(cls, tags: ThinkTags, prompt_token_ids: Sequence[int],
                            template_kwargs: Mapping[str, Any]) -> bool:
        return _last_tag(tags, prompt_token_ids, frozenset()) != tags.end_id


class Qwen3Parser(ReasoningParser):
    """Qwen3: thinking unless enable_thinking is false or the prompt's last turn closed the block."""

    @classmethod
    def starts_in_reasoning(cls, tags: ThinkTags, prompt_token_ids: Sequence[int],
                            template_kwargs: Mapping[str, Any]) -> bool:
        if template_kwargs.get("enable_thinking", True) is False:
            return False
        return _last_tag(tags, prompt_token_ids, tags.turn_boundary_ids) != tags.end_id


@dataclass(frozen=True)
class HarmonyTokens:
    """The harmony tokens the openai_gptoss parser counts reasoning tokens by, in the served model's tokenizer."""

    channel_id: int
    message_id: int
    analysis_id: int
    """The token of the word `analysis` (the reasoning channel's name, one token in GPT-OSS's o200k_harmony)."""
    start_id: int
    body_end_ids: frozenset[int]
    """`<|end|>`, `<|call|>`, `<|return|>` and `<|start|>`."""


class HarmonyParser(ReasoningParser):
    """GPT-OSS (harmony, router/harmony.py): the analysis channel's messages are the reasoning (joined
    with newlines, as vLLM joins them); the final channel's and commentary's without a function recipient
    (preambles) are content; a call (a message to `functions.NAME`) stays in the content as harmony,
    `<|start|>assistant` + its header + body + its end marker (`<|call|>` where the model opened the next
    message without one; none where the output ended), for the `openai` tool call parser to read. Reasoning
    tokens: the analysis messages' body tokens, read off the token ids (see _count)."""

    applies_structured_output = False

    def __init__(self, tags: HarmonyTokens, in_reasoning: bool) -> None:  # type: ignore[override]
        self.tags = tags
        self.in_reasoning = in_reasoning
        self.reasoning_tokens = 0
        self._reader = harmony.HarmonyReader(in_header=True)
        self._open: harmony.Header | None = None
        self._reasoning_messages = 0
        self._ended = False
        """finish() was called: a call the output cut is passed on as cut (no end marker)."""
        self._token_state = "header"
        """Where the token ids read so far end: header, channel (after the header's first <|channel|>),
        analysis_header, other_header, analysis_body, body or between (messages)."""

    @classmethod
    def starts_in_reasoning(cls, tags: HarmonyTokens, prompt_token_ids: Sequence[int],  # type: ignore[override]
                            template_kwargs: Mapping[str, Any]) -> bool:
        return False  # where the output is, its channel says; nothing carries over from the prompt

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ReasoningDelta:
        self._count(token_ids)
        return self._deltas(self._reader.feed(text))

    def finish(self) -> ReasoningDelta:
        self._ended = True
        return self._deltas(self._reader.finish())

    def _deltas(self, events: list[harmony.Event]) -> ReasoningDelta:
        out = ReasoningDelta()
        for event in events:
            out += self._delta(event)
        return out

    def _delta(self, event: harmony.Event) -> ReasoningDelta:
        if isinstance(event, harmony.Loose):
            return ReasoningDelta(content=event.text)
        if isinstance(event, harmony.Opened):
            self._open = event.header
            self.in_reasoning = self._is_reasoning(event.header)
            if self.in_reasoning:
                self._reasoning_messages += 1
                return ReasoningDelta(reasoning="\n" if self._reasoning_messages > 1 else "")
            if event.header.function is not None:
                start = "" if event.header.text.startswith(harmony.START) else harmony.START + "assistant"
                return ReasoningDelta(content=start + event.header.text)
            return ReasoningDelta()
        if isinstance(event, harmony.Body):
            return ReasoningDelta(reasoning=event.text) if self.in_reasoning else ReasoningDelta(content=event.text)
        header, self._open, self.in_reasoning = self._open, None, False
        if header is not None and header.function is not None and not (self._ended and not event.marker):
            return ReasoningDelta(content=event.marker or harmony.CALL)
        return ReasoningDelta()

    @staticmethod
    def _is_reasoning(header: harmony.Header) -> bool:
        return header.channel == harmony.ANALYSIS and header.function is None

    def _count(self, token_ids: Sequence[int]) -> None:
        """The reader's states over token ids: a header (the output starts in one; `<|start|>` opens one)
        is the analysis channel's when the `analysis` token follows its first `<|channel|>`; its body
        runs from `<|message|>` to an end marker or `<|start|>`."""
        tags = self.tags
        for token_id in token_ids:
            state = self._token_state
            if state in ("body", "analysis_body"):
                if token_id in tags.body_end_ids:
                    self._token_state = "header" if token_id == tags.start_id else "between"
                elif state == "analysis_body":
                    self.reasoning_tokens += 1
            elif token_id == tags.start_id:
                self._token_state = "header"
            elif state == "between":
                continue
            elif token_id == tags.message_id:
                self._token_state = "analysis_body" if state == "analysis_header" else "body"
            elif state == "header" and token_id == tags.channel_id:
                self._token_state = "channel"
            elif state == "channel":
                self._token_state = "analysis_header" if token_id == tags.analysis_id else "other_header"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1Parser,
    "qwen3": Qwen3Parser,
    "openai_gptoss": HarmonyParser,
}
"""--reasoning-parser's choices."""
KEEPS_SPECIAL_TOKENS = frozenset({"qwen3", "openai_gptoss"})
"""Parsers that read the output with special tokens kept (vLLM's engine-based parsers turn
skip_special_tokens off; its deepseek_r1 parser leaves it as the request says)."""


HARMONY_TOKENS = ("<|channel|>", "<|message|>", "analysis", "<|end|>", "<|call|>", "<|return|>", "<|start|>")
"""The tokens the openai_gptoss parser needs the tokenizer to have (GPT-OSS's o200k_harmony has them all)."""


@dataclass(frozen=True)
class ReasoningFormat:
    """The server's reasoning parser over its model's tokenizer."""

    name: str
    tags: ThinkTags | HarmonyTokens

    @classmethod
    def for_tokenizer(cls, name: str, token_id: Callable[[str], int | None]) -> ReasoningFormat:
        """`token_id`: a token's id by its text, None if the tokenizer has no such token (the
        `tokenizers` Tokenizer's token_to_id). ValueError naming the missing tag otherwise (vLLM
        refuses to start then too)."""
        if name not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
        needed = HARMONY_TOKENS if name == "openai_gptoss" else (THINK_START, THINK_END)
        ids = {tag: token_id(tag) for tag in needed}
        missing = [tag for tag, token in ids.items() if token is None]
        if missing:
            raise ValueError(f"--reasoning-parser {name} needs the tokenizer to have the token {missing[0]}")
        if name == "openai_gptoss":
            channel, message, analysis, *body_ends = ids.values()
            return cls(name, HarmonyTokens(channel, message, analysis, ids["<|start|>"], frozenset(body_ends)))
        boundaries = frozenset(i for tag in QWEN3_TURN_BOUNDARIES if (i := token_id(tag)) is not None) \
            if name == "qwen3" else frozenset()
        return cls(name, ThinkTags(THINK_START, THINK_END, ids[THINK_START], ids[THINK_END], boundaries))

    def for_request(self, prompt_token_ids: Sequence[int], template_kwargs: Mapping[str, Any],
                    include_reasoning: bool) -> ReasoningOutput:
        parser = REASONING_PARSERS[self.name]
        return ReasoningOutput(self.tags, parser, parser.starts_in_reasoning(self.tags, prompt_token_ids,
                                                                             template_kwargs),
                               include_reasoning, self.name in KEEPS_SPECIAL_TOKENS)

    @property
    def writes_harmony_calls(self) -> bool:
        """Its content keeps the output's calls in harmony (openai_gptoss), for the `openai` tool call parser."""
        return self.name == "openai_gptoss"


@dataclass(frozen=True)
class ReasoningOutput:
    """How one request's choices are split into reasoning and content."""

    tags: ThinkTags | HarmonyTokens
    parser: type[ReasoningParser]
    starts_in_reasoning: bool
    include_reasoning: bool
    """False: the reasoning is dropped from the response (vLLM's include_reasoning)."""
    keeps_special_tokens: bool = False

    def new_parser(self) -> ReasoningParser:
        return self.parser(self.tags, self.starts_in_reasoning)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling as the parser needs it: special tokens kept for a parser that reads
        them, and a structured output constraint that starts after the reasoning (vLLM's: the grammar
        applies from the end tag on; from the first token when the reasoning is not returned, or
        the prompt ended it). A harmony output's final message starts after several tokens, where no
        constraint can start: InvalidRequestError."""
        if self.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        constraint = params.structured_output
        if constraint is not None and not self.parser.applies_structured_output:
            raise InvalidRequestError("response_format", "structured output (response_format, structured_outputs, "
                                      "a named or \"required\" tool_choice) is not supported with this server's "
                                      "--reasoning-parser openai_gptoss")
        if constraint is None or not self.starts_in_reasoning or not self.include_reasoning:
            return params
        return dataclasses.replace(params, structured_output=constraint.after_token(self.tags.end_id))


def parse_reasoning(parser: ReasoningParser, text: str, token_ids: Sequence[int] = ()) -> ParsedReasoning:
    """A whole output through `parser` (fresh)."""
    delta = parser.feed_piece(text, token_ids, last=True)
    return ParsedReasoning(delta.reasoning or None, delta.content or None)
