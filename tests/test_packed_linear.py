"""oneDNN-packed linear layers against F.linear, in fp32 and bf16, with bf16 computed natively where
the CPU has bf16 GEMMs and widened to fp32 where it has not (both paths run on every CPU: the widened
one is chosen explicitly here); and the C++ panel kernel (PanelLinear) bit for bit against its float32
summation emulated in torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.cpu_gemm import cpu_gemm_dtype, has_bf16_gemm
from splitserve.engine.cpu_kernels import AVX2, AVX512, AVX512_BF16
from splitserve.engine.models.layer_ops import CpuKernelLayerOps, GatedActivation, gelu_tanh_and_mul
from splitserve.engine.models.llama import MLP, GeluTanhMLP
from splitserve.engine.models.packed_linear import (PANEL_COLUMNS, PackedLinear, PanelGatedLinear, PanelLinear,
                                                    can_pack, pack_linears, pack_panels, uses_panels)

from tests.factories import needs_kernels

needs_onednn = pytest.mark.skipif(not can_pack(torch.float32, torch.device("cpu")), reason="torch without oneDNN")
NATIVE_BF16 = has_bf16_gemm()


def _case(rows: int, dtype: torch.dtype, bias: bool = True) -> tuple[torch.nn.Linear, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(96, 80, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 96, generator=generator) / 10)
        if bias:
            linear.bias.copy_(torch.randn(80, generator=generator))
    return linear.to(dtype), torch.randn(rows, 96, generator=generator).to(dtype)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 64, 129])
def test_fp32_packed_linear_equals_f_linear_up_to_summation_order(rows):
    linear, x = _case(rows, torch.float32)
    torch.testing.assert_close(PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias), atol=1e-5, rtol=1e-5)


@needs_onednn
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows", [1, 3, 64, 129])
def test_widened_bf16_linear_equals_the_bf16_gemm(rows, bias):
    """fp32 GEMM over widened bf16 weights and inputs, rounded to bf16 once: what torch's bf16 GEMM
    computes (it also accumulates in fp32 and rounds once), up to summation order. So every output
    is within one bf16 rounding (2^-8 relative) of the exact fp32 result, and differs from torch's
    bf16 GEMM by at most one bf16 ulp."""
    linear, x = _case(rows, torch.bfloat16, bias)
    got = PackedLinear(linear, compute_dtype=torch.float32)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 80)
    bias_fp32 = None if linear.bias is None else linear.bias.float()
    exact = F.linear(x.float(), linear.weight.float(), bias_fp32)
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-6)
    one_ulp = exact.abs() * 2**-7
    assert ((got.float() - F.linear(x, linear.weight, linear.bias).float()).abs() <= one_ulp).all()


@pytest.mark.skipif(not NATIVE_BF16, reason="this CPU has no oneDNN bf16 GEMM (the widened path covers it)")
@pytest.mark.parametrize("rows", [1, 3, 64, 129])
def test_native_bf16_packed_linear_equals_f_linear(rows):
    linear, x = _case(rows, torch.bfloat16)
    assert torch.equal(PackedLinear(linear)(x), F.linear(x, linear.weight, linear.bias))


def test_bf16_computes_natively_only_where_onednn_has_bf16_gemms():
    assert cpu_gemm_dtype(torch.bfloat16) == (torch.bfloat16 if NATIVE_BF16 else torch.float32)
    assert cpu_gemm_dtype(torch.float32) == torch.float32


@needs_onednn
def test_pack_linears_replaces_every_linear_and_keeps_the_output():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8, bias=False))
    model = model.to(torch.bfloat16)
    x = torch.randn(5, 16).to(torch.bfloat16)
    expected = model(x)
    pack_linears(model, torch.bfloat16, kernel_isa=None)
    assert [type(m).__name__ for m in model] == ["PackedLinear", "SiLU", "PackedLinear"]
    assert {m.compute_dtype for m in model if isinstance(m, PackedLinear)} == {cpu_gemm_dtype(torch.bfloat16)}
    torch.testing.assert_close(model(x), expected, rtol=2**-7, atol=0)  # at most one bf16 ulp apart


# ---- PanelLinear (csrc/panel_linear.cpp) ------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def test_bf16_panels_pair_consecutive_inputs_of_each_column_in_one_word():
    weight = torch.randn(17, 5).to(torch.bfloat16)  # 2 panels (the second 1 column wide), 3 pairs (the last half)
    panels = pack_panels(weight)
    assert panels.shape == (2, 3, PANEL_COLUMNS) and panels.dtype == torch.int32
    words = panels.to(torch.int64) & 0xFFFFFFFF
    padded = torch.zeros(2 * PANEL_COLUMNS, 6, dtype=torch.bfloat16)
    padded[:17, :5] = weight
    for p, k2, j in [(0, 0, 0), (0, 2, 15), (1, 1, 0), (1, 2, 0), (1, 0, 7)]:
        column = PANEL_COLUMNS * p + j
        low, high = _bits(padded[column, 2 * k2]), _bits(padded[column, 2 * k2 + 1])
        assert words[p, k2, j] == low | (high << 16)
    assert torch.equal(words[1, :, 1:], torch.zeros(3, PANEL_COLUMNS - 1, dtype=torch.int64))  # columns 17..31
    assert torch.equal(words[:, 2] >> 16, torch.zeros(2, PANEL_COLUMNS, dtype=torch.int64))  # input 5 of 5


def test_fp32_panels_hold_sixteen_columns_per_input():
    weight = torch.randn(17, 5)
    panels = pack_panels(weight)
    assert panels.shape == (2, 5, PANEL_COLUMNS) and panels.dtype == torch.float32
    assert torch.equal(panels[0], weight[:16].T)
    assert torch.equal(panels[1, :, 0], weight[16])
    assert torch.equal(panels[1, :, 1:], torch.zeros(5, PANEL_COLUMNS - 1))


def _emulated(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel's arithmetic in torch: float32 sums in ascending k, one rounding per term (a bf16 x bf16
    product is exact in float32, so the kernel's fused multiply-add rounds exactly where this add does)."""
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc = acc + x[:, k:k + 1].float() * weight[:, k].float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(x.dtype)


