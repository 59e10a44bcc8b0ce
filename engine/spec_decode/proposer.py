"""The proposer interface: what every way of guessing draft tokens implements."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class DraftSlot:
    """One decoding request that may speculate this step."""

    request_id: str
    token_ids: list[int]
    """The request's prompt and output so far (its own list: read only)."""
    num_tokens: int
    """Most draft tokens to propose (>= 1); a proposer may return fewer, or none."""


class Proposer(Protocol):
    """Proposes draft tokens, deterministically: a draft is a point mass, so the verification needs
    only the target's probabilities (a draft d is accepted when the token drawn from p equals it: with
    probability p(d), else the draw is from p with d removed). A proposer that samples its drafts (an
    EAGLE head on the target's hidden states, a sampled draft model) would add its draft probabilities
    to what it returns and to the verification; the slots and the engine's calls stay as they are."""

    def propose(self, slots: Sequence[DraftSlot]) -> list[tuple[int, ...]]:
        """Draft tokens for each slot, in slot order (at most slot.num_tokens each)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished: release whatever the proposer keeps for it (idempotent)."""
        ...
