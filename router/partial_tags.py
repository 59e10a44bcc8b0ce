"""What a streaming output parser holds back: the end of the text so far that may be the start of a tag
(`<think>`, `<tool_call>`, a harmony marker) whose rest comes in the next piece."""

from __future__ import annotations


def partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a start of `tag` (shorter than the tag itself: a whole
    tag is no longer partial)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
