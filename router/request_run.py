"""One request's state at the router while it runs: the current attempt (its worker-side id, its
prefill and decode assignments, its output stream), what has been streamed, and the timeline that
becomes its RequestRecord."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from splitserve.common.detokenizer import Decoder, IncrementalDetokenizer
from splitserve.common.kv_transfer_types import TransferParams
from splitserve.common.slo import SloConfig, request_slo_outcome
from splitserve.common.stats import FINISH_REASONS, KVTransferRecord, RequestRecord
from splitserve.common.token_logprobs import TokenLogprobs
from splitserve.common.worker_api import WorkerLostError
from splitserve.common.worker_messages import TokenDelta
from splitserve.router.api_types import GenerationInput, RouterError, StreamChunk, Timing, Usage
from splitserve.router.policy import RouteDecision
from splitserve.router.records import RequestTimeline
from splitserve.router.worker_pool import Assignment

T = TypeVar("T")


class RequestRun:
    """One request's progress at the router."""

    def __init__(self, inp: GenerationInput, tokenizer: Decoder, arrival: float,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        """`eos_token_ids`: the model's, which end the output (unless ignore_eos) like a stop token."""
        self.inp = inp
        self.eos_token_ids = eos_token_ids
        self.decision: RouteDecision | None = None
        self.rejection_reason: str | None = None
        self.cached_tokens: dict[str, int] = {}
        """Prompt tokens each worker's prefix cache held when the request was routed."""
        self.worker_request_id = ""
        """The id workers know the current attempt by: unique across routers, clients and
        attempts (a client's own id may repeat after it finishes, or collide with another's)."""
        self.num_migrations = 0
        self.resumed = False
        """The current attempt recomputes tokens already streamed (it is a migration)."""
        self.active_worker_id: str | None = None
        """The worker computing for the request now (prefill worker during the prefill call, then
        the decode worker): its loss interrupts the attempt."""
        self.relay_worker_id: str | None = None
        """Layer-wise transfer, during the prefill call: the decode worker that already holds the
        request and is relayed its progress; its loss interrupts the attempt too (what it held is
        gone, and nothing else would end the wait for its tokens)."""
        self.lost: WorkerLostError | None = None
        self.stream: asyncio.Queue | None = None
        """The current attempt's deltas (TokenDelta), or the WorkerLostError that ends it."""
        self._pending_call: asyncio.Future | None = None
        self.timeline = RequestTimeline(arrival)
        params = inp.sampling_params
        self.detokenizer = IncrementalDetokenizer(tokenizer, list(inp.prompt_token_ids), params.stop,
                                                  params.skip_special_tokens, params.include_stop_str_in_output)
        self.prefill: Assignment | None = None
        """The current attempt's claim on its prefill worker (None: prefilled where it decodes)."""
        self.decode: Assignment | None = None
        """The current attempt's claim on its decode worker."""
        self.worker_finished = False
        self.finish_reason: str | None = None
        self.output_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.transfer: TransferParams | None = None
        """Where the prefill worker holds the prompt's KV for the decode worker to pull."""
        self.error_code: str | None = None
        """How the request failed (a gRPC status code name), if it did."""

    @property
    def assignments(self) -> list[Assignment]:
        """The current attempt's claims, prefill first."""
        return [a for a in (self.prefill, self.decode) if a is not None]

    def begin_attempt(self, worker_request_id: str, stream: asyncio.Queue) -> None:
        self.worker_request_id = worker_request_id
        self.stream = stream
        self.resumed = bool(self.output_token_ids)
        self.lost = None

    @property
    def context_token_ids(self) -> tuple[int, ...]:
        """What a worker must hold KV for to go on: the prompt and the tokens streamed so far."""
        return self.inp.prompt_token_ids + tuple(self.output_token_ids)

    def depends_on(self, worker_id: str) -> bool:
        """The attempt cannot go on without this worker (see active_worker_id, relay_worker_id)."""
        return worker_id in (self.active_worker_id, self.relay_worker_id)

    def lose(self, lost: WorkerLostError) -> None:
        """The active worker is gone: interrupt the pending worker call or the stream wait."""
        if self.lost is not None:
            return
        self.lost = lost
        if self._pending_call is not None:
            self._pending_call.cancel()
        self.stream.put_nowait(lost)

    async def call(self, awaitable: Awaitable[T]) -> T:
        """Await a worker call within the deadline; raises WorkerLostError if the active worker
        is lost meanwhile (the call is cancelled)."""
        call = asyncio.ensure_future(awaitable)
        self._pending_call = call
        try:
            return await self.bounded(call)
        except asyncio.CancelledError:
            if self.lost is not None and call.cancelled() and not asyncio.current_task().cancelling():
                raise self.lost from None
            raise
        finally:
            self._pending_call = None

    async def bounded(self, awaitable: Awaitable[T]) -> T:
        """Await within the request's deadline."""
        if self.inp.deadline is None:
            return await awaitable
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + self.inp.deadline - time.monotonic()):
                return await awaitable
        except TimeoutError:
            raise RouterError("DEADLINE_EXCEEDED", "the request's deadline passed") from None

    def on_tokens(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], finish_reason: str | None,
                  stop_reason: int | str | None,
                  prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None) -> StreamChunk:
        """Detokenize new tokens, cutting at a stop string; a finish here ends the stream. A stop token
        that ended the request is counted and reported but its text is not part of the output (as in
        vLLM: include_stop_str_in_output is false)."""
        emitted = []
        params = self.inp.sampling_params
        stop_token_at = len(token_ids) - 1 if self._ends_on_stop_token(token_ids, finish_reason, stop_reason) else None
        for position, token_id in enumerate(token_ids):
            emitted.append(token_id)
            if position == stop_token_at:
                break
            may_stop = params.may_stop(len(self.output_token_ids) + len(emitted))
            stop_string = self.detokenizer.append(token_id, may_stop)
            if stop_string is not None:
                finish_reason, stop_reason = "stop", stop_string
                break
        self.output_token_ids.extend(emitted)
        now = time.monotonic()
        self.timeline.on_tokens(len(emitted), finish_reason is not None, now)
        self.finish_reason = finish_reason
        text = self.detokenizer.take_delta(finish_reason is not None)
        if finish_reason is None:
            return StreamChunk(self.inp.request_id, tuple(emitted), text, tuple(logprobs[:len(emitted)]),
                               prompt_logprobs=prompt_logprobs)
        return StreamChunk(self.inp.request_id, tuple(emitted), text, tuple(logprobs[:len(emitted)]),
                           finish_reason, stop_reason, self._usage(), self._timing(now),
                           prompt_logprobs=prompt_logprobs)

    def _ends_on_stop_token(self, token_ids: Sequence[int], finish_reason: str | None,
                            stop_reason: int | str | None) -> bool:
        """Whether the last of `token_ids` is the token that stopped the request: one of its stop
        token ids (the stop reason), or EOS (no stop reason: an ending grammar stops on text tokens)."""
        if finish_reason != "stop" or not token_ids:
            return False
        return isinstance(stop_reason, int) or (stop_reason is None and not self.inp.sampling_params.ignore_eos
                                                and token_ids[-1] in self.eos_token_ids)

    def on_decode_timing(self, delta: TokenDelta) -> None:
        """Note what a decode worker's delta says about the KV pull and the worker's first output
        (a resumed attempt's recompute is not part of the request's TTFT)."""
        timeline = self.timeline
        timeline.transfer_failed |= delta.kv_transfer_failed
        if self.resumed:
            return
        if delta.transfer_s is not None:
            timeline.on_pulled(delta.transfer_s)
        if delta.queue_s is None:
            return
        if self.decision.prefill_worker_id is None:  # it prefilled the prompt itself
            timeline.on_prefilled(delta.queue_s, delta.compute_s, time.monotonic())
        else:
            timeline.on_decode_first_output(delta.queue_s + delta.compute_s)

    def _usage(self) -> Usage:
        return Usage(len(self.inp.prompt_token_ids), self.num_cached_tokens, len(self.output_token_ids))

    def _timing(self, now: float) -> Timing:
        timeline = self.timeline
        return Timing(timeline.queue_s or 0.0, timeline.prefill_s or 0.0, timeline.transfer_s or 0.0,
                      (timeline.first_token_at or now) - timeline.arrival, now - timeline.arrival)

    def record(self, targets: SloConfig) -> RequestRecord:
        """What observers learn about the request once it ended; `targets` are its SLO targets."""
        timeline, decision = self.timeline, self.decision
        finish_reason = self.finish_reason if self.finish_reason in FINISH_REASONS else None
        # A worker that ends a stream with finish reason 'abort' (and no error) aborted it.
        error_code = None if finish_reason is not None else self.error_code or "ABORTED"
        ttft_s, e2e_s = timeline.ttft_s, timeline.e2e_s(time.monotonic())
        num_output = len(self.output_token_ids)
        return RequestRecord(
            self.inp.request_id, finish_reason, error_code, decision and decision.reason, self.rejection_reason,
            decision and decision.prefill_worker_id, decision and decision.decode_worker_id,
            len(self.inp.prompt_token_ids), self.num_cached_tokens, num_output, ttft_s,
            tuple(timeline.inter_token_latencies), e2e_s, timeline.queue_s, timeline.prefill_s,
            None if ttft_s is None else e2e_s - ttft_s, tuple(timeline.phases), self._kv_transfer(),
            request_slo_outcome(targets, error_code, ttft_s, e2e_s, num_output), self.num_migrations,
            self.inp.step_of, self.inp.client_request_id)

    def _kv_transfer(self) -> KVTransferRecord | None:
        """The pull's outcome, when the decode worker reported one."""
        timeline = self.timeline
        if self.transfer is None or (timeline.transfer_s is None and not timeline.transfer_failed):
            return None
        num_bytes = 0 if timeline.transfer_s is None else self.transfer.num_bytes
        return KVTransferRecord(self.decision.prefill_worker_id, self.decision.decode_worker_id,
                                timeline.transfer_s, num_bytes)
