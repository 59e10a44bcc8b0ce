"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): each prompt token's logprob given the tokens
before it, with its rank and the top-N alternatives, against transformers' log_softmax of the whole
prompt's forward (fp32, tiny Llama)."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from tests.factories import _hf_model, assert_pool_idle
from splitserve.common.errors import InvalidRequestError
from splitserve.engine import LLM, SamplingParams
from splitserve.testing.in_process_cluster import InProcessCluster, worker_engine_config

PROMPT = list(range(3, 103))  # 100 tokens


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> torch.Tensor:
    """[100, vocab]: transformers' log_softmax after each prompt position (row p scores token p + 1)."""
    with torch.inference_mode():
        return torch.log_softmax(_hf_model(tiny_llama_dir)(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


def params(prompt_logprobs: int | None = 3, max_tokens: int = 4, **overrides) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                             "prompt_logprobs": prompt_logprobs, **overrides})


def assert_matches(entries, reference: torch.Tensor, num_top: int) -> None:
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position in range(1, len(PROMPT)):
        entry, row = entries[position], reference[position - 1]
        token = PROMPT[position]
        assert entry.token_id == token
        assert math.isclose(entry.logprob, float(row[token]), abs_tol=1e-4)
        assert entry.rank == int((row > row[token]).sum()) + 1
        assert [t for t, _ in entry.top] == torch.topk(row, num_top).indices.tolist()
        assert all(math.isclose(value, float(row[t]), abs_tol=1e-4) for t, value in entry.top)


@pytest.mark.parametrize("budget", [2048, 24], ids=["one-chunk", "chunks-of-24"])
def test_prompt_logprobs_equal_transformers(tiny_llama_dir, reference, budget):
    llm = LLM(tiny_llama_dir, block_size=16, dtype="float32", max_model_len=256, num_kv_blocks=32,
              max_num_batched_tokens=budget)
    output = llm.generate([PROMPT], params(3))[0]
    assert_matches(output.prompt_logprobs, reference, 3)
    assert output.logprobs is None  # the output's own logprobs stay separate
    assert output.token_ids == llm.generate([PROMPT], params(None))[0].token_ids
    assert_pool_idle(llm.engine.block_manager)


def test_zero_alternatives_still_scores_every_token(tiny_llama_dir, reference):
    llm = LLM(tiny_llama_dir, block_size=16, dtype="float32", max_model_len=256, num_kv_blocks=32)
    output = llm.generate([PROMPT], params(0))[0]
    assert_matches(output.prompt_logprobs, reference, 0)


def test_a_request_without_them_gets_none(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=16, dtype="float32", max_model_len=256, num_kv_blocks=32)
    assert llm.generate([PROMPT], params(None))[0].prompt_logprobs is None


def test_a_cached_prefix_is_not_read_but_computed(tiny_llama_dir, reference):
    llm = LLM(tiny_llama_dir, block_size=16, dtype="float32", max_model_len=256, num_kv_blocks=32)
    assert llm.generate([PROMPT], params(None))[0].num_cached_tokens == 0
    assert llm.generate([PROMPT], params(None))[0].num_cached_tokens == 96  # the cache holds the prompt's 6 blocks
    scored = llm.generate([PROMPT], params(2))[0]
    assert scored.num_cached_tokens == 0  # vLLM's skip_reading_prefix_cache
    assert_matches(scored.prompt_logprobs, reference, 2)
    assert llm.generate([PROMPT], params(None))[0].num_cached_tokens == 96


def test_batched_copies_with_different_counts_each_get_their_own(tiny_llama_dir, reference):
    """What n > 1 and a batch of scorers do: several requests of the same prompt in one step."""
    llm = LLM(tiny_llama_dir, block_size=16, dtype="float32", max_model_len=256, num_kv_blocks=64,
              max_num_batched_tokens=64)
    outputs = llm.generate([PROMPT, PROMPT, PROMPT], [params(1), params(None), params(5, temperature=1.0, seed=7)])
    assert_matches(outputs[0].prompt_logprobs, reference, 1)
    assert outputs[1].prompt_logprobs is None
    assert_matches(outputs[2].prompt_logprobs, reference, 5)


