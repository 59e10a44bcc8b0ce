"""router/peers.py: each (decode worker, prefill agent) pair shakes hands once, shared while it
runs, retried after a failure, dropped on a restart."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.router.peers import PeerHandshakes


def test_concurrent_requests_share_one_handshake_and_later_ones_reuse_it():
    calls: list[str] = []

    async def scenario():
        peers, gate = PeerHandshakes(), asyncio.Event()

        async def shake():
            calls.append("add_peer")
            await gate.wait()

        waiting = [asyncio.ensure_future(peers.ensure("decode-0", "agent-a", shake)) for _ in range(3)]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*waiting)
        await peers.ensure("decode-0", "agent-a", shake)

    asyncio.run(scenario())
    assert calls == ["add_peer"]


def test_a_failed_handshake_is_tried_again_by_the_next_request():
    calls: list[int] = []

    async def scenario():
        peers = PeerHandshakes()

        async def shake():
            calls.append(len(calls))
            if len(calls) == 1:
                raise ConnectionError("agent-a is gone")

        with pytest.raises(ConnectionError, match="agent-a is gone"):
            await peers.ensure("decode-0", "agent-a", shake)
        await peers.ensure("decode-0", "agent-a", shake)

    asyncio.run(scenario())
    assert calls == [0, 1]


def test_a_restart_drops_the_workers_pairs_and_only_those():
    calls: list[tuple[str, str]] = []

    async def scenario():
        peers = PeerHandshakes()

        def shake_for(pair):
            async def shake():
                calls.append(pair)
            return shake

        pairs = [("decode-0", "agent-a"), ("decode-1", "agent-a"), ("decode-1", "agent-b"), ("decode-0", "agent-b")]
        for pair in pairs:
            await peers.ensure(*pair, shake_for(pair))
        peers.forget("prefill-0", "agent-a")  # prefill-0 restarted: its old agent agent-a is gone
        peers.forget("decode-1", "agent-none")  # decode-1 restarted: it knows no peer
        for pair in pairs:
            await peers.ensure(*pair, shake_for(pair))

    asyncio.run(scenario())
    assert calls == [("decode-0", "agent-a"), ("decode-1", "agent-a"), ("decode-1", "agent-b"), ("decode-0", "agent-b"),
                     ("decode-0", "agent-a"), ("decode-1", "agent-a"), ("decode-1", "agent-b")]
