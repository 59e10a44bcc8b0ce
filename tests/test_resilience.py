"""The router keeps its promises when things go wrong.

Worker loss: requests move off a lost worker — the router re-routes them and a decode worker
recomputes the prompt + the tokens already streamed, so the client's stream goes on (greedy
output equal to Hugging Face's), the move is counted, and no live worker keeps a block of the
request. Overload: beyond the in-flight limit a request is rejected at once. Drain: new requests
are refused (and health says NOT_SERVING) while running ones finish. Router death: decode
workers abort the orphaned requests."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.router.api_types import GenerationInput, RouterError
from splitserve.router.policy import RoutingConfig
from splitserve.testing.in_process_cluster import InProcessCluster
from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy

PROMPT = list(range(5, 45))
NUM_TOKENS = 48
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
ROUND_ROBIN = RoutingConfig(policy="round_robin", disaggregation="always")


async def _decode_worker_running_a_request(cluster: InProcessCluster) -> str:
    for worker in cluster.decode_workers:
        if (await worker.stats()).engine.num_running:
            return worker.worker_id
    raise AssertionError("no decode worker runs a request")


async def _generate_killing_decode_after(cluster: InProcessCluster, num_tokens: int, inp: GenerationInput,
                                         fault=InProcessCluster.kill) -> tuple[list[int], str]:
    """Stream the request; once `num_tokens` tokens arrived, kill (or another `fault`) the decode
    worker running it. Returns the streamed tokens and that worker's id."""
    tokens: list[int] = []
    killed = ""
    async for chunk in cluster.orchestrator.generate(inp):
        tokens.extend(chunk.token_ids)
        if not killed and len(tokens) >= num_tokens:
            killed = await _decode_worker_running_a_request(cluster)
            fault(cluster, killed)
    return tokens, killed


def test_killing_the_decode_worker_mid_stream_moves_the_request_and_the_stream_goes_on(tiny_llama_dir):
    records = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_decode=2, routing=ROUND_ROBIN,
                                    observer=records.append) as cluster:
            result = await _generate_killing_decode_after(cluster, 4, GenerationInput("a", tuple(PROMPT), GREEDY))
            await cluster.wait_idle()
            return result

    tokens, killed = asyncio.run(scenario())
    assert tokens == hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))
    [record] = records
    assert (record.finish_reason, record.error_code, record.num_migrations) == ("length", None, 1)
    assert record.decode_worker != killed and record.num_output_tokens == NUM_TOKENS
    assert len(record.inter_token_latencies) == NUM_TOKENS - 1


def test_a_decode_worker_that_stops_answering_is_dropped_after_the_report_timeout_and_its_stream_moves(
        tiny_llama_dir):
    from splitserve.router.worker_link import WorkerLinkConfig

    records = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_decode=2, routing=ROUND_ROBIN, observer=records.append,
                                    worker_link=WorkerLinkConfig(report_timeout_s=0.3)) as cluster:
            tokens, frozen = await _generate_killing_decode_after(
                cluster, 4, GenerationInput("a", tuple(PROMPT), GREEDY), InProcessCluster.freeze)
            unroutable = cluster.orchestrator.monitor.load(frozen) is None
            cluster.kill(frozen)
            await cluster.wait_idle()
            return tokens, frozen, unroutable

    tokens, frozen, unroutable = asyncio.run(scenario())
    assert tokens == hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))
    [record] = records
    assert (record.finish_reason, record.num_migrations) == ("length", 1) and record.decode_worker != frozen
    assert unroutable


def test_a_prefill_worker_lost_before_it_answers_hands_the_prompt_to_another(tiny_llama_dir):
    records = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_prefill=2, routing=ROUND_ROBIN,
                                    observer=records.append) as cluster:
            # Round-robin turn 0 picks prefill-0; it dies before the router has noticed.
            cluster.kill("prefill-0")
            chunks = await cluster.generate("a", PROMPT, GREEDY)
            await cluster.wait_idle()
            return [t for c in chunks for t in c.token_ids]

    tokens = asyncio.run(scenario())
    assert tokens == hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))
    [record] = records
    assert (record.num_migrations, record.prefill_worker, record.finish_reason) == (1, "prefill-1", "length")


