"""GPT-OSS (GptOssForCausalLM): greedy parity with transformers on a tiny random checkpoint, attention with sinks
on every CPU attention path against a plain-torch formula, and what the engine refuses.

The checkpoint (fp32) has what sets GPT-OSS apart: attention sinks (logits around 1, so that they take a share of
each softmax the tokens depend on), sliding (window 24, shorter than the long prompt) and full layers alternating,
q/k/v/o biases, q_size 128 != hidden 64, YaRN RoPE, a biased router weighting the top 2 of 4 experts by a softmax
over their logits, experts with biases and a clamped SwiGLU whose limit (1.0) bends many of the tiny model's
gate and up values, and their gate/up columns interleaved as transformers stores them.

Tolerances of the attention tests: the formula runs in float64 on the inputs as stored; fp32 paths differ from it
by float32 rounding (1e-5 absolute on O(1) outputs), bf16 paths by a few bf16 ulps of the output (2e-2), as in
test_cpu_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.factories import (MOE_DEFAULTS, assert_pool_idle, copy_with_config_fields, decode_metadata, hf_greedy,
                             needs_kernels, paged_decode_case, paged_prefill_case, save_random_hf_model,
                             use_flashinfer_on_cpu)
from splitserve.common.config import EngineConfig
from splitserve.common.errors import UnsupportedModelError
from splitserve.deploy.cli import build_parser, serve_config
from splitserve.deploy.preflight import PreflightError, check_serving_sinks
from splitserve.engine import EngineCore
from splitserve.engine.attention import CpuPagedAttention, TorchReferenceAttention
from splitserve.engine.model_loader import check_attention_sinks, fuse_gpt_oss_experts, load_hf_config, parse_arch
from splitserve.engine.models.layer_ops import TorchLayerOps
from splitserve.engine.models.llama import build_feed_forward
from splitserve.testing.workloads import GreedyCase

GPT_OSS_CONFIG = dict(head_dim=32, sliding_window=24, swiglu_limit=1.0, rope_parameters={
    "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 256})

PROMPT_A = [(7 * i + 3) % 381 + 3 for i in range(70)]
"""Longer than the window (24) and than four 16-token prefill chunks."""
CASES = [GreedyCase(PROMPT_A, 8, ignore_eos=True),
         GreedyCase([(5 * i + 11) % 381 + 3 for i in range(9)], 8, ignore_eos=True),
         GreedyCase([(11 * i + 2) % 381 + 3 for i in range(33)], 8, ignore_eos=True)]
CACHED_CASE = GreedyCase(PROMPT_A[:48] + [5, 9, 200, 31, 77], 8, ignore_eos=True)
"""Sent after CASES finished: its first 48 tokens (3 blocks of 16) are PROMPT_A's, a prefix-cache hit."""

ENGINE_PATHS = {
    "cpu-kernels": dict(),
    "cpu-torch-ops": dict(cpu_kernels=False),
}
"""The C++ kernels (attention and layer ops), and the CPU backend's torch ops, whose attention with sinks is the
reference's eager one (TorchReferenceAttention itself: the formula tests below)."""


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    return save_random_hf_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=3, **GPT_OSS_CONFIG)


@pytest.fixture(scope="module")
def expected_tokens(gpt_oss_dir) -> list[list[int]]:
    """transformers' greedy tokens of CASES, then of CACHED_CASE."""
    return [hf_greedy(gpt_oss_dir, case) for case in [*CASES, CACHED_CASE]]


def _engine(model_dir, **config) -> EngineCore:
    """A 16-token step budget (chunked prefill), blocks of 16, a pool of 24 blocks."""
    return EngineCore(model_dir, EngineConfig(block_size=16, max_num_batched_tokens=16, max_model_len=128,
                                              num_kv_blocks=24, **config))


