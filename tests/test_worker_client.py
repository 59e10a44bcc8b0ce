"""RayWorker, the router's proxy for a worker actor: a call the router stops awaiting is cancelled on the actor
(with a stand-in actor handle; tests/test_faults.py and the Ray cluster tests run the real one)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.worker_messages import PrefillRequest
from splitserve.router import worker_client
from splitserve.router.worker_client import RayWorker


class _PendingCall:
    """An actor call's ObjectRef that never resolves (the actor task still running)."""

    def __await__(self):
        return asyncio.get_running_loop().create_future().__await__()


class _Method:
    def __init__(self) -> None:
        self.calls: list[_PendingCall] = []

    def remote(self, *args: object) -> _PendingCall:
        self.calls.append(_PendingCall())
        return self.calls[-1]


class _Handle:
    def __init__(self) -> None:
        self.prefill = _Method()


def test_a_cancelled_prefill_cancels_its_actor_task(monkeypatch):
    cancelled: list[object] = []
    monkeypatch.setattr(worker_client, "_cancel", cancelled.append)
    handle = _Handle()
    worker = RayWorker("prefill-0", handle)
    request = PrefillRequest("r1", [1, 2, 3], SamplingParams(max_tokens=4), "router-0")

    async def run() -> None:
        task = asyncio.create_task(worker.prefill(request))
        await asyncio.sleep(0)
        assert cancelled == []  # in flight: nothing cancelled yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert cancelled == handle.prefill.calls and len(cancelled) == 1
