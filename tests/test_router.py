"""The router's orchestration with in-process workers: stop strings, seeds, deadlines, cancels,
lease expiry — exact outputs, and both worker pools idle afterwards."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.router.api_types import RouterError
from splitserve.testing.in_process_cluster import InProcessCluster
from splitserve.testing.workloads import mixed_workload
from tests.factories import hf_greedy

PROMPT = list(range(3, 60))


def _offline(model_dir, prompt, params):
    (output,) = LLM(model_dir, block_size=8, num_kv_blocks=256, dtype="float32", device="cpu").generate(
        [prompt], params)
    return output


def _tokens(chunks):
    return [t for c in chunks for t in c.token_ids]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_greedy_matches_hf_with_shared_prefixes(tiny_llama_dir, mode):
    cases = mixed_workload(512, num_requests=10, seed=11, max_prompt=100, max_output=12)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, mode, num_decode=2) as cluster:
            outputs = await asyncio.gather(*(cluster.generate(f"r{i}", c.prompt_token_ids, c.params())
                                             for i, c in enumerate(cases)))
            await cluster.wait_idle()
            return [_tokens(chunks) for chunks in outputs]

    assert asyncio.run(scenario()) == [hf_greedy(tiny_llama_dir, case) for case in cases]


def test_stop_string_is_cut_at_the_router_like_the_engine(tiny_llama_dir):
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full_text = _offline(tiny_llama_dir, PROMPT, base).text
    stop = full_text[len(full_text) // 2: len(full_text) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=(stop,))
    expected = _offline(tiny_llama_dir, PROMPT, params)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            chunks = await cluster.generate("a", PROMPT, params)
            await cluster.wait_idle()
            return chunks

    chunks = asyncio.run(scenario())
    final = chunks[-1]
    assert "".join(c.text for c in chunks) == expected.text
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert _tokens(chunks) == expected.token_ids


def test_seeded_sampling_continues_the_same_stream_across_workers(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    expected = _offline(tiny_llama_dir, PROMPT, params).token_ids

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            return _tokens(await cluster.generate("a", PROMPT, params))

    assert asyncio.run(scenario()) == expected


def test_deadline_exceeded_frees_both_workers(tiny_llama_dir):
    params = SamplingParams(max_tokens=2000, ignore_eos=True)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            with pytest.raises(RouterError) as error:
                await cluster.generate("a", PROMPT, params, deadline=time.monotonic() + 0.5)
            assert error.value.code == "DEADLINE_EXCEEDED"
            await cluster.wait_idle()

    asyncio.run(scenario())


def test_cancel_mid_stream_frees_both_workers(tiny_llama_dir):
    from splitserve.router.api_types import GenerationInput

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            stream = cluster.orchestrator.generate(
                GenerationInput("a", tuple(PROMPT), SamplingParams(max_tokens=2000, ignore_eos=True)))
            received = [await anext(stream) for _ in range(3)]
            await stream.aclose()
            assert cluster.orchestrator.num_in_flight == 0 and all(c.token_ids for c in received)
            await cluster.wait_idle()

    asyncio.run(scenario())


def test_a_stream_closed_after_its_deadline_passed_ran_out_of_time(tiny_llama_dir):
    """gRPC cancels a call whose deadline passed by its own timer, which can run before the
    request's own (the same instant): a stream closed once its deadline passed ends as
    DEADLINE_EXCEEDED (it counts against the SLO), one closed before as CANCELLED (it does not)."""
    from splitserve.router.api_types import GenerationInput

    records = []
    params = SamplingParams(max_tokens=2000, ignore_eos=True)

    async def close_after_first_chunk(cluster, request_id: str, deadline: float, block_until_deadline: bool):
        stream = cluster.orchestrator.generate(GenerationInput(request_id, tuple(PROMPT), params, deadline))
        await anext(stream)
        if block_until_deadline:  # the loop cannot run the request's timer: gRPC's cancel comes first
            time.sleep(max(0.0, deadline - time.monotonic()))
        await stream.aclose()

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, observer=records.append) as cluster:
            await close_after_first_chunk(cluster, "late", time.monotonic() + 0.3, True)
            await close_after_first_chunk(cluster, "early", time.monotonic() + 60, False)
            await cluster.wait_idle()

    asyncio.run(scenario())
    assert [(r.request_id, r.error_code) for r in records] == [("late", "DEADLINE_EXCEEDED"), ("early", "CANCELLED")]


@pytest.mark.parametrize(("finish_reason", "stop_reason", "ignore_eos", "text_tokens"), [
    ("stop", None, False, [5, 6]),  # EOS: counted, its text left out
    ("stop", 40, False, [5, 6]),  # a stop token id (its stop reason)
    ("stop", None, True, [5, 6, 0]),  # under ignore_eos the EOS id is text (a grammar's last token)
    ("length", None, False, [5, 6, 0]),
])
def test_the_token_that_stopped_a_request_is_not_in_its_text(tiny_llama_dir, finish_reason, stop_reason, ignore_eos,
                                                              text_tokens):
    from splitserve.router.api_types import GenerationInput
    from splitserve.router.request_run import RequestRun
    from splitserve.router.tokenizer import RouterTokenizer

    tokenizer = RouterTokenizer.from_model_dir(tiny_llama_dir)
    last = 0 if stop_reason is None else stop_reason
    params = SamplingParams(skip_special_tokens=False, ignore_eos=ignore_eos)
    run = RequestRun(GenerationInput("a", (7, 8), params), tokenizer.backend, time.monotonic(),
                     tokenizer.eos_token_ids)
    chunk = run.on_tokens([5, 6, last], [], finish_reason, stop_reason)
    assert 0 in tokenizer.eos_token_ids  # <|endoftext|>
    assert (chunk.token_ids, chunk.usage.completion_tokens) == ((5, 6, last), 3)
    assert chunk.text == tokenizer.decode(text_tokens, skip_special_tokens=False)


def _answer_after_the_lease_expired(worker) -> None:
    """The prefill worker answers only once its lease expired (its poll reclaimed the blocks), so
    the decode worker's pull always meets reclaimed blocks: its generation check fails it."""
    prefill = worker.prefill

    async def prefill_then_expire(request):
        result = await prefill(request)
        deadline = time.monotonic() + 5.0
        while (await worker.stats()).num_held_leases:
            assert time.monotonic() < deadline, "the prefill worker's lease did not expire"
            await asyncio.sleep(0.001)
        return result

    worker.prefill = prefill_then_expire


