"""Every supported architecture variant loads and matches transformers greedy output exactly."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from tests.factories import (_hf_model, assert_pool_idle, copy_with_config_fields, hf_greedy, hf_logits,
                             save_random_hf_model, use_flashinfer_on_cpu)
from splitserve.common.config import EngineConfig
from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.generation_config import GenerationConfigError
from splitserve.common.model_dir import check_model_dir, weight_files
from splitserve.engine import EngineCore, SamplingParams
from splitserve.engine.model_loader import build_rotary, load_hf_config, model_fingerprint, parse_arch
from splitserve.testing.workloads import GreedyCase, mixed_workload

FAMILIES = {
    "llama-bias-tied": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "llama-rope-llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128})),
    "llama-rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                         "factor": 2.0})),
    "llama-rope-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                       "original_max_position_embeddings": 256})),
    "llama-head-dim-32": ("llama", dict(head_dim=32)),
    "mistral-sliding-window": ("mistral", dict(sliding_window=48)),
    "qwen2": ("qwen2", dict()),
    "qwen3-qk-norm": ("qwen3", dict(head_dim=32)),
    # Phi-4-mini's 0.75: RoPE on the first 12 of each head's 16 dims; a window shorter than most prompts
    "phi3-partial-rotary-sliding-window": ("phi3", dict(partial_rotary_factor=0.75, sliding_window=40)),
    "phi3-tied": ("phi3", dict(tie_word_embeddings=True)),
    # multipliers that are no powers of two (each product rounds), and a softmax scale that is not 1 / sqrt(16)
    "granite-multipliers-bias": ("granite", dict(embedding_multiplier=6.3, attention_multiplier=0.9,
                                                 residual_multiplier=0.35, logits_scaling=2.5, attention_bias=True,
                                                 mlp_bias=True)),
    "gemma": ("gemma", dict()),
    # sliding and full layers, a window shorter than the prompts, a local RoPE base other than the global one,
    # a softmax scale other than 1 / sqrt(head_dim)
    "gemma3-sliding-local-rope-scale": ("gemma3", dict(
        num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=24, query_pre_attn_scalar=24, rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # sliding and full layers, attention and final logit softcaps small enough to change the scores and logits
    "gemma2-sliding-softcaps-scale": ("gemma2", dict(
        num_hidden_layers=3, sliding_window=24, query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
        final_logit_softcapping=3.0)),
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse: 8 experts, 2 per token, renormalized
    "qwen3-moe-mlp-only-layers": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1], head_dim=32)),
    # decoder_sparse_step 2: layers 1 and 3 sparse; top 3 of 8 not renormalized; attention biases
    "qwen3-moe-sparse-step-2-top-3": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                                        num_experts_per_tok=3, norm_topk_prob=False,
                                                        attention_bias=True)),
    "mixtral-sliding-window": ("mixtral", dict(sliding_window=48)),
    # layers 1 and 3 unrotated (no_rope_layer_interval 2), a window over those layers shorter than most prompts,
    # attention and MLP biases, untied
    "smollm3-nope-sliding-bias": ("smollm3", dict(num_hidden_layers=4, no_rope_layer_interval=2,
                                                  use_sliding_window=True, sliding_window=40, attention_bias=True,
                                                  mlp_bias=True, tie_word_embeddings=False)),
    # an explicit no_rope_layers list (layer 0 unrotated), full attention, tied embeddings as SmolLM3-3B
    "smollm3-no-rope-layers-list": ("smollm3", dict(num_hidden_layers=3, no_rope_layers=[0, 1, 1])),
    # q/k norms over the whole projections of 4 query and 2 key heads, post-norm layers
    "olmo2": ("olmo2", dict(num_hidden_layers=3)),
    "olmo2-attention-bias": ("olmo2", dict(attention_bias=True)),
}


def engine_deltas(engine: EngineCore) -> list:
    """Every delta of an engine stepped until it has no unfinished request."""
    deltas = []
    while engine.has_unfinished_requests():
        deltas.extend(engine.step())
    return deltas


def run_engine(model_dir, cases: list[GreedyCase], **config) -> tuple[list[list[int]], EngineCore]:
    engine = EngineCore(model_dir, EngineConfig(**{"block_size": 16, **config}))
    for index, case in enumerate(cases):
        engine.add_request(str(index), list(case.prompt_token_ids), case.params())
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    for delta in engine_deltas(engine):
        outputs[delta.request_id].extend(delta.new_token_ids)
    return [outputs[str(i)] for i in range(len(cases))], engine


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(family, tmp_path):
    architecture, overrides = FAMILIES[family]
    model_dir = save_random_hf_model(tmp_path / family, architecture, seed=3, **overrides)
    cases = [GreedyCase(c.prompt_token_ids, c.max_tokens, ignore_eos=True)
             for c in mixed_workload(vocab_size=384, num_requests=8, seed=11, max_prompt=200, max_output=12)]
    # A pool for all 8 at once (at most 212 tokens each): one sized from memory takes ~1 s to set up.
    outputs, engine = run_engine(model_dir, cases, max_num_batched_tokens=64, max_model_len=256, num_kv_blocks=112)
    assert outputs == [hf_greedy(model_dir, case) for case in cases]
    assert_pool_idle(engine.block_manager)


SHORT_CASES = [GreedyCase(c.prompt_token_ids, c.max_tokens, ignore_eos=True)
               for c in mixed_workload(vocab_size=384, num_requests=3, seed=5, max_prompt=60, max_output=6)]


def short_run_config(block_size: int = 16) -> dict:
    """A 16-token step budget (chunked prefill) and a pool of 384 tokens, room for SHORT_CASES at once: a pool
    sized from memory would hold a million one-token blocks and take seconds to set up."""
    return dict(block_size=block_size, max_num_batched_tokens=16, max_model_len=128,
                num_kv_blocks=-(-384 // block_size))


# Shapes the families above do not take, each at a block size of its own: (architecture, config
# overrides, block_size).
SHAPES = {
    # head_dim 40 (not hidden / heads, not a multiple of the kernels' 16 lanes), one KV head for 7 query
    # heads, a vocabulary that is no multiple of 8
    "llama-head-dim-40-mqa-7-vocab-389": ("llama", dict(hidden_size=70, num_attention_heads=7,
                                                        num_key_value_heads=1, head_dim=40,
                                                        intermediate_size=90, vocab_size=389), 3),
    # a window shorter than one block and no multiple of it; 3 query heads per KV head of 80
    "mistral-window-5-block-16-gqa-3": ("mistral", dict(hidden_size=48, num_attention_heads=6,
                                                        num_key_value_heads=2, head_dim=80, sliding_window=5), 16),
    # full attention in layer 0, a 7-token window in layers 1-2, blocks of one token
    "qwen2-max-window-layers-block-1": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True,
                                                      sliding_window=7, max_window_layers=1), 1),
    "qwen3-tied-head-dim-256": ("qwen3", dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                                              tie_word_embeddings=True), 16),
    # transformers rescales `dynamic` only past max_position_embeddings, which max_model_len never passes
    "llama-rope-dynamic": ("llama", dict(max_position_embeddings=128, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}), 3),
    # RoPE on 32 of 80 dims (the kernels' 16-lane loop and its tail), a window of 9, one KV head for 6 query heads
    "phi3-rotary-32-of-80-window-9-mqa": ("phi3", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=1,
                                                       head_dim=80, partial_rotary_factor=0.4, sliding_window=9), 4),
    # a softmax scale far from 1 / sqrt(80) (the decode kernel's 80-dim path)
    "granite-head-dim-80": ("granite", dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                                            head_dim=80, attention_multiplier=0.05, residual_multiplier=0.6,
                                            embedding_multiplier=2.7), 16),
    # one KV head, head_dim other than hidden / heads (Gemma 7B's 256 of 3072 / 16), attention biases, untied
    "gemma-mqa-head-dim-32-bias-untied": ("gemma", dict(num_key_value_heads=1, head_dim=32, attention_bias=True,
                                                        tie_word_embeddings=False), 16),
    # Gemma 3 4B's RoPE (linear scaling of the global table only), layer types from sliding_window_pattern
    # (every 2nd layer full), a window of 5 over blocks of 3
    "gemma3-rope-linear-global-window-5-block-3": ("gemma3", dict(
        num_hidden_layers=3, sliding_window_pattern=2, sliding_window=5, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}), 3),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_matches_transformers(shape, tmp_path):
    architecture, overrides, block_size = SHAPES[shape]
    model_dir = save_random_hf_model(tmp_path / shape, architecture, seed=3, **overrides)
    outputs, engine = run_engine(model_dir, SHORT_CASES, **short_run_config(block_size))
    assert outputs == [hf_greedy(model_dir, case) for case in SHORT_CASES]
    assert_pool_idle(engine.block_manager)


@pytest.mark.parametrize("family", ["granite-multipliers-bias", "phi3-partial-rotary-sliding-window"])
def test_partial_rotary_and_softmax_scale_match_transformers_on_the_pure_torch_ops(family, tmp_path):
    """cpu_kernels false: the torch rotary op's partial branch, and the matmul decode and the split prefill
    after a prefix with the model's softmax scale."""
    architecture, overrides = FAMILIES[family]
    model_dir = save_random_hf_model(tmp_path / family, architecture, seed=3, **overrides)
    outputs, engine = run_engine(model_dir, SHORT_CASES, cpu_kernels=False, **short_run_config())
    assert outputs == [hf_greedy(model_dir, case) for case in SHORT_CASES]
    assert_pool_idle(engine.block_manager)


