"""Pools change size while the router serves (the planner's scale-up and scale-down): a worker
that joins takes requests at once; a retiring worker takes no new request, its streams finish
(or move once its grace is over), and the router forgets it; a worker that cannot serve next to
the others is refused. Outputs stay equal to Hugging Face's greedy tokens throughout."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.block_hash import BlockHasher
from splitserve.common.sampling_params import SamplingParams
from splitserve.router.api_types import GenerationInput
from splitserve.router.policy import RoutingConfig
from splitserve.router.worker_pool import WorkerPool
from splitserve.testing.in_process_cluster import InProcessCluster, KillableWorker, make_decode_worker, \
    worker_engine_config
from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy

PROMPT = list(range(5, 45))
NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
ROUND_ROBIN = RoutingConfig(policy="round_robin", disaggregation="always")


class FakeClient:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id


def test_a_pool_hands_out_no_new_work_on_a_retiring_worker_and_releases_it_when_its_claims_end():
    async def scenario():
        pool = WorkerPool([FakeClient("decode-0"), FakeClient("decode-1")])
        pool.add(FakeClient("decode-2"))
        with pytest.raises(ValueError, match="decode-2 is already in the pool"):
            pool.add(FakeClient("decode-2"))
        claim = pool.assign("decode-1", 40)
        released = pool.retire("decode-1")
        assert pool.routable() == ["decode-0", "decode-2"]
        assert not released.is_set()
        with pytest.raises(ValueError, match="decode-1 still holds 1 assignments"):
            pool.remove("decode-1")
        pool.release(claim)
        assert released.is_set()
        pool.remove("decode-1")
        assert list(pool.clients) == ["decode-0", "decode-2"]
        assert pool.retire("decode-2").is_set()  # nothing on it: released at once

    asyncio.run(scenario())


async def _stream(cluster: InProcessCluster, request_id: str, started: asyncio.Event | None = None,
                  cache_salt: str | None = None) -> list[int]:
    tokens: list[int] = []
    inp = GenerationInput(request_id, tuple(PROMPT), GREEDY, cache_salt=cache_salt)
    async for chunk in cluster.orchestrator.generate(inp):
        tokens.extend(chunk.token_ids)
        if started is not None and len(tokens) >= 4:
            started.set()
    return tokens


def test_a_decode_worker_that_joins_takes_requests_at_once(tiny_llama_dir):
    records = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, routing=ROUND_ROBIN, observer=records.append) as cluster:
            assert await cluster.add_worker("decode") == "decode-1"
            assert cluster.orchestrator.decode_pool.routable() == ["decode-0", "decode-1"]
            outputs = await asyncio.gather(*(_stream(cluster, f"r{i}") for i in range(4)))
            await cluster.wait_idle()
            return outputs

    outputs = asyncio.run(scenario())
    expected = hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))
    assert outputs == [expected] * 4
    assert sorted(r.decode_worker for r in records) == ["decode-0", "decode-0", "decode-1", "decode-1"]


def test_a_retiring_decode_worker_finishes_its_streams_and_gets_no_new_request(tiny_llama_dir):
    records = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_decode=2, routing=ROUND_ROBIN,
                                    observer=records.append) as cluster:
            started = [asyncio.Event(), asyncio.Event()]
            running = [asyncio.ensure_future(_stream(cluster, f"old{i}", started[i])) for i in range(2)]
            await asyncio.gather(*(event.wait() for event in started))
            retiring = asyncio.ensure_future(cluster.retire_worker("decode-1", timeout_s=60.0))
            await asyncio.sleep(0)
            assert cluster.orchestrator.decode_pool.routable() == ["decode-0"]
            during = await asyncio.gather(*(_stream(cluster, f"new{i}") for i in range(2)))
            await retiring
            assert list(cluster.orchestrator.decode_pool.clients) == ["decode-0"]
            outputs = [*await asyncio.gather(*running), *during]
            await cluster.wait_idle()
            return outputs

    outputs = asyncio.run(scenario())
    assert outputs == [hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))] * 4
    by_id = {r.request_id: r for r in records}
    assert {by_id["old0"].decode_worker, by_id["old1"].decode_worker} == {"decode-0", "decode-1"}
    assert (by_id["new0"].decode_worker, by_id["new1"].decode_worker) == ("decode-0", "decode-0")
    assert [r.num_migrations for r in records] == [0, 0, 0, 0]


def test_a_retiring_worker_past_its_grace_moves_its_streams_elsewhere(tiny_llama_dir):
    records = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_decode=2, routing=ROUND_ROBIN,
                                    observer=records.append) as cluster:
            started = asyncio.Event()
            first = asyncio.ensure_future(_stream(cluster, "on-decode-0"))
            second = asyncio.ensure_future(_stream(cluster, "on-decode-1", started))
            await started.wait()
            await cluster.retire_worker("decode-1", timeout_s=0.0)
            outputs = await asyncio.gather(first, second)
            await cluster.wait_idle()
            return outputs

    outputs = asyncio.run(scenario())
    assert outputs == [hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))] * 2
    by_id = {r.request_id: r for r in records}
    assert (by_id["on-decode-0"].num_migrations, by_id["on-decode-1"].num_migrations) == (0, 1)
    assert by_id["on-decode-1"].decode_worker == "decode-0"


def test_a_salted_stream_that_moves_is_recomputed_under_its_salted_hashes(tiny_llama_dir):
    """The moved request's DecodeRequest carries its salt: decode-0 recomputes it (prompt and the tokens
    streamed so far) under the salted hashes, beside the unsalted request's blocks of the same tokens,
    instead of hitting those."""
    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_decode=2, routing=ROUND_ROBIN) as cluster:
            started = asyncio.Event()
            first = asyncio.ensure_future(_stream(cluster, "on-decode-0"))
            second = asyncio.ensure_future(_stream(cluster, "on-decode-1", started, cache_salt="user-a"))
            await started.wait()
            await cluster.retire_worker("decode-1", timeout_s=0.0)
            outputs = await asyncio.gather(first, second)
            await cluster.wait_idle()
            decode_0 = cluster.decode_workers[0]
            return outputs, await decode_0._loop.run(lambda engine: engine.block_manager.cached_block_hashes())

    outputs, held = asyncio.run(scenario())
    expected = hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))
    assert outputs == [expected] * 2
    # 40 prompt + 32 output tokens; the last output's KV is never computed: 71 tokens, 8 full blocks of 8.
    computed = PROMPT + expected[:-1]
    hasher = BlockHasher(8, 0)
    assert held == frozenset(hasher.hash_prefix(computed)) | frozenset(hasher.hash_prefix(computed, "user-a"))


def test_a_retired_prefill_worker_is_forgotten_by_routing_and_by_the_handshakes(tiny_llama_dir):
    records = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_prefill=2, routing=ROUND_ROBIN,
                                    observer=records.append) as cluster:
            await asyncio.gather(*(_stream(cluster, f"before{i}") for i in range(2)))
            agent = cluster.orchestrator.infos["prefill-1"].agent.agent_name
            assert ("decode-0", agent) in cluster.orchestrator.peers
            await cluster.retire_worker("prefill-1", timeout_s=60.0)
            assert list(cluster.orchestrator.prefill_pool.clients) == ["prefill-0"]
            assert "prefill-1" not in cluster.orchestrator.infos
            assert cluster.orchestrator.index.stats().num_workers == 2  # prefill-0 and decode-0
            assert (("decode-0", agent) in cluster.orchestrator.peers) is False
            outputs = await asyncio.gather(*(_stream(cluster, f"after{i}") for i in range(2)))
            await cluster.wait_idle()
            return agent, outputs

    agent, outputs = asyncio.run(scenario())
    assert outputs == [hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))] * 2
    by_id = {r.request_id: r for r in records}
    assert {by_id["before0"].prefill_worker, by_id["before1"].prefill_worker} == {"prefill-0", "prefill-1"}
    assert (by_id["after0"].prefill_worker, by_id["after1"].prefill_worker) == ("prefill-0", "prefill-0")


def test_a_worker_with_another_kv_layout_is_refused_and_the_pool_is_unchanged(tiny_llama_dir):
    async def scenario():
        async with InProcessCluster(tiny_llama_dir, routing=ROUND_ROBIN) as cluster:
            stranger = make_decode_worker(tiny_llama_dir, worker_engine_config(block_size=16), "decode-9")
            try:
                with pytest.raises(ValueError, match="decode-9's KV layout differs from the cluster's: "
                                                     "block_size: 8 != 16"):
                    await cluster.orchestrator.add_worker("decode", KillableWorker(stranger))
            finally:
                stranger.shutdown()
            assert list(cluster.orchestrator.decode_pool.clients) == ["decode-0"]
            assert await _stream(cluster, "still-serving") == hf_greedy(
                tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))

    asyncio.run(scenario())


def test_a_colocated_router_has_no_prefill_pool_to_grow(tiny_llama_dir):
    async def scenario():
        async with InProcessCluster(tiny_llama_dir, mode="colocated") as cluster:
            with pytest.raises(ValueError, match="a colocated router has no 'prefill' pool"):
                await cluster.orchestrator.add_worker("prefill", FakeClient("prefill-9"))

    asyncio.run(scenario())
