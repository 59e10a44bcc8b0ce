"""Speculative decoding: greedy identity with and without speculation (both proposers, chunked
prefill, prefix caching, preemption, stops, penalties, logprobs), exact rollback of rejected drafts
(block ids, hashes, KV events), the sampled output distribution (chi-square), the proposers and the
scheduler's speculating chunks."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import pytest
import torch

from splitserve.common.config import EngineConfig, SpeculativeConfig
from splitserve.common.kv_events import BlocksRemoved, BlocksStored
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.stats import SpecDecodeStats
from splitserve.deploy.cli import main
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.sampler import Sampler, filtered_probs
from splitserve.engine.spec_decode.ngram import NgramProposer
from splitserve.engine.spec_decode.proposer import DraftSlot
from splitserve.engine.spec_decode.verifier import SpeculativeRows, verify, verify_sampled
from tests.factories import (assert_pool_idle, chi_square_p_value, make_draft_model_dir, make_request,
                             make_sampling_row, make_scheduler, two_sample_chi_square_p_value)

BASE = EngineConfig(block_size=4, num_kv_blocks=512, max_num_batched_tokens=256, dtype="float32", device="cpu")
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1, ngram_max=3,
                          disable_above_batch_size=1024)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def random_draft_dir(tiny_llama_dir, tmp_path_factory):
    return make_draft_model_dir(tiny_llama_dir, tmp_path_factory.mktemp("draft"), seed=5)


def _draft(model_dir) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft", draft_model=str(model_dir), num_speculative_tokens=3,
                             disable_above_batch_size=1024)


def _prompts(count: int, length: int, shared: int = 0) -> list[list[int]]:
    """Prompts that repeat a motif (so n-grams match) after `shared` tokens common to all."""
    common = [(7 * j) % 500 + 3 for j in range(shared)]
    return [common + [(11 * i + 5 * (j % (3 + i))) % 500 + 3 for j in range(length)] for i in range(count)]


def _run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, tuple]:
    """request id -> (token ids, finish reason, stop reason, logprobs) once every request finished."""
    for index, prompt in enumerate(prompts):
        engine.add_request(f"r{index}", prompt, params)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    finals = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            logprobs.setdefault(delta.request_id, []).extend(delta.new_logprobs)
            if delta.finished:
                finals[delta.request_id] = delta
    return {rid: (tokens[rid], finals[rid].finish_reason, finals[rid].stop_reason, logprobs[rid]) for rid in finals}


def _speculative(model_dir, speculative: SpeculativeConfig, **config) -> EngineCore:
    return EngineCore(model_dir, replace(BASE, speculative=speculative, **config))


def _proposers(tiny_llama_dir, random_draft_dir) -> dict[str, SpeculativeConfig]:
    """ngram; the target as its own draft (drafts mostly accepted); a random draft (mostly rejected)."""
    return {"ngram": NGRAM, "draft-self": _draft(tiny_llama_dir), "draft-random": _draft(random_draft_dir)}


SCENARIOS = {
    "plain": (dict(), 4, 12, 0),
    "chunked-prefill": (dict(max_num_batched_tokens=16), 4, 40, 0),
    "prefix-caching": (dict(), 4, 10, 24),
    "preemption": (dict(num_kv_blocks=40, max_model_len=64), 6, 12, 0),
}
"""name -> (engine config changes, prompts, prompt length, shared prefix length)."""


@pytest.mark.parametrize("proposer", ["ngram", "draft-self", "draft-random"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_output_is_identical_with_and_without_speculation(tiny_llama_dir, random_draft_dir, proposer,
                                                                 scenario):
    changes, count, length, shared = SCENARIOS[scenario]
    prompts = _prompts(count, length, shared)
    plain = EngineCore(tiny_llama_dir, replace(BASE, **changes))
    engine = _speculative(tiny_llama_dir, _proposers(tiny_llama_dir, random_draft_dir)[proposer], **changes)
    if shared:  # the shared prefix is cached by a first request before the others arrive
        assert _run(engine, prompts[:1], GREEDY) == _run(plain, prompts[:1], GREEDY)
    expected = _run(plain, prompts, GREEDY)
    assert _run(engine, prompts, GREEDY) == expected
    stats = engine.stats()
    spec = stats.spec_decode
    assert spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_drafts
    assert spec.num_accepted_tokens == sum(spec.num_accepted_tokens_per_pos)
    assert list(spec.num_accepted_tokens_per_pos) == sorted(spec.num_accepted_tokens_per_pos, reverse=True)
    assert stats.num_generation_tokens == plain.stats().num_generation_tokens == (count + bool(shared)) * GREEDY.max_tokens
    if proposer != "draft-random":
        assert spec.num_accepted_tokens > 0 and stats.num_steps <= plain.stats().num_steps
    if proposer != "ngram":
        assert_pool_idle(engine.speculator.proposer.block_manager)
    if scenario == "preemption":
        assert stats.num_preemptions > 0
    if scenario == "prefix-caching":
        assert stats.prefix_cache_hits == plain.stats().prefix_cache_hits > 0
    assert_pool_idle(engine.block_manager)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.4,
                   presence_penalty=0.2),
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=10, logprobs=3),
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logit_bias={5: 3.0, 17: -4.0, 40: 2.5},
                   allowed_token_ids=tuple(range(0, 300, 2)), bad_words_token_ids=((40, 40), (8,), (6, 4, 12))),
], ids=["penalties", "min-tokens-logprobs", "logit-controls"])
def test_greedy_identity_holds_with_penalties_min_tokens_and_logprobs(tiny_llama_dir, params):
    prompts = _prompts(3, 12)
    expected = _run(EngineCore(tiny_llama_dir, BASE), prompts, params)
    actual = _run(_speculative(tiny_llama_dir, _draft(tiny_llama_dir)), prompts, params)
    for rid, (tokens, reason, stop, logprobs) in expected.items():
        assert actual[rid][:3] == (tokens, reason, stop)
        if params.logprobs is None:
            continue
        assert [lp.token_id for lp in actual[rid][3]] == [lp.token_id for lp in logprobs] == tokens
        for mine, theirs in zip(actual[rid][3], logprobs):
            assert mine.rank == theirs.rank and [t for t, _ in mine.top] == [t for t, _ in theirs.top]
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)


def test_stop_token_inside_an_accepted_run_ends_the_output_there(tiny_llama_dir):
    prompts = _prompts(3, 12)
    outputs = _run(EngineCore(tiny_llama_dir, BASE), prompts, GREEDY)
    # A token each output has after its 6th: stopping on it cuts inside runs the drafts propose.
    stop_ids = tuple({tokens[6] for tokens, *_ in outputs.values()})
    params = replace(GREEDY, stop_token_ids=stop_ids)
    expected = _run(EngineCore(tiny_llama_dir, BASE), prompts, params)
    engine = _speculative(tiny_llama_dir, _draft(tiny_llama_dir))
    assert _run(engine, prompts, params) == expected
    assert all(reason == "stop" and len(tokens) <= 7 for tokens, reason, *_ in expected.values())
    assert_pool_idle(engine.block_manager)


def _flat_events(engine: EngineCore) -> list[tuple]:
    """Every KV event since start as (kind, hash, parent) per block, so batching does not matter."""
    batches, snapshot = engine.kv_report(engine.epoch, 0)
    assert snapshot is None
    flat = []
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlocksStored):
                parents = (event.parent_hash, *event.block_hashes[:-1])
                flat.extend(("stored", h, p) for h, p in zip(event.block_hashes, parents))
            elif isinstance(event, BlocksRemoved):
                flat.extend(("removed", h, None) for h in event.block_hashes)
    return flat


def test_rollback_publishes_exactly_the_blocks_of_non_speculative_decoding(tiny_llama_dir, random_draft_dir):
    """Same block ids, hashes, KV events and free order as without speculation, and after every step
    a speculating request owns exactly the blocks of its computed tokens (no rejected tail)."""
    prompts = _prompts(1, 13)
    params = replace(GREEDY, max_tokens=40)
    config = dict(num_kv_blocks=32, max_model_len=128)
    plain = EngineCore(tiny_llama_dir, replace(BASE, **config))
    expected = _run(plain, prompts, params)
    for speculative in (_draft(random_draft_dir), _draft(tiny_llama_dir), NGRAM):
        engine = _speculative(tiny_llama_dir, speculative, **config)
        engine.add_request("r0", prompts[0], params)
        tokens = []
        while engine.has_unfinished_requests():
            tokens.extend(t for d in engine.step() for t in d.new_token_ids)
            request = engine.scheduler.requests.get("r0")
            if request is not None:
                manager = engine.block_manager
                assert len(manager.block_table("r0")) == manager.blocks_needed(request.num_computed_tokens)
                assert request.num_computed_tokens == request.num_tokens - 1
        assert tokens == expected["r0"][0]
        assert _flat_events(engine) == _flat_events(plain)
        assert engine.block_manager.free_block_order() == plain.block_manager.free_block_order()
        assert engine.block_manager.cached_block_hashes() == plain.block_manager.cached_block_hashes()


def test_preemption_mid_speculation_drops_the_drafts():
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    first, second = make_request("a", [1, 2, 3]), make_request("b", [4, 5, 6])
    for request in (first, second):
        scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.advance(output)
    for request, token in ((first, 9), (second, 8)):
        request.append_output_token(token)
        request.spec_token_ids.extend([10, 11, 12])
    output = scheduler.schedule()  # "a" needs 2 blocks for 1 + 3 tokens: "b" (the youngest) is preempted
    assert output.preempted_request_ids == ("b",)
    assert [(c.request_id, c.token_ids, c.start_position, c.num_spec_tokens, c.num_sampled_rows)
            for c in output.chunks] == [("a", (9, 10, 11, 12), 3, 3, 4)]
    assert second.spec_token_ids == [] and second.num_computed_tokens == 0
    assert scheduler.block_manager.block_table("a") == [0, 1]


def test_drafts_past_the_token_budget_are_dropped():
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=3)
    request = make_request("a", [1, 2])
    scheduler.add_request(request)
    scheduler.advance(scheduler.schedule())
    request.append_output_token(5)
    request.spec_token_ids.extend([6, 7, 8, 9])
    output = scheduler.schedule()
    (chunk,) = output.chunks
    assert (chunk.token_ids, chunk.num_spec_tokens, output.num_batched_tokens) == ((5, 6, 7), 2, 3)
    scheduler.advance(output)
    assert request.num_computed_tokens == 3 and request.spec_token_ids == []


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(ngram_min=1, ngram_max=3)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    # Suffix [1, 2, 3] occurs at 0 only: what followed it was 4, 9, 2.
    assert proposer.propose([DraftSlot("a", tokens, 3)]) == [(4, 9, 2)]
    # Suffix [7, 3]: no match of 2; [3] last occurred at 6 (before the end): 5, 6, 1, 7.
    assert proposer.lookup([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 7, 3], 4) == (5, 6, 1, 7)
    assert proposer.lookup([1, 2, 3], 2) == ()
    assert proposer.lookup([4, 4], 3) == (4,)  # a match right before the end proposes what is left


def _processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return filtered_probs(logits, [params] * logits.shape[0])


SAMPLED = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=4),
           SamplingParams(temperature=1.0, top_p=0.7)]


@pytest.mark.parametrize("params", SAMPLED, ids=["temperature", "top-k", "top-p"])
def test_sampled_verification_emits_the_target_distribution_at_each_position(params):
    """Small vocab (8), fixed logits, drafts the target likes (accepted often) and dislikes (mostly
    rejected: the residual draw): the first emitted token is distributed as p_0, the second (after an
    accepted draft) as p_1."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.2],
                           [0.1, 1.8, -0.3, 1.2, 0.4, 0.9, -1.0, 0.0],
                           [0.5, 0.0, 1.0, -1.0, 2.0, 0.3, 0.1, 0.7]])  # [1 + k, vocab]
    probs = _processed_probs(logits, params)
    for drafts in ((0, 1), (5, 3)):
        generator = torch.Generator().manual_seed(sum(drafts))
        rows = tuple(make_sampling_row(params) for _ in range(3))
        rows = tuple(replace(row, generator=generator) for row in rows)
        first, second = [0] * 8, [0] * 8
        num_samples = 2000
        for _ in range(num_samples):
            run = verify_sampled(logits, SpeculativeRows(rows, drafts))
            first[run.token_ids[0]] += 1
            if run.num_accepted >= 1:
                second[run.token_ids[1]] += 1
        # The second token only after drafts the target likes (the others are rarely accepted).
        checked = ((first, probs[0]), (second, probs[1])) if drafts == (0, 1) else ((first, probs[0]),)
        for counts, p in checked:
            support = [t for t in range(8) if p[t] > 0]
            assert all(counts[t] == 0 for t in range(8) if p[t] == 0)
            total = sum(counts)
            assert total > 400
            assert chi_square_p_value([counts[t] for t in support], [total * float(p[t]) for t in support]) > 1e-3


