"""Layer-wise transfer in the cluster's request path (kv_transfer_layerwise), on in-process clusters:
the router hands the decode worker the request when the prefill starts and relays the prefill's
TransferParams, layer announcements and first token; the decode worker's pull READs each layer as
it is announced (ConsumerConnector's layer-wise pull, which refuses an unannounced READ).

Ray + NIXL: tests/test_cluster.py::test_layerwise_transfer_matches_hf_1p1d.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import suppress

import pytest

from splitserve.common.block_hash import BlockHasher
from splitserve.common.sampling_params import SamplingParams
from splitserve.decode_worker.worker import PullDone, queue_without_pull
from splitserve.kv_transfer import PullStatus
from splitserve.kv_transfer.connector import ProducerStats
from splitserve.router.api_types import RouterError
from splitserve.testing.in_process_cluster import InProcessCluster
from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy

NUM_KV_BLOCKS = 256  # worker_engine_config's pool
BLOCK_SIZE = 8
CASES = [
    GreedyCase(tuple(range(3, 8)), 6, True),  # one partial block
    GreedyCase(tuple(range(10, 26)), 6, True),  # two full blocks: the first token starts a third
    GreedyCase(tuple((7 * i) % 500 + 1 for i in range(300)), 5, True),  # two chunks (256-token budget)
    GreedyCase(tuple((7 * i) % 500 + 1 for i in range(300)), 4, True),  # the same prompt: a prefix-cache hit
]


MID_PROMPT = tuple(range(1, 30))  # 29 tokens: 4 blocks on the prefill worker, 4 (room for token 30) on decode
MID_PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
"""The request the tests that interrupt a transfer run."""


def _blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def _tokens(chunks) -> list[int]:
    return [token for chunk in chunks for token in chunk.token_ids]


class LayerGate:
    """Stands between a layer-wise prefill worker's engine and its announcer: after the announcer
    announced layer `layer` of the first forward it follows, it holds the engine thread until
    release(); with `fail`, the forward then raises (a step that fails mid-forward)."""

    def __init__(self, worker, layer: int, fail: bool = False) -> None:
        self._announcer = worker._announcer
        self._layer, self._fail = layer, fail
        self.reached = threading.Event()
        self._released = threading.Event()
        worker.engine.set_layer_listener(self)

    def final_chunks_starting(self, chunks) -> None:
        self._announcer.final_chunks_starting(chunks)

    def layer_written(self, layer: int) -> None:
        self._announcer.layer_written(layer)
        if layer != self._layer or self.reached.is_set():
            return
        self.reached.set()
        assert self._released.wait(30.0), "the test never released the gate"
        if self._fail:
            raise RuntimeError("injected: the forward failed after layer 0")

    def release(self) -> None:
        self._released.set()


async def _until(worker, read, expected, timeout_s: float = 10.0) -> None:
    """Wait until read(engine), run on the worker's engine thread, returns `expected` (checked after
    every call and step there: EngineLoop.wait_until)."""
    if not await worker._loop.wait_until(lambda engine: read(engine) == expected, timeout_s):
        raise AssertionError(f"{await worker._loop.run(read)!r} != {expected!r}")


def _pull_of_the_one_request(decode):
    """What the decode worker's one request's pull is at: (status, layers READ or being READ)."""
    def read(engine):
        (request_id,) = decode._routes
        return decode._pulls.status(request_id), decode._pulls.layers_read(request_id)

    return read


async def _end_state(cluster):
    """Once every worker is idle: both workers' stats, the prefill's leases, the decode worker's pulls."""
    prefill, decode = cluster.prefill_workers[0], cluster.decode_workers[0]
    await cluster.wait_idle()
    return await prefill.stats(), await decode.stats(), prefill._leases.stats(), decode._pulls.stats()