def test_float16_on_cpu_matches_transformers_in_float16(tmp_path):
    """dtype float16 on CPU (vLLM serves it on x86): the C++ kernels are built for fp32 / bf16 only, so the engine
    attends with the torch ops (its prefill kernel for windowed layers and its decode kernel raised "dtype Half is
    not supported" at the first step), and its tokens are transformers' with the checkpoint cast to float16."""
    model_dir = save_random_hf_model(tmp_path / "mistral", "mistral", seed=3, sliding_window=24)
    outputs, engine = run_engine(model_dir, SHORT_CASES, dtype="float16", **short_run_config())
    assert engine.kv_cache.spec.dtype == torch.float16
    assert outputs == [hf_greedy(model_dir, case, dtype="float16") for case in SHORT_CASES]
    assert_pool_idle(engine.block_manager)


def test_granite_logprobs_are_of_its_logits_divided_by_logits_scaling(tmp_path):
    """Greedy tokens cannot show logits_scaling (dividing keeps the argmax); logprobs do: each prompt token's equals
    transformers' log_softmax of its (divided) logits."""
    architecture, overrides = FAMILIES["granite-multipliers-bias"]
    model_dir = save_random_hf_model(tmp_path / "granite", architecture, seed=3, **overrides)
    prompt = list(range(3, 43))
    with torch.inference_mode():
        reference = torch.log_softmax(_hf_model(model_dir)(torch.tensor([prompt])).logits[0].float(), dim=-1)
    engine = EngineCore(model_dir, EngineConfig(block_size=16, max_model_len=64, num_kv_blocks=8))
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=0))
    [entries] = [delta.prompt_logprobs for delta in engine_deltas(engine) if delta.prompt_logprobs is not None]
    assert entries[0] is None
    for position in range(1, len(prompt)):
        assert entries[position].token_id == prompt[position]
        assert math.isclose(entries[position].logprob, float(reference[position - 1, prompt[position]]), abs_tol=1e-4)


