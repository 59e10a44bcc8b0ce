"""The priority scheduling policy end to end on the tiny Llama: which request finishes first and which is
preempted in a tight KV pool, greedy outputs still equal to transformers', and fcfs refusing priorities."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from tests.factories import assert_pool_idle, hf_greedy
from splitserve.common.errors import InvalidRequestError
from splitserve.engine import LLM, BeamSearchParams, EngineConfig, EngineCore, SamplingParams
from splitserve.testing.workloads import GreedyCase

LOW = list(range(40, 80))
HIGH = list(range(100, 140))
"""Two 40-token prompts (3 blocks of 16 each); with 40 output tokens each needs 5 blocks, so two do not fit
in the 8 blocks of TIGHT_POOL together."""
TIGHT_POOL = dict(block_size=16, num_kv_blocks=8, max_model_len=128)


def greedy(max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _engine(model_dir, policy: str) -> EngineCore:
    return EngineCore(model_dir, EngineConfig(scheduling_policy=policy, **TIGHT_POOL),
                      Tokenizer.from_file(str(model_dir / "tokenizer.json")))


def _run(engine: EngineCore, low_priority: int) -> tuple[list[str], list[str], dict[str, list[int]]]:
    """`low` arrives first and prefills alone, then `high` (priority 0) joins: (finish order, preempted
    request ids in order, each request's output token ids)."""
    engine.add_request("low", LOW, greedy(), priority=low_priority)
    finished, preempted, tokens = [], [], {"low": [], "high": []}
    while engine.has_unfinished_requests():
        if engine.num_steps == 1:
            engine.add_request("high", HIGH, greedy())
        victims_before = {rid: r.num_preemptions for rid, r in engine.scheduler.requests.items()}
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
            if delta.finished:
                finished.append(delta.request_id)
        preempted += [rid for rid, r in engine.scheduler.requests.items() if r.num_preemptions > victims_before[rid]]
    return finished, preempted, tokens


@pytest.fixture(scope="module")
def expected(tiny_llama_dir) -> dict[str, list[int]]:
    return {name: hf_greedy(tiny_llama_dir, GreedyCase(tuple(prompt), 40, ignore_eos=True))
            for name, prompt in (("low", LOW), ("high", HIGH))}


def test_priority_policy_preempts_the_low_priority_request_and_finishes_the_high_one_first(tiny_llama_dir, expected):
    engine = _engine(tiny_llama_dir, "priority")
    finished, preempted, tokens = _run(engine, low_priority=1)
    # low grows past 64 tokens first and finds no block: it is the largest (priority, arrival), so it
    # preempts itself; high (admitted later) runs on alone and finishes first.
    assert (finished, preempted) == (["high", "low"], ["low"])
    assert tokens == expected
    assert_pool_idle(engine.block_manager)


def test_fcfs_policy_preempts_the_latest_admitted_request(tiny_llama_dir, expected):
    engine = _engine(tiny_llama_dir, "fcfs")
    finished, preempted, tokens = _run(engine, low_priority=0)
    assert (finished, preempted) == (["low", "high"], ["high"])
    assert tokens == expected
    assert_pool_idle(engine.block_manager)


def test_llm_generate_takes_one_priority_per_prompt(tiny_llama_dir, expected):
    llm = LLM(tiny_llama_dir, scheduling_policy="priority", max_num_seqs=1, **TIGHT_POOL)
    outputs = llm.generate([LOW, {"prompt_token_ids": HIGH}], greedy(), priority=[3, -2])
    assert [o.outputs[0].token_ids for o in outputs] == [expected["low"], expected["high"]]
    streamed = [t for delta in llm.stream(HIGH, greedy(), priority=7) for t in delta.new_token_ids]
    assert streamed == expected["high"]
    for priority, message in (([0], "priority: got 1 for 2 prompts"),
                              (5, "priority: must be a list of integers (one per prompt) or None, got int"),
                              ([0, "1"], "priority: must be an integer, got \"1\""),
                              ([0, True], "priority: must be an integer, got true")):
        with pytest.raises(InvalidRequestError) as error:
            llm.generate([LOW, HIGH], greedy(), priority=priority)
        assert str(error.value) == message
    assert_pool_idle(llm.engine.block_manager)


def test_llm_chat_and_beam_search_take_one_priority_per_prompt(tiny_llama_dir, monkeypatch):
    """chat() passes one priority per conversation, beam_search() its prompt's to every beam of every step;
    outputs are those of the same calls without priorities, and a list of the wrong length is refused."""
    llm = LLM(tiny_llama_dir, scheduling_policy="priority")
    hello = [{"role": "user", "content": "hello"}]
    mill = [{"role": "user", "content": "Tell me about the old mill."}]
    beams = BeamSearchParams(2, 2, ignore_eos=True)
    plain_chat, plain_beams = llm.chat([hello, mill], greedy(4)), llm.beam_search([LOW[:5], HIGH[:5]], beams)
    queued = []
    add_request = llm.engine.add_request
    monkeypatch.setattr(llm.engine, "add_request", lambda *args, priority, **kwargs: (
        queued.append(priority), add_request(*args, priority=priority, **kwargs)))
    chat = llm.chat([hello, mill], greedy(4), priority=[3, -2])
    assert [o.outputs[0].token_ids for o in chat] == [o.outputs[0].token_ids for o in plain_chat]
    assert queued == [3, -2]
    queued.clear()
    assert llm.beam_search([LOW[:5], HIGH[:5]], beams, priority=[5, -1]) == plain_beams
    # step 1: each prompt's one beam; step 2: each prompt's two beams (prompt order)
    assert queued == [5, -1, 5, 5, -1, -1]
    for call in (lambda: llm.chat([hello, mill], greedy(4), priority=[0]),
                 lambda: llm.beam_search([LOW[:5], HIGH[:5]], beams, priority=[0])):
        with pytest.raises(InvalidRequestError) as error:
            call()
        assert str(error.value) == "priority: got 1 for 2 prompts"
    assert_pool_idle(llm.engine.block_manager)


def test_fcfs_refuses_a_priority_other_than_zero_naming_the_field(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, **TIGHT_POOL)
    assert llm.engine.config.scheduling_policy == "fcfs"
    assert llm.generate([LOW], greedy(2), priority=[0])[0].outputs[0].token_ids == llm.generate(LOW, greedy(2))[0].token_ids
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([LOW, HIGH], greedy(), priority=[0, 1])
    assert str(error.value) == ("priority: is 1, but priority scheduling is not enabled: the scheduling policy is "
                                "'fcfs' (set scheduling_policy, --scheduling-policy, to 'priority')")
    conversation = [{"role": "user", "content": "hello"}]
    for call in (lambda: llm.chat([conversation, conversation], greedy(), priority=[0, 1]),
                 lambda: llm.beam_search([LOW, HIGH], BeamSearchParams(2, 2), priority=[0, 1])):
        with pytest.raises(InvalidRequestError) as same_error:
            call()
        assert str(same_error.value) == str(error.value)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ValueError, match=r"scheduling_policy must be one of \('fcfs', 'priority'\), got 'lifo'"):
        EngineConfig(scheduling_policy="lifo")
