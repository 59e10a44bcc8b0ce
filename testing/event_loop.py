"""An asyncio loop on a background thread, for synchronous code that drives async servers."""

from __future__ import annotations

import asyncio
import threading


class EventLoopThread:
    """An asyncio loop on a background thread, so sync tests can drive async servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine, timeout_s: float = 300.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def close(self) -> None:
        """Cancel what still runs on the loop and wait for it, then stop and close the loop (a task
        left pending would be finalized later, on whatever code is running then)."""
        self.run(self._cancel_pending())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        self.loop.close()

    @staticmethod
    async def _cancel_pending() -> None:
        pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
