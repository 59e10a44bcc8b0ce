"""KV pulled from GPU memory: a NIXL READ between two processes' CUDA pools (VRAM, registered as such), and a
1 prefill + 1 decode cluster sharing one GPU whose greedy output equals transformers' (in one process, and as
two Ray actors)."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import time
import uuid

import pytest
import torch

from splitserve.common.kv_transfer_types import KVLayout, TransferParams
from splitserve.kv_transfer import ConsumerConnector, KVLayoutMismatchError, PullStatus
from splitserve.kv_transfer.nixl_backend import NixlBackend
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.testing.in_process_cluster import InProcessCluster, worker_engine_config
from splitserve.testing.local_cluster import running_cluster, tiny_cluster_config
from splitserve.testing.workloads import mixed_workload
from tests.factories import assert_blocks_pulled, empty_pool, hf_greedy, make_pool, requires_cuda, stream_tokens

pytestmark = requires_cuda

LAYOUT = KVLayout(model_id="tiny-llama", dtype="float32", block_size=16, num_layers=4, num_kv_heads=2, head_dim=64,
                  hash_seed=0, memory_kind="VRAM")
REMOTE_IDS, LOCAL_IDS = (30, 3, 17, 8, 22), (1, 19, 4, 12, 0)
NUM_REMOTE, NUM_LOCAL, PRODUCER_OFFSET = 32, 24, 1e7


def _on_gpu(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [layer.cuda() for layer in layers]


def _gpu_producer(conn) -> None:
    """Registers a CUDA pool, sends its metadata, forwards notifications until told to stop."""
    backend = NixlBackend(f"prefill-{uuid.uuid4().hex[:8]}")
    backend.register_kv_pool(_on_gpu(make_pool(LAYOUT, NUM_REMOTE, offset=PRODUCER_OFFSET)), LAYOUT)
    conn.send(backend.metadata())
    notifications: list[str] = []
    while True:
        notifications += backend.take_notifications()
        if conn.poll(0.001):
            if conn.recv() == "stop":
                backend.close()
                return
            conn.send(notifications)
            notifications = []


def _wait_for(condition, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
    return result


def test_a_pull_between_two_processes_reads_gpu_memory_byte_for_byte():
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_gpu_producer, args=(child,), daemon=True)
    process.start()
    consumer = NixlBackend(f"decode-{uuid.uuid4().hex[:8]}")
    try:
        local = _on_gpu(empty_pool(LAYOUT, NUM_LOCAL))
        consumer.register_kv_pool(local, LAYOUT)
        assert parent.poll(120), "producer process did not start"
        metadata = parent.recv()
        assert metadata.layout.memory_kind == "VRAM"
        consumer.add_peer(metadata)
        pulls = ConsumerConnector(consumer)
        pulls.start(TransferParams("req-1", metadata.agent_name, REMOTE_IDS, 80, LAYOUT, 30.0, (0,) * 5), LOCAL_IDS)
        [outcome] = _wait_for(pulls.poll)
        assert outcome.state is PullStatus.DONE, outcome.error
        torch.cuda.synchronize()
        assert_blocks_pulled([layer.cpu() for layer in local], LOCAL_IDS,
                             make_pool(LAYOUT, NUM_REMOTE, offset=PRODUCER_OFFSET), REMOTE_IDS)
        assert _wait_for(lambda: parent.send("notifications") or parent.recv()) == ["req-1"]
    finally:
        parent.send("stop")
        process.join(30)
        consumer.close()


def test_a_host_memory_pool_refuses_a_gpu_peer():
    host = NixlBackend(f"decode-{uuid.uuid4().hex[:8]}")
    gpu = NixlBackend(f"prefill-{uuid.uuid4().hex[:8]}")
    try:
        dram = dataclasses.replace(LAYOUT, memory_kind="DRAM")
        host.register_kv_pool(empty_pool(dram, 4), dram)
        gpu.register_kv_pool(_on_gpu(empty_pool(LAYOUT, 4)), LAYOUT)
        with pytest.raises(KVLayoutMismatchError, match="memory_kind: 'DRAM' != 'VRAM'"):
            host.add_peer(gpu.metadata())
    finally:
        host.close()
        gpu.close()


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-request", "layerwise"])
def test_an_in_process_cluster_on_the_gpu_matches_transformers(tiny_llama_dir, layerwise):
    """Router + prefill worker + decode worker in this process (no Ray), fp32 pools on the GPU, every request's KV
    pulled over NIXL from the prefill worker's VRAM into the decode worker's (layer-wise: each layer announced once
    a CUDA event recorded after it completed); every block back on both sides at the end."""
    cases = mixed_workload(512, num_requests=8, seed=3, max_prompt=200, max_output=16)
    config = dataclasses.replace(worker_engine_config(), device="cuda")

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, layerwise=layerwise, engine_config=config,
                                    transfer_backend="nixl") as cluster:
            outputs = [[token for chunk in await cluster.generate(f"r{index}", case.prompt_token_ids, case.params())
                        for token in chunk.token_ids] for index, case in enumerate(cases)]
            await cluster.wait_idle()
            stats = [await worker.stats() for worker in (*cluster.prefill_workers, *cluster.decode_workers)]
            return outputs, stats, stats[-1]

    outputs, stats, decode = asyncio.run(scenario())
    expected = [hf_greedy(tiny_llama_dir, case) for case in cases]
    assert outputs == expected
    assert [s.engine.num_free_kv_blocks for s in stats] == [s.engine.num_kv_blocks for s in stats]
    # A request that ends at its first token (from the prefill worker) has nothing to decode and is not pulled.
    assert decode.num_layerwise_pulls == (sum(len(tokens) > 1 for tokens in expected) if layerwise else 0)


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole-request", "layerwise"])
def test_one_prefill_and_one_decode_worker_on_one_gpu_match_transformers(tiny_llama_dir, layerwise):
    """Two Ray actors (two processes) sharing the GPU, fp32, the KV pulled over NIXL from the prefill worker's VRAM
    (layer-wise: each layer announced once a CUDA event recorded after it completed)."""
    gpu = {f"{pool}.{key}": value for pool in ("prefill", "decode")
           for key, value in (("engine.device", "cuda"), ("engine.dtype", "float32"), ("resources.num_gpus", 0.5))}
    cases = mixed_workload(512, num_requests=8, seed=3, max_prompt=200, max_output=16)
    config = tiny_cluster_config(tiny_llama_dir, kv_transfer_layerwise=layerwise, **gpu)
    with running_cluster(config) as (cluster, loop):
        outputs = [stream_tokens(cluster.port, _request(index, case))[0] for index, case in enumerate(cases)]
        loop.run(cluster.wait_idle())
    assert outputs == [hf_greedy(tiny_llama_dir, case) for case in cases]


def _request(index: int, case) -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=f"req-{index}", token_ids=pb.TokenIds(ids=case.prompt_token_ids),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=case.max_tokens,
                                                         ignore_eos=case.ignore_eos))
