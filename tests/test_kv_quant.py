"""Quantized KV cache (kv_cache_dtype int8 / fp8_e4m3): the row format's formulas, exact; every attention
path on a quantized pool against the torch reference run on the dequantized pool; the pool's capacity;
and whole engines.

Tolerances: the torch reference on a quantized pool is bitwise the reference on the dequantized pool (it
dequantizes exactly that). The C++ kernels widen codes in registers and apply a row's scale to its score
and weight (float32) where the reference multiplies first and, in bf16, rounds the product to bf16: fp32
results differ by summation order only (1e-5 absolute on O(1) values), bf16 ones by a few bf16 ulps
(2e-2), the bounds of tests/test_cpu_kernels.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import torch

from splitserve.common.config import EngineConfig
from splitserve.common.model_dir import DEFAULT_MODEL_NAME
from splitserve.common.kv_transfer_types import (KV_SCALES_NONE, KV_SCALES_PER_TOKEN_HEAD, KVLayout,
                                                 KVLayoutMismatchError, TransferParams)
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.attention import CpuPagedAttention, TorchReferenceAttention
from splitserve.engine.attention.base import AttentionMetadata, PrefillSpan
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.kv_cache import KVCacheSpec, num_blocks_for
from splitserve.engine.kv_quant import KV_QUANTIZATIONS, kv_quantization, pool_quantization
from splitserve.engine.tiny_model import resolve_model_path
from splitserve.eval import EngineVariant, evaluate, heldout_windows
from splitserve.kv_transfer import InProcessBackend
from splitserve.testing.in_process_cluster import (InProcessCluster, make_decode_worker, make_prefill_worker,
                                                   worker_engine_config)
from splitserve.testing.workloads import mixed_workload

from tests.factories import (decode_metadata, engine_token_ids, needs_kernels, paged_decode_case, paged_prefill_case,
                             requires_nixl)


INT8, FP8 = KV_QUANTIZATIONS["int8"], KV_QUANTIZATIONS["fp8_e4m3"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
QUANTIZATIONS = pytest.mark.parametrize("quantization", [INT8, FP8], ids=["int8", "fp8"])


def _bytes(rows: torch.Tensor) -> list[int]:
    return rows.view(torch.uint8).flatten().tolist()


# ---- the row format ----------------------------------------------------------------------------------
def test_int8_rows_are_rounded_codes_then_the_bf16_scale():
    x = torch.tensor([[127.0, -63.5, 0.4, 2.5],  # max 127: scale 1; -63.5 rounds half to even
                      [254.0, 3.0, -5.0, 1.0],  # max 254: scale 2 -> 127, 1.5, -2.5, 0.5
                      [0.0, 0.0, 0.0, 0.0]])  # all zero: scale 1, codes 0
    rows = INT8.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 6)
    assert rows[:, :4].tolist() == [[127, -64, 0, 2], [127, 2, -2, 0], [0, 0, 0, 0]]
    # bf16 1.0 = 0x3f80, 2.0 = 0x4000, little-endian after the codes
    assert [row[4:] for row in rows.view(torch.uint8).tolist()] == [
        [0x80, 0x3f], [0x00, 0x40], [0x80, 0x3f]]
    assert INT8.dequantize(rows, torch.float32).tolist() == [[127, -64, 0, 2], [254, 4, -4, 0], [0, 0, 0, 0]]


def test_fp8_rows_are_e4m3_codes_rounded_to_nearest_even_then_the_bf16_scale():
    x = torch.tensor([[448.0, 17.0, -0.3, 0.001]])  # max 448: scale 1
    rows = FP8.quantize(x)
    assert rows.dtype == torch.float8_e4m3fn and rows.shape == (1, 6)
    # 448 = 1.75 * 2^8: 0x7e; 17 ties to 16 (even mantissa): 0x58; -0.3 -> -0.3125 = -1.25 * 2^-2: 0xaa;
    # 0.001 -> the subnormal 1 * 2^-9: 0x01
    assert _bytes(rows) == [0x7e, 0x58, 0xaa, 0x01, 0x80, 0x3f]
    assert FP8.dequantize(rows, torch.float32).tolist() == [[448.0, 16.0, -0.3125, 2.0 ** -9]]


def test_a_row_scale_is_its_max_over_the_largest_code_rounded_to_bf16():
    x = torch.tensor([[1.0, -3.0, 0.5, 2.0]])
    for quantization, max_code in ((INT8, 127.0), (FP8, 448.0)):
        rows = quantization.quantize(x)
        scale = rows.view(torch.uint8)[:, 4:].view(torch.bfloat16)
        assert scale.item() == torch.tensor(3.0 / max_code).to(torch.bfloat16).item()
        codes = rows.view(torch.uint8)[:, :4].view(quantization.code_dtype).float()
        assert torch.equal(quantization.dequantize(rows, torch.float32), codes * scale.float())
        assert codes.abs().max().item() == max_code  # the row's max maps to the largest code


@QUANTIZATIONS
def test_round_trip_error_is_bounded_by_half_a_code_step(quantization):
    x = torch.randn(64, 4, 64, generator=torch.Generator().manual_seed(0)) * 3
    restored = quantization.dequantize(quantization.quantize(x), torch.float32)
    scale = x.abs().amax(-1, keepdim=True) / quantization.max_code
    if quantization is INT8:  # uniform steps of one scale (the bf16 rounding of the scale moves them by < 2^-8)
        bound = scale * 0.5 * (1 + 2 ** -7)
    else:  # 3 mantissa bits: half an ulp is 2^-4 of the value (subnormals: half of 2^-9 scales)
        bound = torch.maximum(x.abs() * 2 ** -4, scale * 2 ** -10) * (1 + 2 ** -7)
    assert ((restored - x).abs() <= bound).all()


def test_kv_cache_dtype_names_its_format():
    assert kv_quantization("auto") is None
    assert kv_quantization("int8") is INT8 and kv_quantization("fp8_e4m3") is FP8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")
    assert pool_quantization(torch.zeros(1, dtype=torch.float8_e4m3fn)) is FP8
    assert pool_quantization(torch.zeros(1, dtype=torch.bfloat16)) is None


@needs_kernels
def test_the_kernels_fp8_conversion_is_torchs_bit_for_bit():
    """Every code, through the vector path (16 at a time) and the scalar tail (the last 7)."""
    codes = torch.cat([torch.arange(256), torch.tensor([0x7f, 0xff, 0x80, 0x01, 0x87, 0x7e, 0xfe])]).to(torch.uint8)
    got = torch.empty(codes.shape, dtype=torch.float32)
    torch.ops.splitserve_cpu.fp8_e4m3_to_float(codes, got)
    expected = codes.view(torch.float8_e4m3fn).float()
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan) and nan.sum().item() == 4
    assert torch.equal(got[~nan].view(torch.int32), expected[~nan].view(torch.int32))  # -0.0 included


# ---- capacity ----------------------------------------------------------------------------------------
def test_the_same_memory_holds_1_94x_the_blocks_of_bf16_and_3_88x_of_fp32():
    """88M Llama shape (12 layers, 4 KV heads of 64): a token's row is 64 codes + a 2-byte scale."""
    config = EngineConfig(kv_cache_memory_bytes=1 << 30)
    specs = {name: KVCacheSpec(12, 16, 4, 64, dtype, kv_quantization(kv))
             for name, dtype, kv in (("fp32", torch.float32, "auto"), ("bf16", torch.bfloat16, "auto"),
                                     ("int8", torch.bfloat16, "int8"), ("fp8", torch.bfloat16, "fp8_e4m3"))}
    assert {name: spec.bytes_per_token for name, spec in specs.items()} == {
        "fp32": 12 * 2 * 4 * 64 * 4, "bf16": 12 * 2 * 4 * 64 * 2, "int8": 12 * 2 * 4 * 66, "fp8": 12 * 2 * 4 * 66}
    blocks = {name: num_blocks_for(config, spec, torch.device("cpu")) for name, spec in specs.items()}
    assert blocks == {"fp32": 2730, "bf16": 5461, "int8": 10591, "fp8": 10591}  # 1.94x bf16, 3.88x fp32
    assert specs["int8"].block_shape == (2, 16, 4, 66) and specs["int8"].storage_dtype == torch.int8
    assert specs["fp8"].storage_dtype == torch.float8_e4m3fn


