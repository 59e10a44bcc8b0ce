"""FlashInfer's paged-KV metadata (built on the host) and the FlashInfer backend's plan/run logic, on CPU:
the backend with torch kernels that read only FlashInfer's metadata must equal the reference backend."""

from __future__ import annotations

import random

import pytest
import torch

from splitserve.engine.attention import TorchReferenceAttention, flashinfer_installed, select_backend
from splitserve.engine.attention.flashinfer import FlashInferAttention, window_left
from splitserve.engine.attention.paged_kv_metadata import ChunkPages, build_paged_kv_batch
from splitserve.engine.model_runner import InputBuilder
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput
from splitserve.testing.paged_reference import ReferencePagedKernels
from tests.factories import random_paged_step


def _lists(batch) -> tuple:
    return (batch.qo_indptr.tolist(), batch.kv_indptr.tolist(), batch.kv_indices.tolist(),
            batch.kv_last_page_len.tolist(), batch.query_rows.tolist())


def test_input_builder_splits_a_step_into_flashinfer_prefill_and_decode_batches():
    block_size = 4
    output = SchedulerOutput(chunks=(
        ScheduledChunk("decode", (9,), start_position=5, block_table=(3, 7), samples=True),
        ScheduledChunk("prefill", (1, 2, 3), start_position=2, block_table=(5, 2, 8), samples=False),
        ScheduledChunk("fresh", (4, 5), start_position=0, block_table=(6,), samples=True),
        ScheduledChunk("decode2", (8,), start_position=8, block_table=(1, 4, 9), samples=True),
    ), preempted_request_ids=())
    paged = InputBuilder(block_size, torch.device("cpu"), bucket_decodes=False, paged_metadata=True).build(
        output).metadata.paged
    # Prefill chunks: "prefill" has 5 tokens of KV in blocks 5, 2 (1 token in the last), "fresh" 2 in block 6;
    # their queries are rows 1-3 and 4-5 of the step. Block 8 of "prefill" is past its context: not listed.
    assert _lists(paged.prefill) == ([0, 3, 5], [0, 2, 3], [5, 2, 6], [1, 2], [1, 2, 3, 4, 5])
    # Decodes: contexts 6 (blocks 3, 7, 2 in the last) and 9 (blocks 1, 4, 9, 1 in the last), rows 0 and 6.
    assert _lists(paged.decode) == ([0, 1, 2], [0, 2, 5], [3, 7, 1, 4, 9], [2, 1], [0, 6])
    assert paged.decode.kv_lens().tolist() == [6, 9]
    assert paged.prefill.qo_indptr.dtype == paged.decode.kv_indices.dtype == torch.int32


def test_no_paged_metadata_unless_asked_and_none_for_a_missing_part():
    output = SchedulerOutput((ScheduledChunk("a", (1,), 0, (2,), True),), ())
    assert InputBuilder(4, torch.device("cpu")).build(output).metadata.paged is None
    paged = InputBuilder(4, torch.device("cpu"), paged_metadata=True).build(output).metadata.paged
    assert paged.prefill is None and _lists(paged.decode) == ([0, 1], [0, 1], [2], [1], [0])


def test_a_full_last_block_has_last_page_len_page_size_and_a_short_table_is_refused():
    batch = build_paged_kv_batch([ChunkPages(0, 8, 8, (4, 2))], page_size=4)
    assert _lists(batch) == ([0, 8], [0, 2], [4, 2], [4], list(range(8)))
    with pytest.raises(ValueError, match="needs 3 blocks of 4, its table has 2"):
        build_paged_kv_batch([ChunkPages(0, 2, 9, (4, 2))], page_size=4)
    with pytest.raises(ValueError, match="1 <= query_len <= context_len"):
        ChunkPages(0, 3, 2, (1,))


def test_window_left_is_the_window_minus_one():
    assert (window_left(None), window_left(1), window_left(256)) == (-1, 0, 255)