def test_greedy_verification_accepts_the_matching_prefix_and_corrects_the_first_mismatch():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0], [4.0, 0.0, 0.0]])  # argmax 1, 0, 2, 0
    rows = tuple(make_sampling_row(SamplingParams(temperature=0.0)) for _ in range(4))
    (all_accepted, one_accepted) = verify(Sampler(), torch.cat([logits, logits]),
                                          [SpeculativeRows(rows, (1, 0, 2)), SpeculativeRows(rows, (1, 2, 2))])
    assert all_accepted.token_ids == (1, 0, 2, 0) and all_accepted.num_accepted == 3
    assert one_accepted.token_ids == (1, 0) and one_accepted.num_accepted == 1


@pytest.mark.parametrize("params", [replace(p, max_tokens=3, ignore_eos=True) for p in SAMPLED],
                         ids=["temperature", "top-k", "top-p"])
def test_speculative_sampling_matches_the_non_speculative_distribution(tiny_llama_dir, params):
    """Tokens 2 and 3 (the first verified by speculation) of 600 seeded requests on the tiny model,
    with and without speculation (the target drafting for itself: greedy drafts, accepted often but
    not always), come from one distribution."""
    prompt = _prompts(1, 10)[0]
    num_samples = 600

    def sample(engine: EngineCore, seed_base: int) -> list[list[int]]:
        outputs = []
        for start in range(0, num_samples, 300):
            batch = {f"s{i}": replace(params, seed=seed_base + i) for i in range(start, start + 300)}
            for rid, p in batch.items():
                engine.add_request(rid, prompt, p)
            tokens: dict[str, list[int]] = {}
            while engine.has_unfinished_requests():
                for delta in engine.step():
                    tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            outputs.extend(tokens[rid] for rid in batch)
        return outputs

    config = replace(BASE, max_num_seqs=300, max_num_batched_tokens=4096, num_kv_blocks=2048)
    plain = sample(EngineCore(tiny_llama_dir, config), 0)
    engine = EngineCore(tiny_llama_dir, replace(config, speculative=replace(_draft(tiny_llama_dir), adaptive=False)))
    speculative = sample(engine, 10 ** 6)
    spec = engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    for position in (1, 2):
        p_value = two_sample_chi_square_p_value([t[position] for t in plain], [t[position] for t in speculative])
        assert p_value > 1e-3