def test_a_quantized_pool_needs_an_even_head_dim():
    with pytest.raises(ValueError, match="even head_dim"):
        KVCacheSpec(2, 16, 2, 33, torch.float32, INT8)


# ---- attention -----------------------------------------------------------------------------------------
@QUANTIZATIONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (12, 4)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [32, 40, 64, 128])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("use_kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "matmul"])
def test_decode_on_a_quantized_pool_equals_the_reference_on_its_dequantization(quantization, dtype, heads, head_dim,
                                                                                sliding_window, use_kernels):
    generator = torch.Generator().manual_seed(head_dim * 31 + heads[0])
    query, quantized, decode = paged_decode_case(generator, dtype, 5, *heads, head_dim, quantization=quantization)
    plain, metadata = quantization.dequantize(quantized, dtype), decode_metadata(decode)
    expected = TorchReferenceAttention()._decode(query, plain, decode, 0, metadata, sliding_window)
    reference = TorchReferenceAttention()._decode(query, quantized, decode, 0, metadata, sliding_window)
    assert torch.equal(reference, expected)
    got = CpuPagedAttention(use_kernels)._decode(query, quantized, decode, 0, metadata, sliding_window)
    assert got.dtype == dtype and got.shape == query.shape
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@QUANTIZATIONS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("head_dim", [32, 64])
@pytest.mark.parametrize("start, query_len", [(0, 97), (1, 2), (37, 5), (250, 90)])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("use_kernels", [pytest.param(True, marks=needs_kernels), False], ids=["kernel", "torch"])
def test_prefill_on_a_quantized_pool_equals_the_reference_on_its_dequantization(quantization, dtype, heads, head_dim,
                                                                                 start, query_len, sliding_window,
                                                                                 use_kernels):
    generator = torch.Generator().manual_seed(start * 7 + query_len + head_dim)
    query, key, value, quantized, span, metadata = paged_prefill_case(generator, dtype, *heads, head_dim, start,
                                                                      query_len, quantization=quantization)
    plain = quantization.dequantize(quantized, dtype)  # NaN past the context, as the quantized pool's scales
    expected = TorchReferenceAttention()._prefill(query, key, value, plain, span, metadata, sliding_window)
    got = CpuPagedAttention(use_kernels)._prefill(query, key, value, quantized, span, metadata, sliding_window)
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), expected.float(), atol=TOLERANCE[dtype], rtol=0)


