"""KV pool sizing: vLLM's gpu_memory_utilization (a pure decision on made-up sizes; the CUDA measurement is
tests/gpu/test_cuda_engine.py's), which explicit sizes win over it, and what it does on CPU (nothing)."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from splitserve.engine import LLM
from splitserve.engine.attention import select_backend
from splitserve.engine.kv_cache import (EngineMemory, KVCacheSizingError, KVCacheSpec, blocks_for_utilization,
                                        num_blocks_for, sizes_by_utilization)
from splitserve.engine.memory_profile import profiling_step, run_profiling_step
from tests.factories import chunk_summary

GIB = 1 << 30
SPEC = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
"""32 KiB a block: 16 tokens x 2 layers x K and V x 2 heads x 64 x 4 bytes."""
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
H100 = EngineMemory(total=80 * GIB, free_at_start=79 * GIB, used_by_engine=20 * GIB)


def test_spec_block_bytes():
    assert SPEC.bytes_per_block == 32768


# ---- the decision ------------------------------------------------------------------------------
def test_the_pool_is_the_allowed_share_less_what_the_engine_holds_in_whole_blocks():
    assert blocks_for_utilization(0.9, H100, SPEC.bytes_per_block) == (72 - 20) * GIB // 32768 == 1703936
    assert blocks_for_utilization(0.5, H100, SPEC.bytes_per_block) == (40 - 20) * GIB // 32768 == 655360
    allowed = 72 * GIB
    one_block = EngineMemory(80 * GIB, 79 * GIB, allowed - 32768 - 32767)
    assert blocks_for_utilization(0.9, one_block, SPEC.bytes_per_block) == 1


def test_a_utilization_that_leaves_no_room_for_one_block_names_the_sizes():
    small = EngineMemory(total=16 * GIB, free_at_start=16 * GIB, used_by_engine=6 * GIB)
    with pytest.raises(KVCacheSizingError) as refused:
        blocks_for_utilization(0.3, small, SPEC.bytes_per_block)
    assert str(refused.value) == (
        "gpu_memory_utilization 0.3 leaves no room for the KV cache: the engine uses 6.00 GiB (weights and a profiling "
        "step) of the 4.80 GiB (0.3 x 16.00 GiB) it may use, and one block takes 32768 bytes; raise "
        "gpu_memory_utilization or set kv_cache_memory_bytes")
    almost = EngineMemory(80 * GIB, 79 * GIB, 72 * GIB - 32767)
    with pytest.raises(KVCacheSizingError, match="^gpu_memory_utilization 0.9 leaves no room for the KV cache"):
        blocks_for_utilization(0.9, almost, SPEC.bytes_per_block)


def test_a_utilization_above_what_was_free_at_start_is_refused_with_the_highest_that_fits():
    shared = EngineMemory(total=80 * GIB, free_at_start=42 * GIB, used_by_engine=2 * GIB)
    with pytest.raises(KVCacheSizingError) as refused:
        blocks_for_utilization(0.9, shared, SPEC.bytes_per_block)
    assert str(refused.value) == (
        "gpu_memory_utilization 0.9 asks for 72.00 GiB (0.9 x 80.00 GiB), but only 42.00 GiB were free when the "
        "engine started (other processes hold the rest); lower it to at most 0.52")
    assert blocks_for_utilization(0.52, shared, SPEC.bytes_per_block) == (int(0.52 * 80 * GIB) - 2 * GIB) // 32768


# ---- which field sizes the pool ------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "device", "decides"), [
    ({"gpu_memory_utilization": 0.9}, CUDA, True),
    ({"gpu_memory_utilization": 0.9}, CPU, False),
    ({}, CUDA, False),
    ({"gpu_memory_utilization": 0.9, "num_kv_blocks": 7}, CUDA, False),
    ({"gpu_memory_utilization": 0.9, "kv_cache_memory_bytes": 1 << 20}, CUDA, False),
    ({"gpu_memory_utilization": 0.9, "kv_cache_memory_fraction": 0.5}, CUDA, False),
])
def test_gpu_memory_utilization_sizes_the_pool_only_on_cuda_without_an_explicit_size(fields, device, decides):
    assert sizes_by_utilization(EngineConfig(**fields), device) is decides


def test_explicit_sizes_win_over_gpu_memory_utilization():
    assert num_blocks_for(EngineConfig(gpu_memory_utilization=0.9, num_kv_blocks=7), SPEC, CUDA) == 7
    assert num_blocks_for(EngineConfig(gpu_memory_utilization=0.9, kv_cache_memory_bytes=1 << 20), SPEC, CUDA,
                          H100) == 32


def test_on_cuda_the_measured_memory_decides():
    config = EngineConfig(gpu_memory_utilization=0.5)
    assert num_blocks_for(config, SPEC, CUDA, H100) == 655360
    with pytest.raises(ValueError, match="^gpu_memory_utilization sizes this pool: pass the engine's measured memory$"):
        num_blocks_for(config, SPEC, CUDA)


def test_on_cpu_gpu_memory_utilization_changes_nothing():
    assert num_blocks_for(EngineConfig(gpu_memory_utilization=0.1), SPEC, CPU) == DEFAULT_KV_CACHE_MEMORY_BYTES // 32768
    assert num_blocks_for(EngineConfig(gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 20), SPEC, CPU) == 32


@pytest.mark.parametrize(("value", "message"), [
    (0, "gpu_memory_utilization must be in (0, 1], got 0"),
    (1.01, "gpu_memory_utilization must be in (0, 1], got 1.01"),
    (-0.5, "gpu_memory_utilization must be in (0, 1], got -0.5"),
    ("0.9", "gpu_memory_utilization must be a finite number or null, got '0.9'"),
    (True, "gpu_memory_utilization must be a finite number or null, got True"),
])
def test_gpu_memory_utilization_must_be_in_0_1(value, message):
    with pytest.raises(ValueError) as refused:
        EngineConfig(gpu_memory_utilization=value)
    assert str(refused.value) == message


def test_gpu_memory_utilization_goes_with_an_explicit_size_and_1_is_allowed():
    config = EngineConfig(gpu_memory_utilization=1, kv_cache_memory_bytes=1 << 20)
    assert (config.gpu_memory_utilization, config.kv_cache_memory_bytes) == (1, 1 << 20)


# ---- the profiling step ----------------------------------------------------------------------------
def test_the_profiling_step_fills_the_token_budget_with_prompts_that_fit_the_context():
    step = profiling_step(num_tokens=10, max_model_len=5, block_size=2)
    assert chunk_summary(step) == [("profile-0", 0, 4, True), ("profile-1", 0, 4, True), ("profile-2", 0, 2, True)]
    assert [chunk.block_table for chunk in step.chunks] == [(0, 1), (2, 3), (4,)]
    assert {token for chunk in step.chunks for token in chunk.token_ids} == {0}
    assert profiling_step(num_tokens=7, max_model_len=100, block_size=4).chunks[0].block_table == (0, 1)


def test_the_profiling_step_runs_on_a_scratch_pool_of_its_own_blocks(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", block_size=16, num_kv_blocks=8, max_model_len=128)
    engine = llm.engine
    pool_before = [layer.clone() for layer in engine.kv_cache.layers]
    scratch = run_profiling_step(engine.model, engine.kv_cache.spec, CPU, select_backend("auto", "cpu"),
                                 num_tokens=300, max_model_len=128)
    assert scratch == (8 + 8 + 3) * engine.kv_cache.spec.bytes_per_block  # prompts of 127, 127 and 46 tokens
    assert all(torch.equal(before, after) for before, after in zip(pool_before, engine.kv_cache.layers))


def test_llm_takes_gpu_memory_utilization_and_on_cpu_keeps_the_default_pool(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", gpu_memory_utilization=0.5)
    assert llm.engine.kv_cache.num_blocks == DEFAULT_KV_CACHE_MEMORY_BYTES // llm.engine.kv_cache.spec.bytes_per_block
    sized = LLM(tiny_llama_dir, device="cpu", dtype="float32", gpu_memory_utilization=0.5,
                kv_cache_memory_bytes=1 << 20)
    assert sized.engine.kv_cache.num_blocks == (1 << 20) // sized.engine.kv_cache.spec.bytes_per_block
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization must be in \(0, 1\], got 1.5$"):
        LLM(tiny_llama_dir, device="cpu", gpu_memory_utilization=1.5)