def test_seeded_speculative_requests_are_reproducible(tiny_llama_dir):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=20, ignore_eos=True)
    prompts = _prompts(3, 10)
    first = _run(_speculative(tiny_llama_dir, _draft(tiny_llama_dir)), prompts, params)
    again = _run(_speculative(tiny_llama_dir, _draft(tiny_llama_dir)), prompts + _prompts(2, 7), params)
    assert {rid: first[rid] for rid in first} == {rid: again[rid] for rid in first}


@pytest.mark.parametrize("proposer", ["ngram", "draft-self"])
def test_a_seeded_sampled_request_emits_the_same_tokens_with_or_without_speculation_in_any_batch(tiny_llama_dir,
                                                                                                 proposer):
    """The verification draws each position's token as the sampler would without speculation (the same
    noise from the request's own generator) and accepts a draft equal to it: a seeded request's tokens do
    not depend on whether it speculated, so neither on batch mates that turn speculation off (a batch above
    disable_above_batch_size) nor on how many drafts a step verified."""
    params = SamplingParams(temperature=0.2, seed=42, max_tokens=32, ignore_eos=True)
    _assert_seeded_speculation_identity(tiny_llama_dir, proposer, params)


def test_logit_controls_give_the_same_seeded_tokens_with_or_without_speculation(tiny_llama_dir):
    """The verified distribution gets the same logit controls as the sampler (engine/spec_decode/verifier.py
    uses its penalized()), bad words over the drafts before each position included."""
    params = SamplingParams(temperature=0.2, seed=42, max_tokens=32, ignore_eos=True, logit_bias={2: 1.5, 9: -2.0},
                            allowed_token_ids=tuple(range(1, 400, 3)), bad_words_token_ids=((4, 10), (13,)))
    _assert_seeded_speculation_identity(tiny_llama_dir, "ngram", params)