@QUANTIZATIONS
@pytest.mark.parametrize("backend", [TorchReferenceAttention, CpuPagedAttention], ids=["torch", "cpu"])
def test_forward_writes_codes_and_scales_and_attends_what_it_wrote(quantization, backend):
    """A step writes quantize(key) / quantize(value) at the slots; its output is the plain pool's when the
    plain step is given the round-tripped keys and values."""
    generator = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, head_dim, tokens = 4, 2, 32, 6
    key, value = torch.randn(2, tokens, num_kv_heads, head_dim, generator=generator)
    query = torch.randn(tokens, 4, head_dim, generator=generator)
    table = torch.tensor([5, 2])
    key_slots = table[torch.arange(tokens) // block_size] * 2 * block_size + torch.arange(tokens) % block_size
    span = PrefillSpan(query_start=0, query_len=tokens, context_len=tokens, block_table=table)
    metadata = AttentionMetadata(positions=torch.arange(tokens), key_slots=key_slots,
                                 value_slots=key_slots + block_size, prefills=(span,), decodes=(), block_size=block_size)
    pool = torch.zeros(8, 2, block_size, num_kv_heads, head_dim + 2, dtype=quantization.code_dtype)
    out = backend().forward(query, key, value, pool, metadata, None)
    flat = pool.view(torch.uint8).view(-1, num_kv_heads, head_dim + 2)
    assert torch.equal(flat[key_slots], quantization.quantize(key).view(torch.uint8))
    assert torch.equal(flat[key_slots + block_size], quantization.quantize(value).view(torch.uint8))
    written = torch.zeros(8 * 2 * block_size, dtype=torch.bool)
    written[torch.cat([key_slots, key_slots + block_size])] = True
    assert not flat[~written].any()  # nothing else was touched
    round_trip = [quantization.dequantize(quantization.quantize(x), torch.float32) for x in (key, value)]
    plain = torch.zeros(8, 2, block_size, num_kv_heads, head_dim)
    expected = TorchReferenceAttention().forward(query, *round_trip, plain, metadata, None)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


# ---- engines -----------------------------------------------------------------------------------------
ENGINE = dict(block_size=8, num_kv_blocks=256, max_num_batched_tokens=128, dtype="float32", device="cpu")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _generate(engine: EngineCore, prompts) -> dict[str, list[int]]:
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, GREEDY)
    return engine_token_ids(engine)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_engine_layout_and_stats_name_the_kv_dtype(tiny_llama_dir, kv_cache_dtype):
    engine = EngineCore(tiny_llama_dir, EngineConfig(**ENGINE, kv_cache_dtype=kv_cache_dtype))
    code_dtype = KV_QUANTIZATIONS[kv_cache_dtype].code_dtype
    assert [tuple(layer.shape) for layer in engine.kv_cache.layers] == [(256, 2, 8, 2, 18)] * 2
    assert {layer.dtype for layer in engine.kv_cache.layers} == {code_dtype}
    layout = engine.kv_layout("m")
    assert (layout.dtype, layout.row_width, layout.bytes_per_token) == (str(code_dtype)[6:], 18, 2 * 2 * 2 * 18)
    stats = engine.stats()
    assert (stats.kv_cache_dtype, stats.kv_bytes_per_token) == (kv_cache_dtype, 144)
    plain = EngineCore(tiny_llama_dir, EngineConfig(**ENGINE)).stats()
    assert (plain.kv_cache_dtype, plain.kv_bytes_per_token) == ("float32", 2 * 2 * 2 * 16 * 4)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_greedy_tokens_are_the_same_on_the_torch_and_cpu_backends(tiny_llama_dir, kv_cache_dtype):
    """Both backends attend the same dequantized KV (up to summation order); the tokens agree."""
    prompts = [list(case.prompt_token_ids) for case in mixed_workload(512, num_requests=6, max_prompt=60)]
    outputs = [_generate(EngineCore(tiny_llama_dir, EngineConfig(**ENGINE, kv_cache_dtype=kv_cache_dtype,
                                                                 attention_backend=backend)), prompts)
               for backend in ("torch", "cpu")]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


