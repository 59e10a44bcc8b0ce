"""How the router keeps in touch with its workers: report polls and output streams
(`router.worker_link` in the cluster config). Every timeout on that path is a field here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLinkConfig:
    report_wait_s: float = 0.1
    """Longest wait of one report poll for new KV events: how stale a quiet worker's load may get."""
    report_timeout_s: float = 30.0
    """A worker that has not answered a report poll this long after its wait is lost (generous: a
    report waits for the engine's current step, which can take seconds for a long prefill on CPU).
    Time the router's own event loop was stalled does not count."""
    min_poll_interval_s: float = 0.02
    """At least this long between report polls of one worker, so a busy worker's per-step event
    batches are fetched together instead of one round trip per engine step."""
    retry_after_failure_s: float = 0.5
    """Wait before polling a worker again after a poll failed."""
    stream_connect_timeout_s: float = 10.0
    """Longest wait to open a decode worker's output stream (the Ray call for its address, the
    TCP connect and the worker's acknowledgement)."""
    stream_reconnect_s: float = 0.5
    """Wait between tries to reopen a lost worker's output stream."""

    def __post_init__(self) -> None:
        for name in ("report_wait_s", "report_timeout_s", "stream_connect_timeout_s", "stream_reconnect_s",
                     "retry_after_failure_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.min_poll_interval_s < 0:
            raise ValueError(f"min_poll_interval_s must be >= 0, got {self.min_poll_interval_s}")