def test_a_request_fails_with_unavailable_once_it_moved_max_migrations_times(tiny_llama_dir):
    records = []
    routing = RoutingConfig(policy="round_robin", disaggregation="always", max_migrations=0)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_decode=2, routing=routing, observer=records.append) as cluster:
            with pytest.raises(RouterError) as error:
                await _generate_killing_decode_after(cluster, 4, GenerationInput("a", tuple(PROMPT), GREEDY))
            await cluster.wait_idle()
            return error.value

    error = asyncio.run(scenario())
    assert error.code == "UNAVAILABLE"
    # Its output stream closing is the first sign of the death (before any call fails).
    assert error.message.startswith("worker decode-") and "its output stream closed" in error.message
    assert error.message.endswith("the request already moved 0 times (router.routing.max_migrations)")
    [record] = records
    assert (record.error_code, record.num_migrations) == ("UNAVAILABLE", 0)


def test_with_every_decode_worker_lost_the_request_fails_with_unavailable(tiny_llama_dir):
    async def scenario():
        async with InProcessCluster(tiny_llama_dir, routing=ROUND_ROBIN) as cluster:
            with pytest.raises(RouterError) as error:
                await _generate_killing_decode_after(cluster, 4, GenerationInput("a", tuple(PROMPT), GREEDY))
            await cluster.wait_idle()
            return error.value

    error = asyncio.run(scenario())
    assert (error.code, error.message) == ("UNAVAILABLE", "no decode worker is answering")


def test_concurrent_requests_on_a_killed_decode_worker_all_finish_equal_to_hf(tiny_llama_dir):
    prompts = [list(range(3 + i, 30 + 3 * i)) for i in range(6)]
    records = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_prefill=2, num_decode=3, routing=ROUND_ROBIN,
                                    observer=records.append) as cluster:
            first = asyncio.ensure_future(
                _generate_killing_decode_after(cluster, 8, GenerationInput("r0", tuple(prompts[0]), GREEDY)))
            rest = [cluster.generate(f"r{i}", prompt, GREEDY) for i, prompt in enumerate(prompts[1:], 1)]
            results = await asyncio.gather(first, *rest)
            await cluster.wait_idle()
            return results

    first, *rest = asyncio.run(scenario())
    outputs = [first[0], *([t for c in chunks for t in c.token_ids] for chunks in rest)]
    assert outputs == [hf_greedy(tiny_llama_dir, GreedyCase(p, NUM_TOKENS, True)) for p in prompts]
    assert all(r.finish_reason == "length" for r in records)
    moved = sorted(r.request_id for r in records if r.num_migrations)
    assert "r0" in moved and all(r.num_migrations <= 1 for r in records)
    assert all(r.decode_worker != first[1] for r in records if r.request_id in moved)


# ---- overload and drain ---------------------------------------------------------------------
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


async def _first_chunk(stream) -> None:
    await stream.__anext__()


def test_beyond_max_in_flight_requests_a_request_is_rejected_at_once(tiny_llama_dir):
    records = []
    routing = RoutingConfig(disaggregation="always", max_in_flight_requests=1)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, routing=routing, observer=records.append) as cluster:
            running = cluster.orchestrator.generate(GenerationInput("a", tuple(PROMPT), LONG))
            await _first_chunk(running)
            with pytest.raises(RouterError) as error:
                await cluster.generate("b", PROMPT, GREEDY)
            await running.aclose()
            await cluster.wait_idle()
            return error.value, cluster.orchestrator.routing_stats()

    error, stats = asyncio.run(scenario())
    assert (error.code, error.message) == ("RESOURCE_EXHAUSTED", "the router has 1 requests in flight, its limit "
                                           "(router.routing.max_in_flight_requests); retry later")
    assert stats.rejections == (("too_many_requests", 1),)
    assert [(r.request_id, r.error_code, r.rejection_reason) for r in records] == [
        ("b", "RESOURCE_EXHAUSTED", "too_many_requests"), ("a", "CANCELLED", None)]


def test_drain_refuses_new_requests_and_lets_running_ones_finish(tiny_llama_dir):
    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            orchestrator = cluster.orchestrator
            running = asyncio.ensure_future(cluster.generate("a", PROMPT, GREEDY))
            while not orchestrator.num_in_flight:
                await asyncio.sleep(0.001)
            ready_before = orchestrator.is_ready
            drain = asyncio.ensure_future(orchestrator.drain(timeout_s=30))
            await asyncio.sleep(0)
            with pytest.raises(RouterError) as error:
                await cluster.generate("b", PROMPT, GREEDY)
            left, chunks = await drain, await running
            await cluster.wait_idle()
            return ready_before, orchestrator.is_ready, error.value, left, chunks

    ready_before, ready_after, error, left, chunks = asyncio.run(scenario())
    assert (ready_before, ready_after, left) == (True, False, 0)
    assert (error.code, error.message) == ("UNAVAILABLE", "the router is draining (shutting down): it takes no new "
                                                          "requests")
    assert [t for c in chunks for t in c.token_ids] == hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True))


