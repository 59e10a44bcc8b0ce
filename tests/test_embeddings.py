"""Pooling (embedding) requests in the engine and LLM.embed: fp32 embeddings equal transformers' final hidden
states (AutoModel's last_hidden_state, pooled and normalized by hand) within TOLERANCE, under chunked prefill,
prefix-cache hits and batching, and every block comes back."""

from __future__ import annotations

import json
import random

import pytest
import torch

from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.pooling import PoolerConfig, PoolingParams, ResolvedPooling, read_model_pooling
from splitserve.engine import LLM
from splitserve.engine.engine_loop import abort_all
from splitserve.engine.pooling import SequencePool
from tests.factories import (assert_pool_idle, copy_with_config_fields, hf_embedding, save_random_base_model,
                             with_sentence_transformers_files)

TOLERANCE = 2e-6
"""Largest difference allowed per entry of a unit-length fp32 embedding (entries ~0.1): the engine's kernels (oneDNN-
packed GEMMs, paged attention in chunks) round differently from transformers' eager ops; measured at most 2.6e-7 on
both tiny models, every pooling, with the C++ kernels and with the torch ops."""
BUDGET = 16
"""max_num_batched_tokens of the chunked engines: PROMPTS' longest three are prefilled over several steps."""


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(length)] for length in (1, 5, 17, 40, 70)]


PROMPTS = _prompts()


def _pooling_llm(model_dir, pooling_type: str, **config) -> LLM:
    return LLM(model_dir, runner="pooling", pooler_config=PoolerConfig(pooling_type=pooling_type), block_size=4,
               max_num_batched_tokens=BUDGET, **config)


def _assert_matches(outputs, model_dir, pooling_type: str, normalize: bool = True, dimensions=None) -> None:
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        want = torch.tensor(hf_embedding(model_dir, prompt, pooling_type, normalize, dimensions))
        got = torch.tensor(output.outputs.embedding)
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=0, atol=TOLERANCE), (len(prompt), (got - want).abs().max().item())


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_embeddings_match_transformers_under_chunked_prefill(arch, pooling_type, tiny_model_dirs):
    model_dir = tiny_model_dirs[arch]
    llm = _pooling_llm(model_dir, pooling_type)
    outputs = llm.embed(PROMPTS)
    _assert_matches(outputs, model_dir, pooling_type)
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert all(o.finished for o in outputs)
    assert [len(o.outputs.embedding) for o in outputs] == [64] * 5
    assert llm.stats().num_steps >= sum(len(p) for p in PROMPTS) // BUDGET  # the 70-token prompt alone takes 5
    assert_pool_idle(llm.engine.block_manager)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch-ops"])
def test_last_pooling_reuses_cached_blocks_and_still_matches(cpu_kernels, tiny_llama_dir):
    """The second embed of the same prompts starts after their cached full blocks (block_size 4): the 70-token
    prompt reads 68 tokens from the cache and computes only its last 2, yet pools the same vector."""
    llm = _pooling_llm(tiny_llama_dir, "LAST", cpu_kernels=cpu_kernels)
    first = llm.embed(PROMPTS)
    second = llm.embed(PROMPTS)
    assert [o.num_cached_tokens for o in first] == [0, 0, 0, 0, 0]
    assert [o.num_cached_tokens for o in second] == [0, 4, 16, 36, 68]  # every full block but the last token's
    _assert_matches(second, tiny_llama_dir, "LAST")
    assert_pool_idle(llm.engine.block_manager)


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_compute_every_position(pooling_type, tiny_llama_dir):
    """MEAN needs every position's hidden state and CLS the first's: they never start after cached blocks (their
    own blocks are published, so a LAST or generating request could reuse them)."""
    llm = _pooling_llm(tiny_llama_dir, pooling_type)
    llm.embed(PROMPTS)
    again = llm.embed(PROMPTS)
    assert [o.num_cached_tokens for o in again] == [0, 0, 0, 0, 0]
    assert llm.stats().prefix_cache_hits == 0
    assert llm.engine.block_manager.num_cached_free_blocks > 0
    _assert_matches(again, tiny_llama_dir, pooling_type)


