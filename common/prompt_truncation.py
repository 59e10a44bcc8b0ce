"""How long a prompt may be, and vLLM's truncate_prompt_tokens and truncation_side: one rule for every API that
checks or cuts a prompt (the router's HTTP and gRPC requests, the engine, the offline LLM's
SamplingParams.truncate_prompt_tokens)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.errors import ContextLengthExceededError, InvalidRequestError


def longest_prompt(max_model_len: int, pools: bool = False) -> int:
    """The most tokens a prompt may have: max_model_len - 1 for a request that generates (room for one output
    token), max_model_len for a pooling request (`pools`: nothing is generated after it)."""
    return max_model_len if pools else max_model_len - 1


def check_prompt_length(num_tokens: int, max_model_len: int, field: str, pools: bool = False) -> None:
    """ContextLengthExceededError naming `field` when a prompt of `num_tokens` tokens is longer than
    longest_prompt()."""
    longest = longest_prompt(max_model_len, pools)
    if num_tokens > longest:
        room = "" if pools else ", and at least one output token must fit"
        raise ContextLengthExceededError(field, f"has {num_tokens} tokens{room}", max_model_len, num_tokens, longest)


@dataclass(frozen=True)
class PromptTruncation:
    """A tokenized prompt (a chat's as rendered) cut to `keep` tokens before it is checked against the context."""

    keep: int
    """Tokens kept, in [0, max_model_len]."""
    keep_last: bool
    """truncation_side "left" (vLLM's default for generation): cut the start, keep the last tokens."""

    def applied(self, token_ids: tuple[int, ...]) -> tuple[int, ...]:
        if len(token_ids) <= self.keep:
            return token_ids
        return token_ids[len(token_ids) - self.keep:] if self.keep_last else token_ids[:self.keep]


def prompt_truncation(num_tokens: int | None, side: str | None, max_model_len: int, *,
                      pools: bool = False) -> PromptTruncation | None:
    """truncate_prompt_tokens and truncation_side (None: unset) by vLLM's rules: an integer >= -1
    (-1: the most a prompt can have, so the cut prompt is served rather than refused: max_model_len - 1 for
    generation, max_model_len for a pooling request (`pools`), which generates nothing after it, as vLLM's -1),
    at most max_model_len (vLLM's message); side "left" (default: keep the last tokens) or "right"."""
    if side not in (None, "left", "right"):
        raise InvalidRequestError("truncation_side", f"must be 'left' or 'right', got {side!r}")
    if num_tokens is None:
        return None
    if num_tokens < -1:
        raise InvalidRequestError("truncate_prompt_tokens", f"must be an integer >= -1, got {num_tokens}")
    if num_tokens > max_model_len:
        raise InvalidRequestError("truncate_prompt_tokens", f"truncate_prompt_tokens={num_tokens} cannot be "
                                                            f"greater than max_model_len = {max_model_len}. "
                                                            "Please request a smaller truncation size.")
    keep = longest_prompt(max_model_len, pools) if num_tokens == -1 else num_tokens
    return PromptTruncation(keep, keep_last=side != "right")
