"""When a layer-wise announcement may leave the prefill worker: only after the device wrote the layer.

On CPU the forward's layer hook runs once the layer's keys and values are in the pool, so an
announcement can go out at once. On CUDA the host loop runs ahead of its kernels: the hook runs
when layer l's kernels are queued, not done. There, every announcement gets an event recorded on
the stream right when the hook runs (so after layer l's writes and before layer l + 1's), and is
delivered only once that event has completed.

`FencedSender` is the one path from the engine thread to the requests' outboxes. It keeps the order
of everything it is given (a request's TransferParams, then its layers in order, then its
PrefillResult), and on CUDA it waits for the fences on its own thread, so the engine thread never
waits for the GPU. The CUDA-only part is `CudaFences`; the ordering and waiting logic runs on CPU in
the tests with fences a test releases by hand.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

from splitserve.common.kv_transfer_types import LayerAnnouncement

M = TypeVar("M")


class LayerFence(Protocol):
    def wait(self) -> None:
        """Return once the device work queued before the fence was recorded has completed."""


class DeviceFences(Protocol):
    def record(self) -> LayerFence:
        """A fence after everything queued on the device's current stream so far."""


class CudaFences:
    """CUDA only: one torch.cuda.Event per fence, recorded on the device's current stream."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def record(self) -> LayerFence:
        # blocking: the announcing thread sleeps in synchronize() instead of spinning a core for the whole forward.
        event = torch.cuda.Event(blocking=True)
        event.record(torch.cuda.current_stream(self._device))
        return _CudaFence(event)


class _CudaFence:
    def __init__(self, event) -> None:
        self._event = event

    def wait(self) -> None:
        self._event.synchronize()


def device_fences(device: torch.device) -> DeviceFences | None:
    """The fences a forward on `device` needs before a layer is announced (None: the host runs in step)."""
    return CudaFences(device) if device.type == "cuda" else None


class FencedSender(Generic[M]):
    """Delivers every message it is sent, in send order; a LayerAnnouncement only after the fence
    recorded when it was sent has passed.

    Without fences (CPU) `send` delivers inline, on the caller's thread. With fences, `send` only
    records the fence and queues; one thread waits and delivers. `close()` delivers what is queued
    and stops that thread. `deliver` must not raise (it runs on that thread)."""

    def __init__(self, deliver: Callable[[M], None], fences: DeviceFences | None, name: str = "layer-fences") -> None:
        self._deliver = deliver
        self._fences = fences
        self._queue: queue.SimpleQueue[tuple[LayerFence | None, M] | None] = queue.SimpleQueue()
        """(fence to pass first, message), in send order; None stops the thread."""
        self._thread: threading.Thread | None = None
        if fences is not None:
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            self._thread.start()

    def send(self, message: M) -> None:
        if self._fences is None:
            self._deliver(message)
            return
        fence = self._fences.record() if isinstance(message, LayerAnnouncement) else None
        self._queue.put((fence, message))

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fence, message = item
            if fence is not None:
                fence.wait()
            self._deliver(message)
