"""The calls FlashInferKernels makes into flashinfer (the CUDA-only seam), checked on CPU against a stand-in
module that records them: constructor arguments, plan()'s host/device arrays and keywords, run()'s tensors."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from splitserve.engine.attention.flashinfer import (WORKSPACE_BYTES, AttentionShape, FlashInferAttention,
                                                    FlashInferGraphKernels, FlashInferKernels)
from splitserve.engine.model_runner import InputBuilder
from tests.factories import random_paged_step

CPU = torch.device("cpu")


class _Wrapper:
    """Records what a flashinfer wrapper is given; run() returns zeros of the query's shape."""

    def __init__(self, workspace, kv_layout, **kwargs) -> None:
        self.workspace, self.kv_layout, self.kwargs = workspace, kv_layout, kwargs
        self.plans: list[tuple[tuple, dict]] = []
        self.runs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def plan(self, *args, **kwargs) -> None:
        self.plans.append((args, kwargs))

    def run(self, query, kv_cache):
        self.runs.append((query, kv_cache))
        return torch.zeros_like(query)


def _fake_flashinfer() -> SimpleNamespace:
    made: list[_Wrapper] = []

    def factory(kind):
        def make(*args, **kwargs):
            wrapper = _Wrapper(*args, **kwargs)
            wrapper.kind = kind
            made.append(wrapper)
            return wrapper
        return make

    return SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=factory("prefill"),
                           BatchDecodeWithPagedKVCacheWrapper=factory("decode"), made=made)


def _step(num_heads: int, seed: int = 3):
    """A ragged step with prefills and decodes (seed 3 has both), its metadata and tensors: block size 4, 2 KV heads."""
    rng = random.Random(seed)
    output = random_paged_step(rng, 4, 64)
    num_tokens = sum(chunk.num_tokens for chunk in output.chunks)
    metadata = InputBuilder(4, CPU, bucket_decodes=False, paged_metadata=True).build(output).metadata
    assert metadata.paged.prefill is not None and metadata.paged.decode is not None
    query = torch.randn(num_tokens, num_heads, 8, dtype=torch.bfloat16)
    key, value = (torch.randn(num_tokens, 2, 8, dtype=torch.bfloat16) for _ in range(2))
    pool = torch.zeros(64, 2, 4, 2, 8, dtype=torch.bfloat16)
    return metadata, query, key, value, pool


def test_the_wrappers_get_fa2_nhd_one_zeroed_workspace_and_host_indptr_arrays():
    module = _fake_flashinfer()
    metadata, query, key, value, pool = _step(num_heads=4)
    FlashInferAttention(FlashInferKernels(module, CPU)).forward(query, key, value, pool, metadata, sliding_window=5)
    prefill, decode = sorted(module.made, key=lambda wrapper: wrapper.kind == "decode")
    assert (prefill.kind, decode.kind) == ("prefill", "decode")
    assert prefill.workspace is decode.workspace
    assert prefill.workspace.dtype == torch.uint8 and prefill.workspace.numel() == WORKSPACE_BYTES
    assert not prefill.workspace.any()
    assert (prefill.kv_layout, prefill.kwargs) == ("NHD", {"backend": "fa2"})
    assert (decode.kv_layout, decode.kwargs) == ("NHD", {"backend": "fa2", "use_tensor_cores": False})

    [(args, kwargs)] = prefill.plans
    batch = metadata.paged.prefill
    assert [a is b for a, b in zip(args[:4], (batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
                                              batch.kv_last_page_len))] == [True, True, True, True]
    assert args[4:] == (4, 2, 8, 4)  # num_qo_heads, num_kv_heads, head_dim, page_size
    assert kwargs == {"causal": True, "sm_scale": 8 ** -0.5, "window_left": 4, "logits_soft_cap": None,
                      "q_data_type": torch.bfloat16, "kv_data_type": torch.bfloat16}
    [(args, kwargs)] = decode.plans
    batch = metadata.paged.decode
    assert [a is b for a, b in zip(args[:3], (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len))] == [True] * 3
    assert all(array.device == CPU and array.dtype == torch.int32 for array in args[:3])
    assert args[3:] == (4, 2, 8, 4)
    assert kwargs == {"window_left": 4, "sm_scale": 8 ** -0.5, "logits_soft_cap": None,
                      "q_data_type": torch.bfloat16, "kv_data_type": torch.bfloat16}
    for wrapper, batch in ((prefill, metadata.paged.prefill), (decode, metadata.paged.decode)):
        [(run_query, run_pool)] = wrapper.runs
        assert run_query.shape == (batch.num_queries, 4, 8) and run_query.is_contiguous() and run_pool is pool


def test_a_model_s_softmax_scale_is_both_plans_sm_scale():
    """Granite's attention_multiplier replaces 1 / sqrt(head_dim), in the eager plans and in a graph bucket's."""
    module = _fake_flashinfer()
    metadata, query, key, value, pool = _step(num_heads=4)
    FlashInferAttention(FlashInferKernels(module, CPU)).forward(query, key, value, pool, metadata, None, 0.3)
    assert sorted((wrapper.kind, kwargs["sm_scale"]) for wrapper in module.made for _args, kwargs in wrapper.plans) == [
        ("decode", 0.3), ("prefill", 0.3)]
    assert AttentionShape.of(query, pool).sm_scale == 8 ** -0.5
    assert AttentionShape(4, 2, 8, 4, torch.bfloat16, torch.bfloat16, 0.3).sm_scale == 0.3


@pytest.mark.parametrize(("num_heads", "tensor_cores"), [(2, False), (8, False), (12, False), (14, True), (10, True)])
def test_decode_takes_tensor_cores_for_groups_the_cuda_core_kernel_lacks(num_heads, tensor_cores):
    """Groups 1, 4 and 6 (heads / 2 KV heads) have CUDA-core decode kernels, 7 and 5 do not."""
    module = _fake_flashinfer()
    metadata, query, key, value, pool = _step(num_heads)
    FlashInferAttention(FlashInferKernels(module, CPU)).forward(query, key, value, pool, metadata, sliding_window=None)
    [decode] = [wrapper for wrapper in module.made if wrapper.kind == "decode"]
    assert decode.kwargs["use_tensor_cores"] is tensor_cores


def test_a_graph_bucket_decode_wrapper_gets_fixed_int32_buffers_for_its_batch():
    module = _fake_flashinfer()
    metadata, query, *_ = _step(num_heads=4)
    shape = AttentionShape(4, 2, 8, 4, torch.bfloat16, torch.bfloat16)
    kernel = FlashInferGraphKernels(FlashInferKernels(module, CPU), batch_size=8, max_pages=8 * 5).decode(-1)
    kernel.plan(metadata.paged.decode, shape, -1)
    [wrapper] = module.made
    buffers = {name: (tuple(buffer.shape), buffer.dtype, buffer.device) for name, buffer in
               ((name, wrapper.kwargs.pop(name)) for name in
                ("paged_kv_indptr_buffer", "paged_kv_indices_buffer", "paged_kv_last_page_len_buffer"))}
    assert buffers == {"paged_kv_indptr_buffer": ((9,), torch.int32, CPU),
                       "paged_kv_indices_buffer": ((40,), torch.int32, CPU),
                       "paged_kv_last_page_len_buffer": ((8,), torch.int32, CPU)}
    assert wrapper.kwargs == {"use_cuda_graph": True, "use_tensor_cores": False, "backend": "fa2"}