def _assert_seeded_speculation_identity(tiny_llama_dir, proposer: str, params: SamplingParams) -> None:
    prompt = _prompts(1, 24)[0]
    expected = _run(EngineCore(tiny_llama_dir, BASE), [prompt], params)["r0"]
    config = replace(_proposers(tiny_llama_dir, None)[proposer], disable_above_batch_size=2, adaptive=False)
    alone = _speculative(tiny_llama_dir, config)
    assert _run(alone, [prompt], params)["r0"] == expected
    spec = alone.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    in_batch = _speculative(tiny_llama_dir, config)
    assert _run(in_batch, [prompt, *_prompts(2, 9)], params)["r0"] == expected
    assert in_batch.stats().spec_decode.num_drafts == 0


def test_batch_above_the_threshold_does_not_speculate(tiny_llama_dir):
    engine = _speculative(tiny_llama_dir, replace(NGRAM, disable_above_batch_size=2))
    _run(engine, _prompts(3, 12), GREEDY)
    assert engine.stats().spec_decode.num_drafts == 0
    engine = _speculative(tiny_llama_dir, replace(NGRAM, disable_above_batch_size=3))
    _run(engine, _prompts(3, 12), GREEDY)
    assert engine.stats().spec_decode.num_drafts > 0


def test_adaptive_k_follows_the_accepted_length(tiny_llama_dir, random_draft_dir):
    """A draft that is always right keeps k at its maximum; one that is (almost) always wrong drops to 1."""
    for draft_dir, expected_k in ((tiny_llama_dir, 3), (random_draft_dir, 1)):
        engine = _speculative(tiny_llama_dir, _draft(draft_dir))
        engine.add_request("r0", _prompts(1, 12)[0], replace(GREEDY, max_tokens=64))
        for _ in range(12):
            engine.step()
        assert engine.speculator.num_speculative_tokens(engine.scheduler.requests["r0"]) == expected_k


