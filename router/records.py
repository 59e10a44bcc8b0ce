"""What the router measures about one request while it runs; the orchestrator turns it into a
`common.stats.RequestRecord` when the request ends.

Router-side times are time.monotonic() instants on the router; worker-side phases are
durations measured on the worker's own clock (never compared across machines as instants).
"""

from __future__ import annotations


class RequestTimeline:
    """One request's timestamps, inter-token latencies and TTFT phases.

    Invariant: phases follow common.metrics.TTFT_PHASES order (router_queue, prefill_queue,
    prefill_compute from whichever worker prefilled; then transfer and decode_queue from the
    decode worker when the first token came from a prefill worker)."""

    def __init__(self, arrival: float) -> None:
        self.arrival = arrival
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.finished_at: float | None = None
        """When the chunk with the finish reason was built."""
        self.inter_token_latencies: list[float] = []
        self.queue_s: float | None = None
        """Arrival -> the prompt's first scheduled prefill step (set when the prefill ends)."""
        self.prefill_s: float | None = None
        """Prefill compute on the worker that prefilled."""
        self.transfer_s: float | None = None
        """The KV pull's duration on the decode worker, when it succeeded."""
        self.transfer_failed = False
        self.phases: list[tuple[str, float]] = []

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    def e2e_s(self, now: float) -> float:
        """Arrival -> the final chunk, or -> now for a request that did not finish."""
        return (self.finished_at if self.finished_at is not None else now) - self.arrival

    def on_prefilled(self, worker_queue_s: float, compute_s: float, now: float) -> None:
        """The prefill ended now, having waited worker_queue_s on its worker and computed for
        compute_s. What is left of the time since arrival is the router's share: routing and the
        prefill call's trips over the wire (the router sends a request as soon as it is routed)."""
        self.queue_s = max(now - self.arrival - compute_s, 0.0)
        self.prefill_s = compute_s
        self.phases += [("router_queue", max(self.queue_s - worker_queue_s, 0.0)), ("prefill_queue", worker_queue_s),
                        ("prefill_compute", compute_s)]

    def on_pulled(self, transfer_s: float) -> None:
        self.transfer_s = transfer_s
        self.phases.append(("transfer", transfer_s))

    def on_decode_first_output(self, decode_queue_s: float) -> None:
        """The decode worker's first output after a remote prefill: its admission -> first output,
        minus the pull."""
        self.phases.append(("decode_queue", decode_queue_s))

    def on_tokens(self, count: int, finished: bool, now: float) -> None:
        """`count` tokens streamed now: k tokens g seconds after the previous ones count k gaps
        of g / k; tokens that come with the first token count gaps of 0."""
        if count:
            if self.first_token_at is None:
                self.first_token_at = now
                self.inter_token_latencies.extend([0.0] * (count - 1))
            else:
                self.inter_token_latencies.extend([(now - self.last_token_at) / count] * count)
            self.last_token_at = now
        if finished:
            self.finished_at = now
