"""The pools change size on a real Ray cluster (KV over NIXL): a worker the planner's adapter
starts joins the router's pool; one it stops is drained first (its streams finish, new requests
go elsewhere) and its actor ends. Outputs equal Hugging Face's greedy tokens; every worker ends idle."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.planner.core.types import Role
from splitserve.router.api_types import GenerationInput
from splitserve.testing.local_cluster import running_cluster, tiny_cluster_config
from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy

pytestmark = pytest.mark.slow

PROMPT = tuple(range(7, 57))
NUM_TOKENS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


async def _stream(cluster, request_id: str, started: asyncio.Event | None = None) -> list[int]:
    tokens: list[int] = []
    async for chunk in cluster.orchestrator.generate(GenerationInput(request_id, PROMPT, GREEDY)):
        tokens.extend(chunk.token_ids)
        if started is not None and len(tokens) >= 4:
            started.set()
    return tokens


def test_a_started_worker_joins_and_a_stopped_one_drains_with_streams_in_flight(tiny_llama_dir):
    records = []
    config = tiny_cluster_config(tiny_llama_dir, **{"router.routing.policy": "round_robin"})

    async def scenario(cluster):
        cluster.orchestrator.observer = records.append
        assert await cluster.start_worker(Role.DECODE) == "decode-1"
        assert cluster.workers(Role.DECODE) == ["decode-0", "decode-1"]
        started = [asyncio.Event(), asyncio.Event()]
        running = [asyncio.ensure_future(_stream(cluster, f"old{i}", started[i])) for i in range(2)]
        await asyncio.gather(*(event.wait() for event in started))
        stopping = asyncio.ensure_future(cluster.stop_worker("decode-0"))
        await asyncio.sleep(0)
        assert cluster.workers(Role.DECODE) == ["decode-1"]
        during = await _stream(cluster, "new")
        await stopping
        outputs = [*await asyncio.gather(*running), during]
        await cluster.wait_idle()
        return outputs, sorted(cluster.actors)

    with running_cluster(config) as (cluster, loop):
        outputs, actors = loop.run(scenario(cluster))
    assert outputs == [hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))] * 3
    assert actors == ["decode-1", "prefill-0"]
    by_id = {r.request_id: r for r in records}
    assert {by_id["old0"].decode_worker, by_id["old1"].decode_worker} == {"decode-0", "decode-1"}
    assert by_id["new"].decode_worker == "decode-1"
    assert [r.num_migrations for r in records] == [0, 0, 0]


def test_a_load_ramp_grows_the_decode_pool_and_the_quiet_after_it_shrinks_it(tiny_llama_dir):
    """The real planner on a real cluster. Its profile (the prior that dominates a few samples) says a
    decode step costs 17 ms + 3.2 ms per request, so 6 requests/s of 64 tokens overload one decode
    worker at the 50 ms ITL target and two are needed; the load lasts until the second one serves,
    and once it stops, the pool returns to one."""
    planner = {"planner.enabled": True, "planner.tick_s": 1.0, "planner.ttft_s": 2.0, "planner.itl_s": 0.05,
               "planner.prefill.max_replicas": 1, "planner.decode.max_replicas": 2,
               "planner.scale_up_cooldown_s": 0.0, "planner.scale_down_cooldown_s": 2.0,
               "planner.scale_down_ticks": 2, "planner.profile.decode_fixed_s": 0.017,
               "planner.profile.decode_s_per_request": 0.0032}
    config = tiny_cluster_config(tiny_llama_dir, **planner, **{"router.routing.disaggregation": "auto"})
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    async def one(cluster, index: int) -> list[int]:
        inp = GenerationInput(f"ramp-{index}", PROMPT, params)
        return [t async for chunk in cluster.orchestrator.generate(inp) for t in chunk.token_ids]

    async def scenario(cluster):
        sizes: list[int] = []
        watching = asyncio.ensure_future(_watch_decode_pool(cluster, sizes))
        requests = []
        loop = asyncio.get_running_loop()
        grown_by = loop.time() + 90  # a worker takes seconds to start (model load, transfer agent)
        while max(sizes, default=1) < 2 and loop.time() < grown_by:  # 6 requests/s until the pool grew
            requests.append(asyncio.ensure_future(one(cluster, len(requests))))
            await asyncio.sleep(1 / 6)
        outputs = await asyncio.gather(*requests, return_exceptions=True)
        deadline = loop.time() + 60
        while (len(cluster.workers(Role.DECODE)) > 1 or cluster.planner.members()[Role.DECODE].draining) \
                and loop.time() < deadline:
            await asyncio.sleep(0.2)
        watching.cancel()
        await cluster.wait_idle()
        return outputs, sizes, cluster.workers(Role.DECODE), cluster.planner.stats()

    with running_cluster(config) as (cluster, loop):
        outputs, sizes, final_pool, stats = loop.run(scenario(cluster))
    expected = hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, 64, True))
    assert [output == expected for output in outputs] == [True] * len(outputs)
    assert max(sizes) == 2, f"decode pool sizes seen: {sorted(set(sizes))}; decisions {stats.decisions}"
    assert len(final_pool) == 1
    assert stats.failed_starts == 0
    kinds = {reason for pool, reason, _ in stats.decisions if pool == "decode"}
    assert kinds & {"scale_up", "at_max"} and kinds & {"scale_down", "at_min"}  # down to min is "at_min"


async def _watch_decode_pool(cluster, sizes: list[int]) -> None:
    while True:
        sizes.append(len(cluster.workers(Role.DECODE)))
        await asyncio.sleep(0.1)