def test_speculative_config_is_validated():
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)


def test_an_engine_config_refuses_speculative_settings_that_are_not_a_speculative_config():
    """vLLM's offline API takes a dict here; this one names the class to use instead of failing later with an
    AttributeError deep in the engine."""
    with pytest.raises(ValueError, match="speculative must be a SpeculativeConfig .*got dict"):
        EngineConfig(speculative={"method": "ngram", "num_speculative_tokens": 3})


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_gptq_or_awq_draft_model_is_read_as_its_checkpoint_says(tiny_llama_dir, tmp_path, method):
    """A draft checkpoint made by `splitserve quantize` (of the target itself here, so its drafts are
    mostly accepted) is loaded with its own quantization_config, as the target would be."""
    calibration = tmp_path / "calibration"
    calibration.mkdir()
    (calibration / "river.txt").write_text("Tell me about the river and the old mill by the village road. " * 40)
    draft_dir = tmp_path / method
    assert main(["quantize", str(tiny_llama_dir), str(draft_dir), "--method", method, "--group-size", "32",
                 "--calibration-dir", str(calibration), "--num-samples", "2", "--seq-len", "64"]) == 0
    prompts = _prompts(3, 12)
    engine = _speculative(tiny_llama_dir, _draft(draft_dir))
    assert _run(engine, prompts, GREEDY) == _run(EngineCore(tiny_llama_dir, BASE), prompts, GREEDY)
    assert engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("extra_rows", [64, -64], ids=["larger", "smaller"])
def test_a_draft_model_with_another_vocab_size_never_feeds_either_model_an_id_it_has_no_row_for(
        tiny_llama_dir, tmp_path, extra_rows):
    """Same tokenizer, embeddings padded differently (Qwen2.5-0.5B's 151936 rows drafting for 7B's 152064):
    a draft id past the target's rows ends that request's drafts there, and a request holding an id past
    the draft's rows does not speculate; greedy output is unchanged."""
    draft_dir = make_draft_model_dir(tiny_llama_dir, tmp_path / "draft", seed=5, vocab_size=512 + extra_rows)
    prompts = [[*prompt, 500, 505] for prompt in _prompts(3, 12)]  # ids the smaller draft has no row for
    prompts.append(_prompts(4, 12)[3])  # ids all below 448: the smaller draft speculates on this one
    engine = _speculative(tiny_llama_dir, _draft(draft_dir))
    assert _run(engine, prompts, GREEDY) == _run(EngineCore(tiny_llama_dir, BASE), prompts, GREEDY)
    assert engine.stats().spec_decode.num_drafts > 0
    assert_pool_idle(engine.speculator.proposer.block_manager)


