"""What gpu_memory_utilization measures on CUDA: the memory an engine holds before its KV pool exists.

The decision (how many blocks) is engine/kv_cache.py's blocks_for_utilization, a pure function of the sizes
measured here; this module is its thin CUDA adapter: torch.cuda.mem_get_info before and after loading, and the
allocator's peak during one profiling forward (vLLM's profile run)."""

from __future__ import annotations

import torch

from splitserve.engine.attention import AttentionBackend
from splitserve.engine.kv_cache import EngineMemory, KVCache, KVCacheSpec
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.models.llama import LlamaFamilyForCausalLM
from splitserve.engine.scheduler import ScheduledChunk, SchedulerOutput


def profiling_step(num_tokens: int, max_model_len: int, block_size: int) -> SchedulerOutput:
    """The largest forward the scheduler can ask for: num_tokens prompt tokens (id 0), as prompts of at most
    max_model_len - 1 tokens (a prompt leaves room for one output token), each on its own blocks, numbered
    from 0 in chunk order."""
    longest = max_model_len - 1
    chunks, first_block = [], 0
    for index, start in enumerate(range(0, num_tokens, longest)):
        length = min(longest, num_tokens - start)
        num_blocks = -(-length // block_size)
        chunks.append(ScheduledChunk(f"profile-{index}", (0,) * length, 0,
                                     tuple(range(first_block, first_block + num_blocks)), samples=True))
        first_block += num_blocks
    return SchedulerOutput(tuple(chunks), ())


def run_profiling_step(model: LlamaFamilyForCausalLM, spec: KVCacheSpec, device: torch.device,
                       attention: AttentionBackend, num_tokens: int, max_model_len: int) -> int:
    """Runs profiling_step's forward (and its logits) on a scratch pool of just its blocks; returns that pool's
    bytes, which the peak it leaves includes and the engine's real pool replaces."""
    step = profiling_step(num_tokens, max_model_len, spec.block_size)
    num_blocks = sum(len(chunk.block_table) for chunk in step.chunks)
    runner = ModelRunner(model, KVCache(spec, num_blocks, device), device, attention.pads_decode_batches,
                         attention.needs_paged_metadata)
    runner.execute(step)
    return num_blocks * spec.bytes_per_block


def measure_engine_memory(device: torch.device, free_at_start: int, model: LlamaFamilyForCausalLM,
                          spec: KVCacheSpec, attention: AttentionBackend, num_tokens: int,
                          max_model_len: int) -> EngineMemory:
    """CUDA only. `free_at_start`: torch.cuda.mem_get_info's free bytes before the engine loaded its model. What
    the engine holds is what became unavailable since then (weights, and anything the profiling step kept, such
    as a kernel workspace) plus the step's activation peak; a step's kept memory counts in both: conservative."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    scratch_pool = run_profiling_step(model, spec, device, attention, num_tokens, max_model_len)
    torch.cuda.synchronize(device)
    activations = max(0, torch.cuda.max_memory_allocated(device) - before - scratch_pool)
    torch.cuda.empty_cache()  # the scratch pool and activations go back to the device
    free, total = torch.cuda.mem_get_info(device)
    return EngineMemory(total, free_at_start, free_at_start - free + activations)