def test_expired_lease_makes_decode_recompute_with_the_same_output(tiny_llama_dir):
    case = mixed_workload(512, num_requests=1, seed=2, max_prompt=80, max_output=10)[0]

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, lease_ttl_s=1e-6) as cluster:
            _answer_after_the_lease_expired(cluster.prefill_workers[0])
            chunks = await cluster.generate("a", case.prompt_token_ids, case.params())
            await cluster.wait_idle()
            return _tokens(chunks), chunks[-1].timing.transfer_s

    tokens, transfer_s = asyncio.run(scenario())
    assert tokens == hf_greedy(tiny_llama_dir, case) and transfer_s == 0.0


def test_expired_lease_with_fail_policy_ends_with_internal(tiny_llama_dir):
    async def scenario():
        async with InProcessCluster(tiny_llama_dir, lease_ttl_s=1e-6, transfer_failure_policy="fail") as cluster:
            _answer_after_the_lease_expired(cluster.prefill_workers[0])
            with pytest.raises(RouterError) as error:
                await cluster.generate("a", PROMPT, SamplingParams(max_tokens=5))
            assert error.value.code == "INTERNAL" and error.value.message == (
                "KV transfer failed: the producer reclaimed the blocks before the pull completed")
            await cluster.wait_idle()

    asyncio.run(scenario())


def test_failed_pull_recomputes_and_releases_the_producers_lease(tiny_llama_dir):
    case = mixed_workload(512, num_requests=1, seed=4, max_prompt=80, max_output=10)[0]

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            cluster.decode_workers[0]._backend.fail_next_pulls(1)
            chunks = await cluster.generate("a", case.prompt_token_ids, case.params())
            await cluster.wait_idle(timeout_s=5)  # the lease (30 s) must not be what frees the blocks
            return _tokens(chunks)

    assert asyncio.run(scenario()) == hf_greedy(tiny_llama_dir, case)


def test_cancelled_prefill_call_frees_its_blocks(tiny_llama_dir):
    from splitserve.common.worker_messages import PrefillRequest

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            worker = cluster.prefill_workers[0]
            calls = [asyncio.ensure_future(worker.prefill(PrefillRequest(f"p{i}", tuple(PROMPT), SamplingParams())))
                     for i in range(4)]
            await asyncio.sleep(0)
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            await cluster.wait_idle(timeout_s=5)
            assert worker._loop._thread.is_alive()

    asyncio.run(scenario())


def test_a_client_may_reuse_a_finished_request_id(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            first = _tokens(await cluster.generate("same", PROMPT, params))
            second = _tokens(await cluster.generate("same", PROMPT, params))
            await cluster.wait_idle()
            return first, second

    first, second = asyncio.run(scenario())
    assert first == second and len(first) == 4