def test_drain_returns_what_is_still_in_flight_at_its_timeout(tiny_llama_dir):
    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            running = cluster.orchestrator.generate(GenerationInput("a", tuple(PROMPT), LONG))
            await _first_chunk(running)
            left = await cluster.orchestrator.drain(timeout_s=0.05)
            await running.aclose()
            await cluster.wait_idle()
            return left

    assert asyncio.run(scenario()) == 1


def test_stopping_the_servers_ends_a_stream_still_running_after_the_grace_with_unavailable(tiny_llama_dir):
    """SIGTERM twice (or a drain that timed out): the HTTP stream got neither an error event nor [DONE] (cut off
    by uvicorn, or a 500 before its first event), a gRPC one "Cancelling all calls"."""
    from splitserve.deploy.cluster_config import RouterConfig
    from splitserve.deploy.router_app import start_servers

    body = json.dumps({"prompt": PROMPT, "max_tokens": 1800, "ignore_eos": True, "stream": True})

    streaming = threading.Event()

    def events(port: int) -> list[str]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        received = []
        for line in connection.getresponse():
            if line.startswith(b"data: "):
                received.append(line.decode().strip())
                streaming.set()
        return received

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            servers = await start_servers(cluster.orchestrator, cluster.tokenizer,
                                          RouterConfig(grpc_port=0, http_port=0, metrics_port=None), "tiny", None, None)
            reading = asyncio.ensure_future(asyncio.to_thread(events, servers.http.port))
            assert await asyncio.to_thread(streaming.wait, 30)
            await servers.stop(grace_s=0.05)
            await cluster.wait_idle()
            return await reading

    received = asyncio.run(scenario())
    assert len(received) >= 3 and received[-1] == "data: [DONE]"
    assert json.loads(received[-2].removeprefix("data: ")) == {"error": {
        "message": "the server is shutting down", "type": "server_error", "param": None, "code": "unavailable"}}


# ---- a router that dies ---------------------------------------------------------------------
def test_a_decode_worker_aborts_the_requests_of_a_router_whose_output_stream_closed(tiny_llama_dir):
    from splitserve.common.worker_messages import DecodeRequest
    from splitserve.testing.in_process_cluster import make_decode_worker
    from tests.factories import RouterOutputs

    async def scenario():
        worker = make_decode_worker(tiny_llama_dir)
        try:
            streams = {router_id: await RouterOutputs.open(worker, router_id) for router_id in ("router-gone", "router-live")}
            for router_id, stream in streams.items():
                stream.submit(DecodeRequest(f"{router_id}-r", router_id, tuple(PROMPT), (), LONG, 0, None, None))
            streams["router-gone"].close()  # its process died: the OS closes its sockets
            # Until the worker has let the gone router's request go (at once, or this times out), read
            # the live one's deltas: it still runs then (400 tokens take the tiny model ~0.5 s).
            live, stats = [], (await worker.stats()).engine
            async with asyncio.timeout(5.0):
                while stats.num_running != 1:
                    live += await streams["router-live"].next(0.01)
                    stats = (await worker.stats()).engine
            live += await streams["router-live"].next(1.0)
            streams["router-live"].close()
            return stats.num_running, live
        finally:
            worker.shutdown()

    num_running, live = asyncio.run(scenario())
    assert num_running == 1
    assert {d.request_id for d in live} == {"router-live-r"} and all(d.finish_reason is None for d in live)
    assert sum(len(d.token_ids) for d in live) >= 1


def test_a_decode_worker_refuses_on_its_stream_a_request_it_cannot_serve(tiny_llama_dir):
    """A refused request ends at once with an error delta naming the field; nothing is held."""
    from splitserve.common.worker_messages import DecodeRequest, TokenDelta
    from splitserve.testing.in_process_cluster import make_decode_worker
    from tests.factories import RouterOutputs

    async def scenario():
        worker = make_decode_worker(tiny_llama_dir)
        try:
            stream = await RouterOutputs.open(worker, "router-a")
            stream.submit(DecodeRequest("other", "router-b", tuple(PROMPT), (), LONG, 0, None, None))
            stream.submit(DecodeRequest("huge", "router-a", tuple(PROMPT) * 100, (), LONG, 0, None, None))
            answers = await stream.next(5.0) + await stream.next(5.0)
            stream.close()
            return answers, (await worker.stats()).is_idle
        finally:
            worker.shutdown()

    answers, idle = asyncio.run(scenario())
    assert answers[0] == TokenDelta("other", (), (), "abort", None, 0, error="router_id: 'router-b' sent on "
                                    "'router-a''s stream", invalid_field="router_id")
    assert (answers[1].request_id, answers[1].finish_reason, answers[1].invalid_field) == ("huge", "abort",
                                                                                           "prompt")
    assert idle


