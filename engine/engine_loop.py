"""Runs one EngineCore on a background thread; the only thread that touches the engine.

Other threads (a Ray actor's event loop) hand it work as callables through `call()`. Between
steps the loop runs those, then the owner's `background` hook (transfer polling), then one
engine step. It sleeps when there is nothing to do, waking on a new call or when the hook
asks to be polled again.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from splitserve.engine.engine_core import EngineCore
from splitserve.engine.outputs import CompletionDelta

T = TypeVar("T")
logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5
"""Longest sleep when idle; calls wake the loop at once."""


class EngineLoop:
    def __init__(self, engine: EngineCore, on_deltas: Callable[[list[CompletionDelta]], None],
                 background: Callable[[], float | None] = lambda: None, name: str = "engine-loop") -> None:
        """`background()` runs before every step and returns how soon (seconds) it wants to run
        again when the engine is otherwise idle, or None for no hurry."""
        self.engine = engine
        self._on_deltas = on_deltas
        self._background = background
        self._calls: queue.SimpleQueue[tuple[Callable[[EngineCore], object], Future]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)

    def call(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run fn(engine) on the loop thread before its next step."""
        future: Future[T] = Future()
        self._calls.put((fn, future))
        self._wakeup.set()
        return future

    async def run(self, fn: Callable[[EngineCore], T]) -> T:
        """call() for coroutines: await fn(engine) without blocking the event loop."""
        return await asyncio.wrap_future(self.call(fn))

    def _run(self) -> None:
        while not self._stopping:
            self._run_calls()
            poll_again_s = self._background()
            if self.engine.has_work():
                self._step()
                continue
            self._wakeup.wait(IDLE_WAIT_S if poll_again_s is None else min(poll_again_s, IDLE_WAIT_S))
            self._wakeup.clear()
        self._run_calls()

    def _run_calls(self) -> None:
        while True:
            try:
                fn, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except Exception as error:  # handed to the caller, who owns the decision
                future.set_exception(error)

    def _step(self) -> None:
        try:
            deltas = self.engine.step()
        except Exception:
            # A failed forward pass must not kill the loop (every stream would hang): end the
            # in-flight requests (their abort deltas come out of the next step) and go on.
            logger.exception("engine step failed; aborting %d requests", len(self.engine.scheduler.requests))
            for request_id in list(self.engine.scheduler.requests):
                self.engine.abort_request(request_id)
            return
        if deltas:
            self._on_deltas(deltas)
