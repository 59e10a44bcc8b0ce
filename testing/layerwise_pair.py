"""One prefill engine and one consumer KV pool in this process, each with its own transfer agent
(in-process or NIXL/UCX): the transfer half of a 1P+1D pair, whole-request or layer-wise.

Whole-request: the pull starts once the prompt's first token exists (what the cluster does today).
Layer-wise: the producer's LayerwiseAnnouncer holds the blocks as the final chunk's forward starts and
announces each layer as the forward writes it; the consumer starts its pull on the TransferParams
and READs each announced layer. The consumer runs either inline (the announcer's send calls it,
so a layer's READ runs inside the forward, before the next layer is computed: deterministic, for
tests) or on its own thread fed through a queue (the READs overlap the forward: for bench/).
On CUDA a layer is announced only once the device wrote it (prefill_worker.layer_fences, as in the
prefill worker): threaded, a FencedSender's thread waits for each layer's fence before queueing the
announcement; inline, the announcing thread waits for it.

The consumer pool has the producer's shape; pulled requests get local blocks in allocation order
(0, 1, 2, ...), reused only after forget(), so a test can compare the pools of two pairs block by block.
"""

from __future__ import annotations

import queue
from collections import deque
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from splitserve.common.config import EngineConfig
from splitserve.common.kv_transfer_types import TransferParams
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.model_loader import model_fingerprint
from splitserve.kv_transfer import ConsumerConnector, ProducerConnector, PullOutcome, PullStatus, make_backend
from splitserve.common.kv_transfer_types import LayerAnnouncement
from splitserve.prefill_worker.layer_fences import FencedSender, device_fences
from splitserve.prefill_worker.layerwise import LayerwiseAnnouncer, LayerwiseMessage


@dataclass(frozen=True)
class PulledPrompt:
    """One prompt prefilled on the producer and pulled into the consumer pool."""

    request_id: str
    first_token_ids: tuple[int, ...]
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]
    outcome: PullOutcome
    admitted_at: float
    first_token_at: float
    """time.perf_counter() when the prefill step that sampled the first token returned."""
    kv_ready_at: float
    """time.perf_counter() when the consumer's pull was DONE (its KV is usable for decoding)."""


class _Consumer:
    """The consumer side: a pool, an agent, a ConsumerConnector, driven by one thread at a time."""

    def __init__(self, kind: str, layout, like: torch.Tensor, num_blocks: int, producer_metadata) -> None:
        # each layer: [num_blocks, *like.shape[1:]], like's dtype and device
        self.layers = [like.new_zeros((num_blocks, *like.shape[1:])) for _ in range(layout.num_layers)]
        self.backend = make_backend(kind, f"decode-{uuid.uuid4().hex[:8]}")
        self.backend.register_kv_pool(self.layers, layout)
        self.backend.add_peer(producer_metadata)
        self.pulls = ConsumerConnector(self.backend)
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.local_block_ids: dict[str, tuple[int, ...]] = {}
        self.done: dict[str, tuple[PullOutcome, float]] = {}
        """request id -> (its outcome, time.perf_counter() when it was seen)."""

    def receive(self, message: LayerwiseMessage, layerwise: bool) -> None:
        if isinstance(message, TransferParams):
            local = tuple(self.free_blocks.popleft() for _ in message.block_ids)
            self.local_block_ids[message.request_id] = local
            self.pulls.start(message, local, layerwise=layerwise)
        else:
            self.pulls.announce(message)
        self.collect()

    def reading(self) -> bool:
        """Whether a READ is in flight (a pull AWAITING_LAYER has nothing to poll until its next message)."""
        return any(self.pulls.status(request_id) in (PullStatus.PULLING, PullStatus.VERIFYING)
                   for request_id in self.local_block_ids)

    def collect(self) -> None:
        now = time.perf_counter()
        for outcome in self.pulls.poll():
            self.done[outcome.request_id] = (outcome, now)

    def close(self) -> None:
        self.backend.close()