# The engine's other attention paths on the Gemma 2 and 3, SmolLM3 and OLMo 2 models above (the family test runs
# the CPU backend's C++ kernels, Gemma 2's softcap included): the CPU backend's torch ops, the torch reference,
# and the FlashInfer backend's metadata, plans and captured decode steps over torch kernels. Each reads the
# softmax scale, Gemma 2's softcap, Gemma 3's two RoPE tables, SmolLM3's unrotated (strided) queries and keys
# and OLMo 2's whole-projection q/k norms.
GEMMA_ATTENTION_PATHS = {
    "cpu-torch-ops": (dict(cpu_kernels=False), None),
    "torch-reference": (dict(attention_backend="torch"), None),
    "flashinfer-metadata": (dict(), dict(graphs=False)),
    "flashinfer-decode-graphs": (dict(cuda_graphs=True), dict(graphs=True)),
}


@pytest.mark.parametrize("path", sorted(GEMMA_ATTENTION_PATHS))
@pytest.mark.parametrize("family", ["gemma2-sliding-softcaps-scale", "gemma3-sliding-local-rope-scale",
                                    "smollm3-nope-sliding-bias", "olmo2"])
def test_gemma_2_3_smollm3_olmo2_match_transformers_on_every_attention_path(family, path, tmp_path, monkeypatch):
    config, flashinfer = GEMMA_ATTENTION_PATHS[path]
    if flashinfer is not None:
        use_flashinfer_on_cpu(monkeypatch, **flashinfer)
    architecture, overrides = FAMILIES[family]
    model_dir = save_random_hf_model(tmp_path / family, architecture, seed=3, **overrides)
    outputs, engine = run_engine(model_dir, SHORT_CASES, **short_run_config(), **config)
    assert outputs == [hf_greedy(model_dir, case) for case in SHORT_CASES]
    assert_pool_idle(engine.block_manager)
    if config.get("cuda_graphs"):
        assert engine.runner.graphs.num_replays > 0


def test_a_gemma3_config_in_the_released_format_runs_as_transformers_reads_it(tmp_path):
    """google/gemma-3-1b-it's config.json names RoPE bases rope_theta / rope_local_base_freq and the layer types by
    sliding_window_pattern (every n-th layer full); transformers 5 turns them into per-layer-type rope_parameters."""
    model_dir = save_random_hf_model(tmp_path / "gemma3", "gemma3", seed=3, num_hidden_layers=3, sliding_window=7)
    config = json.loads((model_dir / "config.json").read_text())
    for field in ("rope_parameters", "layer_types"):
        del config[field]
    config.update(rope_theta=1000000.0, rope_local_base_freq=100.0, rope_scaling=None, sliding_window_pattern=2)
    (model_dir / "config.json").write_text(json.dumps(config))
    outputs, engine = run_engine(model_dir, SHORT_CASES, **short_run_config())
    assert outputs == [hf_greedy(model_dir, case) for case in SHORT_CASES]
    model = engine.model
    assert model.arch.sliding_windows == (7, None, 7) and model.arch.local_rope_layers == frozenset({0, 2})
    assert model.local_rotary.inv_freq[1].item() == pytest.approx(100.0 ** (-2 / 16))
    assert model.rotary.inv_freq[1].item() == pytest.approx(1000000.0 ** (-2 / 16))


