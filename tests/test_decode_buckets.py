"""CUDA-graph decode buckets on CPU: the bucket table, the padding rules, and that padding rows (run through
the FlashInfer backend with torch kernels) neither change a real row nor touch a real block."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.engine.attention import TorchReferenceAttention
from splitserve.engine.attention.flashinfer import FlashInferAttention
from splitserve.engine.cuda_graphs import uses_cuda_graphs
from splitserve.engine.decode_buckets import DecodeBucketTable, pad_decode_step
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.model_runner import InputBuilder
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from splitserve.testing.paged_reference import ReferencePagedKernels


def test_bucket_table_up_to_a_batch_size():
    assert DecodeBucketTable.up_to(1).sizes == (1,)
    assert DecodeBucketTable.up_to(3).sizes == (1, 2, 3)
    assert DecodeBucketTable.up_to(8).sizes == (1, 2, 4, 8)
    assert DecodeBucketTable.up_to(20).sizes == (1, 2, 4, 8, 16, 20)
    assert DecodeBucketTable.up_to(128).sizes == (1, 2, 4, *range(8, 129, 8))
    table = DecodeBucketTable.up_to(20)
    assert [table.bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 20, 21)] == [1, 2, 4, 8, 8, 16, 16, 20, 20, None]
    for bad in ((), (0, 1), (2, 1), (1, 1)):
        with pytest.raises(ValueError, match="distinct, ascending"):
            DecodeBucketTable(bad)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        DecodeBucketTable.up_to(0)


def test_a_graph_takes_only_sampling_decode_steps_that_fit():
    table = DecodeBucketTable.up_to(2)
    decode = ScheduledChunk("a", (5,), 3, (1,), samples=True)
    assert table.takes((decode, decode))
    assert not table.takes((decode, decode, decode))  # above the largest bucket
    assert not table.takes(())
    assert not table.takes((ScheduledChunk("b", (5, 6), 3, (1,), samples=True),))  # a prefill chunk
    assert not table.takes((ScheduledChunk("c", (5,), 3, (1, 2), samples=False),))  # a recompute chunk that stops short


def test_padding_rows_write_and_read_only_the_dummy_block():
    block_size, dummy = 4, 9
    chunks = (ScheduledChunk("a", (11,), 5, (3, 7), True), ScheduledChunk("b", (12,), 0, (2,), True))
    step = pad_decode_step(chunks, bucket=4, block_size=block_size, dummy_block=dummy)
    assert step.num_real == 2
    assert step.input_ids.tolist() == [11, 12, 0, 0]
    assert step.positions.tolist() == [5, 0, 0, 0]
    # key row = block * 2 * block_size + offset: block 7 offset 1, block 2 offset 0, then the dummy block's slot 0.
    assert step.key_slots.tolist() == [57, 16, 72, 72]
    paged = step.paged
    assert (paged.qo_indptr.tolist(), paged.kv_indptr.tolist(), paged.kv_indices.tolist(),
            paged.kv_last_page_len.tolist(), paged.query_rows.tolist()) == (
        [0, 1, 2, 3, 4], [0, 2, 3, 4, 5], [3, 7, 2, 9, 9], [2, 1, 1, 1], [0, 1, 2, 3])
    assert (step.attention_metadata().value_slots - step.key_slots).tolist() == [4] * 4


def test_padding_refuses_what_a_bucket_cannot_take():
    decode = ScheduledChunk("a", (1,), 0, (0,), True)
    with pytest.raises(ValueError, match="3 decodes do not fit a bucket of 2"):
        pad_decode_step((decode,) * 3, 2, 4, 9)
    with pytest.raises(ValueError, match="only decode steps"):
        pad_decode_step((ScheduledChunk("b", (1, 2), 0, (0,), True),), 2, 4, 9)


@pytest.mark.parametrize("seed", range(6))
def test_a_padded_step_computes_the_real_rows_as_the_unpadded_one_and_keeps_real_blocks(seed):
    rng = random.Random(seed)
    block_size, num_blocks, num_heads, num_kv_heads, head_dim = 4, 40, 4, 2, 8
    dummy = num_blocks  # the pool's extra block
    free = rng.sample(range(num_blocks), num_blocks)
    chunks = []
    for index in range(rng.randint(1, 5)):
        position = rng.randint(0, 14)
        table = tuple(free.pop() for _ in range(position // block_size + 1))
        chunks.append(ScheduledChunk(f"r{index}", (rng.randint(0, 99),), position, table, True))
    table = DecodeBucketTable.up_to(8)
    step = pad_decode_step(chunks, table.bucket_for(len(chunks)), block_size, dummy)
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks + 1, 2, block_size, num_kv_heads, head_dim, generator=generator)
    bucket = step.positions.shape[0]
    query = torch.randn(bucket, num_heads, head_dim, generator=generator)
    key, value = (torch.randn(bucket, num_kv_heads, head_dim, generator=generator) for _ in range(2))

    padded_pool, eager_pool = pool.clone(), pool.clone()
    padded = FlashInferAttention(ReferencePagedKernels()).forward(query, key, value, padded_pool,
                                                                  step.attention_metadata(), None)
    real = len(chunks)
    eager_metadata = InputBuilder(block_size, torch.device("cpu"), bucket_decodes=False, paged_metadata=True).build(
        SchedulerOutput(tuple(chunks), ())).metadata
    eager = FlashInferAttention(ReferencePagedKernels()).forward(query[:real], key[:real], value[:real], eager_pool,
                                                                 eager_metadata, None)
    assert torch.equal(padded[:real], eager)
    assert torch.equal(padded_pool[:num_blocks], eager_pool[:num_blocks])  # every real block as without padding
    if bucket > real:
        assert torch.equal(padded_pool[dummy, :, 0], torch.stack((key[-1], value[-1])))  # padding wrote the dummy


def test_cuda_graphs_are_refused_off_cuda(tiny_llama_dir):
    with pytest.raises(ValueError, match="cuda_graphs needs device 'cuda' and the flashinfer attention backend"):
        EngineCore(tiny_llama_dir, EngineConfig(device="cpu", num_kv_blocks=64, max_model_len=128, cuda_graphs=True))


def test_cuda_graphs_default_to_exactly_where_they_can_be_captured():
    flashinfer, reference = FlashInferAttention(ReferencePagedKernels()), TorchReferenceAttention()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert [uses_cuda_graphs(None, device, attention)
            for device, attention in ((cuda, flashinfer), (cpu, flashinfer), (cuda, reference))] == [True, False, False]
    assert [uses_cuda_graphs(requested, cuda, flashinfer) for requested in (True, False)] == [True, False]
    assert uses_cuda_graphs(False, cpu, reference) is False
    with pytest.raises(ValueError, match="cuda_graphs needs device 'cuda'"):
        uses_cuda_graphs(True, cuda, reference)
    # A mixture of experts syncs with the host in every layer: never captured by default, refused when asked for.
    assert uses_cuda_graphs(None, cuda, flashinfer, sparse_moe=True) is False
    with pytest.raises(ValueError, match="cuda_graphs cannot capture a mixture-of-experts model"):
        uses_cuda_graphs(True, cuda, flashinfer, sparse_moe=True)


def test_an_engine_on_cpu_captures_nothing_by_default(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, EngineConfig(device="cpu", num_kv_blocks=64, max_model_len=128))
    assert (engine.config.cuda_graphs, engine.runner.graphs, engine.kv_cache.dummy_block) == (None, None, None)
