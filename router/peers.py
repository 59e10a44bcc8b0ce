"""Which (decode worker, prefill transfer agent) pairs have shaken hands (the KV-layout check
before a decode worker may pull from a prefill worker's agent).

Each pair shakes hands once; requests that need a pair whose handshake is still running share
it; a failed handshake is forgotten, so the next request tries again. A worker's restart drops
its pairs (a restarted decode worker knows no peer; a restarted prefill worker has a new agent).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable


class PeerHandshakes:
    def __init__(self) -> None:
        self._handshakes: dict[tuple[str, str], asyncio.Future] = {}
        """(decode worker id, prefill agent name) -> its handshake, running or done (event loop only)."""

    async def ensure(self, decode_worker_id: str, agent_name: str, shake: Callable[[], Awaitable[None]]) -> None:
        """Return once the pair has shaken hands, calling shake() only if no handshake of the
        pair is running or done; raises what the handshake raised. A caller cancelled while it
        waits leaves the handshake running for the others."""
        key = (decode_worker_id, agent_name)
        if key not in self._handshakes:
            self._handshakes[key] = asyncio.ensure_future(shake())
        try:
            await asyncio.shield(self._handshakes[key])
        except Exception:
            self._handshakes.pop(key, None)
            raise

    def __contains__(self, pair: tuple[str, str]) -> bool:
        """A (decode worker id, agent name) pair whose handshake is running or done."""
        return pair in self._handshakes

    def forget(self, worker_id: str, agent_name: str) -> None:
        """Drop every pair whose decode worker is `worker_id` or whose agent is `agent_name`."""
        for key in [key for key in self._handshakes if key[0] == worker_id or key[1] == agent_name]:
            del self._handshakes[key]