def test_draft_model_with_another_tokenizer_is_refused(tiny_llama_dir, tiny_qwen2_dir):
    with pytest.raises(ValueError, match="tokenizer"):
        _speculative(tiny_llama_dir, _draft(tiny_qwen2_dir))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_disaggregated_cluster_greedy_output_is_identical_with_a_speculating_decode_worker(tiny_llama_dir, method):
    """1 prefill + 1 decode worker (in-process transfer): the decode worker speculates on prompts whose
    KV it pulled, its draft model rebuilding its own KV from the prompt."""
    from splitserve.testing.in_process_cluster import InProcessCluster

    prompts = _prompts(4, 20)
    params = replace(GREEDY, max_tokens=20)
    speculative = SpeculativeConfig(method=method, draft_model=str(tiny_llama_dir), disable_above_batch_size=1024)

    async def run(decode_speculative):
        async with InProcessCluster(tiny_llama_dir, decode_speculative=decode_speculative) as cluster:
            chunks = await asyncio.gather(*(cluster.generate(f"c{i}", p, params) for i, p in enumerate(prompts)))
            stats = await cluster.clients["decode-0"].stats()
            return [[t for c in request for t in c.token_ids] for request in chunks], stats.engine.spec_decode

    expected, none = asyncio.run(run(None))
    actual, spec = asyncio.run(run(speculative))
    assert none is None and actual == expected
    assert all(len(tokens) == params.max_tokens for tokens in actual)
    assert spec.num_accepted_tokens > 0


def test_structured_output_requests_do_not_speculate_next_to_speculating_ones(tiny_llama_dir):
    """A regex-constrained request in the same batch as speculating ones: its grammar mask reaches its
    own row (the masks are re-indexed to the plain rows), and every output equals the plain engine's."""
    from splitserve.common.structured_output import StructuredOutput, StructuredOutputKind

    constrained = replace(GREEDY, max_tokens=12,
                          structured_output=StructuredOutput(StructuredOutputKind.REGEX, "[0-9]{3}-[a-z]{4}"))
    prompts = _prompts(3, 12)

    plain = EngineCore(tiny_llama_dir, BASE)
    engine = _speculative(tiny_llama_dir, _draft(tiny_llama_dir))
    expected = _run_with_constrained(plain, prompts, constrained)
    actual = _run_with_constrained(engine, prompts, constrained)
    assert actual == expected
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    assert expected["g"][0]  # the constrained output is not empty


def _run_with_constrained(engine: EngineCore, prompts: list[list[int]], constrained: SamplingParams) -> dict:
    """_run over the prompts (greedy) plus one constrained request 'g' in the same batch."""
    engine.add_request("g", prompts[0], constrained)
    return _run(engine, prompts, GREEDY)


# ---- a worker migration mid-speculation ---------------------------------------------------------
MIGRATION_PROMPT = list(range(100, 113)) * 3
"""A phrase said three times: n-grams match from the start; the greedy output varies (12 distinct
tokens in 48)."""
MIGRATION_GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
HOLD_AT_OUTPUT_TOKENS = 12
"""A decode worker stops stepping once a request of it has this many output tokens (a few
verifications in), until the test has moved the request off it."""


def _holds_enough_output(engine: EngineCore) -> bool:
    return any(r.num_output_tokens >= HOLD_AT_OUTPUT_TOKENS for r in engine.scheduler.requests.values())


@dataclass(frozen=True)
class MigratedRun:
    tokens: list[int]
    left: str
    """The decode worker the request moved off."""
    left_spec: SpecDecodeStats | None
    """That worker's counters when the request left it."""
    survivor_spec: SpecDecodeStats | None
    """The other decode worker's counters at the end."""
    engines: dict[str, EngineCore]
    """Both decode workers' engines (the left one's too, stopped or retired)."""