def _assert_ended_mid_transfer(num_free_during: int, end_state) -> None:
    """The decode worker held MID_PROMPT's blocks and one more token's while the request ran; after it
    ended every block is free on both workers, its one lease was released and its one pull aborted."""
    prefill, decode, leases, pulls = end_state
    assert num_free_during == NUM_KV_BLOCKS - _blocks(len(MID_PROMPT) + 1)
    for stats in (prefill, decode):
        assert stats.engine.num_free_kv_blocks == stats.engine.num_kv_blocks == NUM_KV_BLOCKS
    assert leases == ProducerStats(num_held=0, num_pulled=0, num_expired=0, num_released=1, num_late_notifications=0)
    assert (pulls.num_pulling, pulls.num_done, pulls.num_failed, pulls.num_aborted) == (0, 0, 0, 1)


async def _decode_layers_read(decode, num_layers: int) -> None:
    """Wait until the decode worker's one request has READ `num_layers` layers and waits for the next."""
    await _until(decode, _pull_of_the_one_request(decode), (PullStatus.AWAITING_LAYER, num_layers))


def test_a_layerwise_cluster_matches_hugging_face(tiny_llama_dir):
    async def scenario():
        async with InProcessCluster(tiny_llama_dir, layerwise=True) as cluster:
            outputs = [_tokens(await cluster.generate(f"r{i}", case.prompt_token_ids, case.params()))
                       for i, case in enumerate(CASES)]
            await cluster.wait_idle()
            return outputs, await cluster.decode_workers[0].stats(), cluster.decode_workers[0]._pulls.stats()

    outputs, stats, pulls = asyncio.run(scenario())
    assert outputs == [hf_greedy(tiny_llama_dir, case) for case in CASES]
    # Every request that went on past its first token was pulled layer-wise, reading announced layers only.
    assert (stats.num_layerwise_pulls, pulls.num_done, pulls.num_failed) == (4, 4, 0)
    assert pulls.num_unmatched_announcements == 0
    assert stats.engine.num_free_kv_blocks == stats.engine.num_kv_blocks == NUM_KV_BLOCKS


def test_a_salted_request_is_cached_under_its_salted_hashes_on_both_workers(tiny_llama_dir):
    """The decode worker is handed the request before its prefill (first_token_pending): it gets the
    salt then, and caches the pulled blocks under the prefill worker's salted hashes."""
    prompt = list(MID_PROMPT)

    async def cached_hashes(worker) -> frozenset[int]:
        return await worker._loop.run(lambda engine: engine.block_manager.cached_block_hashes())

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, layerwise=True) as cluster:
            chunks = [await cluster.generate(request_id, prompt, MID_PARAMS, cache_salt="user-a")
                      for request_id in ("a", "b")]
            await cluster.wait_idle()
            return chunks, [await cached_hashes(w) for w in (*cluster.prefill_workers, *cluster.decode_workers)]

    chunks, held = asyncio.run(scenario())
    salted = BlockHasher(BLOCK_SIZE, 0).hash_prefix(prompt + _tokens(chunks[0]), "user-a")
    # The prefill worker computed the prompt's 3 full blocks; the decode worker also the 4th, which
    # the generated tokens completed (the chain goes on from the same salted root).
    assert held == [frozenset(salted[:3]), frozenset(salted[:4])]
    assert [c[-1].usage.cached_tokens for c in chunks] == [0, 24]
    assert _tokens(chunks[0]) == _tokens(chunks[1]) == hf_greedy(tiny_llama_dir, GreedyCase(MID_PROMPT, 8, True))


def test_a_request_that_ends_at_its_first_token_frees_the_decode_workers_admitted_blocks(tiny_llama_dir):
    """The decode worker was handed the request (and may have pulled some or all of its layers, or
    had its pull fail as the producer released the lease) before the first token ended it."""
    case = GreedyCase(tuple(range(40, 60)), 1, True)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, layerwise=True) as cluster:
            chunks = await cluster.generate("one", case.prompt_token_ids, case.params())
            await cluster.wait_idle()
            return chunks, await cluster.decode_workers[0].stats(), cluster.decode_workers[0]._pulls.stats()

    chunks, stats, pulls = asyncio.run(scenario())
    assert (_tokens(chunks), chunks[-1].finish_reason) == (hf_greedy(tiny_llama_dir, case), "length")
    assert pulls.num_pulling == 0 and pulls.num_done + pulls.num_failed + pulls.num_aborted == 1
    assert stats.engine.num_free_kv_blocks == stats.engine.num_kv_blocks == NUM_KV_BLOCKS
    assert stats.engine.num_running == stats.engine.num_waiting == stats.num_transfers == 0


