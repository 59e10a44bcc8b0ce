"""Incremental detokenization with exact stop-string cutting.

Tokens are decoded over a short sliding window (the vLLM prefix/read offset scheme) so
multi-byte characters split across tokens and tokenizers that drop a leading space at
the start of a decode both come out right. Text that could still become a stop string is
held back from the stream until it is known not to be one. Torch-free: the router and the
engine both use it.
"""

from __future__ import annotations

from typing import Protocol


class Decoder(Protocol):
    """What detokenization needs of a tokenizer (a `tokenizers.Tokenizer` is one)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

_PROMPT_CONTEXT_TOKENS = 5
"""Prompt tokens decoded together with the first output tokens (for leading-space rules)."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_token_ids: list[int], stop: tuple[str, ...],
                 skip_special_tokens: bool, include_stop: bool = False) -> None:
        """`include_stop` (include_stop_str_in_output): the text is cut after the stop string it ends
        with instead of before it, and nothing is held back (streamed text never needs taking back)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = stop
        self._include_stop = include_stop
        self._hold_back = 0 if include_stop else max((len(s) for s in stop), default=1) - 1
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""
        self._num_emitted = 0

    def append(self, token_id: int, find_stop: bool = True) -> str | None:
        """Add a token; returns the stop string it completed, if any (text is cut before it, or after
        it with include_stop).
        With find_stop False (min_tokens not reached yet), stop strings are not looked for; one
        that straddles the point where they start to count is still found by the next token."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None
        start = len(self.output_text)
        self.output_text += new_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._find_stop(start) if find_stop else None

    def _find_stop(self, new_text_start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.output_text.find(stop, max(0, new_text_start - len(stop) + 1))
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[: index + len(stop) if self._include_stop else index]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed; while unfinished, keeps back a possible stop-string prefix."""
        end = len(self.output_text) if finished else max(self._num_emitted,
                                                          len(self.output_text) - self._hold_back)
        delta = self.output_text[self._num_emitted : end]
        self._num_emitted = end
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)