async def _move_mid_stream(cluster, fault: str) -> tuple[list[int], str, SpecDecodeStats | None]:
    """Stream the request; once the decode worker running it is held mid-stream, move the request
    off it ('kill': the worker dies; 'drain': it is retired with no grace, its engine aborting the
    request once it steps again, after the request resumed elsewhere)."""
    from splitserve.router.api_types import GenerationInput
    from splitserve.testing.fault_scenarios import InProcessView, StepHold

    holds = {w.worker_id: StepHold(InProcessView.engine_loop(w), _holds_enough_output) for w in cluster.decode_workers}
    tokens: list[int] = []
    left, left_spec, retiring = "", None, None
    inp = GenerationInput("a", tuple(MIGRATION_PROMPT), MIGRATION_GREEDY)
    async for chunk in cluster.orchestrator.generate(inp):
        tokens.extend(chunk.token_ids)
        if left and holds:  # the first chunk of the resumed attempt: the request has left for good
            holds.pop(left).release()
        if not left and len(tokens) >= HOLD_AT_OUTPUT_TOKENS:
            (left,) = [w.worker_id for w in cluster.decode_workers if (await w.stats()).engine.num_running]
            left_spec = (await cluster.clients[left].stats()).engine.spec_decode
            if fault == "kill":
                cluster.kill(left)
            else:
                retiring = asyncio.ensure_future(cluster.retire_worker(left, timeout_s=0.0))
            for worker_id in [w for w in holds if w != left]:
                holds.pop(worker_id).release()
    if retiring is not None:
        await retiring
    await cluster.wait_idle()
    return tokens, left, left_spec


def _migrated_run(model_dir, speculative: SpeculativeConfig | None, fault: str) -> MigratedRun:
    from splitserve.router.policy import RoutingConfig
    from splitserve.testing.in_process_cluster import InProcessCluster

    records = []
    routing = RoutingConfig(policy="round_robin", disaggregation="always")

    async def scenario():
        async with InProcessCluster(model_dir, num_decode=2, routing=routing, observer=records.append,
                                    decode_speculative=speculative) as cluster:
            engines = {w.worker_id: w.engine for w in cluster.decode_workers}
            tokens, left, left_spec = await _move_mid_stream(cluster, fault)
            (survivor,) = [w for w in cluster.decode_workers if w.worker_id != left]
            return MigratedRun(tokens, left, left_spec, (await survivor.stats()).engine.spec_decode, engines)

    run = asyncio.run(scenario())
    (record,) = records
    assert (record.finish_reason, record.error_code, record.num_migrations) == ("length", None, 1)
    assert record.decode_worker != run.left and record.num_output_tokens == MIGRATION_GREEDY.max_tokens
    return run


@pytest.fixture(scope="module")
def plain_migrated_tokens(tiny_llama_dir) -> list[int]:
    run = _migrated_run(tiny_llama_dir, None, "kill")
    assert run.left_spec is None and run.survivor_spec is None
    return run.tokens


@pytest.mark.parametrize("fault", ["kill", "drain"])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_output_is_identical_across_a_worker_migration_mid_speculation(tiny_llama_dir, plain_migrated_tokens,
                                                                              method, fault):
    """Disaggregated, two speculating decode workers: the one decoding the request is held a few
    verifications in, then dies or is drained; the router moves the request to the other, which
    recomputes the prompt + the streamed tokens (its draft model rebuilding its own KV from them,
    its adaptive k starting afresh) and speculates on. The client's tokens equal the run without
    speculation, and no engine that still runs keeps speculative state of the request."""
    speculative = SpeculativeConfig(method=method, draft_model=str(tiny_llama_dir), disable_above_batch_size=1024)
    run = _migrated_run(tiny_llama_dir, speculative, fault)
    assert run.tokens == plain_migrated_tokens
    assert run.left_spec.num_drafts > 0 and run.left_spec.num_accepted_tokens > 0
    assert run.survivor_spec.num_drafts > 0 and run.survivor_spec.num_accepted_tokens > 0
    if method == "draft":  # the target drafting for itself: a draft KV rebuilt right proposes what it emits
        assert run.survivor_spec.num_accepted_tokens == run.survivor_spec.num_draft_tokens
    live = [worker_id for worker_id in run.engines if fault == "drain" or worker_id != run.left]
    for worker_id in live:
        speculator = run.engines[worker_id].speculator
        assert speculator.tracked_request_ids() == frozenset()
        if method == "draft":
            assert_pool_idle(speculator.proposer.block_manager)
