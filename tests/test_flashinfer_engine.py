"""The FlashInfer backend and the captured decode steps inside the whole engine, on CPU.

With torch kernels that read only FlashInfer's metadata (splitserve.testing.paged_reference), greedy output
equals transformers' token for token under prefix caching, chunked prefill and preemption: the metadata the
runner builds for every kind of step, and the backend's plans, gathers and scatters, are right before a GPU
runs them. With the decode graph runner over "graphs" that run eagerly (splitserve.testing.eager_graphs), the
replay bookkeeping (static inputs, re-planning, padding rows in the dummy block, output rows) is too.
"""

from __future__ import annotations

import pytest

from splitserve.engine import LLM
from splitserve.engine.attention.flashinfer import FlashInferAttention
from splitserve.testing.workloads import GreedyCase, mixed_workload
from tests.factories import assert_pool_idle, hf_greedy, save_random_hf_model, use_flashinfer_on_cpu
from tests.test_hf_parity import VARIANTS
from tests.test_model_families import FAMILIES, run_engine

CASES = mixed_workload(vocab_size=512, num_requests=12, seed=7, max_prompt=200, max_output=16)


@pytest.fixture(scope="module")
def oracle(tiny_llama_dir) -> list[list[int]]:
    return [hf_greedy(tiny_llama_dir, case) for case in CASES]


def _generate(llm: LLM) -> list[list[int]]:
    return [out.token_ids for out in llm.generate([list(c.prompt_token_ids) for c in CASES], [c.params() for c in CASES])]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_transformers_through_flashinfer_metadata(variant, tiny_llama_dir, oracle, monkeypatch):
    kernels = use_flashinfer_on_cpu(monkeypatch)
    llm = LLM(tiny_llama_dir, block_size=16, **VARIANTS[variant])
    assert isinstance(llm.engine.model.layers[0].self_attn.backend, FlashInferAttention)
    assert _generate(llm) == oracle
    assert_pool_idle(llm.engine.block_manager)
    assert {part for part, _window in kernels.kernels} == {"prefill", "decode"}  # both kinds of step ran


def test_replayed_decode_steps_match_transformers(tiny_llama_dir, oracle, monkeypatch):
    use_flashinfer_on_cpu(monkeypatch, graphs=True)
    llm = LLM(tiny_llama_dir, block_size=16, max_num_seqs=12, max_num_batched_tokens=256, cuda_graphs=True)
    graphs = llm.engine.runner.graphs
    assert graphs.table.sizes == (1, 2, 4, 8, 12)
    assert llm.engine.kv_cache.dummy_block == llm.engine.block_manager.num_blocks  # outside the manager's range
    assert _generate(llm) == oracle
    assert graphs.num_replays > 0
    assert_pool_idle(llm.engine.block_manager)


@pytest.mark.parametrize("family", ["granite-multipliers-bias", "phi3-partial-rotary-sliding-window"])
def test_granite_s_softmax_scale_and_phi3_s_partial_rotary_match_transformers_through_replayed_decodes(
        family, tmp_path, monkeypatch):
    """The model's softmax scale reaches FlashInfer's plans, eager (prefill chunks) and in the captured decode steps."""
    architecture, overrides = FAMILIES[family]
    model_dir = save_random_hf_model(tmp_path / family, architecture, seed=3, **overrides)
    cases = [GreedyCase(c.prompt_token_ids, c.max_tokens, ignore_eos=True)
             for c in mixed_workload(vocab_size=384, num_requests=6, seed=7, max_prompt=120, max_output=12)]
    use_flashinfer_on_cpu(monkeypatch, graphs=True)
    outputs, engine = run_engine(model_dir, cases, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=256,
                                 num_kv_blocks=96, cuda_graphs=True)
    assert outputs == [hf_greedy(model_dir, case) for case in cases]
    assert engine.runner.graphs.num_replays > 0
    assert_pool_idle(engine.block_manager)
