"""oneDNN-packed linear layers against F.linear, in fp32 and bf16, with bf16 computed natively where
the CPU has bf16 GEMMs and widened to fp32 where it has not (both paths run on every CPU: the widened
one is chosen explicitly here)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.cpu_gemm import cpu_gemm_dtype, has_bf16_gemm
from splitserve.engine.models.packed_linear import PackedLinear, can_pack, pack_linears

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
    pack_linears(model, torch.bfloat16)
    assert [type(m).__name__ for m in model] == ["PackedLinear", "SiLU", "PackedLinear"]
    assert {m.compute_dtype for m in model if isinstance(m, PackedLinear)} == {cpu_gemm_dtype(torch.bfloat16)}
    torch.testing.assert_close(model(x), expected, rtol=2**-7, atol=0)  # at most one bf16 ulp apart