def _generate(engine: EngineCore, cases: list[GreedyCase], first_id: int = 0) -> tuple[list[list[int]], list[int]]:
    """(token ids, cached prompt tokens) of each case, all added at once and stepped until done."""
    ids = [str(first_id + index) for index in range(len(cases))]
    for request_id, case in zip(ids, cases):
        engine.add_request(request_id, list(case.prompt_token_ids), case.params())
    tokens: dict[str, list[int]] = {request_id: [] for request_id in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
            cached[delta.request_id] = delta.num_cached_tokens
    return [tokens[i] for i in ids], [cached[i] for i in ids]


def test_the_config_reads_as_gpt_oss(gpt_oss_dir):
    arch = parse_arch(load_hf_config(gpt_oss_dir))
    assert arch.attention_sinks and arch.float32_norms and (arch.qkv_bias, arch.o_bias) == (True, True)
    assert arch.sliding_windows == (24, None)
    moe = arch.moe
    assert (moe.num_experts, moe.experts_per_token, moe.expert_intermediate_size) == (4, 2, 48)
    assert moe.router_bias and moe.softmax_over_top_k and moe.sparse_layers == frozenset({0, 1})
    assert (moe.clamped_swiglu.alpha, moe.clamped_swiglu.limit) == (1.702, 1.0)


@pytest.mark.parametrize("path", sorted(ENGINE_PATHS))
def test_gpt_oss_matches_transformers_with_chunked_prefill_and_a_prefix_cache_hit(gpt_oss_dir, expected_tokens,
                                                                                   path):
    engine = _engine(gpt_oss_dir, **ENGINE_PATHS[path])
    outputs, _ = _generate(engine, CASES)
    assert outputs == expected_tokens[:len(CASES)]
    [cached_output], [cached_tokens] = _generate(engine, [CACHED_CASE], first_id=len(CASES))
    assert cached_tokens == 48
    assert cached_output == expected_tokens[-1]
    assert_pool_idle(engine.block_manager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_experts_block_loaded_from_transformers_layout_equals_transformers_block(dtype):
    """transformers' GptOssMLP (router, and experts whose gate/up columns interleave) against the engine's block
    with the weights the loader de-interleaves from that module's tensors: the same experts in the same order and
    the same routing weights bit for bit (both routers are one F.linear with bias, a top-k and a softmax), the
    outputs within a rounding of the expert biases (transformers adds them after its grouped matmuls, nn.Linear
    fuses them: 1e-5 in fp32, 2 bf16 ulps of O(1) outputs in bf16)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(**{**dict(vocab_size=384, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=32, initializer_range=0.1, swiglu_limit=1.0),
                             **MOE_DEFAULTS["gpt_oss"], "architectures": ["GptOssForCausalLM"]})
    torch.manual_seed(0)
    hf_block = AutoModelForCausalLM.from_config(config, dtype=dtype).eval().model.layers[0].mlp
    with torch.no_grad():
        for name, param in hf_block.named_parameters():
            if name.endswith("bias"):  # zeros from transformers' init: random ones show they are loaded
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    arch = parse_arch(config)
    checkpoint = {f"layers.0.mlp.{name}": tensor.detach() for name, tensor in hf_block.state_dict().items()}
    state = fuse_gpt_oss_experts(checkpoint, 0, arch)
    block = build_feed_forward(arch, 0, TorchLayerOps()).to(dtype)
    block.load_state_dict({name.removeprefix("layers.0.mlp."): tensor for name, tensor in state.items()}, strict=True)
    assert checkpoint == {}  # every tensor of the module was taken
    x = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        _, hf_weights, hf_experts = hf_block.router(x)
        weights, experts = block.eval().route(x)
        assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights)
        assert weights.dtype == dtype
        assert torch.bincount(experts.flatten(), minlength=4).min() > 0  # every expert ran on some tokens
        expected, got = hf_block(x[None])[0][0], block(x)
    torch.testing.assert_close(got, expected, atol={torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype], rtol=0)
    assert expected.abs().max() > 0.5


# ---- attention with sinks against the formula ----------------------------------------------------------------

def sink_attention(query, keys, values, sinks, visible, scale) -> torch.Tensor:
    """The formula in float64: query [Q, H, D], keys / values [L, Hkv, D], visible [Q, L] bool, sinks [H] ->
    [Q, H, D] with out[i, h] = sum over visible j of p_j * v_j, p = softmax over (scale * q_ih . k_j for visible j,
    sinks[h]); query head h reads KV head h // (H / Hkv)."""
    group = query.shape[1] // keys.shape[1]
    keys, values = (rows.double().repeat_interleave(group, dim=1) for rows in (keys, values))  # [L, H, D]
    logits = torch.einsum("qhd,lhd->qhl", query.double(), keys) * scale
    logits = logits.masked_fill(~visible.unsqueeze(1), float("-inf"))
    sink_column = sinks.double().view(1, -1, 1).expand(*logits.shape[:2], 1)
    probs = torch.softmax(torch.cat((logits, sink_column), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("qhl,lhd->qhd", probs, values)


def _pool_rows(kv_cache, table, length):
    """Keys and values of positions 0..length-1 of a sequence's blocks: [length, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    positions = torch.arange(length)
    rows = kv_cache[table[positions // block_size], :, positions % block_size]  # [length, 2, Hkv, D]
    return rows[:, 0], rows[:, 1]


def _visible(positions: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[Q, length] True where the query at positions[i] attends key position j (causal, inside the window)."""
    queries, keys = positions.unsqueeze(1), torch.arange(length).unsqueeze(0)
    visible = keys <= queries
    if window is not None:
        visible &= queries - keys < window
    return visible


BACKENDS = {"kernels": CpuPagedAttention, "reference": TorchReferenceAttention,
            "cpu-torch-ops": lambda: CpuPagedAttention(use_kernels=False)}
"""The CPU paths a sink model's attention takes: the C++ kernels, the reference (eager), and the CPU backend's
torch ops (which route sinks to the reference's eager path, past their matmul decode and split prefill)."""
FP32, BF16 = torch.float32, torch.bfloat16
TOLERANCE = {FP32: 1e-5, BF16: 2e-2}
SINKS = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0, 1.5, -0.5, 4.0])
"""One per query head of 8 (2 KV heads): large enough to take most of a short context's weight, or little."""


def _cases(*cases):
    """pytest params of (backend, dtype, window, ...), the kernel ones skipped where the kernels cannot build."""
    return [pytest.param(*case, marks=[needs_kernels] if case[0] == "kernels" else [],
                         id="-".join(str(part).removeprefix("torch.") for part in case)) for case in cases]


@pytest.mark.parametrize("backend, dtype, window", _cases(
    ("kernels", FP32, None), ("kernels", FP32, 7), ("kernels", BF16, None), ("kernels", BF16, 7),
    ("reference", FP32, 7), ("reference", BF16, None), ("cpu-torch-ops", FP32, None)))
def test_decode_with_sinks_equals_the_formula(backend, dtype, window):
    """Five sequences of ragged lengths (up to 96) over scattered blocks; GQA 8 query heads / 2 KV heads of 64."""
    generator = torch.Generator().manual_seed(7)
    query, kv_cache, decode = paged_decode_case(generator, dtype, batch=5, num_heads=8, num_kv_heads=2, head_dim=64)
    sinks = SINKS.to(dtype)
    attention = BACKENDS[backend]()
    got = attention._decode(query, kv_cache, decode, 0, decode_metadata(decode), window, sinks=sinks)
    for b, length in enumerate(decode.context_lens.tolist()):
        keys, values = _pool_rows(kv_cache, decode.block_tables[b], length)
        expected = sink_attention(query[b:b + 1], keys, values, sinks, _visible(torch.tensor([length - 1]), length,
                                                                                 window), 64 ** -0.5)
        torch.testing.assert_close(got[b:b + 1].double(), expected, atol=TOLERANCE[dtype], rtol=0)
    without_sinks = attention._decode(query, kv_cache, decode, 0, decode_metadata(decode), window)
    assert (got.float() - without_sinks.float()).abs().max() > 0.1  # the sinks change the outputs


@pytest.mark.parametrize("backend, dtype, window, start, query_len", _cases(
    ("kernels", FP32, None, 0, 70), ("kernels", FP32, 7, 37, 40), ("kernels", BF16, None, 37, 40),
    ("kernels", BF16, 7, 0, 70), ("reference", FP32, 7, 37, 40), ("reference", BF16, None, 0, 70),
    ("cpu-torch-ops", FP32, None, 37, 40), ("cpu-torch-ops", FP32, None, 0, 70)))
def test_prefill_with_sinks_equals_the_formula(backend, dtype, window, start, query_len):
    """A whole 70-token prompt, and a 40-token chunk after 37 cached positions (a prefix-cache hit or an earlier
    chunk of the prompt); GQA 8 query heads / 2 KV heads of 64."""
    generator = torch.Generator().manual_seed(start + query_len)
    query, key, value, kv_cache, span, metadata = paged_prefill_case(generator, dtype, 8, 2, 64, start, query_len)
    sinks = SINKS.to(dtype)
    got = BACKENDS[backend]()._prefill(query, key, value, kv_cache, span, metadata, window, sinks=sinks)
    assert got.dtype == dtype
    keys, values = _pool_rows(kv_cache, span.block_table, span.context_len)
    visible = _visible(torch.arange(start, span.context_len), span.context_len, window)
    expected = sink_attention(query, keys, values, sinks, visible, 64 ** -0.5)
    torch.testing.assert_close(got.double(), expected, atol=TOLERANCE[dtype], rtol=0)


# ---- refusals -------------------------------------------------------------------------------------------------

def test_an_mxfp4_checkpoint_is_refused_naming_the_format(gpt_oss_dir, tmp_path):
    model_dir = copy_with_config_fields(gpt_oss_dir, tmp_path / "mxfp4", quantization_config={
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens"]})
    with pytest.raises(UnsupportedModelError, match=r"^checkpoint quantization 'mxfp4' \(GPT-OSS's released MXFP4 "
                                                    r"expert weights\) is not supported: serve a bfloat16"):
        _engine(model_dir)


def test_sinks_are_refused_off_the_cpu_and_on_flashinfer(gpt_oss_dir, monkeypatch):
    arch = parse_arch(load_hf_config(gpt_oss_dir))
    with pytest.raises(UnsupportedModelError, match=r"^GptOssForCausalLM \(attention sinks\) runs on device cpu "
                                                    r"only: .* got device 'cuda'$"):
        check_attention_sinks(arch, torch.device("cuda"), TorchReferenceAttention())
    use_flashinfer_on_cpu(monkeypatch)
    with pytest.raises(UnsupportedModelError, match=r"^GptOssForCausalLM has attention sinks, which attention "
                                                    r"backend FlashInferAttention does not attend with"):
        _engine(gpt_oss_dir)


@pytest.mark.parametrize("flags, got", [(["--device", "cuda", "--set", "prefill.resources.num_gpus=1", "--set",
                                          "decode.resources.num_gpus=1"], "device 'cuda', attention_backend 'auto'"),
                                        (["--set", "decode.engine.attention_backend=flashinfer"],
                                         "device 'auto', attention_backend 'flashinfer'")])
def test_serve_refuses_sinks_off_the_cpu_before_ray_starts(gpt_oss_dir, flags, got):
    config = serve_config(build_parser().parse_args(["serve", str(gpt_oss_dir), *flags]))
    with pytest.raises(PreflightError) as error:
        check_serving_sinks(config)
    role = "prefill" if flags[0] == "--device" else "decode"
    assert str(error.value) == (f"{role}.engine: GptOssForCausalLM has attention sinks, which run on device cpu only "
                                "(the CUDA attention path, FlashInfer, has not been verified with them: docs/gpu.md); "
                                f"got {got}")
    check_serving_sinks(serve_config(build_parser().parse_args(["serve", str(gpt_oss_dir), "--device", "cpu"])))
