"""Weight quantization: the GPTQ / AWQ packings against their reference formulas (exact), the
quantized layers against dequantize-then-matmul, and what a pool resolves to run."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.common.errors import UnsupportedModelError
from splitserve.deploy.cli import main
from splitserve.engine.quantization.formats import (AWQ_PACK_ORDER, PackedTensors, QuantizedWeight, awq_pack,
                                                    awq_unpack, gptq_pack, gptq_unpack, pack_int4, unpack_int4)
from splitserve.engine.quantization.linear import (DequantizingLinear, Int4CpuLinear, Int8CpuLinear,
                                                   int4pack_layout_is_known, make_quantized_linear, unpack_int4pack)
from splitserve.engine.quantization.rtn import int4_grouped, int8_per_channel
from splitserve.common.quantization_spec import QuantizationSpec, resolve_quantization
from splitserve.engine.tiny_model import TinyModelSpec, build_tiny_model
from tests.factories import save_random_hf_model


def _nibble(words: torch.Tensor, index) -> torch.Tensor:
    """The index-th 4-bit field of each int32 word (least significant first), as a plain integer."""
    return (words.long() & 0xFFFFFFFF) >> (4 * torch.as_tensor(index)) & 0xF


def _random_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def _act_order_g_idx(k: int, group_size: int, seed: int = 0) -> torch.Tensor:
    """AutoGPTQ's act-order g_idx: column perm[j] falls in group j // group_size."""
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.long)
    g_idx[perm] = torch.arange(k) // group_size
    return g_idx


def _with_groups(weight: QuantizedWeight, group_index: torch.Tensor) -> QuantizedWeight:
    return QuantizedWeight(weight.codes, weight.scales, weight.zeros, group_index, weight.bits)


def test_pack_int4_puts_the_first_code_in_the_lowest_nibble():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    words = pack_int4(codes, dim=1)
    assert words.dtype == torch.int32 and words.tolist() == [[0x87654321 - (1 << 32)]]
    assert unpack_int4(words, dim=1).tolist() == codes.tolist()


