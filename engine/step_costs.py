"""Recent step durations of one engine, as exponential moving averages (for load reports)."""

from __future__ import annotations

EMA_ALPHA = 0.2
"""Weight of the newest sample."""
MIN_PREFILL_TOKENS = 32
"""A step must compute at least this many prompt tokens to sample the per-token prefill cost
(smaller ones are dominated by fixed per-step overhead)."""


def _ema(average: float | None, sample: float) -> float:
    return sample if average is None else average + EMA_ALPHA * (sample - average)


class StepCosts:
    """prefill_s_per_token: average of seconds / batched tokens over steps with at least
    MIN_PREFILL_TOKENS prompt tokens; decode_step_s: average duration of decode-only steps.
    Both are None until such a step ran; mixed steps with fewer prompt tokens are not sampled."""

    def __init__(self) -> None:
        self.prefill_s_per_token: float | None = None
        self.decode_step_s: float | None = None

    def record(self, num_prefill_tokens: int, num_batched_tokens: int, seconds: float) -> None:
        """One step that computed `num_batched_tokens` tokens, `num_prefill_tokens` of them prompt tokens."""
        if num_prefill_tokens >= MIN_PREFILL_TOKENS:
            self.prefill_s_per_token = _ema(self.prefill_s_per_token, seconds / num_batched_tokens)
        elif num_prefill_tokens == 0 and num_batched_tokens > 0:
            self.decode_step_s = _ema(self.decode_step_s, seconds)
