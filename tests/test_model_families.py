"""Every supported architecture variant loads and matches transformers greedy output exactly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.factories import assert_pool_idle, copy_with_config_fields, hf_greedy, save_random_hf_model
from splitserve.common.config import EngineConfig
from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.generation_config import GenerationConfigError
from splitserve.common.model_dir import check_model_dir, weight_files
from splitserve.engine import EngineCore
from splitserve.engine.model_loader import model_fingerprint
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
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse: 8 experts, 2 per token, renormalized
    "qwen3-moe-mlp-only-layers": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[1], head_dim=32)),
    # decoder_sparse_step 2: layers 1 and 3 sparse; top 3 of 8 not renormalized; attention biases
    "qwen3-moe-sparse-step-2-top-3": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2,
                                                        num_experts_per_tok=3, norm_topk_prob=False,
                                                        attention_bias=True)),
    "mixtral-sliding-window": ("mixtral", dict(sliding_window=48)),
}


def run_engine(model_dir, cases: list[GreedyCase], **config) -> tuple[list[list[int]], EngineCore]:
    engine = EngineCore(model_dir, EngineConfig(**{"block_size": 16, **config}))
    for index, case in enumerate(cases):
        engine.add_request(str(index), list(case.prompt_token_ids), case.params())
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    while engine.has_unfinished_requests():
        for delta in engine.step():
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
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_shape_matches_transformers(shape, tmp_path):
    architecture, overrides, block_size = SHAPES[shape]
    model_dir = save_random_hf_model(tmp_path / shape, architecture, seed=3, **overrides)
    outputs, engine = run_engine(model_dir, SHORT_CASES, **short_run_config(block_size))
    assert outputs == [hf_greedy(model_dir, case) for case in SHORT_CASES]
    assert_pool_idle(engine.block_manager)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "m", "llama")
    config_path = model_dir / "config.json"
    config_path.write_text(config_path.read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel"))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not supported"):
        EngineCore(model_dir, EngineConfig())


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        EngineCore(tmp_path, EngineConfig())


@pytest.mark.parametrize("missing, where", [
    ("model.layers.1.mlp.up_proj.weight", "layers.1.mlp.up_proj.weight (decoder layer 1 of 2)"),
    ("model.norm.weight", "norm.weight (outside the decoder layers)"),
])
def test_a_checkpoint_missing_a_tensor_is_an_unsupported_model_naming_it(tmp_path, missing, where):
    from safetensors.torch import load_file, save_file

    model_dir = save_random_hf_model(tmp_path / "m", "llama", num_hidden_layers=2)
    (weights,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors[missing]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == f"the checkpoint has no tensor {where}"


@pytest.mark.parametrize("field, value, tensor, shapes", [
    ("num_key_value_heads", 1, "layers.0.self_attn.k_proj.weight", "[32, 64], config.json implies [16, 64]"),
    ("intermediate_size", 96, "layers.0.mlp.gate_proj.weight", "[128, 64], config.json implies [96, 64]"),
    ("vocab_size", 400, "embed_tokens.weight", "[384, 64], config.json implies [400, 64]"),
])
def test_a_config_that_disagrees_with_its_checkpoint_is_refused_naming_the_tensor(tmp_path, field, value, tensor,
                                                                                     shapes):
    model_dir = copy_with_config_fields(save_random_hf_model(tmp_path / "m", "llama"), tmp_path / "edited",
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


def test_an_unsupported_activation_is_refused_naming_the_field(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "m", "llama", hidden_act="gelu")
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == "hidden_act 'gelu' is not supported (only silu / swish)"
    (model_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(UnsupportedModelError) as error:
        check_model_dir(model_dir)
    assert str(error.value) == f"{model_dir}: hidden_act 'gelu' is not supported (only silu / swish)"


LONGROPE = dict(max_position_embeddings=256, rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
    "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [1.0 + 0.9 * i for i in range(8)]})


def test_longrope_is_served_up_to_its_original_length_exactly(tmp_path):
    """transformers rotates a sequence longer than original_max_position_embeddings (64) with long_factor
    at every position, the cached ones included: the engine serves such a model up to 64 tokens, where
    its frequencies are fixed, and matches it there (sequences ending at 64, after a chunked prefill)."""
    model_dir = save_random_hf_model(tmp_path / "longrope", "llama", seed=3, **LONGROPE)
    cases = [GreedyCase(tuple(range(3, 3 + n)), 64 - n, ignore_eos=True) for n in (5, 40, 63)]
    outputs, engine = run_engine(model_dir, cases, max_num_batched_tokens=16, num_kv_blocks=12)
    assert engine.max_model_len == 64
    assert outputs == [hf_greedy(model_dir, case) for case in cases]
    with pytest.raises(InvalidRequestError) as error:
        engine.validate("long", list(range(3, 3 + 64)), cases[0].params())
    assert str(error.value) == "prompt: has 64 tokens; max_model_len is 64 (including at least one output token)"


def test_longrope_past_its_original_length_is_refused_naming_max_model_len(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "longrope", "llama", **LONGROPE)
    with pytest.raises(ValueError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu", max_model_len=65))
    assert str(error.value) == (
        "max_model_len 65 exceeds original_max_position_embeddings 64 of this rope_type 'longrope' model: past it "
        "transformers rotates every position with long_factor instead of short_factor, which keys already in the KV "
        "cache cannot follow; set max_model_len <= 64")


def test_a_tied_config_whose_checkpoint_stores_another_lm_head_runs_that_lm_head(tmp_path):
    """transformers unties tie_word_embeddings when the checkpoint holds both tensors with different values."""
    reference_dir = save_random_hf_model(tmp_path / "reference", "llama", seed=3)
    model_dir = copy_with_config_fields(reference_dir, tmp_path / "tied", tie_word_embeddings=True)
    outputs, engine = run_engine(model_dir, SHORT_CASES, **short_run_config())
    assert outputs == [hf_greedy(model_dir, case) for case in SHORT_CASES]
    assert outputs == [hf_greedy(reference_dir, case) for case in SHORT_CASES]


def test_an_untied_checkpoint_without_lm_head_is_refused_naming_it(tmp_path):
    tied_dir = save_random_hf_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    model_dir = copy_with_config_fields(tied_dir, tmp_path / "untied", tie_word_embeddings=False)
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == ("the checkpoint has no tensor lm_head.weight (the output projection; config.json "
                                "does not set tie_word_embeddings)")


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
