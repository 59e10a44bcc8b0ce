"""The allowed-token bitmask of a step's constrained rows, applied to the logits by the sampler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = 32
"""Tokens per bitmask word: token t is allowed iff bit t % 32 of word t // 32 is set (llguidance's layout)."""


def num_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


@dataclass(frozen=True)
class TokenBitmask:
    """Which tokens each constrained row of a sampling batch may take; unconstrained rows are absent."""

    rows: tuple[int, ...]
    """Indices (ascending) of the constrained rows in the batch's logits."""
    words: torch.Tensor
    """[len(rows), num_words(vocab)] int32, row i the mask of logits row rows[i]."""

    def applied_to(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, vocab] float32 with each constrained row's disallowed tokens at -inf (a new
        tensor; logits itself is not modified)."""
        vocab_size = logits.shape[1]
        shifts = torch.arange(BITS, dtype=torch.int32, device=logits.device)  # [32]
        words = self.words.to(logits.device)  # [m, W]
        disallowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(self.rows), -1)[:, :vocab_size] == 0  # [m, vocab]
        if len(self.rows) == logits.shape[0]:  # every row constrained (rows ascending): one pass, no gather
            return logits.masked_fill(disallowed, float("-inf"))
        masked = logits.clone()
        rows = list(self.rows)
        masked[rows] = logits[rows].masked_fill(disallowed, float("-inf"))
        return masked
