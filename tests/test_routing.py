"""Prefix-aware routing, conditional disaggregation and admission control through the router
with in-process workers: where requests go, what they find cached, exact outputs."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.block_hash import BlockHasher
from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.slo import SloConfig
from splitserve.router.api_types import RouterError
from splitserve.router.policy import RoutingConfig
from splitserve.testing.in_process_cluster import InProcessCluster, make_prefill_worker
from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy

BLOCK_SIZE = 8
SHARED_PREFIX = list(range(3, 83))  # 80 tokens = 10 full blocks
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(chunks):
    return [t for c in chunks for t in c.token_ids]


async def _wait_for(predicate, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        assert loop.time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _holds_prefix(cluster: InProcessCluster, worker_id: str, prompt: list[int], cache_salt: str | None = None) -> bool:
    hashes = BlockHasher(BLOCK_SIZE, 0).hash_prefix(prompt, cache_salt)
    return cluster.orchestrator.index.matched_blocks(hashes).get(worker_id, 0) == len(hashes)


def _stats(cluster: InProcessCluster) -> tuple[dict[str, int], dict[str, int]]:
    stats = cluster.orchestrator.routing_stats()
    return dict(stats.decisions), dict(stats.rejections)


def test_a_shared_prefix_follows_the_worker_that_holds_it(tiny_llama_dir):
    first, second = SHARED_PREFIX + [300, 301, 302], SHARED_PREFIX + [400, 401]

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_prefill=2) as cluster:
            await cluster.generate("a", first, GREEDY)
            ids = [w.worker_id for w in cluster.prefill_workers]
            await _wait_for(lambda: any(_holds_prefix(cluster, worker_id, first) for worker_id in ids))
            holder = next(worker_id for worker_id in ids if _holds_prefix(cluster, worker_id, first))
            chunks = await cluster.generate("b", second, GREEDY)
            engines = {w.worker_id: (await w.stats()).engine for w in cluster.prefill_workers}
            await cluster.wait_idle()
            return holder, chunks, engines, _stats(cluster)

    holder, chunks, engines, (decisions, rejections) = asyncio.run(scenario())
    assert chunks[-1].usage.cached_tokens == len(SHARED_PREFIX)
    assert engines[holder].prefix_cache_hits == len(SHARED_PREFIX)
    assert sum(e.prefix_cache_hits for e in engines.values()) == len(SHARED_PREFIX)
    assert decisions == {"load": 1, "cache_hit": 1} and rejections == {}
    assert _tokens(chunks) == hf_greedy(tiny_llama_dir, GreedyCase(second, 6, True))


def test_a_salted_prompt_hits_only_the_blocks_of_its_own_salt(tiny_llama_dir):
    """The router hashes a salted prompt as the workers do: the hashes their KV events report are the
    router's own, so a request with the same salt routes to and hits them, and no other request does."""
    prompt = SHARED_PREFIX + [300]

    async def cached_hashes(worker) -> frozenset[int]:
        return await worker._loop.run(lambda engine: engine.block_manager.cached_block_hashes())

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            chunks = {"a": await cluster.generate("a", prompt, GREEDY, cache_salt="user-a")}
            await _wait_for(lambda: _holds_prefix(cluster, "prefill-0", prompt, "user-a"))
            await _wait_for(lambda: _holds_prefix(cluster, "decode-0", prompt, "user-a"))  # the blocks it pulled
            held = [await cached_hashes(w) for w in (*cluster.prefill_workers, *cluster.decode_workers)]
            unsalted_claims = cluster.orchestrator.index.matched_blocks(BlockHasher(BLOCK_SIZE, 0).hash_prefix(prompt))
            for request_id, cache_salt in (("b", "user-a"), ("c", "user-b"), ("d", None)):
                chunks[request_id] = await cluster.generate(request_id, prompt, GREEDY, cache_salt=cache_salt)
            await cluster.wait_idle()
            return chunks, held, unsalted_claims, _stats(cluster)

    chunks, held, unsalted_claims, (decisions, rejections) = asyncio.run(scenario())
    salted_hashes = BlockHasher(BLOCK_SIZE, 0).hash_prefix(prompt, "user-a")
    assert len(salted_hashes) == 10 and all(hashes == frozenset(salted_hashes) for hashes in held)
    assert unsalted_claims == {"prefill-0": 0, "decode-0": 0}
    assert {r: c[-1].usage.cached_tokens for r, c in chunks.items()} == {"a": 0, "b": 80, "c": 0, "d": 0}
    assert decisions == {"load": 3, "cache_hit": 1} and rejections == {}
    expected = hf_greedy(tiny_llama_dir, GreedyCase(prompt, 6, True))
    assert all(_tokens(c) == expected for c in chunks.values())


