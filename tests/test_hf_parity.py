"""Greedy output equals Hugging Face transformers `generate`, token for token (fp32, CPU), on the
fast CPU path (C++ kernels, oneDNN-packed weights) and on the pure-torch reference ops."""

from __future__ import annotations

import pytest

from tests.factories import assert_pool_idle, hf_greedy
from splitserve.engine import LLM
from splitserve.testing.workloads import mixed_workload

VARIANTS = {
    # (a) prefix caching with shared prefixes; the budget admits requests over several steps
    "prefix-cache": dict(enable_prefix_caching=True, max_num_batched_tokens=1024),
    # (b) a tiny token budget: every long prompt is prefilled in many chunks
    "chunked-prefill": dict(enable_prefix_caching=False, max_num_batched_tokens=24),
    # (c) a tiny block pool: requests are preempted and recomputed
    "preemption": dict(enable_prefix_caching=True, num_kv_blocks=26, max_model_len=400),
}


@pytest.fixture(scope="module")
def oracle(tiny_model_dirs):
    """HF reference outputs per architecture, computed once."""
    result = {}
    for arch, model_dir in tiny_model_dirs.items():
        cases = mixed_workload(vocab_size=512, seed=7)
        result[arch] = (cases, [hf_greedy(model_dir, case) for case in cases])
    return result


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch-ops"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers(arch, variant, cpu_kernels, tiny_model_dirs, oracle):
    cases, expected = oracle[arch]
    llm = LLM(tiny_model_dirs[arch], block_size=16, cpu_kernels=cpu_kernels, **VARIANTS[variant])
    outputs = llm.generate([list(c.prompt_token_ids) for c in cases], [c.params() for c in cases])
    mismatches = [(i, out.token_ids, want) for i, (out, want) in enumerate(zip(outputs, expected))
                  if out.token_ids != want]
    assert mismatches == []
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert_pool_idle(llm.engine.block_manager)
    if variant == "prefix-cache":
        assert stats.prefix_cache_hits > 0
        assert sum(o.num_cached_tokens > 0 for o in outputs) >= 8
        assert all(o.num_cached_tokens % 16 == 0 for o in outputs)
    if variant == "preemption":
        assert stats.num_preemptions > 0
    if variant == "chunked-prefill":
        total_prompt = sum(len(c.prompt_token_ids) for c in cases)
        assert stats.num_steps >= total_prompt // 24


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers_under_priority_scheduling_and_preemption(arch, tiny_model_dirs, oracle):
    """The preemption variant's pool under the priority policy, the cases with mixed priorities: the order of
    admission and the preemption victims change, the outputs do not."""
    cases, expected = oracle[arch]
    llm = LLM(tiny_model_dirs[arch], block_size=16, scheduling_policy="priority", **VARIANTS["preemption"])
    priorities = [(index * 7) % 5 - 2 for index in range(len(cases))]  # -2 .. 2, interleaved with arrival
    outputs = llm.generate([list(c.prompt_token_ids) for c in cases], [c.params() for c in cases], priority=priorities)
    assert [out.token_ids for out in outputs] == expected
    assert llm.stats().num_preemptions > 0
    assert_pool_idle(llm.engine.block_manager)
