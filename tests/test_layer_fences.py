"""FencedSender: on CUDA a layer's announcement leaves only after an event recorded when the layer's
kernels were queued has completed, and nothing overtakes anything. Run here with fences the test
releases by hand (the CUDA event is the one part that needs a GPU: tests/gpu)."""

from __future__ import annotations

import threading

import torch

from splitserve.common.kv_transfer_types import LayerAnnouncement
from splitserve.prefill_worker.layer_fences import CudaFences, FencedSender, device_fences

WAIT_S = 10.0


class HandFence:
    def __init__(self, index: int) -> None:
        self.index = index
        self.passed = threading.Event()

    def wait(self) -> None:
        assert self.passed.wait(WAIT_S), f"fence {self.index} was never released"


class HandFences:
    """Fences the test releases; records when each was taken, relative to the messages sent."""

    def __init__(self) -> None:
        self.fences: list[HandFence] = []

    def record(self) -> HandFence:
        self.fences.append(HandFence(len(self.fences)))
        return self.fences[-1]


class Inbox:
    def __init__(self) -> None:
        self.messages: list = []
        self._changed = threading.Condition()

    def deliver(self, message) -> None:
        with self._changed:
            self.messages.append(message)
            self._changed.notify_all()

    def wait_for(self, count: int) -> list:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.messages) >= count, WAIT_S), self.messages
            return list(self.messages)


def _announcement(layer: int) -> LayerAnnouncement:
    return LayerAnnouncement("r", "prefill-agent", layer)


def test_an_announcement_waits_for_its_fence_and_nothing_overtakes_it():
    fences, inbox = HandFences(), Inbox()
    sender = FencedSender(inbox.deliver, fences)
    try:
        sender.send("params")  # no fence: TransferParams, a PrefillResult
        sender.send(_announcement(0))
        sender.send(_announcement(1))
        sender.send("result")
        assert [fence.index for fence in fences.fences] == [0, 1]  # one per announcement, taken at send()
        assert inbox.wait_for(1) == ["params"]
        fences.fences[1].passed.set()  # layer 1's kernels finished first: it still waits for layer 0
        assert not fences.fences[0].passed.is_set() and inbox.messages == ["params"]
        fences.fences[0].passed.set()
        assert inbox.wait_for(4) == ["params", _announcement(0), _announcement(1), "result"]
    finally:
        sender.close()


def test_close_delivers_what_is_queued():
    fences, inbox = HandFences(), Inbox()
    sender = FencedSender(inbox.deliver, fences)
    sender.send(_announcement(0))
    fences.fences[0].passed.set()
    sender.close()
    assert inbox.messages == [_announcement(0)]


def test_without_fences_it_delivers_inline():
    inbox = Inbox()
    sender = FencedSender(inbox.deliver, None)
    sender.send(_announcement(0))
    assert inbox.messages == [_announcement(0)]  # before send() returned, on this thread
    sender.close()


def test_a_cuda_forward_gets_event_fences_and_a_cpu_one_none():
    assert device_fences(torch.device("cpu")) is None
    assert isinstance(device_fences(torch.device("cuda", 0)), CudaFences)  # built without touching CUDA