def test_a_request_preempted_after_its_first_token_does_not_deliver_them_again(tiny_llama_dir, reference):
    """Two requests that cannot both finish in the pool: the later one is preempted while decoding and
    recomputed (prompt and output); its prompt logprobs, delivered with its first token, do not come again."""
    llm = LLM(tiny_llama_dir, block_size=16, dtype="float32", max_model_len=256, num_kv_blocks=16,
              max_num_batched_tokens=48)
    deltas = {}
    engine = llm.engine
    engine.add_request("a", PROMPT, params(3, max_tokens=100))
    engine.add_request("b", PROMPT, params(3, max_tokens=100))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    assert llm.stats().num_preemptions > 0
    for request_id in ("a", "b"):
        with_them = [d.prompt_logprobs for d in deltas[request_id] if d.prompt_logprobs is not None]
        assert len(with_them) == 1
        assert_matches(with_them[0], reference, 3)
        assert deltas[request_id][0].prompt_logprobs is not None  # with the first token
    assert_pool_idle(engine.block_manager)


def test_a_request_preempted_while_scoring_delivers_them_once_unchanged(tiny_llama_dir, reference):
    """A long decode next to a prompt chunked 15 tokens a step, in a pool too small for both: the prompt
    is preempted (more than once) before its first token and recomputed; its prompt logprobs come once,
    equal to transformers'."""
    llm = LLM(tiny_llama_dir, block_size=16, dtype="float32", max_model_len=128, num_kv_blocks=8,
              max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("decoding", list(range(200, 220)), params(None, max_tokens=100))
    engine.add_request("scoring", PROMPT, params(3))
    deltas = []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == "scoring":
                deltas.append(delta)
                if delta.prompt_logprobs is not None:  # its first token: how often was its prompt preempted?
                    preempted_while_scoring = engine.scheduler.requests["scoring"].num_preemptions
    assert preempted_while_scoring > 1
    with_them = [delta.prompt_logprobs for delta in deltas if delta.prompt_logprobs is not None]
    assert len(with_them) == 1 and deltas[0].prompt_logprobs is not None
    assert_matches(with_them[0], reference, 3)
    assert_pool_idle(engine.block_manager)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_out_of_range_counts_are_refused(value):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_more_than_the_logprobs_limit_is_refused_naming_it():
    """How many is the server's --max-logprobs (vLLM's default 20), which check_logprobs_limit applies."""
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(prompt_logprobs=21).check_logprobs_limit(20, 512)
    assert str(refused.value) == ("prompt_logprobs: Requested prompt logprobs of 21, which is greater than max "
                                  "allowed: 20")


@pytest.mark.parametrize(("mode", "layerwise"), [("disaggregated", False), ("disaggregated", True),
                                                 ("colocated", False)])
def test_the_cluster_returns_the_single_engines_with_the_first_chunk(tiny_llama_dir, mode, layerwise):
    """Disaggregated, the prefill worker computes the prompt and returns them with its first token
    (PrefillResult, also with layer-wise transfer); colocated, the decode worker with its first
    delta (TokenDelta)."""
    config = worker_engine_config()
    single = LLM(tiny_llama_dir, **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
    expected = single.generate([PROMPT], params(4, max_tokens=6))[0]

    async def generate():
        async with InProcessCluster(tiny_llama_dir, mode=mode, layerwise=layerwise) as cluster:
            return await cluster.generate("scored", PROMPT, params(4, max_tokens=6))

    chunks = asyncio.run(generate())
    assert chunks[0].prompt_logprobs == tuple(expected.prompt_logprobs)
    assert all(chunk.prompt_logprobs is None for chunk in chunks[1:])
    assert [t for chunk in chunks for t in chunk.token_ids] == expected.token_ids
