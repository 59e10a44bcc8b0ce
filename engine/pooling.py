"""One pooling request's running pool over its prompt chunks (a prompt longer than the token budget is pooled
across steps), and the embedding (or a classifier's logits) it finishes with."""

from __future__ import annotations

import torch

from splitserve.common.pooling import ResolvedPooling


class SequencePool:
    """Invariant: after add() of the chunks covering positions [0, p), `_state` pools exactly those positions
    that matter for the pooling type (LAST: none kept until the final chunk; MEAN: the float32 sum of rows
    0..p-1; CLS: row 0). A chunk starting at position 0 restarts the pool: a preempted request recomputes its
    prompt from the start (MEAN and CLS never start after cached blocks, so their first chunk is position 0)."""

    def __init__(self, pooling: ResolvedPooling, classifier: torch.Tensor | None = None) -> None:
        """classifier [num_labels, hidden] float32: a sequence-classification model's score head (the pooled vector
        becomes its logits); None for an embedding model."""
        self.pooling = pooling
        self.classifier = classifier
        self._state: torch.Tensor | None = None  # [hidden] float32

    def add(self, start_position: int, hidden: torch.Tensor) -> None:
        """hidden [n, hidden]: the final hidden states of positions start_position .. start_position + n - 1."""
        kind = self.pooling.pooling_type
        if kind == "LAST":
            self._state = hidden[-1].float()
        elif kind == "MEAN":
            chunk_sum = hidden.float().sum(dim=0)
            self._state = chunk_sum if start_position == 0 else self._state + chunk_sum
        elif start_position == 0:  # CLS
            self._state = hidden[0].float()

    def embedding(self, num_tokens: int) -> tuple[float, ...]:
        """The pooled vector of a prompt of `num_tokens` tokens, cut to `dimensions` and then L2-normalized (vLLM's
        order: a Matryoshka prefix is normalized on its own); a classifier's: its logits [num_labels] in float32
        (vLLM's head dtype), no activation (the API applies it)."""
        vector = self._state / num_tokens if self.pooling.pooling_type == "MEAN" else self._state
        if self.classifier is not None:
            return tuple((self.classifier @ vector).cpu().tolist())
        if self.pooling.dimensions is not None:
            vector = vector[:self.pooling.dimensions]
        if self.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, p=2, dim=0)
        return tuple(vector.cpu().tolist())