def test_seeded_sampling_continues_the_prefill_workers_random_stream(tiny_llama_dir):
    """The generator state after the first sample travels with the first token: a layer-wise cluster
    samples what a whole-request one does."""
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    prompt = tuple(range(5, 30))

    async def run(layerwise: bool) -> tuple[list[int], int]:
        async with InProcessCluster(tiny_llama_dir, layerwise=layerwise) as cluster:
            tokens = _tokens(await cluster.generate("s", prompt, params))
            await cluster.wait_idle()
            return tokens, (await cluster.decode_workers[0].stats()).num_layerwise_pulls

    whole, layerwise = asyncio.run(run(False)), asyncio.run(run(True))
    assert layerwise == (whole[0], 1) and whole[1] == 0 and len(whole[0]) == 12


def test_a_cancel_mid_transfer_releases_every_block_on_both_sides(tiny_llama_dir):

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, layerwise=True) as cluster:
            prefill, decode = cluster.prefill_workers[0], cluster.decode_workers[0]
            gate = LayerGate(prefill, layer=0)
            task = asyncio.ensure_future(cluster.generate("c", MID_PROMPT, MID_PARAMS))
            assert await asyncio.to_thread(gate.reached.wait, 30.0)
            await _decode_layers_read(decode, 1)  # layer 0 READ, layer 1 not announced yet
            during = (await decode.stats()).engine.num_free_kv_blocks
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            gate.release()
            return during, await _end_state(cluster)

    _assert_ended_mid_transfer(*asyncio.run(scenario()))


async def _reading_layer_0(cluster: InProcessCluster, request_id: str):
    """Starts a request and returns once its prefill is held before layer 1 and the decode worker's READ of
    layer 0 is in flight (pull completions deferred): (the decode worker, the layer gate, the request's task)."""
    prefill, decode = cluster.prefill_workers[0], cluster.decode_workers[0]
    await decode._loop.run(lambda engine: decode._backend.defer_completions())
    gate = LayerGate(prefill, layer=0)
    task = asyncio.ensure_future(cluster.generate(request_id, MID_PROMPT, MID_PARAMS))
    assert await asyncio.to_thread(gate.reached.wait, 30.0)
    await _until(decode, _pull_of_the_one_request(decode), (PullStatus.PULLING, 1))
    return decode, gate, task


def test_a_cancel_during_a_layers_read_frees_the_decode_side_when_that_read_completes(tiny_llama_dir):
    """The READ of layer 0 is in flight when the request is cancelled: its blocks are freed once that
    READ completes, while the prefill is still held before layer 1 (no wait for layers that will never come)."""

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, layerwise=True) as cluster:
            decode, gate, task = await _reading_layer_0(cluster, "c")
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            await _until(decode, lambda engine: len(decode._abort_after_pull), 1)
            during = (await decode.stats()).engine.num_free_kv_blocks
            assert await decode._loop.run(lambda engine: decode._backend.complete_pending_pulls()) == 1
            await _until(decode, lambda engine: engine.block_manager.num_free_blocks, NUM_KV_BLOCKS)
            gate.release()
            return during, await _end_state(cluster)

    _assert_ended_mid_transfer(*asyncio.run(scenario()))


def test_the_decode_worker_polls_a_pull_only_while_one_of_its_reads_is_in_flight(tiny_llama_dir):
    """A pull waiting for its next layer moves only when that layer is relayed (a call, which wakes
    the engine loop) or its lease_ttl_s runs out: between the layers of a long forward, the loop
    must not wake every transfer_poll_s for it."""
    from splitserve.decode_worker.worker import PULL_POLL_S

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, layerwise=True) as cluster:
            decode, gate, task = await _reading_layer_0(cluster, "p")
            reading = await decode._loop.run(lambda engine: decode._poll_transfers())
            assert await decode._loop.run(lambda engine: decode._backend.complete_pending_pulls()) == 1
            await _decode_layers_read(decode, 1)
            waiting = await decode._loop.run(lambda engine: decode._poll_transfers())
            during = (await decode.stats()).engine.num_free_kv_blocks
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
            gate.release()
            return (reading, waiting), during, await _end_state(cluster)

    poll_again_s, during, end_state = asyncio.run(scenario())
    assert poll_again_s == (PULL_POLL_S, None)
    _assert_ended_mid_transfer(during, end_state)