def test_a_batch_equals_one_prompt_at_a_time(tiny_qwen2_dir):
    """One embed() of every prompt (several share each step's budget) gives each prompt's vector of an embed() of it
    alone, within TOLERANCE (the batch's GEMM shapes differ, so the rounding may)."""
    batched = _pooling_llm(tiny_qwen2_dir, "MEAN", enable_prefix_caching=False).embed(PROMPTS)
    single = _pooling_llm(tiny_qwen2_dir, "MEAN", enable_prefix_caching=False)
    alone = [single.embed([prompt])[0] for prompt in PROMPTS]
    for together, by_itself in zip(batched, alone):
        assert torch.allclose(torch.tensor(together.outputs.embedding), torch.tensor(by_itself.outputs.embedding),
                              rtol=0, atol=TOLERANCE)


def test_a_pool_restarts_at_position_zero():
    """A preempted request recomputes its prompt from position 0 (MEAN and CLS never start after cached blocks): the
    pool starts over there, so every position counts once. hidden rows are i * [1, 2] for position i."""
    rows = torch.arange(6, dtype=torch.float32)[:, None] * torch.tensor([1.0, 2.0])  # [6, 2]
    for kind, want in (("MEAN", [2.5, 5.0]), ("CLS", [0.0, 0.0]), ("LAST", [5.0, 10.0])):
        pool = SequencePool(ResolvedPooling(kind, normalize=False, dimensions=None))
        pool.add(0, rows[:4] + 100)  # the first attempt's chunks, dropped at the preemption
        pool.add(0, rows[:4])
        pool.add(4, rows[4:])
        assert pool.embedding(6) == tuple(want), kind
    pool = SequencePool(ResolvedPooling("MEAN", normalize=True, dimensions=1))
    pool.add(0, rows)
    assert pool.embedding(6) == (1.0,)  # cut to 1 entry, then normalized


def test_unnormalized_and_per_request_normalization(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, runner="pooling", pooler_config={"use_activation": False})
    raw = llm.embed(PROMPTS)
    _assert_matches(raw, tiny_llama_dir, "LAST", normalize=False)
    normalized = llm.embed(PROMPTS, pooling_params=PoolingParams(use_activation=True))
    _assert_matches(normalized, tiny_llama_dir, "LAST", normalize=True)


def test_task_embed_is_runner_pooling(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, task="embed")
    assert llm.engine.config.runner == "pooling"
    _assert_matches(llm.embed(PROMPTS), tiny_llama_dir, "LAST")  # vLLM's decoder default: LAST, normalized


@pytest.mark.parametrize(("mode", "normalize", "expected"), [
    ("mean", False, ("MEAN", False)), ("lasttoken", True, ("LAST", True)), ("cls", True, ("CLS", True))])
def test_sentence_transformers_files_choose_the_pooling(mode, normalize, expected, tiny_llama_dir, tmp_path):
    model_dir = with_sentence_transformers_files(tiny_llama_dir, tmp_path / "st", mode, normalize)
    pooling = read_model_pooling(model_dir)
    assert (pooling.pooling_type, pooling.normalize) == expected
    outputs = LLM(model_dir, runner="pooling").embed(PROMPTS)
    _assert_matches(outputs, model_dir, *expected)


def test_unsupported_sentence_transformers_pooling_is_refused(tiny_llama_dir, tmp_path):
    model_dir = with_sentence_transformers_files(tiny_llama_dir, tmp_path / "st", "max", True)
    with pytest.raises(ValueError, match=r"pooling 'pooling_mode_max_tokens' is not supported; supported: "
                                         r"lasttoken, mean, cls"):
        LLM(model_dir, runner="pooling")


def test_dimensions_need_a_matryoshka_model(tiny_llama_dir, tmp_path):
    llm = LLM(tiny_llama_dir, runner="pooling")
    with pytest.raises(InvalidRequestError, match=r"does not support Matryoshka embeddings; dimensions must be unset "
                                                  r"\(received dimensions=16\)"):
        llm.embed(PROMPTS, pooling_params=PoolingParams(dimensions=16))
    assert_pool_idle(llm.engine.block_manager)
    matryoshka = copy_with_config_fields(tiny_llama_dir, tmp_path / "m", matryoshka_dimensions=[16, 32, 64])
    llm = LLM(matryoshka, runner="pooling")
    _assert_matches(llm.embed(PROMPTS, pooling_params=PoolingParams(dimensions=16)), matryoshka, "LAST",
                    dimensions=16)
    with pytest.raises(InvalidRequestError, match=r"only supports Matryoshka dimensions \[16, 32, 64\], got 8"):
        llm.embed(PROMPTS, pooling_params=PoolingParams(dimensions=8))
    with pytest.raises(InvalidRequestError, match=r"only supports dimensions in range \[1, 64\], got 65"):
        llm.embed(PROMPTS, pooling_params=PoolingParams(dimensions=65))


