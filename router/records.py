"""What the router measures about one request while it runs; the orchestrator turns it into a
`common.stats.RequestRecord` when the request ends (a request run as internal steps: StepwiseRequest; a fan-out
refused before its sequences ran: refused_record); a finished client request's parameters: RequestParamsRecord (a
fan-out's: FanOutParams).

Router-side times are time.monotonic() instants on the router; worker-side phases are
durations measured on the worker's own clock (never compared across machines as instants).
"""

from __future__ import annotations

from splitserve.common.slo import SloConfig, request_slo_outcome
from splitserve.common.stats import RequestParamsRecord, RequestRecord


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


class StepwiseRequest:
    """A client's request that the router runs as internal steps (requests with GenerationInput.step_of:
    a beam search's beams), measured as the one request the client sent.

    Its output exists only once its last step ran and reaches the client whole, so, as for any tokens
    that come together, its first and last token arrive at that moment: TTFT = e2e, and its other tokens
    count inter-token gaps of 0 (TPOT 0)."""

    def __init__(self, request_id: str, num_prompt_tokens: int, arrival: float,
                 client_request_id: str | None = None) -> None:
        """`client_request_id`: the client's id when the router knows the request by another (RequestRecord's)."""
        self.request_id = request_id
        self.client_request_id = client_request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.timeline = RequestTimeline(arrival)
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.num_migrations = 0
        """Its steps' moves off lost workers."""
        self.error_code: str | None = None
        self.rejection_reason: str | None = None
        self.params: RequestParamsRecord | None = None
        """Its parameters and longest returned beam, observed once when it finished (Orchestrator.stepwise)."""

    def on_step_ended(self, num_migrations: int) -> None:
        self.num_migrations += num_migrations

    def on_finished(self, finish_reason: str, num_cached_tokens: int, num_output_tokens: int, now: float,
                    params: RequestParamsRecord | None = None) -> None:
        """Its whole output is ready now: `finish_reason` is its first choice's; the token counts are its usage's;
        `params`: its n (a beam search's width), max_tokens and longest returned sequence."""
        self.finish_reason = finish_reason
        self.params = params
        self.num_cached_tokens = num_cached_tokens
        self.num_output_tokens = num_output_tokens
        self.timeline.on_tokens(num_output_tokens, True, now)

    def record(self, targets: SloConfig, now: float) -> RequestRecord:
        """Its record once it ended (now): no worker, phase or transfer of its own (its steps have those)."""
        timeline = self.timeline
        finish_reason = self.finish_reason if self.error_code is None else None
        error_code = None if finish_reason is not None else self.error_code or "INTERNAL"
        ttft_s, e2e_s = timeline.ttft_s, timeline.e2e_s(now)
        return RequestRecord(
            self.request_id, finish_reason, error_code, None, self.rejection_reason, None, None,
            self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens, ttft_s,
            tuple(timeline.inter_token_latencies), e2e_s, None, None, None if ttft_s is None else e2e_s - ttft_s, (),
            None, request_slo_outcome(targets, error_code, ttft_s, e2e_s, self.num_output_tokens),
            self.num_migrations, client_request_id=self.client_request_id)


def refused_record(request_id: str, num_prompt_tokens: int, error_code: str, rejection_reason: str | None,
                   targets: SloConfig, e2e_s: float, client_request_id: str | None = None) -> RequestRecord:
    """The record of a client's request refused before any of it ran (a fan-out whose sequences' admission slots
    the router could not all hold), as a refused single request's: its status and rejection reason, its prompt
    tokens, no token, worker, routing decision or phase; e2e_s is its arrival -> the refusal."""
    return RequestRecord(request_id, None, error_code, None, rejection_reason, None, None, num_prompt_tokens, 0, 0,
                         None, (), e2e_s, None, None, None, (), None,
                         request_slo_outcome(targets, error_code, None, e2e_s, 0),
                         client_request_id=client_request_id)


class FanOutParams:
    """A fan-out's RequestParamsRecord, gathered from its sequences' records as they end."""

    def __init__(self, n: int, max_tokens: int | None, num_sequences: int) -> None:
        self.n = n
        self.max_tokens = max_tokens
        self.num_sequences = num_sequences
        self.num_finished = 0
        self.longest = 0
        """The most output tokens of a sequence that finished."""

    def on_sequence_ended(self, record: RequestRecord) -> None:
        if record.finish_reason is not None:
            self.num_finished += 1
            self.longest = max(self.longest, record.num_output_tokens)

    def record(self) -> RequestParamsRecord | None:
        """Its record once every sequence finished; None when one did not (the client's request failed or was
        cancelled: observed with finished requests only, as vLLM observes them)."""
        if self.num_finished < self.num_sequences:
            return None
        return RequestParamsRecord(self.n, self.max_tokens, self.longest)
