"""The CPU fast path against its references: the C++ paged decode and bf16 prefill attention (and the
split prefill after a prefix) against TorchReferenceAttention, the fused layer ops against
TorchLayerOps, and whole-engine greedy output with and without the kernels.

The kernels build for the CPU's instruction set (engine/cpu_kernels.py): on an AVX2 machine these tests run
the AVX2 build, on an AVX-512 one the AVX-512 build; the other build is compiled here (not run) so that
neither rots. The bf16 products of the prefill kernel run on AVX512-BF16 dot instructions where the CPU
has them and on two float FMAs elsewhere: the same sums but for denormals (vec16.h), within the bounds below.

Tolerances: fp32 results differ from the reference only by summation order (1e-5 absolute on
O(1) values); bf16 attention computes scores in float32 where the reference rounds them to
bf16 first, so it may differ by a few bf16 ulps of the output (2e-2 on O(1) values); the bf16
prefill kernel also rounds the probabilities to bf16 before weighting the values, within the same bound.
With a softcap (Gemma 2) the kernels cap float32 scores where the reference caps bf16 ones; the bounds are
the same (the cap only shrinks scores: tanh's slope is at most 1). The softcap cases use 2.0, far below
Gemma 2's 50, so that the cap bends most scores of these O(1)-scaled random inputs (see
test_every_attention_path_caps_the_scores_as_the_reference).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine import LLM, SamplingParams
from splitserve.engine.attention import CpuPagedAttention, TorchReferenceAttention
from splitserve.engine.attention.base import AttentionMetadata, DecodeBatch, PrefillSpan
from splitserve.engine.cpu_kernels import (AVX2, AVX512, AVX512_BF16, CSRC, SOURCES, compile_flags, cpu_flags,
                                           cpu_kernel_isa, detect_isa, include_flags, load_cpu_kernels)
from splitserve.engine.models.layer_ops import CpuKernelLayerOps, TorchLayerOps

from tests.factories import decode_metadata, needs_kernels, paged_decode_case, paged_prefill_case

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None or shutil.which("objdump") is None,
                                    reason="needs g++ and objdump")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SOFTCAP = 2.0  # small enough to bend O(1) scores (module docstring)


@pytest.mark.parametrize("capability, flags, expected", [
    ("AVX512", {"avx2", "fma", "avx512f", "avx512_bf16"}, AVX512_BF16),
    ("AVX512", {"avx2", "fma", "avx512f"}, AVX512),
    ("AVX2", {"avx2", "fma", "avx512f", "avx512_bf16"}, AVX2),  # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU
    ("AVX2", {"avx2", "fma"}, AVX2),
    ("DEFAULT", {"sse4_2"}, None),
    ("NEON", set(), None),
])
def test_the_kernels_build_for_aten_s_capability_and_the_bf16_flag(capability, flags, expected):
    assert detect_isa(capability, frozenset(flags)) == expected


@needs_compiler
def test_the_kernels_load_wherever_the_cpu_has_avx2_or_avx512():
    """A failing build fails here, where every other kernel test would only skip."""
    expected = detect_isa(torch.backends.cpu.get_cpu_capability(), cpu_flags())
    if expected is None:
        pytest.skip("this CPU has neither AVX2+FMA nor AVX-512")
    assert load_cpu_kernels()
    assert cpu_kernel_isa() == expected


@needs_compiler
@pytest.mark.slow
@pytest.mark.parametrize("isa, march, sources", [
    (AVX512_BF16, "sapphirerapids", SOURCES),
    (AVX512, "skylake-avx512", (CSRC / "prefill_attention.cpp",)),  # the one source that uses AVX512_BF16
], ids=["avx512_bf16", "avx512"])
def test_the_sources_compile_for_avx512(isa, march, sources, tmp_path):
    """Compiled, not run (this machine may lack AVX-512): the sources build for the target, on 512-bit
    registers, and the prefill kernel's bf16 dot instruction appears exactly where the target has it."""
    objects = [tmp_path / f"{source.stem}.o" for source in sources]
    builds = [subprocess.Popen(["g++", *compile_flags(isa, march), *include_flags(), "-O0", "-c", str(source),
                                "-o", str(target)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for source, target in zip(sources, objects)]
    errors = [build.communicate()[1] for build in builds]
    assert [build.returncode for build in builds] == [0] * len(sources), "\n".join(errors)[-3000:]
    listings = {target.stem: subprocess.run(["objdump", "-d", str(target)], capture_output=True, text=True,
                                            check=True).stdout for target in objects}
    assert all("zmm" in listing for listing in listings.values())
    assert ("vdpbf16ps" in listings["prefill_attention"]) == isa.bf16_dot


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (12, 4), (16, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [32, 40, 64, 128])
@pytest.mark.parametrize("sliding_window", [None, 1, 7, 40])
@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["uncapped", "softcap"])
@pytest.mark.parametrize("use_kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "matmul"])
def test_decode_attention_equals_the_reference(dtype, heads, head_dim, sliding_window, softcap, use_kernels):
    generator = torch.Generator().manual_seed(head_dim * 31 + heads[0])
    query, kv_cache, decode = paged_decode_case(generator, dtype, batch=5, num_heads=heads[0], num_kv_heads=heads[1],
                                           head_dim=head_dim)
    expected = TorchReferenceAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode), sliding_window,
                                                 softcap=softcap)
    got = CpuPagedAttention(use_kernels=use_kernels)._decode(query, kv_cache, decode, 0, decode_metadata(decode),
                                                             sliding_window, softcap=softcap)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(3, 3), (6, 3), (9, 3), (8, 2), (10, 2), (14, 2), (16, 2), (12, 1)],
                         ids=lambda h: f"G{h[0] // h[1]}")
