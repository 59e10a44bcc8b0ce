"""Logprobs of one sampled token: plain data shared by the engine, the workers and the router."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """vLLM's Logprob: one token's entry of a position's {token_id: Logprob} (TokenLogprobs read as a mapping)."""

    logprob: float
    rank: int
    """1-based rank of the token in the distribution."""
    decoded_token: str | None = None
    """Not filled here (None): the text of a token is tokenizer.decode([token_id])."""


@dataclass(frozen=True)
class TokenLogprobs(Mapping[int, Logprob]):
    """Logprob of one sampled token plus the top alternatives (raw model distribution).

    Read as a mapping it is vLLM's {token_id: Logprob} of one position (what a vLLM script indexes
    `CompletionOutput.logprobs[i]` and `RequestOutput.prompt_logprobs[i]` with): the sampled token
    first, then the top alternatives best first (ranks 1, 2, ...), each token once."""

    token_id: int
    logprob: float
    rank: int
    """1-based rank of the sampled token in the distribution."""
    top: tuple[tuple[int, float], ...]
    """(token_id, logprob) of the most likely tokens, best first."""

    def _entries(self) -> dict[int, Logprob]:
        entries = {self.token_id: Logprob(self.logprob, self.rank)}
        for rank, (token_id, logprob) in enumerate(self.top, start=1):
            entries.setdefault(token_id, Logprob(logprob, rank))
        return entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries()[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())
