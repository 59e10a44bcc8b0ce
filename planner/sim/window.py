"""One observation window: what the pools record during it (WindowStats, mutable, reset every
tick) and what a simulator hands over at its end (Window: raw samples, so that the windows of
several shards merge exactly into one Observation)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


class WindowStats:
    """Accumulators for the window since the last tick, except the step samples, which keep the
    last `step_samples` steps of each role whenever they ran."""

    __slots__ = ("finished", "prefill_queue_s", "decode_queue_s", "transfer_s", "routed", "prompt_tokens",
                 "hit_tokens", "local", "prefill_steps", "decode_steps")

    def __init__(self, step_samples: int) -> None:
        self.prefill_steps: deque[tuple[int, float]] = deque(maxlen=step_samples)
        """(prompt tokens, seconds) of recent prefill steps."""
        self.decode_steps: deque[tuple[int, int, float]] = deque(maxlen=step_samples)
        """(batch, context tokens, seconds) of the first step of recent decode macro-steps."""
        self.reset()

    def reset(self) -> None:
        self.finished: list[int] = []
        """Request ids that finished in the window, in finishing order."""
        self.prefill_queue_s: list[float] = []
        """Arrival -> first prefill step, per request whose prefill started in the window."""
        self.decode_queue_s: list[float] = []
        """First token -> admission to a decode worker, per request admitted in the window."""
        self.transfer_s: list[float] = []
        """KV transfer seconds, per transfer started in the window."""
        self.routed = 0
        """Requests routed (to a prefill worker, or to a decode worker for a local prefill)."""
        self.prompt_tokens = 0
        """Their prompt tokens..."""
        self.hit_tokens = 0
        """...and those served from a prefix cache."""
        self.local = 0
        """Requests prefilled on their decode worker."""


@dataclass(frozen=True)
class PoolState:
    """One pool (of one shard) at the end of a window."""

    routable: int
    starting: int
    draining: int
    queue_depth: int
    """Requests waiting for this pool, not started on a worker."""
    running: int
    """Requests held by its workers, started (prefill) or admitted (decode)."""
    kv_reserved: int = 0
    """KV tokens reserved over the routable workers (decode)."""


@dataclass(frozen=True, eq=False)
class Window:
    """One simulator's window (now_s - tick_s, now_s]. Arrays are per request or per sample."""

    now_s: float
    arrival_s: np.ndarray
    """float64: arrivals in the window (sorted)."""
    prompt_tokens: np.ndarray
    """int64: their prompt lengths."""
    ttft_s: np.ndarray
    """float64: per request finished in the window."""
    tpot_s: np.ndarray
    output_tokens: np.ndarray
    prefill_queue_s: np.ndarray
    decode_queue_s: np.ndarray
    transfer_s: np.ndarray
    routed: int
    routed_prompt_tokens: int
    hit_tokens: int
    local: int
    prefill: PoolState
    decode: PoolState
    prefill_steps: tuple[tuple[int, float], ...]
    decode_steps: tuple[tuple[int, int, float], ...]
    scaled_up: bool
    """Whether a replica asked for has become routable by now (the scale-up delay was observed)."""
    unfinished: int
    """Requests of this simulator's trace not finished yet (arrived or not)."""
