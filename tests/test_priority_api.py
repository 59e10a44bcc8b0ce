"""Request priority through every API and the router -> prefill -> decode path: refused (400 /
INVALID_ARGUMENT naming the field) on a cluster whose workers schedule fcfs, taken on one whose workers
schedule by priority, where it reaches both workers' engines."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import grpc
import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.testing.in_process_cluster import InProcessCluster, worker_engine_config
from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy, http_request, served_apis, stream_tokens

MODEL = "tiny-llama"
PROMPT_IDS = [5, 17, 42, 99, 7, 61, 3, 250]
FCFS_REFUSAL = ("priority: is {}, but priority scheduling is not enabled: the scheduling policy is 'fcfs' "
                "(set scheduling_policy, --scheduling-policy, to 'priority')")
PRIORITY_ENGINE = dataclasses.replace(worker_engine_config(), scheduling_policy="priority")


@pytest.fixture(scope="module")
def fcfs_served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL) as served:
        yield served


@pytest.fixture(scope="module")
def priority_served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, engine_config=PRIORITY_ENGINE) as served:
        yield served


def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    status, _, payload = http_request(port, "POST", path, json.dumps(body).encode())
    return status, json.loads(payload)


def _bodies(priority) -> dict[str, dict]:
    """A greedy 6-token request to each OpenAI endpoint with `priority`."""
    sampling = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "priority": priority}
    return {"/v1/completions": {"model": MODEL, "prompt": PROMPT_IDS, **sampling},
            "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **sampling},
            "/v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 6, "temperature": 0,
                              "priority": priority}}


def _grpc_priority(port: int, priority: int):
    request = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=PROMPT_IDS), priority=priority,
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return stream_tokens(port, request)[0]


def test_fcfs_workers_refuse_a_priority_other_than_zero_on_every_api(fcfs_served):
    assert fcfs_served.cluster.orchestrator.scheduling_policy == "fcfs"
    for path, body in _bodies(3).items():
        status, payload = _post(fcfs_served.http_port, path, body)
        assert (status, payload["error"]["param"], payload["error"]["message"]) == (400, "priority",
                                                                                    FCFS_REFUSAL.format(3)), path
    beam_search = {**_bodies(3)["/v1/completions"], "use_beam_search": True, "n": 2}  # each step is a request
    status, payload = _post(fcfs_served.http_port, "/v1/completions", beam_search)
    assert (status, payload["error"]["message"]) == (400, FCFS_REFUSAL.format(3))
    for path, body in _bodies(0).items():
        assert _post(fcfs_served.http_port, path, body)[0] == 200, path
    with pytest.raises(grpc.RpcError) as error:
        _grpc_priority(fcfs_served.grpc_port, -1)
    assert (error.value.code(), error.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, FCFS_REFUSAL.format(-1))
    assert _grpc_priority(fcfs_served.grpc_port, 0)


@pytest.mark.parametrize("priority, message", [(None, "must be an integer, got null"),
                                               ("one", "must be an integer, got 'one'"),
                                               ("1.5", "must be an integer, got '1.5'"),
                                               (1.5, "must be an integer, got 1.5")])
def test_a_priority_that_is_no_integer_is_refused_naming_it(priority_served, priority, message):
    for path, body in _bodies(priority).items():
        status, payload = _post(priority_served.http_port, path, body)
        assert (status, payload["error"]["param"], payload["error"]["message"]) == (400, "priority",
                                                                                    f"priority: {message}"), path


def test_priority_workers_take_a_priority_on_every_api(priority_served, tiny_llama_dir):
    expected = hf_greedy(tiny_llama_dir, GreedyCase(tuple(PROMPT_IDS), 6, ignore_eos=True))
    assert priority_served.cluster.orchestrator.scheduling_policy == "priority"
    for path, body in _bodies(-4).items():
        status, payload = _post(priority_served.http_port, path, body)
        assert status == 200, (path, payload)
    beam_search = {**_bodies(2)["/v1/completions"], "use_beam_search": True, "n": 2}
    status, payload = _post(priority_served.http_port, "/v1/completions", beam_search)
    assert (status, len(payload["choices"])) == (200, 2)
    status, payload = _post(priority_served.http_port, "/v1/completions",
                            {**_bodies(7)["/v1/completions"], "return_token_ids": True})
    assert (status, payload["choices"][0]["token_ids"]) == (200, expected)
    assert _grpc_priority(priority_served.grpc_port, 9) == expected


def test_the_priority_reaches_the_prefill_and_the_decode_worker(tiny_llama_dir):
    """low arrives first, high (a lower value) second, while the prefill worker steps nothing: its engine
    queues high first. Then both run to the end (outputs as transformers'), the decode worker's engine
    having had each request with its own priority."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = hf_greedy(tiny_llama_dir, GreedyCase(tuple(PROMPT_IDS), 6, ignore_eos=True))
    seen_by_decode: dict[str, int] = {}

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, engine_config=PRIORITY_ENGINE) as cluster:
            prefill, decode = cluster.prefill_workers[0], cluster.decode_workers[0]
            prefill._loop.set_step_gate(lambda engine: False)
            decode._loop.set_step_gate(lambda engine: seen_by_decode.update(
                {r.request_id: r.priority for r in engine.scheduler.requests.values()}) or True)
            low = asyncio.ensure_future(cluster.generate("low", PROMPT_IDS, greedy, priority=5))
            while prefill.engine.scheduler.requests == {}:
                await asyncio.sleep(0.01)
            high = asyncio.ensure_future(cluster.generate("high", PROMPT_IDS, greedy, priority=-5))
            while len(prefill.engine.scheduler.requests) < 2:
                await asyncio.sleep(0.01)
            queued = [r.priority for r in prefill.engine.scheduler.waiting]
            prefill._loop.set_step_gate(None)
            return queued, await low, await high

    queued, low, high = asyncio.run(scenario())
    assert queued == [-5, 5]
    assert [t for c in low for t in c.token_ids] == [t for c in high for t in c.token_ids] == expected
    assert sorted(seen_by_decode.values()) == [-5, 5]


