"""Push, not poll: nothing a request's own work runs through (the router's orchestration, the
workers' actor methods, the output streams) sleeps on a timer; every wait ends on an event.

The request's task carries a context variable that every task it starts inherits (asyncio copies
the context at task creation), so a sleep anywhere downstream of the request is caught, while the
router's background loops (report polls, the loop-lag heartbeat) are not on the request path."""

from __future__ import annotations

import asyncio
import contextvars
import traceback

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.router.api_types import GenerationInput
from splitserve.router.policy import RoutingConfig
from splitserve.testing.in_process_cluster import InProcessCluster
from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy

PROMPT = list(range(5, 45))
NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
ON_REQUEST_PATH = contextvars.ContextVar("on_request_path", default=False)


@pytest.mark.parametrize("mode, disaggregation", [("colocated", "never"), ("disaggregated", "always")])
def test_no_timer_sleeps_on_a_requests_path(tiny_llama_dir, monkeypatch, mode, disaggregation):
    real_sleep = asyncio.sleep
    sleeps: list[str] = []

    async def recording_sleep(delay, result=None):
        if ON_REQUEST_PATH.get() and delay > 0:
            sleeps.append(f"asyncio.sleep({delay}) from\n{''.join(traceback.format_stack(limit=6))}")
        return await real_sleep(delay, result)

    monkeypatch.setattr(asyncio, "sleep", recording_sleep)

    async def request(cluster: InProcessCluster) -> list[int]:
        ON_REQUEST_PATH.set(True)
        inp = GenerationInput("a", tuple(PROMPT), GREEDY)
        return [token for chunk in [c async for c in cluster.orchestrator.generate(inp)] for token in chunk.token_ids]

    async def scenario():
        routing = RoutingConfig(disaggregation=disaggregation)
        async with InProcessCluster(tiny_llama_dir, mode=mode, routing=routing) as cluster:
            tokens = await asyncio.create_task(request(cluster))
            await cluster.wait_idle()
            return tokens

    tokens = asyncio.run(scenario())
    assert tokens == hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))
    assert sleeps == []