def test_generate_on_a_pooling_llm_and_embed_on_a_generating_one_are_refused(tiny_llama_dir):
    pooling = LLM(tiny_llama_dir, runner="pooling")
    with pytest.raises(ValueError, match=r"^LLM.generate\(\) is only supported for generative models. Try passing "
                                         r"`--runner generate` to use the model as a generative model.$"):
        pooling.generate(PROMPTS)
    with pytest.raises(InvalidRequestError, match="runner 'pooling'"):
        pooling.engine.add_request("r", [1, 2, 3], pooling.get_default_sampling_params())
    generating = LLM(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"^Embedding API is not supported by this model. Try converting the model "
                                         r"using `--convert embed`."):
        generating.embed(PROMPTS)
    with pytest.raises(InvalidRequestError, match="runner 'generate'"):
        generating.engine.add_pooling_request("r", [1, 2, 3], PoolingParams())


def test_a_prompt_may_fill_max_model_len(tiny_llama_dir):
    """Nothing is generated after a pooled prompt, so it may be max_model_len long (a generating one may not)."""
    llm = LLM(tiny_llama_dir, runner="pooling", max_model_len=70)
    _assert_matches(llm.embed(PROMPTS), tiny_llama_dir, "LAST")
    with pytest.raises(InvalidRequestError) as refused:
        llm.embed([PROMPTS[-1] + [1]])
    assert str(refused.value) == ("This model's maximum context length is 70 tokens. However, prompt has 71 tokens. "
                                  "Please reduce the length of the input.")
    # vLLM's truncate_prompt_tokens=-1 keeps max_model_len tokens of a pooled prompt (generate() keeps one fewer)
    cut = llm.embed([[1] + PROMPTS[-1]], truncate_prompt_tokens=-1)[0]
    assert cut.prompt_token_ids == PROMPTS[-1]
    assert cut.outputs.embedding == llm.embed([PROMPTS[-1]])[0].outputs.embedding


def test_sentence_bert_config_max_seq_length_is_the_default_max_model_len(tiny_llama_dir, tmp_path):
    """As vLLM (its encoder_config): sentence_bert_config.json's max_seq_length (where sentence-transformers cuts a
    prompt) bounds the prompt instead of config.json's max_position_embeddings (1024 here); a longer one is refused
    rather than embedded whole, and a longer max_model_len is refused at start."""
    model_dir = with_sentence_transformers_files(tiny_llama_dir, tmp_path / "st", "lasttoken", True)
    assert read_model_pooling(model_dir).max_seq_length is None
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": False}))
    assert read_model_pooling(model_dir).max_seq_length == 40
    llm = LLM(model_dir, runner="pooling")
    assert llm.engine.max_model_len == 40
    fits = PROMPTS[3]  # 40 tokens: fills it
    want = torch.tensor(hf_embedding(model_dir, fits, "LAST"))
    assert torch.allclose(torch.tensor(llm.embed([fits])[0].outputs.embedding), want, rtol=0, atol=TOLERANCE)
    with pytest.raises(InvalidRequestError) as refused:
        llm.embed([PROMPTS[-1]])
    assert str(refused.value) == ("This model's maximum context length is 40 tokens. However, prompt has 70 tokens. "
                                  "Please reduce the length of the input.")
    assert_pool_idle(llm.engine.block_manager)
    assert LLM(model_dir, runner="pooling", max_model_len=32).engine.max_model_len == 32
    with pytest.raises(ValueError, match=r"^max_model_len 41 exceeds max_seq_length 40 of the model's "
                                         r"sentence_bert_config.json"):
        LLM(model_dir, runner="pooling", max_model_len=41)
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": "40"}))
    with pytest.raises(ValueError, match=r"sentence_bert_config.json: max_seq_length must be a positive integer, "
                                         r"got '40'$"):
        read_model_pooling(model_dir)