@pytest.mark.parametrize("seed", range(12))
def test_flashinfer_backend_on_reference_kernels_equals_the_reference_backend(seed):
    rng = random.Random(seed)
    block_size, num_blocks, num_kv_heads, head_dim = rng.choice((4, 16)), 96, 2, 8
    num_heads = num_kv_heads * rng.choice((1, 3))
    sliding_window = rng.choice((None, 5, 17))
    output = random_paged_step(rng, block_size, num_blocks)
    scale = (None, 0.6)[seed % 2]  # a model's own softmax scale (Granite's attention_multiplier) on odd seeds
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=generator)
    num_tokens = sum(chunk.num_tokens for chunk in output.chunks)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=generator)
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator) for _ in range(2))

    reference_pool, flashinfer_pool = pool.clone(), pool.clone()
    reference = TorchReferenceAttention().forward(
        query, key, value, reference_pool, InputBuilder(block_size, torch.device("cpu")).build(output).metadata,
        sliding_window, scale)
    kernels = ReferencePagedKernels()
    metadata = InputBuilder(block_size, torch.device("cpu"), bucket_decodes=False,
                            paged_metadata=True).build(output).metadata
    backend = FlashInferAttention(kernels)
    for _layer in range(3):  # the layers of one step share one plan per kernel
        got = backend.forward(query, key, value, flashinfer_pool, metadata, sliding_window, scale)
    assert torch.equal(flashinfer_pool, reference_pool)  # same keys and values in the same slots
    torch.testing.assert_close(got, reference, atol=2e-6, rtol=2e-6)
    assert {name: kernel.num_plans for name, kernel in kernels.kernels.items()} == {
        (part, window_left(sliding_window)): 1
        for part, batch in (("prefill", metadata.paged.prefill), ("decode", metadata.paged.decode)) if batch}


def test_flashinfer_backend_refuses_metadata_without_the_paged_part():
    metadata = InputBuilder(4, torch.device("cpu")).build(
        SchedulerOutput((ScheduledChunk("a", (1,), 0, (0,), True),), ())).metadata
    pool = torch.zeros(2, 2, 4, 1, 8)
    with pytest.raises(ValueError, match="needs AttentionMetadata.paged"):
        FlashInferAttention(ReferencePagedKernels()).forward(
            torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), pool, metadata, None)


def test_select_backend_takes_flashinfer_only_on_cuda_in_16_bit_and_installed():
    with pytest.raises(ValueError, match="attention_backend 'flashinfer' needs device 'cuda', got 'cpu'"):
        select_backend("flashinfer", "cpu", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="needs dtype float16 or bfloat16, got torch.float32"):
        select_backend("flashinfer", "cuda", dtype=torch.float32)
    # float32 on CUDA: FlashInfer has no kernels for it, auto takes the reference.
    assert type(select_backend("auto", "cuda", dtype=torch.float32)) is TorchReferenceAttention
    if not flashinfer_installed():
        assert type(select_backend("auto", "cuda", dtype=torch.bfloat16)) is TorchReferenceAttention
        with pytest.raises(ValueError, match=r"pip install 'splitserve\[gpu\]'"):
            select_backend("flashinfer", "cuda", dtype=torch.bfloat16)


def test_a_quantized_kv_pool_never_gets_flashinfer(monkeypatch):
    """FlashInfer reads plain [.., head_dim] rows of the model dtype; an int8 / fp8 pool holds codes and scales."""
    monkeypatch.setattr("splitserve.engine.attention.flashinfer_installed", lambda: True)
    assert type(select_backend("auto", "cuda", dtype=torch.bfloat16, quantized_kv=True)) is TorchReferenceAttention
    with pytest.raises(ValueError, match="'flashinfer' needs kv_cache_dtype auto"):
        select_backend("flashinfer", "cuda", dtype=torch.bfloat16, quantized_kv=True)