async def _cluster_tokens(model_dir, mode: str, kv_cache_dtype: str, prompts) -> list[list[int]]:
    async with InProcessCluster(model_dir, mode=mode, kv_cache_dtype=kv_cache_dtype) as cluster:
        runs = [cluster.generate(f"r{index}", prompt, GREEDY) for index, prompt in enumerate(prompts)]
        chunks = await asyncio.gather(*runs)
        layouts = {worker.engine.kv_layout("m").dtype for worker in [*cluster.prefill_workers, *cluster.decode_workers]}
        await cluster.wait_idle()
    assert layouts == {str(KV_QUANTIZATIONS[kv_cache_dtype].code_dtype)[6:]}
    return [[token for chunk in request for token in chunk.token_ids] for request in chunks]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_disaggregated_with_a_quantized_kv_cache_equals_colocated(tiny_llama_dir, kv_cache_dtype):
    """1P+1D (every prompt prefilled remotely, its quantized blocks pulled in-process) against one decode
    worker doing everything, both with the same kv_cache_dtype: the same greedy tokens."""
    prompts = [list(case.prompt_token_ids) for case in mixed_workload(512, num_requests=6, max_prompt=60)]
    disaggregated = asyncio.run(_cluster_tokens(tiny_llama_dir, "disaggregated", kv_cache_dtype, prompts))
    colocated = asyncio.run(_cluster_tokens(tiny_llama_dir, "colocated", kv_cache_dtype, prompts))
    assert disaggregated == colocated
    assert all(len(tokens) == GREEDY.max_tokens for tokens in colocated)