def test_a_prefill_that_fails_mid_forward_releases_the_decode_workers_blocks(tiny_llama_dir):

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, layerwise=True) as cluster:
            prefill, decode = cluster.prefill_workers[0], cluster.decode_workers[0]
            gate = LayerGate(prefill, layer=0, fail=True)
            task = asyncio.ensure_future(cluster.generate("f", MID_PROMPT, MID_PARAMS))
            assert await asyncio.to_thread(gate.reached.wait, 30.0)
            await _decode_layers_read(decode, 1)
            during = (await decode.stats()).engine.num_free_kv_blocks
            gate.release()
            with pytest.raises(RouterError) as failure:
                await task
            return failure.value, during, await _end_state(cluster)

    error, during, end_state = asyncio.run(scenario())
    assert (error.code, error.message) == ("UNAVAILABLE", "prefill worker prefill-0 aborted the request")
    _assert_ended_mid_transfer(during, end_state)


def test_the_whole_request_path_is_unchanged_with_the_switch_off(tiny_llama_dir):
    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            outputs = [_tokens(await cluster.generate(f"r{i}", case.prompt_token_ids, case.params()))
                       for i, case in enumerate(CASES)]
            await cluster.wait_idle()
            info = await cluster.prefill_workers[0].info()
            return outputs, info.layerwise, cluster.decode_workers[0]._pulls.stats()

    outputs, layerwise, pulls = asyncio.run(scenario())
    assert outputs == [hf_greedy(tiny_llama_dir, case) for case in CASES]
    assert not layerwise and (pulls.num_done, pulls.num_layerwise_done) == (4, 0)


def test_a_worker_that_is_not_layerwise_refuses_a_layerwise_prefill(tiny_llama_dir):
    from splitserve.common.worker_messages import PrefillRequest

    async def scenario():
        async with InProcessCluster(tiny_llama_dir) as cluster:
            stream = cluster.prefill_workers[0].prefill_layerwise(PrefillRequest("x", (1, 2, 3), SamplingParams()))
            with pytest.raises(RuntimeError, match="prefill worker prefill-0 is not layer-wise"):
                await anext(stream)

    asyncio.run(scenario())


def test_relayed_progress_that_comes_after_an_abort_starts_no_pull_into_the_freed_blocks(tiny_llama_dir):
    """Ray reports a router dead (abort_router) a few ms before its process exits, so frames it
    relayed meanwhile still reach the decode worker: the request's TransferParams, its layers and its
    first token come after its blocks were freed, before the step that reports its end. They must
    start no pull: its READs would write blocks another request may already hold."""
    from splitserve.common.worker_messages import (DecodeRequest, LayerwiseProgress, PrefillFirstToken,
                                                   PrefillRequest)
    from splitserve.testing.in_process_cluster import make_decode_worker, make_prefill_worker


    async def scenario():
        prefill, decode = make_prefill_worker(tiny_llama_dir, layerwise=True), make_decode_worker(tiny_llama_dir)
        try:
            await decode.open_output_stream("router-gone")
            await decode.add_peer((await prefill.info()).agent)
            decode._on_stream_frame("router-gone", DecodeRequest("r", "router-gone", MID_PROMPT, (), MID_PARAMS, 0,
                                                                 None, None, first_token_pending=True))
            items = [item async for item in prefill.prefill_layerwise(PrefillRequest("r", MID_PROMPT, MID_PARAMS,
                                                                                     "router-gone"))]
            *progress, result = items
            admitted = await decode._loop.run(lambda engine: engine.block_manager.num_free_blocks)
            decode._loop.set_step_gate(lambda engine: False)  # the step that would report its end waits
            ended = await decode.abort_router("router-gone")
            for frame in [*progress, PrefillFirstToken("r", result.token_ids, result.num_cached_tokens,
                                                       result.generator_state)]:
                decode._on_stream_frame("router-gone", frame)
            after = await decode._loop.run(lambda engine: (engine.block_manager.num_free_blocks,
                                                           decode._pulls.stats()))
            decode._loop.set_step_gate(None)
            await prefill.abort("r")
            await _until(decode, lambda engine: decode._transfers() | decode._routes.keys(), set())
            return ([type(item) for item in progress], admitted, ended, after, await prefill.stats(),
                    await decode.stats())
        finally:
            prefill.shutdown()
            decode.shutdown()

    progress_types, admitted, ended, (free_after, pulls), prefill_stats, decode_stats = asyncio.run(scenario())
    assert progress_types and set(progress_types) == {LayerwiseProgress}
    assert (admitted, ended, free_after) == (NUM_KV_BLOCKS - _blocks(len(MID_PROMPT) + 1), 1, NUM_KV_BLOCKS)
    assert (pulls.num_pulling, pulls.num_done, pulls.num_failed, pulls.num_aborted, pulls.bytes_pulled) == (
        0, 0, 0, 0, 0)
    for stats in (prefill_stats, decode_stats):
        assert stats.is_idle and stats.engine.num_free_kv_blocks == NUM_KV_BLOCKS


