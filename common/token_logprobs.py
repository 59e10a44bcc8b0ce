"""Logprobs of one sampled token: plain data shared by the engine, the workers and the router."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprob of one sampled token plus the top alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int
    """1-based rank of the sampled token in the distribution."""
    top: tuple[tuple[int, float], ...]
    """(token_id, logprob) of the most likely tokens, best first."""