# ---- the transfer handshake --------------------------------------------------------------------------
SCALES = "'bfloat16 per token per kv head, after its head_dim codes'"


def _layout(dtype: str, scales: str = KV_SCALES_NONE) -> KVLayout:
    return KVLayout(model_id="m", dtype=dtype, block_size=16, num_layers=12, num_kv_heads=4, head_dim=64,
                    hash_seed=0, scales=scales)


def test_a_quantized_layout_moves_half_the_bytes_of_bf16_and_a_quarter_of_fp32_plus_its_scales():
    int8, fp8 = _layout("int8", KV_SCALES_PER_TOKEN_HEAD), _layout("float8_e4m3fn", KV_SCALES_PER_TOKEN_HEAD)
    bf16, fp32 = _layout("bfloat16"), _layout("float32")
    assert (int8.row_width, bf16.row_width) == (66, 64)
    assert [layout.bytes_per_token for layout in (fp32, bf16, int8, fp8)] == [24576, 12288, 6336, 6336]
    params = TransferParams("r", "p", (3, 1, 4), 40, int8, 30.0, (0, 0, 0))
    assert params.num_bytes == 3 * 16 * 6336  # 0.516x of bf16's 3 * 16 * 12288
    with pytest.raises(ValueError, match="KV layout dtype must be one of"):
        _layout("fp8_e4m3")