class LayerwisePair:
    """Use as a context manager; not thread-safe (one caller drives prefill())."""

    def __init__(self, model_dir: Path, config: EngineConfig, backend: str = "inprocess", layerwise: bool = True,
                 threaded: bool = False, consumer_blocks: int = 256, lease_ttl_s: float = 30.0) -> None:
        self.layerwise, self.threaded = layerwise, threaded
        self.engine = EngineCore(model_dir, config)
        layout = self.engine.kv_layout(model_fingerprint(Path(model_dir)))
        self.producer = make_backend(backend, f"prefill-{uuid.uuid4().hex[:8]}")
        self.producer.register_kv_pool(self.engine.kv_cache.layers, layout)
        self.leases = ProducerConnector(self.producer, layout, lease_ttl_s)
        self.consumer = _Consumer(backend, layout, self.engine.kv_cache.layers[0], consumer_blocks,
                                  self.producer.metadata())
        self._fences = device_fences(self.engine.device)
        self.announcer = LayerwiseAnnouncer(self.leases, self._send)
        if layerwise:
            self.engine.set_layer_listener(self.announcer)
        self._inbox: queue.SimpleQueue[LayerwiseMessage | None] = queue.SimpleQueue()
        """Messages for the consumer thread (threaded only); None stops it."""
        self._sender = FencedSender(self._inbox.put, self._fences) if threaded else None
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._consume, name="layerwise-consumer", daemon=True)
        if threaded:
            self._thread.start()

    @property
    def consumer_layers(self) -> list[torch.Tensor]:
        return self.consumer.layers

    def prefill(self, request_id: str, prompt: list[int], params: SamplingParams,
                timeout_s: float = 60.0) -> PulledPrompt:
        """Prefill one prompt (its first token must not end it) and wait until the consumer pulled it."""
        admitted_at = time.perf_counter()
        self.engine.add_request(request_id, prompt, params, hold_kv_after_prefill=True)
        first_token_ids: tuple[int, ...] | None = None
        while first_token_ids is None:
            for delta in self.engine.step():
                if delta.request_id == request_id:
                    first_token_ids = delta.new_token_ids
        first_token_at = time.perf_counter()
        held = self.engine.take_held_kv(request_id)
        assert held is not None, f"{request_id} ended at its first token: nothing to pull"
        params_sent = self.announcer.settle(request_id, held)
        if not self.layerwise:
            self._send(self.leases.hold(request_id, held.block_ids, held.num_tokens))
        else:
            assert params_sent is not None
        outcome, kv_ready_at = self._wait_pulled(request_id, timeout_s)
        self._end_lease(request_id, timeout_s)
        return PulledPrompt(request_id, first_token_ids, held.block_ids, self.consumer.local_block_ids[request_id],
                            outcome, admitted_at, first_token_at, kv_ready_at)

    def forget(self, pulled: PulledPrompt) -> None:
        """Give a pulled request's local blocks back (a later pull may overwrite them)."""
        del self.consumer.local_block_ids[pulled.request_id]
        self.consumer.free_blocks.extend(pulled.local_block_ids)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._inbox.put(None)
            self._thread.join(10.0)
        self.consumer.close()
        self.producer.close()

    def __enter__(self) -> LayerwisePair:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------
    def _send(self, message: LayerwiseMessage) -> None:
        if self._sender is not None:
            self._sender.send(message)
            return
        if self._fences is not None and isinstance(message, LayerAnnouncement):
            self._fences.record().wait()
        self.consumer.receive(message, self.layerwise)

    def _consume(self) -> None:
        """Consumer thread: handle each message as it comes; while a READ is in flight (NIXL may
        complete it later), poll it every 0.5 ms between messages."""
        if self.engine.device.type == "cuda":
            # The CUDA runtime makes a device current per thread; UCX's cuda_ipc READs call the driver on this
            # thread, which never ran a CUDA op (an unconfirmed cause of this pair hanging over NIXL on an H200).
            torch.cuda.set_device(self.engine.device)
        while True:
            try:
                message = self._inbox.get(timeout=0.0005 if self.consumer.reading() else None)
            except queue.Empty:
                message = _POLL
            if message is None:
                return
            if message is not _POLL:
                self.consumer.receive(message, self.layerwise)
            else:
                self.consumer.collect()
            with self._done:
                self._done.notify_all()

    def _wait_pulled(self, request_id: str, timeout_s: float) -> tuple[PullOutcome, float]:
        deadline = time.monotonic() + timeout_s
        if not self.threaded:
            while request_id not in self.consumer.done:
                assert time.monotonic() < deadline, f"{request_id}: the pull did not finish"
                self.consumer.collect()
            return self.consumer.done.pop(request_id)
        with self._done:
            assert self._done.wait_for(lambda: request_id in self.consumer.done, timeout_s), \
                f"{request_id}: the pull did not finish"
            return self.consumer.done.pop(request_id)

    def _end_lease(self, request_id: str, timeout_s: float) -> None:
        """Free the producer's blocks once the consumer's notification ended the lease."""
        deadline = time.monotonic() + timeout_s
        while True:
            ended = [lease.request_id for lease in self.leases.poll()]
            for ended_id in ended:
                self.engine.release_held_kv(ended_id)
            if request_id in ended:
                return
            assert time.monotonic() < deadline, f"{request_id}: the lease did not end"
            time.sleep(0.0001)  # NIXL delivers the notification inside poll(): ask again shortly


_POLL = object()
"""What the consumer thread handles when no message came in time: poll the pulls in flight."""


def pulled_bytes(layers: list[torch.Tensor], block_ids: tuple[int, ...]) -> list[torch.Tensor]:
    """Each layer's blocks block_ids, in order, as bytes: [len(block_ids), ...] uint8 per layer."""
    return [layer.view(torch.uint8)[list(block_ids)] for layer in layers]


