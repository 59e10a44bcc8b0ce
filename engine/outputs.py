"""What the engine hands back: per-step deltas and whole-request results."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.token_logprobs import TokenLogprobs


@dataclass(frozen=True)
class CompletionDelta:
    """What one request gained in one step; the last delta of a request has finish_reason set."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprobs, ...]
    text_delta: str
    finish_reason: str | None
    """None while running; 'stop', 'length' or 'abort' on the final delta."""
    stop_reason: int | str | None
    """The stop token id or stop string that ended the request, if any."""
    num_prompt_tokens: int
    num_cached_tokens: int
    first_scheduled_at: float | None = None
    """time.monotonic() of the request's first scheduled step (Request.first_scheduled_at)."""
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """With SamplingParams.prompt_logprobs, on the delta that carries the first output token: one entry per
    prompt token, None for the first (nothing precedes it); None on every other delta."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def queue_and_compute_s(self, admitted_at: float, now: float) -> tuple[float, float]:
        """(admitted_at -> first scheduled step, first scheduled step -> now), time.monotonic()
        seconds; a request never scheduled spent it all queued."""
        scheduled = now if self.first_scheduled_at is None else self.first_scheduled_at
        return max(scheduled - admitted_at, 0.0), now - scheduled


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprobs] | None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first."""
