"""N-gram prompt lookup: the tokens that followed the latest earlier occurrence of the context's
suffix (vLLM's `ngram` method). Stateless and cheap: code and chat answers repeat their prompt."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from splitserve.engine.spec_decode.proposer import DraftSlot


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        """Suffixes of ngram_max tokens down to ngram_min are looked up, the longest first."""
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, slots: Sequence[DraftSlot]) -> list[tuple[int, ...]]:
        return [self.lookup(slot.token_ids, slot.num_tokens) for slot in slots]

    def lookup(self, token_ids: list[int], num_tokens: int) -> tuple[int, ...]:
        """Up to num_tokens tokens after the latest earlier match of the longest suffix that has one."""
        tokens = np.asarray(token_ids, dtype=np.int64)  # [L]
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            # windows[i] = tokens[i : i + n] for every i whose window ends before the last token,
            # so a match is always followed by at least one token.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [L - n, n]
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return tuple(tokens[start:start + num_tokens].tolist())
        return ()

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""