@pytest.mark.parametrize("head_dim", [72, 80])
@pytest.mark.parametrize("sliding_window", [None, 23])
@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["uncapped", "softcap"])
def test_decode_kernel_tiles_every_group_size_and_head_dim(dtype, heads, head_dim, sliding_window, softcap):
    """The kernel reads each KV row once for its G query heads, in tiles of G's largest divisor that fits
    the registers (G = 1 MHA, 2, 3, 4, 5, 7 (prime: tiles of 1 head on AVX2), 8, 12 = H MQA), over whole
    and partial 16-float chunks of head_dim (72: a tail of 8; 80: five chunks, an odd one out)."""
    generator = torch.Generator().manual_seed(head_dim + heads[0] * 7 + heads[1])
    query, kv_cache, decode = paged_decode_case(generator, dtype, batch=4, num_heads=heads[0], num_kv_heads=heads[1],
                                           head_dim=head_dim)
    expected = TorchReferenceAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode), sliding_window,
                                                 softcap=softcap)
    got = CpuPagedAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode),
                                      sliding_window, softcap=softcap)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@needs_kernels
@pytest.mark.parametrize("batch", [1, 2, 3, 64])
def test_decode_attention_splits_heads_for_small_batches_without_changing_results(batch):
    """One sequence spreads its KV heads over the threads; 64 give each task all of a sequence's heads."""
    generator = torch.Generator().manual_seed(batch)
    query, kv_cache, decode = paged_decode_case(generator, torch.float32, batch, 8, 4, 64)
    expected = TorchReferenceAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode), None)
    got = CpuPagedAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode), None)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@needs_kernels
