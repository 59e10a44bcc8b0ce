"""The engine with `device: cuda`: greedy parity with transformers (fp32 exact, bf16 first token; mixtures of
experts in fp32), and no host synchronisation inside a dense model's forward (the sampled ids are the step's one
sync, in the sampler)."""

from __future__ import annotations

import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine import LLM
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.tiny_model import TinyModelSpec
from splitserve.testing.tiny_models import cached_tiny_model
from splitserve.testing.workloads import GreedyCase, mixed_workload
from tests.factories import hf_greedy, requires_cuda, requires_flashinfer, save_random_hf_model
from tests.test_model_families import run_engine

pytestmark = requires_cuda

HEAD_DIM_64 = TinyModelSpec(hidden_size=256, num_heads=4, num_kv_heads=2, seed=5)
"""A tiny Llama whose head size FlashInfer has kernels for (64; the session models' 16 is below its smallest)."""
BF16_TIE_MARGIN = 0.05
"""HF bf16 first tokens whose top-2 logits are closer than this are near-ties: either token is right in bf16."""


def test_greedy_matches_transformers_on_cuda_in_fp32(tiny_llama_dir):
    cases = mixed_workload(vocab_size=512, seed=7)
    llm = LLM(tiny_llama_dir, device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=256)
    assert llm.engine.kv_cache.layers[0].device.type == "cuda"
    outputs = llm.generate([list(c.prompt_token_ids) for c in cases], [c.params() for c in cases])
    mismatches = [i for i, (out, case) in enumerate(zip(outputs, cases)) if out.token_ids != hf_greedy(tiny_llama_dir, case)]
    assert mismatches == []


def _hf_bf16_first_tokens(model_dir, prompts: list[list[int]]) -> list[tuple[int, float]]:
    """(argmax, top-2 logit gap) of transformers' bf16 next-token logits on CUDA, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    result = []
    with torch.inference_mode():
        for prompt in prompts:
            logits = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            result.append((int(logits.argmax()), float(top[0] - top[1])))
    return result


@pytest.mark.parametrize("backend", ["torch", pytest.param("flashinfer", marks=requires_flashinfer)])
def test_bf16_first_token_matches_transformers(backend, tiny_model_dirs):
    """FlashInfer needs head_dim 64/128/256: the tiny models' 16 only runs the reference here."""
    model_dir = cached_tiny_model(HEAD_DIM_64) if backend == "flashinfer" else tiny_model_dirs["llama"]
    cases = mixed_workload(vocab_size=512, seed=11)
    prompts = [list(c.prompt_token_ids) for c in cases]
    llm = LLM(model_dir, device="cuda", dtype="bfloat16", attention_backend=backend, block_size=16)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    expected = _hf_bf16_first_tokens(model_dir, prompts)
    wrong = [i for i, (out, (token, gap)) in enumerate(zip(outputs, expected))
             if out.token_ids[0] != token and gap >= BF16_TIE_MARGIN]
    assert wrong == []


@pytest.mark.parametrize("backend", ["torch", pytest.param("flashinfer", marks=requires_flashinfer)])
def test_a_forward_makes_no_host_sync(backend, monkeypatch):
    """torch raises on any synchronising CUDA call inside ModelRunner.execute: building inputs (pinned,
    non-blocking copies), the FlashInfer plan (host indptr) and the forward must not wait for the GPU."""
    engine = EngineCore(cached_tiny_model(HEAD_DIM_64), EngineConfig(
        device="cuda", dtype="bfloat16", attention_backend=backend, num_kv_blocks=256, max_model_len=512))
    execute = engine.runner.execute

    def strict(output, on_layer):  # EngineCore.step passes its layer hook (None here) positionally
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(output, on_layer)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(engine.runner, "execute", strict)
    for index, length in enumerate((37, 5, 120)):
        engine.add_request(f"r{index}", list(range(3, 3 + length)), SamplingParams(temperature=0.0, max_tokens=4))
    finished = []
    while engine.has_unfinished_requests():  # a prefill step, then decode steps
        finished += [delta.request_id for delta in engine.step() if delta.finished]
    assert sorted(finished) == ["r0", "r1", "r2"]


def test_gpu_memory_utilization_sizes_the_pool_to_the_allowed_share(tiny_llama_dir):
    """The engine's growth of the device's used memory (weights, pool, what the profiling step kept) stays within
    utilization x total and fills it up to the profiling step's peak (a few MiB for the tiny model)."""
    torch.cuda.empty_cache()
    free_at_start, total = torch.cuda.mem_get_info()
    utilization = min(0.05, int(free_at_start / total * 100) / 100)
    llm = LLM(tiny_llama_dir, device="cuda", dtype="float32", gpu_memory_utilization=utilization)
    held = free_at_start - torch.cuda.mem_get_info()[0]
    allowed = int(utilization * total)
    assert allowed - (256 << 20) <= held <= allowed, (held, allowed, llm.engine.kv_cache.num_blocks)


@pytest.mark.parametrize("architecture, overrides", [("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1])),
                                                     ("mixtral", dict(sliding_window=48))])
def test_a_mixture_of_experts_matches_transformers_on_cuda_in_fp32(architecture, overrides, tmp_path):
    """The experts' grouping (a host read of the per-expert counts, index gathers and scatters) on the device."""
    model_dir = save_random_hf_model(tmp_path / architecture, architecture, seed=3, **overrides)
    cases = [GreedyCase(c.prompt_token_ids, c.max_tokens, ignore_eos=True)
             for c in mixed_workload(vocab_size=384, num_requests=8, seed=11, max_prompt=200, max_output=12)]
    outputs, engine = run_engine(model_dir, cases, device="cuda", dtype="float32", max_num_batched_tokens=64,
                                 max_model_len=256, num_kv_blocks=112)
    assert engine.kv_cache.layers[0].device.type == "cuda" and engine.runner.graphs is None
    assert outputs == [hf_greedy(model_dir, case) for case in cases]