def test_a_decode_stream_that_breaks_during_the_prefill_moves_the_request(tiny_llama_dir):
    """The decode worker holds the request from the start of its prefill, so when that worker's stream
    breaks meanwhile (here it drops the router, as it drops one that stops reading; the router
    reconnects at once), the request it ended there must move: relaying the rest of the prefill to
    the reconnected stream would leave the client waiting for tokens nobody computes."""
    from splitserve.router.policy import RoutingConfig

    records = []

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, layerwise=True, num_decode=2, observer=records.append,
                                    routing=RoutingConfig(policy="round_robin", disaggregation="always")) as cluster:
            prefill, decode = cluster.prefill_workers[0], cluster.decode_workers[0]
            gate = LayerGate(prefill, layer=0)
            deadline = time.monotonic() + 20.0  # without the move, the request would wait for its tokens until then
            task = asyncio.ensure_future(cluster.generate("m", MID_PROMPT, MID_PARAMS, deadline))
            assert await asyncio.to_thread(gate.reached.wait, 30.0)
            await _decode_layers_read(decode, 1)
            outputs, router_id = decode._outputs, cluster.orchestrator.router_id
            outputs._drop(router_id, outputs._outboxes[router_id])
            await _until(decode, lambda engine: decode._transfers() | decode._routes.keys(), set())
            async with asyncio.timeout(10.0):
                while not outputs.is_connected(router_id):  # event-loop state: no engine round follows it
                    await asyncio.sleep(0.01)
            gate.release()
            chunks = await task
            await cluster.wait_idle()
            return chunks, [await worker.stats() for worker in [*cluster.prefill_workers, *cluster.decode_workers]]

    chunks, stats = asyncio.run(scenario())
    assert _tokens(chunks) == hf_greedy(tiny_llama_dir, GreedyCase(MID_PROMPT, 8, True))
    ((record),) = records
    assert (record.finish_reason, record.num_migrations, record.decode_worker) == ("length", 1, "decode-1")
    for worker_stats in stats:
        assert worker_stats.engine.num_free_kv_blocks == NUM_KV_BLOCKS


@pytest.mark.parametrize("admitted_at, pull_s, pull_ended_at, expected", [
    (10.0, 0.25, 10.5, 0.5),    # whole-request: admitted at 10.0, pulled 10.25-10.5, scheduled at 10.75
    (10.0, 0.25, 10.125, 0.625),  # a pull begun before admission: only its 0.125 s after it
    (10.0, 0.25, 10.0, 0.75),   # layer-wise: the pull ended as the first token admitted it
    (10.0, 0.25, 9.5, 0.75),    # ... or before
    (10.0, None, None, 0.75),   # no pull (a local prefill)
])
def test_queue_time_leaves_out_only_the_part_of_the_pull_after_admission(admitted_at, pull_s, pull_ended_at, expected):
    pull = None if pull_s is None else PullDone(pull_s, pull_ended_at)
    assert queue_without_pull(0.75, admitted_at, pull) == expected