@pytest.mark.parametrize("architecture, field, value, message", [
    ("gemma3", "attn_logit_softcapping", 50.0,
     "attn_logit_softcapping 50.0 is not supported for Gemma3ForCausalLM (transformers does not apply it): set it "
     "to null"),
    ("gemma3", "use_bidirectional_attention", True,
     "use_bidirectional_attention is not supported (Gemma3ForCausalLM is served causal only)"),
    ("gemma", "use_bidirectional_attention", True,
     "use_bidirectional_attention is not supported (GemmaForCausalLM is served causal only)"),
])
def test_gemma_fields_the_engine_does_not_run_are_refused_naming_them(tmp_path, architecture, field, value,
                                                                      message):
    model_dir = copy_with_config_fields(save_random_hf_model(tmp_path / "m", architecture, num_hidden_layers=1),
                                        tmp_path / "edited", **{field: value})
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == message


@pytest.mark.parametrize("architecture", ["gemma2", "gemma3"])
def test_gemma_final_logit_softcapping_gives_transformers_logits(tmp_path, architecture):
    """Greedy tokens cannot show a softcap (tanh keeps the order): the logits at every prompt position can."""
    model_dir = save_random_hf_model(tmp_path / architecture, architecture, seed=3, final_logit_softcapping=0.5)
    prompt = list(SHORT_CASES[0].prompt_token_ids)
    engine = EngineCore(model_dir, EngineConfig(**short_run_config()))
    assert engine.model.arch.final_logit_softcap == 0.5
    got = engine.prompt_logits(prompt)
    assert got.abs().max() <= 0.5
    torch.testing.assert_close(got, hf_logits(model_dir, prompt), atol=1e-5, rtol=0)


def test_smollm3_layers_without_rope_and_windows_are_read_from_its_config(tmp_path):
    architecture, overrides = FAMILIES["smollm3-nope-sliding-bias"]
    model_dir = save_random_hf_model(tmp_path / "smollm3", architecture, **overrides)
    arch = EngineCore(model_dir, EngineConfig(**short_run_config())).model.arch
    assert arch.nope_layers == frozenset({1, 3})
    assert arch.sliding_windows == (None, 40, None, 40)


def test_a_smollm3_config_whose_sliding_layers_have_no_window_is_refused(tmp_path):
    """layer_types with sliding_attention but use_sliding_window false: transformers' SDPA masks such a layer by
    the window and its flash attention does not."""
    model_dir = copy_with_config_fields(save_random_hf_model(tmp_path / "m", "smollm3", num_hidden_layers=2,
                                                             no_rope_layer_interval=2, sliding_window=8,
                                                             use_sliding_window=True),
                                        tmp_path / "edited", use_sliding_window=False)
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == ("layer_types names sliding_attention layers but use_sliding_window is false or "
                                "sliding_window is null (transformers' attention implementations disagree on such "
                                "a layer): set both, or make every layer full_attention")


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "m", "llama")
    config_path = model_dir / "config.json"
    config_path.write_text(config_path.read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel"))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not supported"):
        EngineCore(model_dir, EngineConfig())