def test_pack_int4_round_trips_along_either_dim():
    codes = torch.randint(0, 16, (16, 24), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    assert torch.equal(unpack_int4(pack_int4(codes, dim=0), dim=0), codes)
    assert torch.equal(unpack_int4(pack_int4(codes, dim=1), dim=1), codes)


def test_awq_word_holds_channels_in_interleaved_order():
    weight = QuantizedWeight(torch.arange(8, dtype=torch.int32)[:, None], torch.ones(1, 8), torch.zeros(1, 8),
                             torch.zeros(1, dtype=torch.long), bits=4)
    packed = awq_pack(weight, group_size=32)
    assert AWQ_PACK_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    assert packed.qweight.tolist() == [[0x75316420]]


def _gptq_reference(t: PackedTensors) -> torch.Tensor:
    """AutoGPTQ v1: w[n, k] = scales[g, n] * (q[k, n] - (z[g, n] + 1)), g = g_idx[k]; [N, K] float32."""
    k, n = t.qweight.shape[0] * 8, t.qweight.shape[1]
    kk, nn_ = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="ij")  # [K, N] each
    g = t.g_idx.long()[kk]
    q = _nibble(t.qweight[kk // 8, nn_], kk % 8)
    z = _nibble(t.qzeros[g, nn_ // 8], nn_ % 8) + 1
    return (t.scales.float()[g, nn_] * (q - z).float()).t()


def _awq_reference(t: PackedTensors, group_size: int) -> torch.Tensor:
    """AutoAWQ GEMM: channel n of a word is nibble AWQ_PACK_ORDER.index(n % 8); [N, K] float32."""
    k, n = t.qweight.shape[0], t.qweight.shape[1] * 8
    kk, nn_ = torch.meshgrid(torch.arange(k), torch.arange(n), indexing="ij")
    position = torch.tensor([AWQ_PACK_ORDER.index(i) for i in range(8)])[nn_ % 8]
    g = kk // group_size
    q = _nibble(t.qweight[kk, nn_ // 8], position)
    z = _nibble(t.qzeros[g, nn_ // 8], position)
    return (t.scales.float()[g, nn_] * (q - z).float()).t()


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_dequantization_equals_the_reference_formula(act_order, group_size):
    weight = int4_grouped(_random_weight(48, 256), group_size, min_zero=1)
    if act_order:
        weight = _with_groups(weight, _act_order_g_idx(256, group_size))
    packed = gptq_pack(weight)
    assert packed.qweight.shape == (32, 48) and packed.qzeros.shape == (256 // group_size, 6)
    assert packed.g_idx.dtype == torch.int32 and packed.scales.dtype == torch.float16
    unpacked = gptq_unpack(packed)
    assert torch.equal(unpacked.codes, weight.codes) and torch.equal(unpacked.zeros, weight.zeros)
    assert torch.equal(unpacked.group_index, weight.group_index)
    assert torch.equal(unpacked.dequantize(), _gptq_reference(packed))


def test_gptq_v1_refuses_a_zero_point_it_cannot_store():
    weight = int4_grouped(_random_weight(8, 64).abs(), 32)  # all >= 0: zero point 0
    with pytest.raises(ValueError, match=r"zero points must be in \[1, 15\]"):
        gptq_pack(weight)


@pytest.mark.parametrize("group_size", [32, 64])
def test_awq_dequantization_equals_the_reference_formula(group_size):
    weight = int4_grouped(_random_weight(64, 192, seed=3), group_size)
    packed = awq_pack(weight, group_size)
    assert packed.qweight.shape == (192, 8) and packed.qzeros.shape == (192 // group_size, 8)
    unpacked = awq_unpack(packed, group_size)
    assert torch.equal(unpacked.codes, weight.codes) and torch.equal(unpacked.zeros, weight.zeros)
    assert torch.equal(unpacked.dequantize(), _awq_reference(packed, group_size))


def test_int8_rtn_is_symmetric_per_output_channel():
    weight = torch.tensor([[0.5, -1.0, 0.25], [2.0, 1.0, -0.5]])
    q = int8_per_channel(weight)
    assert q.codes.tolist() == [[64, -127, 32], [127, 64, -32]]
    assert torch.equal(q.scales, torch.tensor([[1.0 / 127, 2.0 / 127]]))
    assert q.zeros.tolist() == [[0.0, 0.0]]


def test_int4_rtn_grid_spans_the_group_and_zero():
    q = int4_grouped(torch.tensor([[-1.5, 0.0, 2.0, 6.0], [0.5, 1.0, 1.5, 7.5]]), group_size=4)
    assert q.scales.tolist() == [[0.5, 0.5]] and q.zeros.tolist() == [[3.0, 0.0]]
    assert q.codes.tolist() == [[0, 3, 7, 15], [1, 2, 3, 15]]


def _layer_cases():
    w = _random_weight(100, 704, seed=5)  # N not a multiple of 16, K not of 128: both padded
    yield "int8", int8_per_channel(w), 0
    for group_size in (32, 64, 128):
        yield f"int4-g{group_size}", int4_grouped(w, group_size), group_size
    yield "int4-act-order", _with_groups(int4_grouped(w, 64), _act_order_g_idx(704, 64, seed=2)), 64


@pytest.mark.parametrize("name, weight, group_size", list(_layer_cases()), ids=lambda v: v if isinstance(v, str) else "")
def test_quantized_layers_match_dequantize_then_matmul_in_float32(name, weight, group_size):
    """Tolerance 2e-6 x max|y|: the kernels sum in another order ((code - 8) * s + offset for int4)."""
    bias = torch.randn(100, generator=torch.Generator().manual_seed(8))
    layer = make_quantized_linear(weight, bias, group_size, torch.float32, torch.device("cpu"))
    assert isinstance(layer, Int8CpuLinear if weight.bits == 8 else Int4CpuLinear)
    fallback = DequantizingLinear(weight, bias, torch.float32)
    # int8: the packed kernel, then cast-and-GEMM above INT8_KERNEL_MAX_ROWS; int4: the packed kernel for one
    # row, then W rebuilt from the packed codes and a dense GEMM above INT4_FP32_KERNEL_MAX_ROWS
    for rows in (1, 7, 40):
        x = torch.randn(rows, 704, generator=torch.Generator().manual_seed(9))
        expected = x @ weight.dequantize().t() + bias  # [rows, 100]
        for got in (layer(x), fallback(x)):
            assert got.shape == (rows, 100)
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-6 * expected.abs().max().item())


def test_unpack_int4pack_inverts_torchs_cpu_packing():
    codes = torch.randint(0, 16, (96, 160), dtype=torch.int32, generator=torch.Generator().manual_seed(4))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    assert int4pack_layout_is_known()
    assert torch.equal(unpack_int4pack(packed, 160).to(torch.int32), codes)


@pytest.mark.parametrize("bits", [4, 8])
def test_bfloat16_layers_stay_within_bfloat16_rounding(bits):
    """3 rows: the packed kernels; 120: int8's cast-and-GEMM (widened to float32 without a bf16 GEMM)."""
    w = _random_weight(64, 256)
    weight = int4_grouped(w, 64) if bits == 4 else int8_per_channel(w)
    layer = make_quantized_linear(weight, None, 64, torch.bfloat16, torch.device("cpu"))
    for rows in (3, 120):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
        expected = x @ weight.dequantize().t()
        got = layer(x.bfloat16())
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected, rtol=0, atol=0.02 * expected.abs().max().item())


def test_float_checkpoints_resolve_to_what_the_config_asks():
    assert resolve_quantization("auto", 128, None) == QuantizationSpec("none", None, None)
    assert resolve_quantization("int8", 128, None) == QuantizationSpec("int8", 8, None)
    assert resolve_quantization("int4", 32, None) == QuantizationSpec("int4", 4, 32)
    with pytest.raises(UnsupportedModelError, match="needs a GPTQ checkpoint"):
        resolve_quantization("gptq", 128, None)


def test_packed_checkpoints_resolve_to_their_own_config():
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True}
    assert resolve_quantization("auto", 128, gptq) == QuantizationSpec("gptq", 4, 64, 1)
    assert resolve_quantization("gptq", 128, {**gptq, "checkpoint_format": "gptq_v2"}).gptq_zero_offset == 0
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    assert resolve_quantization("awq", 32, awq) == QuantizationSpec("awq", 4, 128)
    for requested, config, message in [("int8", gptq, "the checkpoint is GPTQ-quantized"),
                                       ("auto", {**gptq, "bits": 8}, "8 bits are not supported"),
                                       ("auto", {**awq, "version": "gemv"}, "GEMM packing"),
                                       ("auto", {"quant_method": "fp8"}, "'fp8' is not supported")]:
        with pytest.raises(UnsupportedModelError, match=message):
            resolve_quantization(requested, 128, config)


def test_engine_config_validates_quantization_fields():
    assert EngineConfig().quantization == "auto"
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        EngineConfig(quantization_group_size=100)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantize_refuses_a_projection_the_format_cannot_pack_naming_it(method, tmp_path, capsys):
    """Both formats pack 8 codes per int32 across output channels (qzeros; AWQ's qweight too): a
    100-wide MLP is refused in one line before any calibration, not by a reshape error at the end."""
    model_dir = build_tiny_model(tmp_path / "model", TinyModelSpec(intermediate_size=100))
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    (calibration / "river.txt").write_text("Tell me about the river and the old mill by the village road. " * 40)
    argv = ["quantize", str(model_dir), str(tmp_path / "out"), "--method", method, "--group-size", "32",
            "--calibration-dir", str(calibration), "--num-samples", "2", "--seq-len", "64"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (  # after transformers' loading bar
        f"splitserve: error: {method} packs 8 4-bit codes per int32 along the output channels: "
        "model.layers.0.mlp.gate_proj has 100 (a multiple of 8 is needed)")
    assert not (tmp_path / "out").exists()


def test_quantize_copies_no_other_weights_of_the_source_directory(tmp_path):
    """The output's only weights are its model.safetensors: a source's other safetensors (Mistral's
    consolidated.safetensors next to the Hugging Face shards) or .bin copy would be read with it."""
    from transformers import AutoModelForCausalLM

    from splitserve.common.model_dir import weight_files
    from splitserve.engine.quantization.quantize import QuantizeConfig, write_checkpoint

    model_dir = build_tiny_model(tmp_path / "model", TinyModelSpec())
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as handle:
        weight_map = {name: "model.safetensors" for name in handle.keys()}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (model_dir / "consolidated.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    (model_dir / "pytorch_model.bin").write_bytes(b"an older copy of the weights")
    out_dir = write_checkpoint(model_dir, tmp_path / "out", AutoModelForCausalLM.from_pretrained(model_dir), {},
                               QuantizeConfig("gptq"))
    assert weight_files(out_dir) == [out_dir / "model.safetensors"]
    assert not (out_dir / "consolidated.safetensors").exists() and not (out_dir / "pytorch_model.bin").exists()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantize_refuses_fused_projections_naming_the_architecture(method, tmp_path, capsys):
    """transformers' Phi-3 holds q/k/v as one qkv_proj and gate/up as one gate_up_proj: refused in one line
    before any calibration, not by an AttributeError on self_attn.q_proj."""
    model_dir = save_random_hf_model(tmp_path / "phi3", "phi3")
    argv = ["quantize", str(model_dir), str(tmp_path / "out"), "--method", method]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"splitserve: error: {method} quantization of Phi3ForCausalLM is not supported: its layers hold fused "
        "projections (self_attn.qkv_proj, mlp.gate_up_proj), and quantization reads and writes q_proj, k_proj, "
        "v_proj, gate_proj and up_proj separately")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("architecture, reason", [
    ("gemma", "its norms scale by (1 + weight), so dividing a norm's weight does not divide its output"),
    ("gemma3", "its norms scale by (1 + weight), so dividing a norm's weight does not divide its output, and "
               "pre_feedforward_layernorm, not post_attention_layernorm, feeds its MLP"),
    ("olmo2", "it norms each sublayer's output instead (it has no input_layernorm)"),
])
def test_awq_refuses_layouts_its_scale_folding_does_not_fit(architecture, reason, tmp_path, capsys):
    """AWQ folds 1 / scales into the norms feeding q/k/v and gate/up: wrong (silently, before) for Gemma's
    (1 + weight) norms and sandwich layout, an AttributeError for OLMo 2's post-norms. Refused before calibration."""
    model_dir = save_random_hf_model(tmp_path / architecture, architecture)
    argv = ["quantize", str(model_dir), str(tmp_path / "out"), "--method", "awq"]
    assert main(argv) == 2
    config = json.loads((model_dir / "config.json").read_text())
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"splitserve: error: awq quantization of {config['architectures'][0]} is not supported: AWQ folds its scales "
        f"into input_layernorm (for q/k/v) and post_attention_layernorm (for gate/up), and {reason}")
    assert not (tmp_path / "out").exists()
