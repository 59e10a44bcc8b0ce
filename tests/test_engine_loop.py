"""EngineLoop.wait_until: a condition on the engine, woken by the call or step that makes it
true (an event, not a timer), bounded by its timeout."""

from __future__ import annotations

import asyncio
import time

from splitserve.engine.engine_loop import EngineLoop


class _IdleEngine:
    """What the loop reads of an engine that never has work; `flag` is the state under test."""

    num_steps = 0
    flag = False

    def has_work(self) -> bool:
        return False


def test_a_waiter_wakes_on_the_call_that_makes_its_condition_true_and_not_before():
    async def scenario():
        loop = EngineLoop(_IdleEngine(), on_deltas=lambda deltas: None)
        loop.start()
        try:
            waiting = asyncio.ensure_future(loop.wait_until(lambda engine: engine.flag, 60.0))
            await asyncio.sleep(0.05)
            still_waiting = not waiting.done()
            started = time.monotonic()
            await loop.run(lambda engine: setattr(engine, "flag", True))
            woke = await asyncio.wait_for(waiting, 5)
            # The idle loop sleeps up to IDLE_WAIT_S between rounds: the call, not a timer, woke it.
            fast = time.monotonic() - started < 0.25
            return still_waiting, woke, fast, await loop.run(lambda engine: len(loop._waiters))
        finally:
            loop.stop()

    assert asyncio.run(scenario()) == (True, True, True, 0)


def test_a_waiter_that_times_out_answers_false_and_is_dropped():
    async def scenario():
        loop = EngineLoop(_IdleEngine(), on_deltas=lambda deltas: None)
        loop.start()
        try:
            timed_out = await loop.wait_until(lambda engine: engine.flag, 0.05)
            already_true = await loop.wait_until(lambda engine: True, 5.0)
            await loop.run(lambda engine: None)
            return timed_out, already_true, await loop.run(lambda engine: len(loop._waiters))
        finally:
            loop.stop()

    assert asyncio.run(scenario()) == (False, True, 0)
