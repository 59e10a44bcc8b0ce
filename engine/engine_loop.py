"""Runs one EngineCore on a background thread; the only thread that touches the engine.

Other threads (a Ray actor's event loop) hand it work as callables through `call()`. Between
steps the loop runs those, then the owner's `background` hook (transfer polling), then one
engine step. It sleeps when there is nothing to do, waking on a new call or when the hook
asks to be polled again. `wait_until()` lets another thread wait for a condition on the engine
that a call or a step makes true (e.g. new KV events), checked once per round: an event, not
a timer.
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


class EngineLoopStopped(RuntimeError):
    """A call reached an engine loop that has been stopped."""


class EngineLoop:
    def __init__(self, engine: EngineCore, on_deltas: Callable[[list[CompletionDelta]], None],
                 background: Callable[[], float | None] = lambda: None,
                 on_step_failure: Callable[[EngineCore], None] | None = None, name: str = "engine-loop") -> None:
        """`background()` runs before every step and returns how soon (seconds) it wants to run
        again when the engine is otherwise idle, or None for no hurry. `on_step_failure(engine)`
        decides what happens to the in-flight requests when a step raises (default: abort all)."""
        self.engine = engine
        self._on_deltas = on_deltas
        self._background = background
        self._on_step_failure = on_step_failure or abort_all
        self._calls: queue.SimpleQueue[tuple[Callable[[EngineCore], object], Future]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopping = False
        self._step_gate: Callable[[EngineCore], bool] | None = None
        self._waiters: list[tuple[Callable[[EngineCore], bool], Future[None]]] = []
        """Conditions checked after every step (loop thread only)."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout_s)
        self._fail_queued_calls()

    def call(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run fn(engine) on the loop thread before its next step. Once the loop is stopped,
        the future fails with EngineLoopStopped (a caller never waits forever)."""
        future: Future[T] = Future()
        self._calls.put((fn, future))
        self._wakeup.set()
        if self._stopping:
            self._fail_queued_calls()
        return future

    async def run(self, fn: Callable[[EngineCore], T]) -> T:
        """call() for coroutines: await fn(engine) without blocking the event loop."""
        return await asyncio.wrap_future(self.call(fn))

    async def wait_until(self, condition: Callable[[EngineCore], bool], timeout_s: float) -> bool:
        """Wait (without blocking the event loop) until condition(engine), evaluated on the loop
        thread now and after every round of calls and step, holds; False when timeout_s passed first."""
        waiter: Future[None] = Future()
        await self.run(lambda engine: self._add_waiter(condition, waiter))
        try:
            await asyncio.wait_for(asyncio.wrap_future(waiter), timeout_s)
        except TimeoutError:  # the waiter was cancelled with it; the loop drops it
            return False
        return True

    def set_step_gate(self, gate: Callable[[EngineCore], bool] | None) -> None:
        """Test hook: before each step the loop asks gate(engine) (on the loop thread); while it
        answers False the loop still runs calls and the background hook but steps no request, so
        a test can hold a request in one state (queued, part-prefilled, decoding) and act on it
        there. None removes the gate."""
        self._step_gate = gate
        self._wakeup.set()

    def _run(self) -> None:
        """Invariant: the thread survives any exception from a hook or a step (a dead loop would
        leave every stream of this worker hanging)."""
        while not self._stopping:
            self._run_calls()
            poll_again_s = self._guarded(self._background)
            stepped = self.engine.has_work() and self._may_step() and self._step()
            if self._waiters:
                self._wake_waiters()
            if stepped:
                continue
            # Idle, or the scheduler could place nothing (e.g. every block is held for a
            # transfer): sleep until a call arrives or the hook wants to poll again.
            self._wakeup.wait(IDLE_WAIT_S if poll_again_s is None else min(poll_again_s, IDLE_WAIT_S))
            self._wakeup.clear()
        self._run_calls()

    def _add_waiter(self, condition: Callable[[EngineCore], bool], waiter: Future[None]) -> None:
        self._waiters = [(c, w) for c, w in self._waiters if not w.done()]
        self._waiters.append((condition, waiter))
        self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Invariant: a waiter is resolved at most once; cancelled (timed-out) ones are skipped."""
        for condition, waiter in self._waiters:
            if not waiter.done() and self._guarded(lambda: condition(self.engine)):
                if waiter.set_running_or_notify_cancel():
                    waiter.set_result(None)
        self._waiters = [(c, w) for c, w in self._waiters if not w.done()]

    def _may_step(self) -> bool:
        gate = self._step_gate
        return gate is None or bool(self._guarded(lambda: gate(self.engine)))

    def _guarded(self, hook: Callable[[], T]) -> T | None:
        try:
            return hook()
        except Exception:
            logger.exception("%s: %s failed", self._thread.name, getattr(hook, "__name__", hook))
            return None

    def _fail_queued_calls(self) -> None:
        while True:
            try:
                _, future = self._calls.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineLoopStopped(f"{self._thread.name} is stopped"))

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

    def _step(self) -> bool:
        """One engine step; False when it made no progress (nothing scheduled, nothing to report)."""
        steps_before = self.engine.num_steps
        try:
            deltas = self.engine.step()
        except Exception:
            logger.exception("%s: engine step failed with %d requests in flight", self._thread.name,
                             len(self.engine.scheduler.requests))
            self._guarded(lambda: self._on_step_failure(self.engine))
            return True
        if deltas:
            self._guarded(lambda: self._on_deltas(deltas))
        return bool(deltas) or self.engine.num_steps != steps_before


def abort_all(engine: EngineCore) -> None:
    """Default step-failure policy: end every request (their abort deltas come out of the next step)."""
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
