"""Producer/consumer engine roles: a request prefilled on one engine and decoded on another
(blocks copied by hand here; kv_transfer moves them in the cluster) gives the same tokens."""

from __future__ import annotations

import pytest

from dataclasses import replace

from splitserve.common.config import EngineConfig, SpeculativeConfig
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.testing.workloads import mixed_workload
from tests.factories import assert_pool_idle

CONFIG = EngineConfig(block_size=8, num_kv_blocks=256, max_num_batched_tokens=128, dtype="float32", device="cpu")


def _run_all(engine: EngineCore) -> dict[str, list]:
    deltas: dict[str, list] = {}
    while engine.has_work():
        for delta in engine.step():
            deltas.setdefault(delta.request_id, []).append(delta)
    return deltas


def _tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def _copy_blocks(src: EngineCore, dst: EngineCore, src_ids, dst_ids) -> None:
    for src_layer, dst_layer in zip(src.kv_cache.layers, dst.kv_cache.layers):
        dst_layer[list(dst_ids)] = src_layer[list(src_ids)]


def _disaggregated(producer: EngineCore, consumer: EngineCore, prompts, params) -> dict[str, list[int]]:
    for index, prompt in enumerate(prompts):
        producer.add_request(f"r{index}", prompt, params, hold_kv_after_prefill=True)
    prefilled = _run_all(producer)
    for request_id, deltas in prefilled.items():
        (final,) = deltas
        assert final.finish_reason == "prefilled"
        held = producer.take_held_kv(request_id)
        index = int(request_id[1:])
        local = consumer.add_remote_request(request_id, prompts[index], list(final.new_token_ids), params,
                                            final.num_cached_tokens, held.generator_state)
        assert len(local) == len(held.block_ids) == -(-len(prompts[index]) // CONFIG.block_size)
        _copy_blocks(producer, consumer, held.block_ids, local)
        assert producer.release_held_kv(request_id)
        consumer.remote_kv_ready(request_id)
    decoded = _run_all(consumer)
    return {rid: list(prefilled[rid][0].new_token_ids) + _tokens(decoded[rid]) for rid in prefilled}


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12,
                                                   ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_prefill_here_decode_there_matches_one_engine(tiny_llama_dir, params):
    prompts = [list(case.prompt_token_ids) for case in mixed_workload(512, num_requests=8, max_prompt=60)]
    whole = EngineCore(tiny_llama_dir, CONFIG)
    for index, prompt in enumerate(prompts):
        whole.add_request(f"r{index}", prompt, params)
    expected = {rid: _tokens(deltas) for rid, deltas in _run_all(whole).items()}
    producer, consumer = EngineCore(tiny_llama_dir, CONFIG), EngineCore(tiny_llama_dir, CONFIG)
    assert _disaggregated(producer, consumer, prompts, params) == expected
    assert_pool_idle(producer.block_manager)
    assert_pool_idle(consumer.block_manager)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculating_consumer_matches_one_engine(tiny_llama_dir, method):
    """The consumer speculates on a prompt whose KV it pulled: a draft model rebuilds its own KV from the
    prompt on the consumer (the producer ships only the target's blocks)."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [list(case.prompt_token_ids) for case in mixed_workload(512, num_requests=6, max_prompt=60)]
    whole = EngineCore(tiny_llama_dir, CONFIG)
    for index, prompt in enumerate(prompts):
        whole.add_request(f"r{index}", prompt, params)
    expected = {rid: _tokens(deltas) for rid, deltas in _run_all(whole).items()}
    speculative = SpeculativeConfig(method=method, draft_model=str(tiny_llama_dir), disable_above_batch_size=1024)
    consumer = EngineCore(tiny_llama_dir, replace(CONFIG, speculative=speculative))
    assert _disaggregated(EngineCore(tiny_llama_dir, CONFIG), consumer, prompts, params) == expected
    assert consumer.stats().spec_decode.num_accepted_tokens > 0
    assert_pool_idle(consumer.block_manager)


def test_held_blocks_stay_allocated_until_released(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, CONFIG)
    engine.add_request("a", list(range(3, 23)), SamplingParams(temperature=0, max_tokens=5),
                       hold_kv_after_prefill=True)
    (delta,) = _run_all(engine)["a"]
    held = engine.take_held_kv("a")
    assert (delta.finish_reason, held.num_tokens, len(held.block_ids)) == ("prefilled", 20, 3)
    assert held.generator_state is None
    assert [engine.block_manager.ref_count(b) for b in held.block_ids] == [1, 1, 1]
    assert engine.num_held == 1 and not engine.has_work()
    assert engine.release_held_kv("a") and not engine.release_held_kv("a")
    assert_pool_idle(engine.block_manager)


def test_request_that_stops_at_its_first_token_holds_nothing(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, CONFIG)
    engine.add_request("a", list(range(3, 23)), SamplingParams(temperature=0, max_tokens=1),
                       hold_kv_after_prefill=True)
    (delta,) = _run_all(engine)["a"]
    assert delta.finish_reason == "length" and engine.take_held_kv("a") is None
    assert_pool_idle(engine.block_manager)


def test_abort_while_waiting_for_remote_kv_frees_blocks(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, CONFIG)
    local = engine.add_remote_request("a", list(range(3, 40)), [5], SamplingParams(max_tokens=4), 0, None)
    assert len(local) == 5 and engine.block_manager.num_free_blocks == 251 and not engine.has_work()
    assert engine.abort_request("a")
    (delta,) = engine.step()
    assert delta.finish_reason == "abort"
    assert_pool_idle(engine.block_manager)


def test_failed_pull_recomputes_the_prompt_locally(tiny_llama_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(3, 50))
    whole = EngineCore(tiny_llama_dir, CONFIG)
    whole.add_request("a", prompt, params)
    expected = _tokens(_run_all(whole)["a"])
    engine = EngineCore(tiny_llama_dir, CONFIG)
    assert engine.add_remote_request("a", prompt, expected[:1], params, 0, None) is not None
    engine.remote_kv_failed("a")
    assert expected[:1] + _tokens(_run_all(engine)["a"]) == expected
    assert_pool_idle(engine.block_manager)


def test_remote_admission_without_room_changes_nothing(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, EngineConfig(block_size=8, num_kv_blocks=8, max_model_len=64,
                                                     dtype="float32", device="cpu"))
    assert engine.add_remote_request("a", list(range(3, 60)), [5], SamplingParams(), 0, None) is not None
    assert engine.add_remote_request("b", list(range(3, 20)), [5], SamplingParams(), 0, None) is None
    assert engine.block_manager.num_free_blocks == 0 and "b" not in engine.scheduler.requests
    engine.abort_request("a")
    engine.step()
    assert_pool_idle(engine.block_manager)


def test_remote_request_with_block_aligned_prompt_decodes_in_a_full_pool(tiny_llama_dir):
    """The first decode token needs a new block when the prompt fills its last one: it is
    allocated at admission, so a full pool cannot stall the request."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = EngineCore(tiny_llama_dir, EngineConfig(block_size=8, num_kv_blocks=3, max_model_len=24,
                                                     dtype="float32", device="cpu"))
    local = engine.add_remote_request("a", list(range(3, 19)), [5], params, 0, None)
    assert len(local) == 2 and engine.block_manager.num_free_blocks == 0
    engine.remote_kv_ready("a")
    assert len(_tokens(_run_all(engine)["a"])) == 2
    assert_pool_idle(engine.block_manager)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                                    SamplingParams(temperature=0.9, seed=11, max_tokens=6, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_a_request_admitted_before_its_first_token_decodes_as_one_engine(tiny_llama_dir, params):
    """Layer-wise transfer: the consumer admits the request (room for the coming first token too)
    while the producer still prefills, and takes its first token and RNG state afterwards."""
    prompt = list(range(3, 27))  # 3 full blocks: the first token starts a fourth
    whole = EngineCore(tiny_llama_dir, CONFIG)
    whole.add_request("a", prompt, params)
    expected = _tokens(_run_all(whole)["a"])
    producer, consumer = EngineCore(tiny_llama_dir, CONFIG), EngineCore(tiny_llama_dir, CONFIG)
    local = consumer.add_remote_request("a", prompt, [], params, 0, None, first_token_pending=True)
    assert len(local) == 3 and consumer.block_manager.num_free_blocks == 252 and not consumer.has_work()
    producer.add_request("a", prompt, params, hold_kv_after_prefill=True)
    (first,) = _run_all(producer)["a"]
    held = producer.take_held_kv("a")
    _copy_blocks(producer, consumer, held.block_ids, local)
    consumer.remote_first_token("a", first.new_token_ids, first.num_cached_tokens, held.generator_state)
    with pytest.raises(ValueError, match="'a' is not waiting for its first token"):
        consumer.remote_first_token("a", first.new_token_ids, 0, None)
    consumer.remote_kv_ready("a")
    assert list(first.new_token_ids) + _tokens(_run_all(consumer)["a"]) == expected
    assert producer.release_held_kv("a")
    assert_pool_idle(producer.block_manager)
    assert_pool_idle(consumer.block_manager)