def test_the_first_supported_entry_of_architectures_runs(tmp_path, tiny_llama_dir):
    """["MyWrapperForCausalLM", "LlamaForCausalLM"] was refused naming the wrapper (the engine read only the first
    entry); vLLM runs the first entry it supports. The CLI's directory check and the engine agree."""
    model_dir = copy_with_config_fields(tiny_llama_dir, tmp_path / "wrapped",
                                        architectures=["MyWrapperForCausalLM", "LlamaForCausalLM"])
    check_model_dir(model_dir)
    [case] = mixed_workload(512, num_requests=1, seed=5, max_prompt=60, max_output=8)
    tokens, _ = run_engine(model_dir, [case])
    assert tokens == [hf_greedy(tiny_llama_dir, case)]
    only_unknown = copy_with_config_fields(tiny_llama_dir, tmp_path / "unknown",
                                           architectures=["MyWrapperForCausalLM", "GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="'MyWrapperForCausalLM' is not supported"):
        check_model_dir(only_unknown)


@pytest.mark.parametrize("architectures", [None, []], ids=["missing", "empty"])
def test_a_config_naming_no_architecture_is_refused_naming_the_field(tmp_path, architectures):
    """A config.json that LlamaConfig(...).save_pretrained writes has no architectures (transformers' Auto classes
    go by model_type); the engine, like vLLM, runs a class by its architectures entry: the error names the field
    (it said "architecture '?' is not supported"), as the CLI's check of the directory does."""
    model_dir = save_random_hf_model(tmp_path / "m", "llama", num_hidden_layers=1)
    config = json.loads((model_dir / "config.json").read_text())
    if architectures is None:
        del config["architectures"]
    else:
        config["architectures"] = architectures
    (model_dir / "config.json").write_text(json.dumps(config))
    message = ("config.json names no architecture (`architectures` is missing or empty); supported: "
               "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM, "
               "GraniteForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, SmolLM3ForCausalLM, "
               "Olmo2ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM")
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == message
    with pytest.raises(UnsupportedModelError) as error:
        check_model_dir(model_dir)
    assert str(error.value) == f"{model_dir}: {message}"


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        EngineCore(tmp_path, EngineConfig())


@pytest.mark.parametrize("architecture, missing, where", [
    ("llama", "model.layers.1.mlp.up_proj.weight", "layers.1.mlp.up_proj.weight (decoder layer 1 of 2)"),
    ("llama", "model.norm.weight", "norm.weight (outside the decoder layers)"),
    ("phi3", "model.layers.1.self_attn.qkv_proj.weight", "layers.1.self_attn.qkv_proj.weight (decoder layer 1 of 2)"),
])
def test_a_checkpoint_missing_a_tensor_is_an_unsupported_model_naming_it(tmp_path, architecture, missing, where):
    from safetensors.torch import load_file, save_file

    model_dir = save_random_hf_model(tmp_path / "m", architecture, num_hidden_layers=2)
    (weights,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors[missing]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == f"the checkpoint has no tensor {where}"


@pytest.mark.parametrize("architecture, field, value, tensor, shapes", [
    ("llama", "num_key_value_heads", 1, "layers.0.self_attn.k_proj.weight", "[32, 64], config.json implies [16, 64]"),
    ("llama", "intermediate_size", 96, "layers.0.mlp.gate_proj.weight", "[128, 64], config.json implies [96, 64]"),
    ("llama", "vocab_size", 400, "embed_tokens.weight", "[384, 64], config.json implies [400, 64]"),
    # Phi3's fused projections: q, k and v heads in one tensor, gate and up in another
    ("phi3", "num_key_value_heads", 1, "layers.0.self_attn.qkv_proj.weight",
     "[128, 64], config.json implies [96, 64]"),
    ("phi3", "intermediate_size", 96, "layers.0.mlp.gate_up_proj.weight", "[256, 64], config.json implies [192, 64]"),
])
def test_a_config_that_disagrees_with_its_checkpoint_is_refused_naming_the_tensor(tmp_path, architecture, field, value,
                                                                                     tensor, shapes):
    model_dir = copy_with_config_fields(save_random_hf_model(tmp_path / "m", architecture), tmp_path / "edited",
                                        **{field: value})
    fields = {"vocab_size": 384, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "intermediate_size": 128, field: value}
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == (f"the checkpoint's {tensor} has shape {shapes} ("
                                + ", ".join(f"{name} {number}" for name, number in fields.items()) + ")")


# Fields a config.json may carry that transformers' modules of its architecture never read (a
# Llama-converted Mistral keeps its sliding_window; Mistral windows whatever a Qwen-style
# use_sliding_window says; Qwen2 and Mistral build no o / MLP biases whatever attention_bias or
# mlp_bias say), or read as what the engine runs (transformers' swish is its SiLU): with them the engine
# serves what transformers' model computes without them. The reference is the directory without the
# fields: transformers' generate on a Llama config with sliding_window keeps only the last window of
# each layer's cache (its cache reads the field, its model does not), so after the prompt it attends
# through neither a full nor a sliding mask.
NEUTRAL_FIELDS = {  # variant: (architecture, the reference's config overrides, fields added to its config.json)
    "llama-sliding-window": ("llama", dict(), dict(sliding_window=8)),
    "llama-layer-types": ("llama", dict(), dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "qwen2-mlp-bias": ("qwen2", dict(), dict(mlp_bias=True)),
    "mistral-attention-and-mlp-bias": ("mistral", dict(), dict(attention_bias=True, mlp_bias=True)),
    "mistral-use-sliding-window": ("mistral", dict(sliding_window=5), dict(use_sliding_window=False)),
    "qwen3-mlp-bias": ("qwen3", dict(), dict(mlp_bias=True)),
    "llama-hidden-act-swish": ("llama", dict(), dict(hidden_act="swish")),
    "phi3-attention-and-mlp-bias": ("phi3", dict(), dict(attention_bias=True, mlp_bias=True)),
    "phi3-layer-types": ("phi3", dict(sliding_window=5), dict(layer_types=["full_attention", "full_attention"])),
    "granite-sliding-window": ("granite", dict(), dict(sliding_window=8)),
    # the official Gemma checkpoints' legacy name, which GemmaConfig reads as gelu_pytorch_tanh
    "gemma-hidden-act-gelu": ("gemma", dict(), dict(hidden_act="gelu")),
    # Gemma reads hidden_act (Gemma 3 hidden_activation) and attends fully in every layer
    "gemma-hidden-activation-sliding-window": ("gemma", dict(), dict(hidden_activation="silu", sliding_window=8)),
}


@pytest.mark.parametrize("variant", sorted(NEUTRAL_FIELDS))
def test_config_fields_transformers_does_not_read_do_not_change_the_model(variant, tmp_path):
    architecture, reference_overrides, fields = NEUTRAL_FIELDS[variant]
    reference_dir = save_random_hf_model(tmp_path / "reference", architecture, seed=3,
                                         **{"sliding_window": None, **reference_overrides})
    model_dir = copy_with_config_fields(reference_dir, tmp_path / variant, **fields)
    outputs, engine = run_engine(model_dir, SHORT_CASES, **short_run_config())
    assert outputs == [hf_greedy(reference_dir, case) for case in SHORT_CASES]
    assert_pool_idle(engine.block_manager)


@pytest.mark.parametrize("architecture, field, value, message", [
    ("llama", "hidden_act", "gelu", "hidden_act 'gelu' is not supported (only silu / swish)"),
    ("gemma", "hidden_act", "silu", "hidden_act 'silu' is not supported (only gelu_pytorch_tanh / gelu)"),
    # Gemma3TextConfig keeps "gelu" (the exact GeLU), unlike GemmaConfig
    ("gemma3", "hidden_activation", "gelu", "hidden_activation 'gelu' is not supported (only gelu_pytorch_tanh)"),
])
def test_an_unsupported_activation_is_refused_naming_the_field(tmp_path, architecture, field, value, message):
    model_dir = save_random_hf_model(tmp_path / "m", architecture, num_hidden_layers=1, **{field: value})
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == message
    (model_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(UnsupportedModelError) as error:
        check_model_dir(model_dir)
    assert str(error.value) == f"{model_dir}: {message}"


@pytest.mark.parametrize("architecture, factor, message", [
    ("llama", 0.5, "partial_rotary_factor != 1 is not supported for LlamaForCausalLM"),
    ("phi3", 0.5625, "partial_rotary_factor 0.5625 of head_dim 16 rotates 9 dims; RoPE needs an even number from 2 "
                     "to 16"),
])
def test_a_partial_rotary_is_refused_where_transformers_would_not_run_it(tmp_path, architecture, factor, message):
    """Only Phi3's modules rotate part of a head; an odd number of rotated dims has no rotate_half."""
    reference_dir = save_random_hf_model(tmp_path / "m", architecture)
    config = json.loads((reference_dir / "config.json").read_text())
    rope_parameters = {**config["rope_parameters"], "partial_rotary_factor": factor}
    model_dir = copy_with_config_fields(reference_dir, tmp_path / "partial", rope_parameters=rope_parameters,
                                        partial_rotary_factor=factor)
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == message


LONGROPE = dict(max_position_embeddings=256, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
    "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.9 * i for i in range(8)]})
# Phi-4-mini's shape of config: longrope over a partial rotary of 0.75 (12 of 16 dims: 6 factors), tied embeddings;
# Phi3Config's own original_max_position_embeddings overrides the one in rope_parameters
PHI4_MINI_LONGROPE = dict(max_position_embeddings=256, original_max_position_embeddings=64, tie_word_embeddings=True,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 64, "partial_rotary_factor": 0.75,
                                           "short_factor": [1.0 + 0.1 * i for i in range(6)],
                                           "long_factor": [1.0 + 0.9 * i for i in range(6)]})


@pytest.mark.parametrize("architecture, overrides", [("llama", LONGROPE), ("phi3", PHI4_MINI_LONGROPE)],
                         ids=["llama", "phi3-partial-rotary"])
def test_longrope_is_served_up_to_its_original_length_exactly(tmp_path, architecture, overrides):
    """transformers rotates a sequence longer than original_max_position_embeddings (64) with long_factor
    at every position, the cached ones included: the engine serves such a model up to 64 tokens, where
    its frequencies are fixed, and matches it there (sequences ending at 64, after a chunked prefill)."""
    model_dir = save_random_hf_model(tmp_path / "longrope", architecture, seed=3, **overrides)
    cases = [GreedyCase(tuple(range(3, 3 + n)), 64 - n, ignore_eos=True) for n in (5, 40, 63)]
    outputs, engine = run_engine(model_dir, cases, max_num_batched_tokens=16, num_kv_blocks=12)
    assert engine.max_model_len == 64
    assert outputs == [hf_greedy(model_dir, case) for case in cases]
    with pytest.raises(InvalidRequestError) as error:
        engine.validate("long", list(range(3, 3 + 64)), cases[0].params())
    assert str(error.value) == ("This model's maximum context length is 64 tokens. However, prompt has 64 tokens, and "
                                 "at least one output token must fit. Please reduce the length of the input.")


def test_longrope_past_its_original_length_is_refused_naming_max_model_len(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "longrope", "llama", **LONGROPE)
    with pytest.raises(ValueError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu", max_model_len=65))
    assert str(error.value) == (
        "max_model_len 65 exceeds original_max_position_embeddings 64 of this rope_type 'longrope' model: past it "
        "transformers rotates every position with long_factor instead of short_factor, which keys already in the KV "
        "cache cannot follow; set max_model_len <= 64")


def test_a_legacy_phi3_su_rope_is_refused_naming_it(tmp_path):
    """Older Phi-3 repos (Phi-3-mini-128k before its rename) write rope_scaling {"type": "su", ...}, which
    transformers reads as longrope but then misses original_max_position_embeddings in: a KeyError from inside
    config loading becomes an UnsupportedModelError naming the field, its value and the rename that reads."""
    reference_dir = save_random_hf_model(tmp_path / "reference", "phi3")
    model_dir = copy_with_config_fields(reference_dir, tmp_path / "su", rope_parameters=None, rope_scaling={
        "type": "su", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8})
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == (
        "config.json's rope_scaling type 'su' (Phi-3's legacy name for 'longrope'): transformers cannot read it "
        "(KeyError: \"Missing required keys in `rope_parameters` for 'rope_type'='longrope': "
        "{'original_max_position_embeddings'}\"); newer Phi-3 checkpoints name it 'longrope' (set its type to "
        "\"longrope\")")


def test_kv_heads_that_do_not_divide_the_query_heads_are_refused_naming_both(tmp_path):
    """transformers builds (and saves) a model of 4 query heads over 3 KV heads, which no grouped-query attention
    runs (its own forward fails too): the engine refuses it at load instead of failing the first step."""
    model_dir = save_random_hf_model(tmp_path / "m", "llama", num_hidden_layers=1, num_key_value_heads=3)
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == ("num_attention_heads 4 is not a multiple of num_key_value_heads 3 (grouped-query "
                                "attention gives each KV head the same number of query heads)")


@pytest.mark.parametrize("fields, reason", [
    (dict(vocab_size="384"), "TypeError: Field 'vocab_size' expected int, got str (value: '384')"),
    (dict(hidden_size=100, num_attention_heads=3),
     "ValueError: The hidden size (100) is not a multiple of the number of attention heads (3)."),
], ids=["field-type", "shape"])
def test_a_config_transformers_validation_refuses_is_an_unsupported_model_in_its_words(tmp_path, fields, reason):
    """transformers 5's config classes validate field types and shapes (huggingface_hub strict dataclasses, whose
    errors are no ValueError): the engine refused such a config.json with that raw exception (a traceback from
    `splitserve generate`); its cause names the field, and the config's rope_parameters are not blamed."""
    model_dir = copy_with_config_fields(save_random_hf_model(tmp_path / "m", "llama", num_hidden_layers=1),
                                        tmp_path / "edited", **fields)
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == f"config.json: transformers cannot read it ({reason})"


def test_rope_parameters_transformers_cannot_build_are_refused_naming_them(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "linear", "llama", **FAMILIES["llama-rope-linear"][1])
    config = load_hf_config(model_dir)
    del config.rope_parameters["factor"]  # what a config that transformers' validation let through may lack
    with pytest.raises(UnsupportedModelError) as error:
        build_rotary(config, parse_arch(config))
    assert str(error.value) == ('rope_parameters {"rope_theta": 10000.0, "rope_type": "linear"}: transformers '
                                "cannot build its RoPE (KeyError: 'factor')")


def test_a_tied_config_whose_checkpoint_stores_another_lm_head_runs_that_lm_head(tmp_path):
    """transformers unties tie_word_embeddings when the checkpoint holds both tensors with different values."""
    reference_dir = save_random_hf_model(tmp_path / "reference", "llama", seed=3)
    model_dir = copy_with_config_fields(reference_dir, tmp_path / "tied", tie_word_embeddings=True)
    outputs, engine = run_engine(model_dir, SHORT_CASES, **short_run_config())
    assert outputs == [hf_greedy(model_dir, case) for case in SHORT_CASES]
    assert outputs == [hf_greedy(reference_dir, case) for case in SHORT_CASES]


def test_a_tied_checkpoint_storing_only_lm_head_runs_it_as_the_embedding(tmp_path):
    """transformers ties either tensor of a tied config to the other: a checkpoint holding the shared matrix as
    lm_head.weight alone loads there (the engine refused it: "no tensor embed_tokens.weight")."""
    from safetensors.torch import load_file, save_file

    tied_dir = save_random_hf_model(tmp_path / "tied", "llama", seed=3, tie_word_embeddings=True)
    model_dir = Path(shutil.copytree(tied_dir, tmp_path / "lm-head-only"))
    tensors = load_file(model_dir / "model.safetensors")
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    outputs, engine = run_engine(model_dir, SHORT_CASES, **short_run_config())
    assert outputs == [hf_greedy(model_dir, case) for case in SHORT_CASES]
    assert outputs == [hf_greedy(tied_dir, case) for case in SHORT_CASES]
    assert_pool_idle(engine.block_manager)


def test_an_untied_checkpoint_without_lm_head_is_refused_naming_it(tmp_path):
    tied_dir = save_random_hf_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    model_dir = copy_with_config_fields(tied_dir, tmp_path / "untied", tie_word_embeddings=False)
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == ("the checkpoint has no tensor lm_head.weight (the output projection; config.json "
                                "does not set tie_word_embeddings; a checkpoint saved without its LM head, as "
                                "embedding models are, runs with runner 'pooling' (--runner pooling) only)")


def pytorch_bin_copy(model_dir: Path, out_dir: Path, num_shards: int) -> Path:
    """`model_dir` with its safetensors rewritten as PyTorch state dicts, as older checkpoints ship them: one
    pytorch_model.bin, or `num_shards` shards and their pytorch_model.bin.index.json."""
    from safetensors.torch import load_file

    shutil.copytree(model_dir, out_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    tensors = {name: tensor for path in sorted(model_dir.glob("*.safetensors")) for name, tensor in load_file(path).items()}
    if num_shards == 1:
        torch.save(tensors, out_dir / "pytorch_model.bin")
        return out_dir
    names = sorted(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file_name = f"pytorch_model-{shard + 1:05d}-of-{num_shards:05d}.bin"
        torch.save({name: tensors[name] for name in names[shard::num_shards]}, out_dir / file_name)
        weight_map.update({name: file_name for name in names[shard::num_shards]})
    (out_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir


@pytest.mark.parametrize("num_shards", [1, 3])
def test_a_pytorch_bin_checkpoint_runs_like_its_safetensors(num_shards, tmp_path):
    model_dir = save_random_hf_model(tmp_path / "safetensors", "qwen2", seed=4)
    bin_dir = pytorch_bin_copy(model_dir, tmp_path / "bin", num_shards)
    assert not list(bin_dir.glob("*.safetensors"))
    outputs, engine = run_engine(bin_dir, SHORT_CASES, **short_run_config())
    assert outputs == [hf_greedy(model_dir, case) for case in SHORT_CASES]
    assert_pool_idle(engine.block_manager)
    assert model_fingerprint(bin_dir) != model_fingerprint(model_dir)


def test_checkpoint_files_that_cannot_load_are_named(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "m", "llama", num_hidden_layers=1)
    sharded = pytorch_bin_copy(model_dir, tmp_path / "sharded", 2)
    (sharded / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(UnsupportedModelError, match=r"pytorch_model.bin.index.json: names shards that are missing: "
                                                    r"pytorch_model-00002-of-00002.bin$"):
        weight_files(sharded)
    broken = pytorch_bin_copy(model_dir, tmp_path / "broken", 1)
    (broken / "pytorch_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(UnsupportedModelError, match=r"pytorch_model.bin: not a loadable PyTorch state dict"):
        EngineCore(broken, EngineConfig(device="cpu"))
    (broken / "pytorch_model.bin").unlink()
    with pytest.raises(UnsupportedModelError, match=r"no weights \(\*.safetensors, or pytorch_model\*.bin\)$"):
        check_model_dir(broken)


@pytest.mark.parametrize("shard", ["../outside.bin", "/tmp/outside.bin", "sub/pytorch_model.bin"])
def test_an_index_naming_a_shard_outside_the_directory_is_refused(tmp_path, shard):
    model_dir = save_random_hf_model(tmp_path / "m", "llama", num_hidden_layers=1)
    sharded = pytorch_bin_copy(model_dir, tmp_path / "sharded", 1)
    (tmp_path / "outside.bin").write_bytes((sharded / "pytorch_model.bin").read_bytes())
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": shard}}))
    with pytest.raises(UnsupportedModelError) as error:
        weight_files(sharded)
    assert str(error.value) == (f"{sharded / 'pytorch_model.bin.index.json'}: names shards that are not file names "
                                f"in its directory: {shard}")


def test_eos_ids_come_from_generation_config_else_config_json_and_a_bad_file_is_named(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "m", "llama", num_hidden_layers=1, eos_token_id=7)
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    config = EngineConfig(device="cpu", num_kv_blocks=16, max_model_len=64)
    assert EngineCore(model_dir, config).eos_token_ids == frozenset({7})  # config.json's
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 9]}))
    assert EngineCore(model_dir, config).eos_token_ids == frozenset({3, 9})
    (model_dir / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(GenerationConfigError, match=r"generation_config.json: not a JSON object, got list$"):
        EngineCore(model_dir, config)
