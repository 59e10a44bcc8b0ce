"""The prefill worker (producer role): computes prompts' KV, returns the first token and
holds the blocks under a lease until a decode worker pulls them.

Layer-wise (`layerwise=True`, the cluster's kv_transfer_layerwise): the worker holds a prompt's
blocks as its final chunk's forward starts and announces each layer as it is written
(LayerwiseAnnouncer); `prefill_layerwise` streams that progress, then the first token, to the
router, which relays it to the decode worker that is already pulling.

A plain class so it can be tested without Ray; deploy/ wraps it with `ray.remote`. Its async
methods run on the actor's event loop; the engine runs on its own thread (EngineLoop).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from splitserve.common.config import EngineConfig
from splitserve.common.kv_events import WorkerReport
from splitserve.common.worker_messages import (LayerwiseProgress, PrefillRequest, PrefillResult, WorkerInfo,
                                               WorkerStats)
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.engine_loop import EngineLoop, abort_all
from splitserve.engine.model_loader import model_fingerprint
from splitserve.engine.outputs import CompletionDelta
from splitserve.engine.worker_report import wait_for_report
from splitserve.kv_transfer import ProducerConnector, make_backend
from splitserve.prefill_worker.layer_fences import FencedSender, device_fences
from splitserve.prefill_worker.layerwise import LayerwiseAnnouncer, LayerwiseMessage

logger = logging.getLogger(__name__)

LEASE_POLL_S = 0.002
"""How often held leases are checked for pull notifications and expiry (the default of the
prefill pool's transfer_poll_s)."""


@dataclass
class _InFlight:
    future: Future | None
    """Where prefill() waits for the result; None: a prefill_layerwise() stream (its outbox)."""
    admitted_at: float


@dataclass
class _Outbox:
    """A prefill_layerwise() stream's queue on the actor's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[LayerwiseMessage | PrefillResult]

    def put(self, item: LayerwiseMessage | PrefillResult) -> None:
        """Any thread; dropped once the loop is closed (the worker is shutting down)."""
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class PrefillWorker:
    def __init__(self, model_dir: str | Path, engine_config: EngineConfig, transfer_backend: str = "nixl",
                 lease_ttl_s: float = 30.0, worker_id: str | None = None,
                 transfer_poll_s: float = LEASE_POLL_S, layerwise: bool = False,
                 tokenizer_dir: str | Path | None = None) -> None:
        """`layerwise`: announce each layer as it is written (prefill_layerwise streams it); `tokenizer_dir`:
        the cluster's --tokenizer directory (structured output's vocabulary), None: the model directory."""
        self.worker_id = worker_id or f"prefill-{uuid.uuid4().hex[:8]}"
        self.engine = EngineCore(model_dir, engine_config, show_progress=True, tokenizer_dir=tokenizer_dir)
        self._layout = self.engine.kv_layout(model_fingerprint(Path(model_dir)))
        # A new agent name on every start, so peers never confuse a restarted worker with its old self.
        self._backend = make_backend(transfer_backend, f"{self.worker_id}-{uuid.uuid4().hex[:8]}")
        self._backend.register_kv_pool(self.engine.kv_cache.layers, self._layout)
        self._leases = ProducerConnector(self._backend, self._layout, lease_ttl_s)
        self._info = WorkerInfo(self.worker_id, "prefill", self.engine.max_model_len, self.engine.vocab_size,
                                self._layout, self._backend.metadata(),
                                max_num_seqs=engine_config.max_num_seqs, layerwise=layerwise,
                                scheduling_policy=engine_config.scheduling_policy)
        self._outboxes: dict[str, _Outbox] = {}
        """request id -> its prefill_layerwise() stream: added and removed on the event loop, read by
        the thread that delivers (the engine thread, or on CUDA the fence thread)."""
        self._sender: FencedSender[LayerwiseMessage | PrefillResult] | None = None
        """Layer-wise: the one ordered path of a request's progress and result to its stream."""
        self._announcer: LayerwiseAnnouncer | None = None
        if layerwise:
            self._sender = FencedSender(self._deliver, device_fences(self.engine.device),
                                        name=f"{self.worker_id}-fences")
            self._announcer = LayerwiseAnnouncer(self._leases, self._sender.send)
            self.engine.set_layer_listener(self._announcer)
        self._in_flight: dict[str, _InFlight] = {}
        self._routers: dict[str, str] = {}
        """request id -> the router that sent it, from admission until the request or its lease
        ends (engine thread only)."""
        self._transfer_poll_s = transfer_poll_s
        self._loop = EngineLoop(self.engine, self._on_deltas, self._poll_leases, self._on_step_failure,
                                name=self.worker_id)
        self._loop.start()

    # ---- actor API -----------------------------------------------------------------------
    async def info(self) -> WorkerInfo:
        return self._info

    async def prefill(self, request: PrefillRequest) -> PrefillResult:
        """Prefill one prompt; returns once its first token exists (or it ended). A cancelled
        call aborts the request here (and frees its lease if it got that far)."""
        future: Future = Future()
        try:
            await self._loop.run(lambda engine: self._admit(engine, request, future))
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()  # if the engine thread admitted it anyway, the result is dropped and the KV freed
            self._loop.call(lambda engine: self._abort(engine, request.request_id))
            raise

    async def prefill_layerwise(self, request: PrefillRequest) -> AsyncIterator[LayerwiseProgress | PrefillResult]:
        """Prefill one prompt on a layer-wise worker: its LayerwiseProgress (TransferParams as its final
        chunk starts, then each layer written; what queued meanwhile travels as one item), then its
        PrefillResult, which ends the stream. Closing the stream early aborts the request here."""
        if self._announcer is None:
            raise RuntimeError(f"prefill worker {self.worker_id} is not layer-wise (kv_transfer_layerwise is off)")
        outbox = self._outboxes[request.request_id] = _Outbox(asyncio.get_running_loop(), asyncio.Queue())
        ended = False
        try:
            await self._loop.run(lambda engine: self._admit(engine, request, None))
            while not ended:
                items = [await outbox.queue.get()]
                while not outbox.queue.empty():
                    items.append(outbox.queue.get_nowait())
                progress = tuple(item for item in items if not isinstance(item, PrefillResult))
                if progress:
                    yield LayerwiseProgress(request.request_id, progress)
                for result in (item for item in items if isinstance(item, PrefillResult)):
                    ended = True
                    yield result
        finally:
            del self._outboxes[request.request_id]
            if not ended:  # nobody will pull its KV: ends it in any state (a no-op once it ended)
                self._loop.call(lambda engine: self._abort(engine, request.request_id))

    async def abort(self, request_id: str) -> bool:
        """Stop a request in any state here: queued, prefilling, or holding KV for a pull."""
        return await self._loop.run(lambda engine: self._abort(engine, request_id))

    async def abort_router(self, router_id: str) -> int:
        """End every request of a router that is gone (Ray reports its actor dead): queued,
        prefilling, or holding KV for a pull nobody will ask for. Returns how many it ended."""
        return await self._loop.run(lambda engine: self._abort_router(engine, router_id))

    async def stats(self) -> WorkerStats:
        return await self._loop.run(lambda engine: WorkerStats(engine.stats(), self._leases.stats().num_held, 0,
                                                               frozenset(self._routers.values())))

    async def report(self, epoch: str | None, after_seq: int, max_wait_s: float) -> WorkerReport:
        """Load and KV events after the router's cursor (epoch, after_seq), or a snapshot when the cursor
        cannot be continued; with nothing new it waits up to max_wait_s for events."""
        return await wait_for_report(self._loop, self.worker_id, epoch, after_seq, max_wait_s,
                                     lambda: self._leases.stats().num_expired)

    def shutdown(self) -> None:
        self._loop.stop()
        if self._sender is not None:
            self._sender.close()
        self._backend.close()

    # ---- engine thread -------------------------------------------------------------------
    def _admit(self, engine: EngineCore, request: PrefillRequest, future: Future | None) -> None:
        if request.pooling_params is not None:  # an embedding: nothing is held, no KV moves
            engine.add_pooling_request(request.request_id, list(request.prompt_token_ids), request.pooling_params,
                                       request.cache_salt, request.priority, request.lora_request)
        else:
            engine.add_request(request.request_id, list(request.prompt_token_ids), request.sampling_params,
                               hold_kv_after_prefill=True, cache_salt=request.cache_salt, priority=request.priority,
                               lora_request=request.lora_request)
        self._in_flight[request.request_id] = _InFlight(future, time.monotonic())
        self._routers[request.request_id] = request.router_id
        logger.debug("[%s] prefill admitted (%d prompt tokens)", request.request_id, len(request.prompt_token_ids))

    def _abort(self, engine: EngineCore, request_id: str) -> bool:
        if engine.abort_request(request_id):
            return True  # its final delta (an abort) ends it in _on_deltas
        if self._leases.release(request_id):
            engine.release_held_kv(request_id)
            self._routers.pop(request_id, None)
            return True
        return False

    def _abort_router(self, engine: EngineCore, router_id: str) -> int:
        request_ids = [request_id for request_id, sender in self._routers.items() if sender == router_id]
        if request_ids:
            logger.warning("router %s is gone with %d requests here: aborting them", router_id, len(request_ids))
        return sum(self._abort(engine, request_id) for request_id in request_ids)

    def _on_deltas(self, deltas: list[CompletionDelta]) -> None:
        now = time.monotonic()
        for delta in deltas:
            in_flight = self._in_flight.pop(delta.request_id, None)
            if in_flight is None:  # every prefill delta is final: the first token or an abort
                continue
            result = self._result(delta, *delta.queue_and_compute_s(in_flight.admitted_at, now))
            if result.transfer is None:  # nothing held: the request ends here
                self._routers.pop(delta.request_id, None)
            if in_flight.future is None:
                self._sender.send(result)  # after the request's announcements
                continue
            if not in_flight.future.set_running_or_notify_cancel():
                # The caller went away: nobody will pull these blocks.
                self._abort(self.engine, delta.request_id)
                continue
            in_flight.future.set_result(result)

    def _result(self, delta: CompletionDelta, queue_s: float, compute_s: float) -> PrefillResult:
        held = self.engine.take_held_kv(delta.request_id)
        transfer = None
        finish_reason = delta.finish_reason
        if self._announcer is not None:  # held (or released) as its final chunk started
            transfer = self._announcer.settle(delta.request_id, held)
        elif held is not None:
            transfer = self._leases.hold(delta.request_id, held.block_ids, held.num_tokens)
        if held is not None:
            finish_reason = None
        error = delta.error
        return PrefillResult(delta.request_id, delta.new_token_ids, delta.new_logprobs, finish_reason,
                             delta.stop_reason, delta.num_cached_tokens, transfer,
                             held.generator_state if held is not None else None, compute_s, queue_s,
                             delta.prompt_logprobs, None if error is None else str(error),
                             None if error is None else error.field, delta.embedding)

    def _deliver(self, item: LayerwiseMessage | PrefillResult) -> None:
        """To the request's prefill_layerwise() stream. A result nobody waits for any more (the stream
        closed) has its lease and blocks released; progress for it is dropped."""
        outbox = self._outboxes.get(item.request_id)
        if outbox is not None:
            outbox.put(item)
        elif isinstance(item, PrefillResult) and item.transfer is not None:
            self._loop.call(lambda engine: self._abort(engine, item.request_id))

    def _on_step_failure(self, engine: EngineCore) -> None:
        """Release the leases held as final chunks started (their generations are bumped before the
        blocks can be reused), then end every request (their abort results reach their callers)."""
        if self._announcer is not None:
            self._announcer.abandon()
        abort_all(engine)

    def _poll_leases(self) -> float | None:
        # poll() and release() bump the blocks' generations before they return, so a pull still
        # reading these blocks fails its check instead of decoding from the reused blocks.
        for lease in self._leases.poll():
            self.engine.release_held_kv(lease.request_id)
            self._routers.pop(lease.request_id, None)
            logger.debug("[%s] lease ended: %s", lease.request_id, lease.state.value)
        return self._transfer_poll_s if self._leases.stats().num_held else None