def test_decode_attention_reads_only_the_context_positions():
    """Positions past context_len (the rest of the last block) and unlisted blocks may hold anything."""
    generator = torch.Generator().manual_seed(3)
    query, kv_cache, decode = paged_decode_case(generator, torch.float32, 4, 8, 2, 64)
    expected = CpuPagedAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode), None)
    poisoned = torch.full_like(kv_cache, float("nan"))
    block_size = kv_cache.shape[2]
    for row, length in enumerate(decode.context_lens.tolist()):
        for position in range(length):
            block = decode.block_tables[row, position // block_size]
            poisoned[block, :, position % block_size] = kv_cache[block, :, position % block_size]
    got = CpuPagedAttention()._decode(query, poisoned, decode, 0, decode_metadata(decode), None)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (12, 4)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [32, 40, 64])
@pytest.mark.parametrize("start, query_len", [(0, 2), (0, 97), (1, 2), (1, 300), (16, 17), (37, 5), (250, 90),
                                              (700, 2)])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["uncapped", "softcap"])
@pytest.mark.parametrize("use_kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "torch"])
def test_prefill_attention_equals_the_reference(dtype, heads, head_dim, start, query_len, sliding_window, softcap,
                                                use_kernels):
    """The bf16 kernel (head_dim a multiple of 16), and the prefix + causal chunk parts merged by
    log-sum-exp, equal one masked call over the whole context."""
    generator = torch.Generator().manual_seed(start * 7 + query_len + head_dim)
    query, key, value, kv_cache, span, metadata = paged_prefill_case(generator, dtype, heads[0], heads[1],
                                                                     head_dim, start, query_len)
    expected = TorchReferenceAttention()._prefill(query, key, value, kv_cache, span, metadata, sliding_window,
                                                  softcap=softcap)
    got = CpuPagedAttention(use_kernels)._prefill(query, key, value, kv_cache, span, metadata, sliding_window,
                                                  softcap=softcap)
    assert got.dtype == dtype and got.shape == query.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@needs_kernels
@pytest.mark.parametrize("head_dim", [16, 48, 80, 96, 112, 256])
@pytest.mark.parametrize("softcap", [None, SOFTCAP], ids=["uncapped", "softcap"])
def test_prefill_kernel_covers_every_multiple_of_16_head_size(head_dim, softcap):
    generator = torch.Generator().manual_seed(head_dim)
    query, key, value, kv_cache, span, metadata = paged_prefill_case(generator, torch.bfloat16, 6, 2, head_dim,
                                                                     start=70, query_len=45)
    expected = TorchReferenceAttention()._prefill(query, key, value, kv_cache, span, metadata, None, softcap=softcap)
    got = CpuPagedAttention()._prefill(query, key, value, kv_cache, span, metadata, None, softcap=softcap)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[torch.bfloat16], rtol=0)


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_kernel_results_do_not_depend_on_the_thread_count(threads):
    """Tasks are taken from a shared counter in any order; each writes only its own rows."""
    generator = torch.Generator().manual_seed(5)
    query, key, value, kv_cache, span, metadata = paged_prefill_case(generator, torch.bfloat16, 8, 2, 64,
                                                                     start=33, query_len=200)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = CpuPagedAttention()._prefill(query, key, value, kv_cache, span, metadata, None)
        torch.set_num_threads(threads)
        got = CpuPagedAttention()._prefill(query, key, value, kv_cache, span, metadata, None)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got, expected)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_silu_and_mul_and_rotary_are_bitwise_the_reference(dtype):
    generator = torch.Generator().manual_seed(0)
    kernels, reference = CpuKernelLayerOps(), TorchLayerOps()
    gate_up = (torch.randn(37, 2 * 200, generator=generator) * 4).to(dtype)
    assert torch.equal(kernels.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))
    for head_dim in (32, 40, 64, 128):
        # qk as the model passes it: a [T, heads, D] view into a wider projection output
        projection = torch.randn(19, 6 * head_dim + 24, generator=generator).to(dtype)
        qk = projection[:, : 5 * head_dim].view(19, 5, head_dim)
        angles = torch.randn(19, head_dim // 2, generator=generator).repeat(1, 2)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        expected = reference.rotary(qk, cos, sin)
        assert torch.equal(kernels.rotary(qk, cos, sin), expected)
        assert torch.equal(projection[:, : 5 * head_dim].view(19, 5, head_dim), expected)  # rotated in place


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 12), (80, 32), (128, 96), (64, 2)])
def test_a_partial_rotary_rotates_the_leading_dims_bitwise_the_reference(dtype, head_dim, rotary_dim):
    """cos/sin of R < D dims (Phi3's partial_rotary_factor): each head's first R dims rotate as a whole R-dim head
    would, the other D - R stay as they were, in the kernel (in place) and in the reference."""
    generator = torch.Generator().manual_seed(head_dim + rotary_dim)
    kernels, reference = CpuKernelLayerOps(), TorchLayerOps()
    projection = torch.randn(19, 6 * head_dim + 24, generator=generator).to(dtype)
    original = projection.clone()
    qk = projection[:, : 5 * head_dim].view(19, 5, head_dim)
    angles = torch.randn(19, rotary_dim // 2, generator=generator).repeat(1, 2)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = reference.rotary(qk, cos, sin)
    heads = original[:, : 5 * head_dim].view(19, 5, head_dim)
    assert torch.equal(expected[..., :rotary_dim], reference.rotary(heads[..., :rotary_dim].contiguous(), cos, sin))
    assert torch.equal(expected[..., rotary_dim:], heads[..., rotary_dim:])
    assert torch.equal(kernels.rotary(qk, cos, sin), expected)
    assert torch.equal(projection[:, : 5 * head_dim].view(19, 5, head_dim), expected)  # rotated in place
    assert torch.equal(projection[:, 5 * head_dim:], original[:, 5 * head_dim:])  # the rest of the row untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("use_kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "torch"])
def test_every_attention_path_takes_the_model_s_softmax_scale(dtype, sliding_window, use_kernels):
    """Granite's attention_multiplier replaces 1 / sqrt(head_dim) in decode (kernel, grouped matmuls) and in every
    prefill path (kernel, a chunk after a prefix merged by log-sum-exp, SDPA) as in the reference, and changes the
    output (here 0.4 against 1 / sqrt(64))."""
    generator = torch.Generator().manual_seed(17)
    scale = 0.4
    query, kv_cache, decode = paged_decode_case(generator, dtype, batch=5, num_heads=8, num_kv_heads=2, head_dim=64)
    expected = TorchReferenceAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode),
                                                 sliding_window, scale)
    got = CpuPagedAttention(use_kernels)._decode(query, kv_cache, decode, 0, decode_metadata(decode),
                                                 sliding_window, scale)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)
    unscaled = TorchReferenceAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode), sliding_window)
    assert (expected.float() - unscaled.float()).abs().max() > 0.05
    for start, query_len in ((0, 40), (37, 20)):
        query, key, value, kv_cache, span, metadata = paged_prefill_case(generator, dtype, 8, 2, 64, start, query_len)
        expected = TorchReferenceAttention()._prefill(query, key, value, kv_cache, span, metadata, sliding_window,
                                                      scale)
        got = CpuPagedAttention(use_kernels)._prefill(query, key, value, kv_cache, span, metadata, sliding_window,
                                                      scale)
        torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)
        unscaled = TorchReferenceAttention()._prefill(query, key, value, kv_cache, span, metadata, sliding_window)
        assert (expected.float() - unscaled.float()).abs().max() > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("use_kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "torch"])
def test_every_attention_path_caps_the_scores_as_the_reference(dtype, sliding_window, use_kernels):
    """Gemma 2 2B's attention shape (8 query heads / 4 KV heads of 256, scale 256 ** -0.5) with a cap that bends
    these random O(1) scores (its own 50 barely would; scaling the scores up to meet it instead would leave the
    bf16 reference rounding scores of ~50 to 0.25): decode and prefill (from position 0, and a chunk after a
    prefix) equal the reference's eager softcapped attention, and the cap changes the output."""
    generator = torch.Generator().manual_seed(29)
    scale, softcap = 256 ** -0.5, SOFTCAP
    query, kv_cache, decode = paged_decode_case(generator, dtype, batch=5, num_heads=8, num_kv_heads=4, head_dim=256)
    expected = TorchReferenceAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode),
                                                 sliding_window, scale,
                                                 softcap)
    got = CpuPagedAttention(use_kernels)._decode(query, kv_cache, decode, 0, decode_metadata(decode),
                                                 sliding_window, scale,
                                                 softcap)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)
    uncapped = TorchReferenceAttention()._decode(query, kv_cache, decode, 0, decode_metadata(decode),
                                                 sliding_window, scale)
    assert (expected.float() - uncapped.float()).abs().max() > 0.05
    for start, query_len in ((0, 40), (37, 20)):
        query, key, value, kv_cache, span, metadata = paged_prefill_case(generator, dtype, 8, 4, 256, start,
                                                                         query_len)
        expected = TorchReferenceAttention()._prefill(query, key, value, kv_cache, span, metadata, sliding_window,
                                                      scale, softcap)
        got = CpuPagedAttention(use_kernels)._prefill(query, key, value, kv_cache, span, metadata, sliding_window,
                                                      scale, softcap)
        torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)
        uncapped = TorchReferenceAttention()._prefill(query, key, value, kv_cache, span, metadata, sliding_window,
                                                      scale)
        assert (expected.float() - uncapped.float()).abs().max() > 0.05


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norms_equal_the_reference_up_to_summation_order(dtype):
    generator = torch.Generator().manual_seed(1)
    kernels, reference = CpuKernelLayerOps(), TorchLayerOps()
    x = torch.randn(33, 200, generator=generator).to(dtype)
    weight = torch.randn(200, generator=generator).to(dtype)
    tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=2 ** -7)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), **tolerance)
    residual = torch.randn(33, 200, generator=generator).to(dtype)
    kernel_residual, reference_residual = residual.clone(), residual.clone()
    got = kernels.add_rms_norm(kernel_residual, x, weight, 1e-6)
    expected = reference.add_rms_norm(reference_residual, x, weight, 1e-6)
    assert torch.equal(kernel_residual, reference_residual)
    assert torch.equal(kernel_residual, residual + x)
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ops", [CpuKernelLayerOps(), TorchLayerOps()], ids=["kernel-ops", "torch-ops"])
@torch.inference_mode()
def test_gemma_norm_and_gelu_tanh_and_mul_are_bitwise_transformers(dtype, ops):
    """Gemma's two ops (no C++ kernel: both LayerOps run the reference's) against transformers' own modules."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(33, 200, generator=generator) * 3).to(dtype)
    norm = Gemma3RMSNorm(200, eps=1e-6)
    norm.weight.copy_(torch.randn(200, generator=generator))
    norm = norm.to(dtype)
    assert torch.equal(ops.rms_norm_unit_offset(x, norm.weight, 1e-6), norm(x))
    gate_up = (torch.randn(37, 2 * 200, generator=generator) * 4).to(dtype)
    gate, up = gate_up.split(200, dim=-1)
    assert torch.equal(ops.gelu_tanh_and_mul(gate_up), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_engine_greedy_tokens_equal_with_and_without_kernels(arch, tiny_model_dirs):
    """fp32: the kernel path and the pure-torch path produce the same tokens, chunked and prefix-cached."""
    prompts = [[(7 * i + 3 * j) % 500 + 2 for j in range(20 + 37 * i)] for i in range(6)]
    prompts += [prompts[3][:50] + [9, 9, 9]]  # shares three blocks with prompt 3
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = {}
    for cpu_kernels in (True, False):
        llm = LLM(tiny_model_dirs[arch], block_size=16, max_num_batched_tokens=64, cpu_kernels=cpu_kernels)
        outputs[cpu_kernels] = [out.token_ids for out in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]