def test_a_bad_salt_handed_to_the_orchestrator_is_refused_before_it_is_routed(tiny_llama_dir):
    """The APIs check cache_salt while parsing; a library caller of Orchestrator.generate gets the same
    InvalidRequestError, before the router hashes with it (an int has no UTF-8) or a worker sees it."""
    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            messages = []
            for request_id, cache_salt in (("empty", ""), ("int", 5)):
                with pytest.raises(InvalidRequestError) as error:
                    await cluster.generate(request_id, SHARED_PREFIX, GREEDY, cache_salt=cache_salt)
                messages.append((error.value.field, str(error.value)))
            await cluster.wait_idle()
            return messages, _stats(cluster)

    messages, stats = asyncio.run(scenario())
    assert messages == [("cache_salt", 'cache_salt: must be a non-empty string, got ""'),
                        ("cache_salt", "cache_salt: must be a non-empty string, got 5")]
    assert stats == ({}, {})


def test_a_restarted_worker_no_longer_claims_its_old_blocks(tiny_llama_dir):
    prompt = SHARED_PREFIX + [300]

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            await cluster.generate("a", prompt, GREEDY)
            await _wait_for(lambda: _holds_prefix(cluster, "prefill-0", prompt))
            assert cluster.orchestrator.index.num_blocks("prefill-0") == len(prompt) // BLOCK_SIZE
            old = cluster.prefill_workers[0]
            old_agent = (await old.info()).agent.agent_name
            decode = cluster.decode_workers[0]

            async def decode_knows(agent_name: str) -> bool:
                return await decode._loop.run(lambda engine: decode._backend.has_peer(agent_name))

            knew_old = await decode_knows(old_agent)
            old.shutdown()
            # What a Ray actor restart does: the same handle now reaches a new engine.
            new = make_prefill_worker(tiny_llama_dir, cluster.engine_config)
            cluster.prefill_workers[0] = new
            cluster.orchestrator.prefill_pool.clients["prefill-0"].worker = new
            await _wait_for(lambda: cluster.orchestrator.index.cursor("prefill-0")[0] == new.engine.epoch)
            claimed = cluster.orchestrator.index.num_blocks("prefill-0")
            chunks = await cluster.generate("b", prompt, GREEDY)  # pulls from the new worker's agent
            await cluster.wait_idle()
            peers = (knew_old, await decode_knows(old_agent), await decode_knows((await new.info()).agent.agent_name))
            return claimed, chunks, peers

    claimed, chunks, (knew_old, knows_old, knows_new) = asyncio.run(scenario())
    assert (knew_old, knows_old, knows_new) == (True, False, True)  # the decode worker dropped the stale agent
    assert claimed == 0
    assert chunks[-1].usage.cached_tokens == 0
    assert _tokens(chunks) == hf_greedy(tiny_llama_dir, GreedyCase(prompt, 6, True))