def test_the_handshake_refuses_pools_that_disagree_on_the_kv_dtype():
    backends = []
    try:
        for name, layout in (("int8", _layout("int8", KV_SCALES_PER_TOKEN_HEAD)), ("bf16", _layout("bfloat16")),
                             ("fp8", _layout("float8_e4m3fn", KV_SCALES_PER_TOKEN_HEAD))):
            backend = InProcessBackend(f"{name}-{uuid.uuid4().hex[:8]}")
            backends.append(backend)
            dtype = {"int8": torch.int8, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[name]
            backend.register_kv_pool([torch.zeros(2, 2, 16, 4, layout.row_width, dtype=dtype)] * 12, layout)
        int8, bf16, fp8 = backends
        with pytest.raises(KVLayoutMismatchError) as refused:
            bf16.add_peer(int8.metadata())
        assert str(refused.value) == (f"refusing to pull from {int8.agent_name!r}: KV layouts differ (ours != theirs): "
                                      f"dtype: 'bfloat16' != 'int8'; scales: 'none' != {SCALES}")
        with pytest.raises(KVLayoutMismatchError, match="dtype: 'float8_e4m3fn' != 'int8'$"):
            fp8.add_peer(int8.metadata())
        assert not bf16.has_peer(int8.agent_name) and not fp8.has_peer(int8.agent_name)
    finally:
        for backend in backends:
            backend.close()


def test_a_decode_worker_refuses_a_prefill_worker_with_another_kv_dtype(tiny_llama_dir):
    prefill = make_prefill_worker(tiny_llama_dir, worker_engine_config(kv_cache_dtype="int8"))
    decode = make_decode_worker(tiny_llama_dir, worker_engine_config(kv_cache_dtype="fp8_e4m3"))
    try:
        with pytest.raises(KVLayoutMismatchError, match="dtype: 'float8_e4m3fn' != 'int8'$"):
            asyncio.run(decode.add_peer(asyncio.run(prefill.info()).agent))
    finally:
        prefill.shutdown()
        decode.shutdown()


@requires_nixl
@QUANTIZATIONS
def test_a_nixl_pull_moves_codes_and_scales_byte_for_byte(quantization):
    """Two NIXL (UCX) agents in this process: a pull of scattered blocks of a quantized pool copies them
    exactly (codes and scales) and moves (head_dim + 2) bytes per row, against 2 * head_dim for bf16."""
    from splitserve.kv_transfer import ConsumerConnector, LeaseState, ProducerConnector, ReleasedLease, make_backend

    layout = KVLayout(model_id="m", dtype=str(quantization.code_dtype)[6:], block_size=16, num_layers=3,
                      num_kv_heads=2, head_dim=32, hash_seed=0, scales=KV_SCALES_PER_TOKEN_HEAD)
    generator = torch.Generator().manual_seed(11)
    remote = [quantization.quantize(torch.randn(12, 2, 16, 2, 32, generator=generator)) for _ in range(3)]
    local = [torch.zeros(8, 2, 16, 2, 34, dtype=quantization.code_dtype) for _ in range(3)]
    producer, consumer = make_backend("nixl", f"prefill-{uuid.uuid4().hex[:8]}"), \
        make_backend("nixl", f"decode-{uuid.uuid4().hex[:8]}")
    try:
        producer.register_kv_pool(remote, layout)
        consumer.register_kv_pool(local, layout)
        consumer.add_peer(producer.metadata())
        leases, pulls = ProducerConnector(producer, layout, lease_ttl_s=30.0), ConsumerConnector(consumer)
        pulls.start(leases.hold("r", (9, 2, 5), num_tokens=40), (1, 7, 0))
        [outcome] = _wait_for(pulls.poll)
        assert (outcome.error, outcome.num_bytes) == (None, 3 * 3 * 2 * 16 * 2 * 34)  # bf16: 3*3*2*16*2*64
        for dst, src in zip(local, remote):
            assert torch.equal(dst.view(torch.uint8)[[1, 7, 0]], src.view(torch.uint8)[[9, 2, 5]])
            assert not dst.view(torch.uint8)[[2, 3, 4, 5, 6]].any()
        assert _wait_for(leases.poll) == [ReleasedLease("r", (9, 2, 5), LeaseState.PULLED)]
    finally:
        consumer.close()
        producer.close()


def _wait_for(condition, timeout_s: float = 5.0):
    """Poll `condition()` until it returns something truthy (NIXL progresses inside our calls)."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
    return result


def test_the_trained_model_keeps_its_perplexity_within_one_percent():
    """Issue 17's quality target on the embedded trained model (4 held-out windows, float32 compute): a
    quantized KV cache changes the held-out perplexity by less than 1% and keeps top-1 agreement with the
    float32 reference above 0.97 (measured: int8 +0.01% / 0.996, fp8 +0.09% / 0.986 on one window)."""
    model_dir = resolve_model_path(DEFAULT_MODEL_NAME)
    variants = [EngineVariant(f"kv-{kv}", dtype="float32", kv_cache_dtype=kv) for kv in ("auto", "int8", "fp8_e4m3")]
    _, plain, int8, fp8 = evaluate(model_dir, variants, heldout_windows(model_dir, 4))
    assert plain.top1_agreement == 1.0
    for row in (int8, fp8):
        assert abs(row.perplexity / plain.perplexity - 1) < 0.01, row
        assert row.top1_agreement > 0.97 and row.kl_divergence > 0, row  # quantized: close, not identical
