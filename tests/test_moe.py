"""Mixture-of-experts layers (engine/models/moe.py): routing and expert mixing against transformers' own modules,
both checkpoint forms of the experts, and what the engine refuses for these models."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.common.config import EngineConfig
from splitserve.common.errors import UnsupportedModelError
from splitserve.engine import EngineCore
from splitserve.engine.model_loader import parse_arch
from splitserve.engine.models.layer_ops import TorchLayerOps
from splitserve.engine.models.llama import build_feed_forward
from splitserve.engine.models.moe import SparseMoeBlock
from splitserve.engine.quantization.quantize import check_packable
from tests.factories import MOE_DEFAULTS, assert_pool_idle, hf_greedy, save_random_hf_model
from tests.test_model_families import SHORT_CASES, run_engine, short_run_config

NUM_TOKENS = 96


def hf_model(architecture: str, dtype: torch.dtype, **overrides):
    """A random transformers model of `architecture` as the factory configures it, in memory, in `dtype`."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    config_class, name = {"qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
                          "mixtral": (MixtralConfig, "MixtralForCausalLM")}[architecture]
    base = dict(architectures=[name], vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    config = config_class(**{**base, **MOE_DEFAULTS[architecture], **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def engine_block(hf, layer: int, dtype: torch.dtype) -> SparseMoeBlock:
    """The engine's block for transformers' layer `layer`, with its weights (plain nn.Linear layers, torch ops)."""
    block = build_feed_forward(parse_arch(hf.config), layer, TorchLayerOps()).to(dtype)
    experts = hf.model.layers[layer].mlp.experts
    state = {"gate.weight": hf.model.layers[layer].mlp.gate.weight}
    for e in range(experts.num_experts):
        state[f"experts.{e}.gate_up_proj.weight"] = experts.gate_up_proj[e]
        state[f"experts.{e}.down_proj.weight"] = experts.down_proj[e]
    block.load_state_dict(state, strict=True)
    return block.eval()


@pytest.mark.parametrize("architecture, overrides", [
    ("qwen3_moe", dict()),
    ("qwen3_moe", dict(norm_topk_prob=False, num_experts_per_tok=3)),
    ("mixtral", dict()),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_and_mixing_match_transformers_modules(architecture, overrides, dtype):
    hf = hf_model(architecture, dtype, **overrides)
    hf_block, block = hf.model.layers[0].mlp, engine_block(hf, 0, dtype)
    x = torch.randn(NUM_TOKENS, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        _, hf_weights, hf_experts = hf_block.gate(x)
        weights, experts = block.route(x)
        assert torch.equal(experts, hf_experts)
        assert torch.equal(weights, hf_weights)
        assert torch.equal(block(x), hf_block(x[None])[0])
    # Qwen3-MoE rounds the weights to the model's dtype, Mixtral keeps float32.
    assert weights.dtype == (dtype if architecture == "qwen3_moe" else torch.float32)
    k, num_experts = experts.shape[1], block.moe.num_experts
    assert torch.bincount(experts.flatten(), minlength=num_experts).min() > 0  # every expert ran on some tokens
    sums = weights.float().sum(dim=-1)
    if overrides.get("norm_topk_prob", True):
        torch.testing.assert_close(sums, torch.ones(NUM_TOKENS), atol=1e-2, rtol=0)
    else:
        assert sums.max() < 0.99  # the top k's raw probabilities
    assert k == overrides.get("num_experts_per_tok", 2)


def test_routing_on_a_known_router_picks_the_largest_logits_in_order():
    hf = hf_model("qwen3_moe", torch.float32)
    block = engine_block(hf, 0, torch.float32)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[:, 0] = torch.tensor([0.0, 3.0, 1.0, 0.0, 2.0, 0.0, 0.0, 0.0])  # logits = x[0] * these
    weights, experts = block.route(torch.eye(64)[:1])  # x[0] = 1: logits [0, 3, 1, 0, 2, 0, 0, 0]
    assert experts.tolist() == [[1, 4]]
    e3, e2 = torch.exp(torch.tensor(3.0)), torch.exp(torch.tensor(2.0))
    torch.testing.assert_close(weights, torch.stack((e3, e2)).unsqueeze(0) / (e3 + e2), atol=0, rtol=1e-6)


def layer_layout(architecture: str, **overrides) -> list[bool]:
    """Which decoder layers parse_arch makes sparse for a config."""
    arch = parse_arch(hf_model(architecture, torch.float32, **overrides).config)
    return [arch.is_sparse_layer(i) for i in range(arch.num_layers)]


def test_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step():
    assert layer_layout("qwen3_moe", num_hidden_layers=4) == [True, True, True, True]
    assert layer_layout("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0, 2]) == [False, True, False, True]
    assert layer_layout("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2) == [False, True, False, True]
    assert layer_layout("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=3,
                        mlp_only_layers=[5]) == [False, False, True, False, False, False]
    assert layer_layout("qwen3_moe", num_hidden_layers=2, num_experts=0) == [False, False]
    assert layer_layout("mixtral", num_hidden_layers=3) == [True, True, True]


def stacked_copy(model_dir, out_dir, block: str):
    """`model_dir` with each sparse layer's experts as the [num_experts, ...] stacks transformers 5 holds in memory
    (`{block}.experts.gate_up_proj`, `{block}.experts.down_proj`), its router as `{block}.gate.weight`."""
    import shutil

    shutil.copytree(model_dir, out_dir)
    (weights,) = out_dir.glob("*.safetensors")
    tensors = load_file(weights)
    renames = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
               "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in [n for n in tensors if ".experts." in n or n.endswith(".gate.weight")]:
        tensor = tensors.pop(name)
        layer = name.split(".")[2]
        if name.endswith(".gate.weight"):
            tensors[f"model.layers.{layer}.{block}.gate.weight"] = tensor
            continue
        expert, projection = int(name.split(".")[5]), renames[name.split(".")[6]]
        experts.setdefault(layer, {}).setdefault(projection, {})[expert] = tensor
    for layer, projections in experts.items():
        def stack(projection):
            return torch.stack([projections[projection][e] for e in sorted(projections[projection])])
        prefix = f"model.layers.{layer}.{block}.experts."
        tensors[prefix + "gate_up_proj"] = torch.cat((stack("gate_proj"), stack("up_proj")), dim=1)
        tensors[prefix + "down_proj"] = stack("down_proj")
    save_file(tensors, weights, metadata={"format": "pt"})
    return out_dir


@pytest.mark.parametrize("architecture, block, overrides", [
    ("qwen3_moe", "mlp", dict(num_hidden_layers=3, mlp_only_layers=[0])),
    ("mixtral", "mlp", dict()),
    ("mixtral", "block_sparse_moe", dict()),
])
def test_stacked_experts_load_like_per_expert_tensors(architecture, block, overrides, tmp_path):
    model_dir = save_random_hf_model(tmp_path / "hub", architecture, seed=5, **overrides)
    stacked = stacked_copy(model_dir, tmp_path / "stacked", block)
    assert not [n for n in load_file(next(stacked.glob("*.safetensors"))) if ".experts.0." in n]
    outputs, engine = run_engine(stacked, SHORT_CASES, **short_run_config())
    expected = [hf_greedy(model_dir, case) for case in SHORT_CASES]
    assert outputs == expected
    assert [hf_greedy(stacked, case) for case in SHORT_CASES] == expected  # transformers reads this form too
    assert_pool_idle(engine.block_manager)


def test_a_missing_or_misshapen_expert_is_named(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "m", "qwen3_moe")
    (weights,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == ("the checkpoint has no tensor layers.1.mlp.experts.5.up_proj.weight (the experts of "
                                "decoder layer 1 of 2)")
    tensors["model.layers.0.mlp.gate.weight"] = tensors["model.layers.0.mlp.gate.weight"][:6]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu"))
    assert str(error.value) == ("the checkpoint's layers.0.mlp.gate.weight has shape [6, 64], config.json implies "
                                "[8, 64] (vocab_size 384, hidden_size 64, num_attention_heads 4, num_key_value_heads "
                                "2, head_dim 16, intermediate_size 128, num_experts 8, expert width 48)")


def test_quantizing_a_mixture_of_experts_is_refused(tmp_path):
    model_dir = save_random_hf_model(tmp_path / "m", "mixtral")
    with pytest.raises(UnsupportedModelError) as error:
        EngineCore(model_dir, EngineConfig(device="cpu", quantization="int8"))
    assert str(error.value) == ("quantization 'int8' is not supported for mixture-of-experts models "
                                "(MixtralForCausalLM): their experts and router run float weights only; set "
                                "quantization to none")
    with pytest.raises(UnsupportedModelError) as error:
        check_packable(hf_model("qwen3_moe", torch.float32), "gptq")
    assert str(error.value) == ("gptq quantization of mixture-of-experts models (Qwen3MoeForCausalLM) is not "
                                "supported: the engine runs their experts and router in float only")


def test_a_bad_top_k_is_refused(tmp_path):
    config = hf_model("qwen3_moe", torch.float32).config
    config.num_experts_per_tok = 9
    with pytest.raises(UnsupportedModelError) as error:
        parse_arch(config)
    assert str(error.value) == "num_experts_per_tok must be between 1 and num_experts 8, got 9"