def test_auto_disaggregation_prefills_short_prompts_on_the_decode_worker(tiny_llama_dir):
    short, long = list(range(10, 30)), list(range(10, 110))
    routing = RoutingConfig(disaggregation="auto", max_local_prefill_tokens=32)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, routing=routing) as cluster:
            short_chunks = await cluster.generate("short", short, GREEDY)
            prefill_steps = (await cluster.prefill_workers[0].stats()).engine.num_prompt_tokens
            long_chunks = await cluster.generate("long", long, GREEDY)
            await cluster.wait_idle()
            return short_chunks, prefill_steps, long_chunks, _stats(cluster)

    short_chunks, prefill_tokens_after_short, long_chunks, (decisions, _) = asyncio.run(scenario())
    assert prefill_tokens_after_short == 0
    assert short_chunks[-1].timing.transfer_s == 0.0 and long_chunks[-1].timing.transfer_s > 0.0
    assert decisions == {"local_prefill": 1, "load": 1}
    assert _tokens(short_chunks) == hf_greedy(tiny_llama_dir, GreedyCase(short, 6, True))
    assert _tokens(long_chunks) == hf_greedy(tiny_llama_dir, GreedyCase(long, 6, True))


def test_the_next_chat_turn_hits_the_previous_turns_blocks(tiny_llama_dir):
    from splitserve.router.tokenizer import RouterTokenizer

    tokenizer = RouterTokenizer.from_model_dir(tiny_llama_dir)
    turn_1 = [{"role": "system", "content": "You are a helpful assistant who answers briefly."},
              {"role": "user", "content": "Tell me about rivers and the sea, please."}]
    first_prompt = tokenizer.apply_chat_template(turn_1, True)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            reply = await cluster.generate("t1", first_prompt, GREEDY)
            turn_2 = turn_1 + [{"role": "assistant", "content": "".join(c.text for c in reply)},
                               {"role": "user", "content": "And lakes?"}]
            second_prompt = tokenizer.apply_chat_template(turn_2, True)
            chunks = await cluster.generate("t2", second_prompt, GREEDY)
            await cluster.wait_idle()
            return second_prompt, chunks

    second_prompt, chunks = asyncio.run(scenario())
    assert second_prompt[:len(first_prompt)] == first_prompt
    assert chunks[-1].usage.cached_tokens == len(first_prompt) // BLOCK_SIZE * BLOCK_SIZE


def test_admission_rejects_a_request_that_cannot_meet_its_ttft_slo(tiny_llama_dir):
    from splitserve.router.api_types import GenerationInput

    routing = RoutingConfig(disaggregation="always", admission_ttft_factor=2.0, default_prefill_s_per_token=1.0)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, routing=routing, slo=SloConfig(ttft_s=10.0)) as cluster:
            # No prefill has run yet, so no worker has measured its cost: the default applies.
            with pytest.raises(RouterError) as error:
                await anext(cluster.orchestrator.generate(GenerationInput("a", tuple(range(3, 30)), GREEDY)))
            tight = GenerationInput("b", tuple(range(3, 30)), GREEDY, ttft_slo_s=1e-9)
            with pytest.raises(RouterError):
                await anext(cluster.orchestrator.generate(tight))
            assert cluster.orchestrator.num_in_flight == 0
            await cluster.wait_idle()
            return error.value, _stats(cluster)

    error, (decisions, rejections) = asyncio.run(scenario())
    assert error.code == "RESOURCE_EXHAUSTED" and "TTFT" in error.message
    assert rejections == {"ttft_slo": 2} and decisions == {}


def test_a_stopped_worker_fails_calls_instead_of_hanging(tiny_llama_dir):
    from splitserve.engine.engine_loop import EngineLoopStopped

    worker = make_prefill_worker(tiny_llama_dir)
    worker.shutdown()
    with pytest.raises(EngineLoopStopped):
        asyncio.run(asyncio.wait_for(worker.report(None, 0, 0.1), 5))


def test_a_burst_spreads_over_decode_workers_before_any_report_shows_it(tiny_llama_dir):
    prompts = [list(range(10 + i, 60 + i)) for i in range(4)]

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_decode=2) as cluster:
            await asyncio.gather(*(cluster.generate(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)))
            engines = [(await w.stats()).engine for w in cluster.decode_workers]
            await cluster.wait_idle()
            return engines

    engines = asyncio.run(scenario())
    # Each decode worker continues two requests: 5 tokens each after the prefill worker's first.
    assert [e.num_generation_tokens for e in engines] == [10, 10]