def test_a_draining_router_reports_not_serving_on_every_api_and_finishes_running_streams(tiny_llama_dir):
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.proto.inference import grpc_service_pb2 as triton_pb
    from splitserve.proto.inference import grpc_service_pb2_grpc as triton_grpc
    from splitserve.proto.splitserve.v1 import generation_pb2 as pb
    from tests.factories import served_apis, stream_tokens

    def health(channel) -> list[int]:
        stub = health_pb2_grpc.HealthStub(channel)
        return [stub.Check(health_pb2.HealthCheckRequest(service=s)).status
                for s in ("", "splitserve.v1.Generation", "inference.GRPCInferenceService")]

    def wait_until(predicate) -> None:
        deadline = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < deadline, "condition not reached"
            time.sleep(0.001)

    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
    with served_apis(tiny_llama_dir, "tiny") as served, ThreadPoolExecutor(2) as pool, \
            grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        orchestrator = served.cluster.orchestrator
        before = (health(channel), _http_health(served.http_port))
        running = pool.submit(stream_tokens, served.grpc_port, request)
        wait_until(lambda: orchestrator.num_in_flight)
        drained = pool.submit(served.drain)
        wait_until(lambda: not orchestrator.accepting)
        after = (health(channel), _http_health(served.http_port),
                 triton_grpc.GRPCInferenceServiceStub(channel).ServerReady(triton_pb.ServerReadyRequest()).ready)
        with pytest.raises(grpc.RpcError) as refused:
            stream_tokens(served.grpc_port, request)
        tokens, left = running.result()[0], drained.result()
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert before == ([serving] * 3, (200, b""))
    grpc_health, http_health, triton_ready = after
    assert grpc_health == [not_serving] * 3 and not triton_ready
    status, body = http_health
    assert (status, json.loads(body)["error"]["message"]) == (503, "the router is draining (shutting down)")
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert refused.value.details() == "the router is draining (shutting down): it takes no new requests"
    assert tokens == hf_greedy(tiny_llama_dir, GreedyCase(PROMPT, NUM_TOKENS, True)) and left == 0


def _http_health(port: int) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_grpc_readiness_follows_the_decode_pool_and_liveness_stays_serving(tiny_llama_dir):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.factories import served_apis

    def statuses(channel) -> list[int]:
        stub = health_pb2_grpc.HealthStub(channel)
        return [stub.Check(health_pb2.HealthCheckRequest(service=s)).status
                for s in ("", "splitserve.v1.Generation", "inference.GRPCInferenceService")]

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    with served_apis(tiny_llama_dir, "tiny") as served, \
            grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        before = statuses(channel)
        served.cluster.kill("decode-0")
        deadline = time.monotonic() + 30
        while statuses(channel)[1] != not_serving:
            assert time.monotonic() < deadline, "readiness did not follow the lost decode pool"
            time.sleep(0.05)
        after, http_health = statuses(channel), _http_health(served.http_port)
    assert before == [serving] * 3 and after == [serving, not_serving, not_serving]
    assert (http_health[0], json.loads(http_health[1])["error"]["message"]) == (503, "no decode worker is answering")


def test_a_prefill_worker_ends_a_gone_routers_queued_and_held_requests_and_only_those(tiny_llama_dir):
    """abort_router (called when Ray reports the router's actor dead) ends the router's requests in
    every state: its KV held for a pull nobody will ask for, and its prompt still queued. The
    other router's held KV stays; nothing of the gone router is left."""
    from splitserve.common.worker_messages import PrefillRequest
    from splitserve.testing.in_process_cluster import make_prefill_worker

    two_tokens = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # the second is decode's

    async def scenario():
        worker = make_prefill_worker(tiny_llama_dir)
        try:
            gone_held = await worker.prefill(PrefillRequest("gone-held", tuple(PROMPT), two_tokens, "router-gone"))
            live_held = await worker.prefill(PrefillRequest("live-held", tuple(range(50, 90)), two_tokens,
                                                            "router-live"))
            worker._loop.set_step_gate(lambda engine: False)  # the next prompt stays queued
            queued = asyncio.ensure_future(worker.prefill(PrefillRequest("gone-queued", tuple(range(100, 140)),
                                                                         two_tokens, "router-gone")))
            while (await worker.stats()).engine.num_waiting != 1:
                await asyncio.sleep(0.01)
            before = await worker.stats()
            ended = await worker.abort_router("router-gone")
            worker._loop.set_step_gate(None)
            queued_result = await asyncio.wait_for(queued, 5.0)
            after = await worker.stats()
            again = await worker.abort_router("router-gone")
            await worker.abort("live-held")
            return gone_held, live_held, before, ended, queued_result, after, again, await worker.stats()
        finally:
            worker.shutdown()

    gone_held, live_held, before, ended, queued_result, after, again, last = asyncio.run(scenario())
    assert gone_held.transfer is not None and live_held.transfer is not None
    assert (before.num_held_leases, before.engine.num_waiting, before.routers) == (
        2, 1, frozenset({"router-gone", "router-live"}))
    assert ended == 2
    assert (queued_result.request_id, queued_result.finish_reason, queued_result.transfer) == (
        "gone-queued", "abort", None)
    assert (after.num_held_leases, after.engine.num_waiting, after.routers) == (1, 0, frozenset({"router-live"}))
    assert again == 0
    assert last.is_idle and last.routers == frozenset()