def test_sentence_bert_config_do_lower_case_is_refused(tiny_llama_dir, tmp_path):
    """sentence-transformers and vLLM lowercase every text input of such a model; embedding the text as given would
    be silently different, so the engine (and serve's preflight, which reads the same) refuses it."""
    model_dir = with_sentence_transformers_files(tiny_llama_dir, tmp_path / "st", "mean", True)
    (model_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40, "do_lower_case": True}))
    with pytest.raises(ValueError, match=r"sentence_bert_config.json: do_lower_case \(lowercasing every text input\) "
                                         r"is not supported$"):
        LLM(model_dir, runner="pooling")


def test_an_aborted_pooling_request_frees_its_blocks(tiny_llama_dir):
    llm = _pooling_llm(tiny_llama_dir, "MEAN")
    engine = llm.engine
    engine.add_pooling_request("long", PROMPTS[-1], PoolingParams())
    assert engine.step() == []  # the first 16 of 70 tokens
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort_request("long")
    (delta,) = engine.step()
    assert (delta.request_id, delta.finish_reason, delta.embedding) == ("long", "abort", None)
    assert engine._pools == {}
    assert_pool_idle(engine.block_manager)


def test_the_final_delta_carries_the_embedding(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, runner="pooling", pooler_config=PoolerConfig(pooling_type="LAST"))
    llm.engine.add_pooling_request("one", PROMPTS[2], PoolingParams())
    (delta,) = llm.engine.step()
    assert (delta.finish_reason, delta.new_token_ids, delta.num_prompt_tokens, len(delta.embedding)) == (
        "stop", (), 17, 64)
    assert torch.allclose(torch.tensor(delta.embedding), torch.tensor(hf_embedding(tiny_llama_dir, PROMPTS[2], "LAST")),
                          rtol=0, atol=TOLERANCE)


def test_pooler_config_is_for_the_pooling_runner(tiny_llama_dir):
    with pytest.raises(ValueError, match="pooler_config is for runner 'pooling'"):
        LLM(tiny_llama_dir, pooler_config=PoolerConfig(pooling_type="MEAN"))
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(tiny_llama_dir, runner="embed")
    with pytest.raises(ValueError, match="task must be 'embed', 'classify', 'score' or 'generate'"):
        LLM(tiny_llama_dir, task="reward")


def test_modules_json_with_a_dense_module_is_refused(tiny_llama_dir, tmp_path):
    model_dir = with_sentence_transformers_files(tiny_llama_dir, tmp_path / "st", "mean", True)
    modules = json.loads((model_dir / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense module"):
        read_model_pooling(model_dir)


def test_a_failed_step_then_abort_all_frees_every_pooling_request(tiny_llama_dir, monkeypatch):
    """The workers' step-failure policy (engine_loop.abort_all) after a forward that raised: every pooling request ends
    with an abort delta and its blocks and pool are freed."""
    llm = _pooling_llm(tiny_llama_dir, "MEAN")
    engine = llm.engine
    for index, prompt in enumerate(PROMPTS[3:]):
        engine.add_pooling_request(f"r{index}", prompt, PoolingParams())
    engine.step()  # 16 tokens of the 40-token prompt hold 4 blocks
    monkeypatch.setattr(engine.runner, "execute_with_hidden", lambda output: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.step()
    abort_all(engine)
    monkeypatch.undo()
    assert sorted((d.request_id, d.finish_reason, d.embedding) for d in engine.step()) == [
        ("r0", "abort", None), ("r1", "abort", None)]
    assert engine._pools == {}
    assert_pool_idle(engine.block_manager)


@pytest.mark.parametrize("architecture", ["qwen3", "mistral"])
def test_a_checkpoint_saved_without_its_lm_head_embeds(architecture, tmp_path):
    """Qwen3-Embedding and e5-mistral ship their decoder alone (Qwen3Model / MistralModel, no lm_head): a pooling
    engine runs it as its causal-LM family; a generating one refuses it naming the missing head."""
    model_dir = save_random_base_model(tmp_path / architecture, architecture, seed=5)
    prompts = [[token % 384 for token in prompt] for prompt in PROMPTS]
    llm = _pooling_llm(model_dir, "LAST")
    for output, prompt in zip(llm.embed(prompts), prompts):
        want = torch.tensor(hf_embedding(model_dir, prompt, "LAST"))
        assert torch.allclose(torch.tensor(output.outputs.embedding), want, rtol=0, atol=TOLERANCE)
    with pytest.raises(UnsupportedModelError, match=r"no tensor lm_head.weight .*runs with runner 'pooling'"):
        LLM(model_dir)
