"""The decode worker (consumer role): admits requests whose prompt KV it pulls from a prefill
worker, decodes them in its continuous batch and streams tokens to the routers.

Outputs are pushed: every engine step's deltas for a router go out as one frame on that router's
output stream (decode_worker/output_server.py) the moment the step ends, with one hand-off from
the engine thread to the event loop. It also prefills locally when a request brings no transfer
(colocated mode). A plain class so it can be tested without Ray.

Layer-wise transfer: a request that comes `first_token_pending` is admitted (its blocks allocated)
while a prefill worker computes it; its pull starts when its TransferParams are relayed and reads
each layer as its announcement is relayed (ConsumerConnector, layer-wise); it joins the batch once
both its pull is DONE and its first token (PrefillFirstToken) has come.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.common.config import EngineConfig
from splitserve.common.errors import InvalidRequestError
from splitserve.common.kv_events import WorkerReport
from splitserve.common.kv_transfer_types import (TRANSFER_FAILURE_POLICIES, AgentMetadata, LayerAnnouncement,
                                                 TransferParams)
from splitserve.common.output_stream import OutputStreamAddress, RouterFrame, StreamAbort
from splitserve.common.worker_messages import (DecodeRequest, LayerwiseProgress, PrefillFirstToken, TokenDelta,
                                               WorkerInfo, WorkerStats)
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.engine_loop import EngineLoop
from splitserve.engine.model_loader import model_fingerprint
from splitserve.engine.outputs import CompletionDelta
from splitserve.engine.request_queue import RequestQueue
from splitserve.engine.worker_report import wait_for_report
from splitserve.kv_transfer import ConsumerConnector, PullOutcome, PullStatus, make_backend
from splitserve.decode_worker.output_server import OutputServer

logger = logging.getLogger(__name__)

PULL_POLL_S = 0.0005
"""How often pulls with a READ in flight are polled while the engine has nothing else to do (the
default of the decode pool's transfer_poll_s)."""
MAX_UNREAD_OUTPUT_BYTES = 64 << 20
"""A router that leaves this much of its output stream unread is gone (hung): its requests end."""


@dataclass
class _PendingPrefill:
    """A first_token_pending request, from its admission until its KV and its first token are both in."""

    local_block_ids: tuple[int, ...] | None = None
    """Its prompt's blocks here, once allocated."""
    transfer: TransferParams | None = None
    early_announcements: list[LayerAnnouncement] = field(default_factory=list)
    """Relayed before its pull could start (no blocks yet): announced to the pull when it starts."""
    first_token: PrefillFirstToken | None = None
    outcome: PullOutcome | None = None


@dataclass(frozen=True)
class PullDone:
    seconds: float
    ended_at: float
    """time.monotonic() when the pull's outcome was used."""


def queue_without_pull(queue_s: float, admitted_at: float, pull: PullDone | None) -> float:
    """A request's time queued here, from admitted_at to its first scheduling (queue_s), less the part of
    its pull in that window: all of a whole-request pull (it starts at admission); none of a layer-wise
    one, which ended before the request was admitted with its first token; nothing without a pull."""
    if pull is None:
        return queue_s
    pulled_in_window = min(pull.seconds, max(pull.ended_at - admitted_at, 0.0))
    return max(queue_s - pulled_in_window, 0.0)


def _priority_only(request: DecodeRequest) -> tuple[int]:
    """The awaiting-blocks queue's order under the priority policy: a request joins it once, so requests
    of equal priority keep their arrival order (the queue keeps push order among equal keys)."""
    return (request.priority,)


class DecodeWorker:
    def __init__(self, model_dir: str | Path, engine_config: EngineConfig, transfer_backend: str = "nixl",
                 worker_id: str | None = None, transfer_failure_policy: str = "recompute",
                 output_host: str | None = None, max_unread_output_bytes: int = MAX_UNREAD_OUTPUT_BYTES,
                 transfer_poll_s: float = PULL_POLL_S, tokenizer_dir: str | Path | None = None) -> None:
        """`output_host`: the address routers reach this worker's output streams at (None: the
        Ray node's address inside a Ray cluster, else 127.0.0.1); `tokenizer_dir`: the cluster's
        --tokenizer directory (structured output's vocabulary), None: the model directory."""
        if transfer_failure_policy not in TRANSFER_FAILURE_POLICIES:
            raise ValueError(f"transfer_failure_policy must be one of {TRANSFER_FAILURE_POLICIES}, "
                             f"got {transfer_failure_policy!r}")
        self.worker_id = worker_id or f"decode-{uuid.uuid4().hex[:8]}"
        self.engine = EngineCore(model_dir, engine_config, show_progress=True, tokenizer_dir=tokenizer_dir)
        self._layout = self.engine.kv_layout(model_fingerprint(Path(model_dir)))
        self._backend = make_backend(transfer_backend, f"{self.worker_id}-{uuid.uuid4().hex[:8]}")
        self._backend.register_kv_pool(self.engine.kv_cache.layers, self._layout)
        self._pulls = ConsumerConnector(self._backend)
        self._failure_policy = transfer_failure_policy
        self._transfer_poll_s = transfer_poll_s
        self._info = WorkerInfo(self.worker_id, "decode", self.engine.max_model_len, self.engine.vocab_size,
                                self._layout, self._backend.metadata(),
                                max_num_seqs=engine_config.max_num_seqs,
                                scheduling_policy=engine_config.scheduling_policy)
        # Engine-thread state: requests waiting for free blocks, pulls in flight, aborts deferred
        # until their pull ends (a block being written by a pull is never freed), pull durations.
        self._awaiting_blocks: RequestQueue[DecodeRequest] = RequestQueue(engine_config.scheduling_policy,
                                                                          _priority_only)
        """Admitted requests whose KV comes from elsewhere, waiting for free blocks: in arrival order
        (priority policy: by priority, ties in arrival order, as the engine's waiting queue)."""
        self._pulling: set[str] = set()
        self._abort_after_pull: dict[str, str | None] = {}
        """Requests to end once their pull ends, with the error to report (None: a plain abort)."""
        self._pulls_done: dict[str, PullDone] = {}
        """request id -> its pull's time, from the pull's end until its first delta."""
        self._admitted_at: dict[str, float] = {}
        """request id -> time.monotonic() of its admission, until its first delta with tokens."""
        self._recomputed: set[str] = set()
        self._pending: dict[str, _PendingPrefill] = {}
        """first_token_pending requests until they join the engine's batch (or end)."""
        self._routes: dict[str, str] = {}
        """request id -> router id; engine thread only."""
        self._unheard: set[str] = set()
        """Requests of a router that is gone, until their final delta: they end without a word to it.
        Its stream closed, or Ray reports its actor dead, which it does a few ms before the process
        has exited: a plain abort sent then would reach the dying router's client as a stream that
        finished (finish_reason 'abort'), where its other clients see the connection cut.
        Engine thread only."""
        self._outputs = OutputServer(output_host or _reachable_host(), self._on_stream_frame, self._on_router_gone,
                                     max_unread_output_bytes)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._loop = EngineLoop(self.engine, self._on_deltas, self._poll_transfers, self._on_step_failure,
                                name=self.worker_id)
        self._loop.start()

    # ---- actor API -----------------------------------------------------------------------
    async def info(self) -> WorkerInfo:
        return self._info

    async def add_peer(self, peer: AgentMetadata) -> None:
        """Handshake with a prefill worker (raises KVLayoutMismatchError on an incompatible one)."""
        await self._loop.run(lambda engine: self._backend.add_peer(peer))

    async def remove_peer(self, agent_name: str) -> None:
        await self._loop.run(lambda engine: self._backend.remove_peer(agent_name))

    async def open_output_stream(self, router_id: str) -> OutputStreamAddress:
        """Where `router_id` connects to send its requests and receive their tokens
        (common/output_stream.py)."""
        self._event_loop = asyncio.get_running_loop()
        return await self._outputs.address()

    async def abort(self, request_id: str) -> bool:
        return await self._loop.run(lambda engine: self._abort(engine, request_id))

    async def abort_router(self, router_id: str) -> int:
        """End every request of a router that is gone (Ray reports its actor dead, which may come
        before its output stream closes), sending it nothing more. Returns how many it ended."""
        return await self._loop.run(lambda engine: self._abort_router(engine, router_id))

    async def stats(self) -> WorkerStats:
        return await self._loop.run(
            lambda engine: WorkerStats(engine.stats(), 0, len(self._transfers()), frozenset(self._routes.values()),
                                       self._pulls.stats().num_layerwise_done))

    async def report(self, epoch: str | None, after_seq: int, max_wait_s: float) -> WorkerReport:
        """Load and KV events after the router's cursor (epoch, after_seq), or a snapshot when the cursor
        cannot be continued; with nothing new it waits up to max_wait_s for events."""
        return await wait_for_report(self._loop, self.worker_id, epoch, after_seq, max_wait_s)

    def shutdown(self) -> None:
        self._loop.stop()
        self._backend.close()
        loop = self._event_loop
        if loop is None or loop.is_closed():
            return
        if _running_loop() is loop:
            self._outputs.close()
        else:
            loop.call_soon_threadsafe(self._outputs.close)

    # ---- event loop ----------------------------------------------------------------------
    def _on_stream_frame(self, router_id: str, payload: RouterFrame) -> None:
        """A router's frame, handed to the engine thread in the order it was sent."""
        if isinstance(payload, StreamAbort):
            self._loop.call(lambda engine: self._abort(engine, payload.request_id))
        elif isinstance(payload, DecodeRequest):
            self._loop.call(lambda engine: self._admit_from(engine, router_id, payload))
        elif isinstance(payload, LayerwiseProgress):
            self._loop.call(lambda engine: self._on_progress(router_id, payload))
        else:
            self._loop.call(lambda engine: self._on_first_token(router_id, payload))

    def _on_router_gone(self, router_id: str) -> None:
        """Its output stream closed: end its requests (one hand-off to the engine thread)."""
        self._loop.call(lambda engine: self._abort_router(engine, router_id))

    # ---- engine thread -------------------------------------------------------------------
    def _admit_from(self, engine: EngineCore, router_id: str, request: DecodeRequest) -> None:
        """Admit a request that came on router_id's stream; one it refuses ends at once with an
        error delta on that stream (naming the field when it can never be served)."""
        try:
            if request.router_id != router_id:
                raise InvalidRequestError("router_id", f"{request.router_id!r} sent on {router_id!r}'s stream")
            self._admit(engine, request)
        except Exception as error:
            if not isinstance(error, InvalidRequestError):
                logger.exception("[%s] admission failed", request.request_id)
            refusal = TokenDelta(request.request_id, (), (), "abort", None, 0, error=str(error),
                                 invalid_field=error.field if isinstance(error, InvalidRequestError) else None)
            self._event_loop.call_soon_threadsafe(self._outputs.send, router_id, [refusal])

    def _admit(self, engine: EngineCore, request: DecodeRequest) -> None:
        if request.request_id in self._routes:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in flight")
        if request.first_token_pending:
            engine.validate(request.request_id, list(request.prompt_token_ids), request.sampling_params,
                            request.cache_salt, request.priority, request.lora_request)
            self._awaiting_blocks.push(request)
            self._pending[request.request_id] = _PendingPrefill()
        elif request.pooling_params is not None:  # an embedding pooled here (colocated): one final delta
            engine.add_pooling_request(request.request_id, list(request.prompt_token_ids), request.pooling_params,
                                       request.cache_salt, request.priority, request.lora_request)
        elif request.transfer is None:
            engine.add_request(request.request_id, list(request.prompt_token_ids), request.sampling_params,
                               output_token_ids=request.output_token_ids, cache_salt=request.cache_salt,
                               priority=request.priority, lora_request=request.lora_request)
        else:
            engine.validate(request.request_id, list(request.prompt_token_ids), request.sampling_params,
                            request.cache_salt, request.priority, request.lora_request)
            self._awaiting_blocks.push(request)
        self._routes[request.request_id] = request.router_id
        self._admitted_at[request.request_id] = time.monotonic()
        self._start_pulls(engine)

    def _start_pulls(self, engine: EngineCore) -> None:
        """Allocate blocks and start pulls in queue order; stop at the first that does not fit."""
        while self._awaiting_blocks:
            request = self._awaiting_blocks.peek()
            local_block_ids = engine.add_remote_request(
                request.request_id, list(request.prompt_token_ids), list(request.output_token_ids),
                request.sampling_params, request.num_cached_tokens, request.generator_state,
                first_token_pending=request.first_token_pending, cache_salt=request.cache_salt,
                priority=request.priority, lora_request=request.lora_request)
            if local_block_ids is None:
                return
            self._awaiting_blocks.pop()
            pending = self._pending.get(request.request_id)
            if pending is None:
                self._pulls.start(request.transfer, local_block_ids)
                self._pulling.add(request.request_id)
                continue
            pending.local_block_ids = local_block_ids
            if pending.transfer is not None:
                self._start_layerwise_pull(request.request_id, pending)

    def _start_layerwise_pull(self, request_id: str, pending: _PendingPrefill) -> None:
        """Its blocks and its TransferParams are here: start the pull, with the layers already announced."""
        self._pulls.start(pending.transfer, pending.local_block_ids, layerwise=True)
        self._pulling.add(request_id)
        for announcement in pending.early_announcements:
            self._pulls.announce(announcement)
        pending.early_announcements.clear()

    def _on_progress(self, router_id: str, progress: LayerwiseProgress) -> None:
        """A first_token_pending request's TransferParams and layers, relayed by its router."""
        pending = self._pending.get(progress.request_id)
        if pending is None or self._routes.get(progress.request_id) != router_id:
            return  # it ended here, or ends once its READ in flight completes (an abort crossed the relay)
        for message in progress.messages:
            if isinstance(message, TransferParams):
                pending.transfer = message
                if pending.local_block_ids is not None:
                    self._start_layerwise_pull(progress.request_id, pending)
            elif progress.request_id in self._pulling:
                self._pulls.announce(message)
            else:
                pending.early_announcements.append(message)

    def _on_first_token(self, router_id: str, first: PrefillFirstToken) -> None:
        pending = self._pending.get(first.request_id)
        if pending is None or self._routes.get(first.request_id) != router_id:
            return
        pending.first_token = first
        self._join(first.request_id, pending)

    def _join(self, request_id: str, pending: _PendingPrefill) -> None:
        """Once both its pull's outcome and its first token are in, the request goes on as a
        whole-request pull's would (a failed pull under policy 'fail' ends it without waiting)."""
        outcome = pending.outcome
        if outcome is None:
            return
        failing = outcome.state is not PullStatus.DONE and self._failure_policy == "fail"
        if pending.first_token is None and not failing:
            return
        del self._pending[request_id]
        if pending.first_token is not None:
            first = pending.first_token
            self.engine.remote_first_token(request_id, first.token_ids, first.num_cached_tokens, first.generator_state)
            self._admitted_at[request_id] = time.monotonic()  # its life here starts with its first token
        self._use_pull(outcome)

    def _transfers(self) -> set[str]:
        """Requests waiting for blocks, pulling KV, or (layer-wise) waiting for their first token."""
        return {request.request_id for request in self._awaiting_blocks} | self._pulling | self._pending.keys()

    def _abort(self, engine: EngineCore, request_id: str, error: str | None = None) -> bool:
        """End a request in any state; one being pulled ends when its pull does (its blocks are
        being written). With `error`, its router gets an error delta instead of a plain abort."""
        # A layer-wise request takes nothing relayed after this: an abort that is not its router's
        # (abort_router, when Ray reports the router dead while its relayed frames are still coming)
        # may come before its TransferParams, which would start a pull into the blocks freed here.
        self._pending.pop(request_id, None)
        if request_id in self._pulling:
            if self._pulls.status(request_id) is not PullStatus.AWAITING_LAYER:
                self._abort_after_pull[request_id] = error
                return True
            self._pulls.abort(request_id)  # no READ in flight: nothing writes its blocks any more
            self._pulling.discard(request_id)
        for request in self._awaiting_blocks:
            if request.request_id == request_id:
                self._awaiting_blocks.remove(request)
                self._publish([TokenDelta(request_id, (), (), "abort", None, request.num_cached_tokens, error=error)])
                return True
        if error is not None and request_id in engine.scheduler.requests:
            self._fail(request_id, error)
            return True
        return engine.abort_request(request_id)

    def _abort_router(self, engine: EngineCore, router_id: str) -> int:
        """End the router's requests without sending it anything more (`_unheard`)."""
        request_ids = [r for r, routed_to in self._routes.items() if routed_to == router_id]
        if request_ids:  # a router stopping cleanly has none left
            logger.warning("router %s is gone with %d requests in flight: aborting them", router_id, len(request_ids))
        self._unheard.update(request_ids)  # before _abort: it publishes a waiting request's end at once
        ended = [request_id for request_id in request_ids if self._abort(engine, request_id)]
        self._unheard.difference_update(set(request_ids) - set(ended))
        return len(ended)

    def _on_step_failure(self, engine: EngineCore) -> None:
        for request_id in [*engine.scheduler.requests, *(r.request_id for r in self._awaiting_blocks)]:
            self._abort(engine, request_id, "the decode worker's engine step failed (see its log)")

    def _poll_transfers(self) -> float | None:
        for outcome in self._pulls.poll():
            self._pulling.discard(outcome.request_id)
            self._finish_pull(outcome)
        self._end_aborted_between_layers()
        self._start_pulls(self.engine)
        # A layer-wise pull waiting for its next layer moves only when that layer is relayed (a call,
        # which wakes the loop) or its lease_ttl_s runs out (seen on the loop's idle wake-ups).
        reading = any(self._pulls.status(request_id) is not PullStatus.AWAITING_LAYER for request_id in self._pulling)
        return self._transfer_poll_s if reading or self._awaiting_blocks else None

    def _end_aborted_between_layers(self) -> None:
        """A layer-wise pull aborted during a READ ends once that READ is done and no other is in
        flight: the layers still to come may never be announced (its prefill was aborted too)."""
        idle = [request_id for request_id in self._abort_after_pull
                if self._pulls.status(request_id) is PullStatus.AWAITING_LAYER]
        for request_id in idle:
            self._pulls.abort(request_id)
            self._pulling.discard(request_id)
            self._end_aborted(request_id, self._abort_after_pull.pop(request_id))

    def _finish_pull(self, outcome: PullOutcome) -> None:
        request_id = outcome.request_id
        if request_id in self._abort_after_pull:
            self._end_aborted(request_id, self._abort_after_pull.pop(request_id))
        elif request_id in self._pending:
            self._pending[request_id].outcome = outcome
            self._join(request_id, self._pending[request_id])
        else:
            self._use_pull(outcome)

    def _end_aborted(self, request_id: str, error: str | None) -> None:
        if error is None:
            self.engine.abort_request(request_id)
        else:
            self._fail(request_id, error)

    def _use_pull(self, outcome: PullOutcome) -> None:
        """The pull ended and the request has its first token: decode from the pulled KV, recompute
        the prompt, or fail (transfer_failure_policy)."""
        request_id = outcome.request_id
        if outcome.state is PullStatus.DONE:
            self._pulls_done[request_id] = PullDone(outcome.seconds, time.monotonic())
            self.engine.remote_kv_ready(request_id)
        elif self._failure_policy == "recompute":
            logger.warning("[%s] KV pull failed (%s); recomputing the prompt locally", request_id, outcome.error)
            self._recomputed.add(request_id)
            self.engine.remote_kv_failed(request_id)
        else:
            logger.warning("[%s] KV pull failed: %s", request_id, outcome.error)
            self._fail(request_id, f"KV transfer failed: {outcome.error}", kv_transfer_failed=True)

    def _fail(self, request_id: str, error: str, kv_transfer_failed: bool = False) -> None:
        request = self.engine.scheduler.requests[request_id]
        self.engine.abort_request(request_id)
        self._publish([TokenDelta(request_id, (), (), "abort", None, max(request.num_cached_tokens, 0),
                                  error=error, kv_transfer_failed=kv_transfer_failed)])

    def _on_deltas(self, deltas: list[CompletionDelta]) -> None:
        self._publish([self._token_delta(delta) for delta in deltas if delta.request_id in self._routes])

    def _token_delta(self, delta: CompletionDelta) -> TokenDelta:
        pull = self._pulls_done.pop(delta.request_id, None)
        transfer_s = pull.seconds if pull is not None else None
        queue_s = compute_s = None
        first_output = delta.new_token_ids or delta.embedding is not None
        admitted_at = self._admitted_at.pop(delta.request_id, None) if first_output else None
        if admitted_at is not None:  # the first delta with tokens (or an embedding); the pull is no queueing
            queue_s, compute_s = delta.queue_and_compute_s(admitted_at, time.monotonic())
            queue_s = queue_without_pull(queue_s, admitted_at, pull)
        error = delta.error  # the engine ended it for the request's own fault: the router answers a request error
        return TokenDelta(delta.request_id, delta.new_token_ids, delta.new_logprobs, delta.finish_reason,
                          delta.stop_reason, delta.num_cached_tokens, transfer_s,
                          error=None if error is None else str(error),
                          invalid_field=None if error is None else error.field,
                          kv_transfer_failed=delta.request_id in self._recomputed, queue_s=queue_s,
                          compute_s=compute_s, prompt_logprobs=delta.prompt_logprobs, embedding=delta.embedding)

    def _publish(self, deltas: list[TokenDelta]) -> None:
        """Engine thread: hand each router its deltas as one frame on the event loop."""
        by_router: dict[str, list[TokenDelta]] = {}
        for delta in deltas:
            router_id = self._routes.get(delta.request_id)
            if router_id is not None and delta.request_id not in self._unheard:
                by_router.setdefault(router_id, []).append(delta)
            if delta.finish_reason is not None:
                self._routes.pop(delta.request_id, None)
                self._admitted_at.pop(delta.request_id, None)
                self._pulls_done.pop(delta.request_id, None)
                self._pending.pop(delta.request_id, None)
                self._unheard.discard(delta.request_id)
            self._recomputed.discard(delta.request_id)
        for router_id, batch in by_router.items():
            self._event_loop.call_soon_threadsafe(self._outputs.send, router_id, batch)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _reachable_host() -> str:
    """The address other nodes reach this process at: the Ray node's inside a Ray cluster (the
    local launcher binds Ray to 127.0.0.1), else loopback."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
