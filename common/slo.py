"""Service-level objectives: the targets, and whether one finished request met them.

Goodput follows DistServe: a request counts toward goodput only when it met both its TTFT
and its TPOT target; goodput is the rate of such requests (and of their output tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.validation import require


@dataclass(frozen=True)
class SloConfig:
    """The served model's latency targets (a request may bring its own)."""

    ttft_s: float | None = None
    """Time-to-first-token target in seconds; None: no TTFT target (every request meets it).
    Admission control also uses it (router.routing.admission_ttft_factor)."""
    tpot_s: float | None = None
    """Time-per-output-token target in seconds: a request's (e2e - TTFT) / (output tokens - 1);
    None: no TPOT target."""

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            value = getattr(self, name)
            require(value is None or 0 < value < float("inf"), f"{name} must be a finite number > 0, got {value}")


@dataclass(frozen=True)
class SloOutcome:
    """Which targets one finished request met (a missing target counts as met)."""

    ttft_met: bool
    tpot_met: bool

    @property
    def both_met(self) -> bool:
        return self.ttft_met and self.tpot_met


def tpot_s(ttft_s: float, e2e_s: float, num_output_tokens: int) -> float | None:
    """Mean time per output token after the first; None with fewer than two output tokens."""
    if num_output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (num_output_tokens - 1)


def evaluate_slo(targets: SloConfig, ttft_s: float | None, e2e_s: float, num_output_tokens: int) -> SloOutcome:
    """ttft_s None (no token was produced) misses any TTFT target; a request with fewer than two
    output tokens has no TPOT and meets any TPOT target."""
    ttft_met = targets.ttft_s is None or (ttft_s is not None and ttft_s <= targets.ttft_s)
    tpot = tpot_s(ttft_s, e2e_s, num_output_tokens) if ttft_s is not None else None
    tpot_met = targets.tpot_s is None or tpot is None or tpot <= targets.tpot_s
    return SloOutcome(ttft_met, tpot_met)


UNCOUNTED_ERROR_CODES = ("CANCELLED", "INVALID_ARGUMENT")
"""Requests ending with these codes do not count toward SLO attainment: the client withdrew, or
sent a request that can never be served."""


def request_slo_outcome(targets: SloConfig, error_code: str | None, ttft_s: float | None, e2e_s: float,
                        num_output_tokens: int) -> SloOutcome | None:
    """A finished request (error_code None) is evaluated against its targets; one that failed
    (rejected, deadline, worker fault) counts and meets neither target, since DistServe counts a
    request toward goodput only when it completed within both; None for an uncounted one."""
    if error_code in UNCOUNTED_ERROR_CODES:
        return None
    if error_code is not None:
        return SloOutcome(False, False)
    return evaluate_slo(targets, ttft_s, e2e_s, num_output_tokens)