CASES = [(1, 80, 96), (1, 48, 8), (2, 80, 96), (3, 48, 31), (5, 17, 7), (6, 16, 2), (7, 1, 1), (13, 33, 64),
         (64, 80, 96), (129, 48, 31), (1100, 40, 251)]
"""(rows, out_features, in_features): fewer rows than a tile (1-2 rows: 4 / 2 panels per tile and the panels
left over), 1 to 2 tiles of rows and their tails, partial panels, odd inputs; 1100 x 251 inputs are over the
1 MiB of float32 inputs up to which the tiles read x packed (csrc/panel_linear.cpp's kMaxTiledBytes)."""


def _linear(out_features: int, in_features: int, bias: bool, dtype: torch.dtype, seed: int) -> torch.nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=generator))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=generator))
    return linear.to(dtype)


@needs_kernels
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows, out_features, in_features", CASES)
def test_bf16_panel_linear_computes_the_float32_sum_in_k_order_bit_for_bit(rows, out_features, in_features, bias):
    linear = _linear(out_features, in_features, bias, torch.bfloat16, rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = PanelLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert torch.equal(got, _emulated(x, linear.weight, linear.bias))
    # float32 activations holding bf16 values: the same sums, not rounded to bf16 at the end
    assert torch.equal(PanelLinear(linear)(x.float()), _emulated(x.float(), linear.weight, linear.bias))


@needs_kernels
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows, out_features, in_features", CASES)
def test_fp32_panel_linear_equals_the_float64_product_within_float32_rounding(rows, out_features, in_features, bias):
    """fp32 x fp32 products are not exact in float32, so the fused multiply-adds round differently from torch's
    mul-then-add: compared against float64 within the error bound of an in_features-term float32 sum."""
    linear = _linear(out_features, in_features, bias, torch.float32, rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = PanelLinear(linear)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    exact = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    magnitude = x.double().abs() @ linear.weight.double().abs().T + 1
    assert ((got.double() - exact).abs() <= (in_features + 1) * 2 ** -24 * magnitude).all()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_panel_linear_of_no_rows_is_empty(dtype):
    """A step can ask the LM head for no rows (only non-final prefill chunks): an empty result, no tile runs."""
    layer = PanelLinear(torch.nn.Linear(96, 80).to(dtype))
    out = layer(torch.empty(0, 96, dtype=dtype))
    assert out.shape == (0, 80) and out.dtype == dtype


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_panel_linear_gives_a_row_the_same_result_in_any_batch(dtype):
    linear = torch.nn.Linear(96, 80).to(dtype)
    x = torch.randn(13, 96).to(dtype)
    layer = PanelLinear(linear)
    batch = layer(x)
    for row in (0, 5, 6, 12):
        assert torch.equal(layer(x[row:row + 1]), batch[row:row + 1])
        assert torch.equal(layer(x[row:]), batch[row:])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("make_layer", [PanelLinear, lambda linear: PanelGatedLinear(linear, GatedActivation.SILU),
                                        lambda linear: PanelGatedLinear(linear, GatedActivation.GELU_TANH)],
                         ids=["linear", "silu", "gelu-tanh"])
def test_a_row_gets_the_same_result_whether_x_is_read_packed_or_in_place(make_layer, dtype):
    """1100 rows of 251 inputs (1.1 MB in float32) are read in place, any 200 of them packed in row tiles: the
    same sums in the same k order."""
    layer = make_layer(_linear(48, 251, True, dtype, 11))
    x = torch.randn(1100, 251, generator=torch.Generator().manual_seed(3)).to(dtype)
    batch = layer(x)
    for first in (0, 5, 897):
        assert torch.equal(layer(x[first:first + 200]), batch[first:first + 200])


@needs_kernels
def test_bf16_panel_linear_sums_float32_activations_within_float32_rounding():
    linear = torch.nn.Linear(200, 40).to(torch.bfloat16)
    x = torch.randn(9, 200)
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    torch.testing.assert_close(PanelLinear(linear)(x).double(), exact, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("call, message", [
    (lambda layer: layer(torch.randn(2, 94).to(torch.bfloat16)), "x has 94 features, the panels 48 pairs"),
    (lambda layer: layer(torch.randn(2, 96).half()), "x must be float32 or bfloat16"),
    (lambda layer: torch.ops.splitserve_cpu.panel_linear(torch.randn(2, 96), layer.panels, None, 97),
     "97 output features do not fill 5 panels"),
    (lambda layer: torch.ops.splitserve_cpu.panel_linear(torch.randn(2, 96), layer.panels.double(), None, 80),
     "panels must be a contiguous int32"),
])
def test_panel_linear_refuses_mismatched_inputs_with_a_message(call, message):
    layer = PanelLinear(torch.nn.Linear(96, 80).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match=message):
        call(layer)


# ---- PanelGatedLinear (csrc/panel_linear.cpp's panel_linear_silu_mul and panel_linear_gelu_tanh_mul) --------

GATED_CASES = [(1, 80, 96), (1, 33, 5), (2, 48, 31), (3, 17, 7), (5, 7, 64), (6, 16, 2), (7, 40, 97), (13, 33, 64),
               (64, 80, 96), (3, 72, 40), (1100, 24, 251)]
"""(rows, intermediate, in_features): one row (two pairs per tile, and the pair left over), two rows (gate and up
panels in one tile), taller tiles and their tails, a partial last pair (intermediate not a multiple of 16: the
fused op's scalar tail; for GeLU-tanh also whole panels past the last 32 / 64 columns torch's loop runs in vector
steps, 72 = 64 + 8), odd inputs, inputs over the packed-x bound (x read in place)."""

UNFUSED = {GatedActivation.SILU: CpuKernelLayerOps().silu_and_mul, GatedActivation.GELU_TANH: gelu_tanh_and_mul}
"""The fused products' oracles: fused_ops.cpp's SiLU-and-mul kernel, torch's F.gelu(gate, approximate="tanh") * up."""


@needs_kernels
@pytest.mark.parametrize("activation", list(GatedActivation), ids=lambda activation: activation.value)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("rows, intermediate, in_features", GATED_CASES)
def test_fused_gate_up_equals_panel_linear_then_its_activation_and_mul_bit_for_bit(rows, intermediate, in_features,
                                                                                   bias, dtype, activation):
    gate_up = _linear(2 * intermediate, in_features, bias, dtype, rows * 1000 + intermediate)
    x = (torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)) * 2).to(dtype)
    got = PanelGatedLinear(gate_up, activation)(x)
    assert got.dtype == dtype and got.shape == (rows, intermediate)
    assert torch.equal(got, UNFUSED[activation](PanelLinear(gate_up)(x)))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("rows, intermediate", [(1, 2048), (64, 2048)])
def test_fused_gelu_tanh_gate_up_equals_torch_at_the_88m_mlp_width(rows, intermediate, dtype):
    gate_up = _linear(2 * intermediate, 64, False, dtype, intermediate)
    x = (torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    got = PanelGatedLinear(gate_up, GatedActivation.GELU_TANH)(x)
    assert torch.equal(got, gelu_tanh_and_mul(PanelLinear(gate_up)(x)))


@needs_kernels
@pytest.mark.parametrize("width", [1000, 1024, 37])
def test_fused_gelu_tanh_equals_torch_on_every_bf16_gate(width):
    """Every finite bf16 value but -0 as a gate: gate weights the identity and up weights zero with bias 1, so
    each row's gate sums are its inputs exactly (a sum from +0 turns -0 into +0) and the output is the rounded
    gelu itself; widths put values both in torch's vector steps and in its scalar tail."""
    codes = torch.arange(-2 ** 15 + 1, 2 ** 15, dtype=torch.int32).to(torch.int16)  # from 0x8001: no -0
    gates = codes.view(torch.bfloat16)[torch.isfinite(codes.view(torch.bfloat16))]
    gates = gates[:gates.numel() // width * width].view(-1, width)
    gate_up = torch.nn.Linear(width, 2 * width).to(torch.bfloat16)
    with torch.no_grad():
        gate_up.weight.copy_(torch.cat((torch.eye(width), torch.zeros(width, width))))
        gate_up.bias.copy_(torch.cat((torch.zeros(width), torch.ones(width))))
    got = PanelGatedLinear(gate_up, GatedActivation.GELU_TANH)(gates)
    expected = gelu_tanh_and_mul(torch.cat((gates, torch.ones_like(gates)), dim=1))
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@needs_kernels
def test_fused_gate_up_interleaves_gate_and_up_panels_and_their_biases():
    gate_up = _linear(2 * 17, 5, True, torch.float32, 7)  # I = 17: two pairs, the second 1 column wide
    layer = PanelGatedLinear(gate_up, GatedActivation.SILU)
    gate, up = pack_panels(gate_up.weight[:17]), pack_panels(gate_up.weight[17:])
    assert layer.panels.shape == (4, 5, PANEL_COLUMNS)
    assert [torch.equal(layer.panels[i], part[i // 2]) for i, part in enumerate((gate, up, gate, up))] == [True] * 4
    bias = layer.bias.view(4, PANEL_COLUMNS)
    assert torch.equal(bias[0], gate_up.bias[:16]) and torch.equal(bias[1], gate_up.bias[17:33])
    assert bias[2, 0] == gate_up.bias[16] and bias[3, 0] == gate_up.bias[33]
    assert torch.equal(bias[2:, 1:], torch.zeros(2, PANEL_COLUMNS - 1))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_fused_gate_up_of_no_rows_is_empty(dtype):
    out = PanelGatedLinear(torch.nn.Linear(96, 2 * 40).to(dtype), GatedActivation.GELU_TANH)(
        torch.empty(0, 96, dtype=dtype))
    assert out.shape == (0, 40) and out.dtype == dtype


@needs_kernels
def test_fused_gate_up_refuses_panels_that_are_not_pairs():
    layer = PanelLinear(torch.nn.Linear(96, 80))  # 5 panels
    with pytest.raises(RuntimeError, match="40 features do not fill 5 panels in pairs"):
        torch.ops.splitserve_cpu.panel_linear_silu_mul(torch.randn(2, 96), layer.panels, None, 40)


def _mlp(dtype: torch.dtype, mlp_class: type = MLP) -> MLP | GeluTanhMLP:
    arch = type("Arch", (), {"hidden_size": 32, "intermediate_size": 24, "mlp_bias": False})()
    mlp = mlp_class(arch, CpuKernelLayerOps())
    with torch.no_grad():
        for parameter in mlp.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(parameter.numel())))
    return mlp.to(dtype)


@needs_onednn
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_linears_fuses_an_mlps_silu_and_mul_where_it_packs_panels(dtype):
    mlp = _mlp(dtype)
    x = torch.randn(5, 32).to(dtype)
    unfused = _mlp(dtype)
    pack_linears(unfused, dtype, None)  # no kernels: oneDNN, the MLP's own SiLU-and-mul
    assert type(unfused.gate_up_proj) is PackedLinear and not unfused.gate_up_applies_activation
    pack_linears(mlp, dtype, AVX2)
    assert type(mlp.gate_up_proj) is PanelGatedLinear and type(mlp.down_proj) is PanelLinear
    assert mlp.gate_up_proj.activation == GatedActivation.SILU
    reference = _mlp(dtype)
    gated = CpuKernelLayerOps().silu_and_mul(PanelLinear(reference.gate_up_proj)(x))
    expected = PanelLinear(reference.down_proj)(gated)
    assert torch.equal(mlp(x), expected)


@needs_onednn
@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_linears_fuses_a_gelu_tanh_mlps_activation_and_mul_where_it_packs_panels(dtype):
    """Gemma's MLP: its gate/up projection runs panel_linear_gelu_tanh_mul, equal to the unfused projection
    then gelu_tanh_and_mul."""
    mlp = _mlp(dtype, GeluTanhMLP)
    x = torch.randn(5, 32).to(dtype)
    pack_linears(mlp, dtype, AVX2)
    assert type(mlp.gate_up_proj) is PanelGatedLinear and type(mlp.down_proj) is PanelLinear
    assert mlp.gate_up_proj.activation == GatedActivation.GELU_TANH and mlp.gate_up_applies_activation
    reference = _mlp(dtype, GeluTanhMLP)
    gated = gelu_tanh_and_mul(PanelLinear(reference.gate_up_proj)(x))
    assert torch.equal(mlp(x), PanelLinear(reference.down_proj)(gated))


@pytest.mark.parametrize("dtype, isa, bf16_gemm, expected", [
    (torch.float32, AVX2, False, True),
    (torch.bfloat16, AVX2, False, True),
    (torch.bfloat16, AVX512, False, True),
    (torch.float32, AVX512, False, False),
    (torch.bfloat16, AVX512_BF16, True, False),
    (torch.float32, AVX512_BF16, True, False),
    (torch.float32, None, False, False),
    (torch.bfloat16, None, False, False),
    (torch.float16, AVX2, False, False),
])
def test_panels_run_where_they_were_measured_faster(dtype, isa, bf16_gemm, expected):
    assert uses_panels(dtype, isa, bf16_gemm) == expected


@needs_onednn
@pytest.mark.parametrize("kernel_isa", [AVX2, None], ids=["avx2-kernels", "no-kernels"])
def test_pack_linears_replaces_every_linear_by_what_uses_panels_says(kernel_isa):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)).to(torch.bfloat16)
    pack_linears(model, torch.bfloat16, kernel_isa)
    panels = uses_panels(torch.bfloat16, kernel_isa, NATIVE_BF16)
    assert [type(m) for m in model] == [PanelLinear if panels else PackedLinear] * 2