def test_a_worker_with_another_scheduling_policy_is_refused(tiny_llama_dir):
    from splitserve.testing.in_process_cluster import KillableWorker, make_decode_worker

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            stranger = make_decode_worker(tiny_llama_dir, PRIORITY_ENGINE, "decode-9")
            try:
                with pytest.raises(ValueError) as error:
                    await cluster.orchestrator.add_worker("decode", KillableWorker(stranger))
            finally:
                stranger.shutdown()
            return str(error.value), list(cluster.orchestrator.decode_pool.clients)

    message, decode_pool = asyncio.run(scenario())
    assert message == "worker decode-9's scheduling policy is 'priority'; the cluster's is 'fcfs'"
    assert decode_pool == ["decode-0"]


def test_the_decode_worker_pulls_into_free_blocks_in_priority_order(tiny_llama_dir):
    """A decode pool of 4 blocks of 8 holds one 24-token prompt (+ its token) at a time: while `first`
    holds it (the decode worker steps nothing), `low` then `high` wait for blocks, high ahead of low."""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {name: list(range(base, base + 24)) for name, base in (("first", 10), ("low", 60), ("high", 110))}
    small_decode = dataclasses.replace(PRIORITY_ENGINE, num_kv_blocks=4, max_model_len=32)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, engine_config=PRIORITY_ENGINE,
                                    decode_engine_config=small_decode) as cluster:
            decode = cluster.decode_workers[0]
            decode._loop.set_step_gate(lambda engine: False)
            runs = {"first": asyncio.ensure_future(cluster.generate("first", prompts["first"], greedy))}
            while decode.engine.block_manager.num_free_blocks:
                await asyncio.sleep(0.01)
            for name, priority in (("low", 3), ("high", -3)):
                runs[name] = asyncio.ensure_future(cluster.generate(name, prompts[name], greedy, priority=priority))
                while len(decode._awaiting_blocks) < len(runs) - 1:
                    await asyncio.sleep(0.01)
            waiting = [request.priority for request in decode._awaiting_blocks]
            decode._loop.set_step_gate(None)
            return waiting, {name: [t for c in await run for t in c.token_ids] for name, run in runs.items()}

    waiting, outputs = asyncio.run(scenario())
    assert waiting == [-3, 3]
    assert outputs == {name: hf_greedy(tiny_llama_dir, GreedyCase(tuple(prompt), 4, ignore_eos=True))
                       for name, prompt in prompts.items()}