def test_a_decode_worker_ends_a_gone_routers_requests_when_told_without_a_word_to_it(tiny_llama_dir):
    """abort_router on a decode worker: the gone router's request ends even while its output stream
    is still open (Ray says so a few ms before the process has exited), and nothing more about it
    reaches that stream: a dying router would hand a plain abort to its client as a finished stream.
    A request sent on the same stream afterwards streams to its end, so every frame about the first
    came before it. The other router's request runs on."""
    from splitserve.common.worker_messages import DecodeRequest
    from splitserve.testing.in_process_cluster import make_decode_worker
    from tests.factories import RouterOutputs

    async def scenario():
        worker = make_decode_worker(tiny_llama_dir)
        try:
            streams = {router_id: await RouterOutputs.open(worker, router_id) for router_id in ("router-gone", "router-live")}
            for router_id, stream in streams.items():
                stream.submit(DecodeRequest(f"{router_id}-r", router_id, tuple(PROMPT), (), LONG, 0, None, None))
            while (await worker.stats()).routers != frozenset(streams):
                await asyncio.sleep(0.01)
            ended = await worker.abort_router("router-gone")
            streams["router-gone"].submit(DecodeRequest("router-gone-after", "router-gone", tuple(PROMPT), (),
                                                        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
                                                        0, None, None))
            gone = []
            async with asyncio.timeout(30.0):
                while not any(d.request_id == "router-gone-after" and d.finish_reason for d in gone):
                    gone += await streams["router-gone"].next(0.5)
            stats = await worker.stats()
            for stream in streams.values():
                stream.close()
            return ended, gone, stats
        finally:
            worker.shutdown()

    ended, gone, stats = asyncio.run(scenario())
    assert ended == 1
    assert [d for d in gone if d.request_id == "router-gone-r" and d.finish_reason is not None] == []
    assert [(d.finish_reason, d.error) for d in gone if d.request_id == "router-gone-after" and d.finish_reason] == [
        ("length", None)]
    assert (stats.routers, stats.engine.num_running) == (frozenset({"router-live"}), 1)


def test_a_worker_ray_reports_unavailable_is_unroutable_at_once_and_its_request_moves(tiny_llama_dir):
    """Orchestrator.worker_unavailable (Ray's actor state said RESTARTING or DEAD): the worker is
    unroutable before any call to it failed, and the request it was decoding moves to the other
    decode worker with output equal to Hugging Face's. (This worker still answers, so its next
    report makes it routable again, as a restarted worker's does.)"""
    records = []
    routable_after = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, num_decode=2, routing=ROUND_ROBIN,
                                    observer=records.append) as cluster:
            orchestrator = cluster.orchestrator

            def unavailable(cluster: InProcessCluster, worker_id: str) -> None:
                orchestrator.worker_unavailable(worker_id, "Ray reports its actor RESTARTING")
                routable_after.extend(worker for worker, _ in orchestrator._reporting(orchestrator.decode_pool))

            result = await _generate_killing_decode_after(cluster, 4, GenerationInput("a", tuple(PROMPT), GREEDY),
                                                          fault=unavailable)
            orchestrator.worker_unavailable("decode-9", "not in any pool")  # ignored
            await cluster.wait_idle()
            return result

    tokens, moved_from = asyncio.run(scenario())
    assert tokens == hf_greedy(tiny_llama_dir, GreedyCase(tuple(PROMPT), NUM_TOKENS, True))
    assert routable_after == [worker_id for worker_id in ("decode-0", "decode-1") if worker_id != moved_from]
    assert [record.num_migrations for record in records] == [1]
