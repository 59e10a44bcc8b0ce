"""Multi-LoRA serving in the engine: PEFT adapters per request, checked against transformers running the base model
with the adapter merged into its weights; prefix caching per adapter; the scheduler's max_loras; LRU residency;
what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.common.block_hash import BlockHasher, adapter_root, hash_block, root_hash, salted_root
from splitserve.common.config import EngineConfig, SpeculativeConfig
from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.kv_events import LoraLoad
from splitserve.common.lora import LoRARequest
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.llm import LLM
from splitserve.engine.request import RequestStatus
from splitserve.testing.workloads import GreedyCase
from tests.factories import (engine_token_ids, hf_greedy, make_request, make_scheduler, merge_lora_adapter,
                             run_fake_step, save_random_hf_model, save_random_lora_adapter, use_flashinfer_on_cpu)

LORA_POOL = dict(block_size=16, max_model_len=256, num_kv_blocks=64, dtype="float32")
PROMPTS = ([5, 17, 42, 99, 3, 250, 7, 64, 128, 31, 8, 77],
           [300, 12, 9, 81, 45, 2, 190, 66, 23, 404, 11],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20])
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir) -> dict[str, Path]:
    """Two adapters of the tiny Llama: "all" adapts every projection (alpha / r scaling), "some" four of them
    with rsLoRA scaling (alpha / sqrt(r)) and another rank."""
    root = tmp_path_factory.mktemp("adapters")
    return {"all": save_random_lora_adapter(tiny_llama_dir, root / "all", seed=1),
            "some": save_random_lora_adapter(tiny_llama_dir, root / "some", seed=2, rank=4, lora_alpha=8,
                                             targets=("q_proj", "v_proj", "up_proj", "down_proj"), use_rslora=True)}


def lora(adapters: dict[str, Path], name: str, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, str(adapters[name]))


@pytest.fixture(scope="module")
def lora_llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, enable_lora=True, max_loras=2, **LORA_POOL)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_mixed_batch_matches_transformers_with_each_adapter_merged(lora_llm, adapters, tiny_llama_dir, tmp_path):
    """One generate() batch: the base model, adapter "all" twice, adapter "some"; each request's greedy tokens are
    transformers' greedy tokens of the base model with its adapter merged (W + scaling * B @ A)."""
    requests = [None, lora(adapters, "all", 1), lora(adapters, "some", 2), lora(adapters, "all", 1)]
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    outputs = lora_llm.generate([list(p) for p in prompts], greedy(), lora_request=requests)
    merged = {name: merge_lora_adapter(tiny_llama_dir, adapters[name], tmp_path / name) for name in adapters}
    expected = [hf_greedy(tiny_llama_dir if request is None else merged[request.lora_name],
                          GreedyCase(tuple(prompt), MAX_TOKENS, True))
                for request, prompt in zip(requests, prompts)]
    assert [output.outputs[0].token_ids for output in outputs] == expected
    # the adapters change the model: the same prompt's tokens differ from the base model's, and the other adapter's
    assert expected[1] != expected[0]
    assert hf_greedy(merged["some"], GreedyCase(PROMPTS[0], MAX_TOKENS, True)) not in (expected[0], expected[1])


def test_one_adapter_sent_under_another_id_is_the_adapter_the_engine_knows(lora_llm, adapters):
    """Each router numbers the adapters it loads at runtime itself (router/lora_adapters.py), so two routers
    (router.replicas) that loaded adapters in another order, or a restarted router, send one adapter (its name and
    directory) under different ids. The engine knows an adapter by name and directory: the same adapter, not read
    again (was: 400 'already known as' for every request through the other router)."""
    generated = lora_llm.generate([list(PROMPTS[1])], greedy(), lora_request=lora(adapters, "all", 1))
    num_loads = lora_llm.engine.lora.num_loads
    renumbered = lora_llm.generate([list(PROMPTS[1])], greedy(), lora_request=lora(adapters, "all", 7))
    assert renumbered[0].outputs[0].token_ids == generated[0].outputs[0].token_ids
    assert lora_llm.engine.lora.num_loads == num_loads


def test_stream_and_chat_take_a_lora_request(lora_llm, adapters):
    request = lora(adapters, "all", 1)
    generated = lora_llm.generate([list(PROMPTS[1])], greedy(), lora_request=request)[0].outputs[0].token_ids
    streamed = [t for delta in lora_llm.stream(list(PROMPTS[1]), greedy(), lora_request=request)
                for t in delta.new_token_ids]
    assert streamed == generated
    conversation = [{"role": "user", "content": "hi"}]
    chatted = lora_llm.chat(conversation, greedy(), lora_request=request)[0].outputs[0].token_ids
    assert chatted != lora_llm.chat(conversation, greedy())[0].outputs[0].token_ids


def test_qwen2_with_qkv_biases_matches_transformers(tiny_qwen2_dir, tmp_path):
    adapter = save_random_lora_adapter(tiny_qwen2_dir, tmp_path / "adapter", seed=3)
    llm = LLM(tiny_qwen2_dir, enable_lora=True, **LORA_POOL)
    tokens = llm.generate([list(PROMPTS[0])], greedy(), lora_request=LoRARequest("q", 1, str(adapter)))
    merged = merge_lora_adapter(tiny_qwen2_dir, adapter, tmp_path / "merged")
    assert tokens[0].outputs[0].token_ids == hf_greedy(merged, GreedyCase(PROMPTS[0], MAX_TOKENS, True))
    assert tokens[0].outputs[0].token_ids != hf_greedy(tiny_qwen2_dir, GreedyCase(PROMPTS[0], MAX_TOKENS, True))


def test_steps_with_adapter_rows_never_replay_a_cuda_graph(lora_llm, adapters, tiny_llama_dir, monkeypatch):
    """FlashInfer with captured decode steps (an eager stand-in on CPU): base-only decode steps replay the graphs,
    a step with any adapter row runs eagerly (the graphs hold the base model's ops only); the tokens are the
    eager engine's."""
    requests = [lora(adapters, "all", 1), None, lora(adapters, "some", 2)]
    prompts = [list(PROMPTS[0]), list(PROMPTS[1]), list(PROMPTS[2])]
    expected = [o.outputs[0].token_ids for o in lora_llm.generate(prompts, greedy(), lora_request=requests)]
    use_flashinfer_on_cpu(monkeypatch, graphs=True)
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=2, cuda_graphs=True, **LORA_POOL)
    graphs = llm.engine.runner.graphs
    assert llm.generate([prompts[1]], greedy())[0].outputs[0].token_ids == expected[1]
    replays = graphs.num_replays
    assert replays == MAX_TOKENS - 1  # every decode step of the base request
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), lora_request=requests)] == expected
    assert graphs.num_replays == replays


@pytest.mark.parametrize("architecture, targets", [
    ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")),  # its checkpoints' (and adapters') fused modules
    ("gemma", ("k_proj", "gate_proj", "up_proj")),  # GeLU-tanh MLP, (1 + w) norms, scaled embeddings
])
def test_other_families_match_transformers_with_the_adapter_merged(architecture, targets, tmp_path):
    model_dir = save_random_hf_model(tmp_path / architecture, architecture, seed=5)
    adapter = save_random_lora_adapter(model_dir, tmp_path / "adapter", seed=6, targets=targets)
    engine = EngineCore(model_dir, EngineConfig(enable_lora=True, **LORA_POOL))
    case = GreedyCase(tuple(PROMPTS[2]), MAX_TOKENS, True)
    engine.add_request("base", list(case.prompt_token_ids), case.params())
    engine.add_request("adapted", list(case.prompt_token_ids), case.params(),
                       lora_request=LoRARequest("a", 1, str(adapter)))
    tokens = engine_token_ids(engine)
    merged = merge_lora_adapter(model_dir, adapter, tmp_path / "merged")
    assert tokens == {"base": hf_greedy(model_dir, case), "adapted": hf_greedy(merged, case)}
    assert tokens["adapted"] != tokens["base"]


# ---- prefix caching ------------------------------------------------------------------------------------------
def test_adapter_root_starts_its_own_hash_chain():
    tokens = list(range(8))
    hasher = BlockHasher(4, seed=0)
    root = root_hash(0)
    assert hasher.hash_prefix(tokens, lora_name="a") == [
        hash_block(adapter_root(root, "a"), tokens[:4]),
        hash_block(hash_block(adapter_root(root, "a"), tokens[:4]), tokens[4:])]
    assert hasher.hash_prefix(tokens, cache_salt="s", lora_name="a")[0] == hash_block(
        adapter_root(salted_root(root, "s"), "a"), tokens[:4])
    first_blocks = {hasher.hash_prefix(tokens, salt, name)[0] for salt in (None, "a") for name in (None, "a", "b")}
    assert len(first_blocks) == 6  # base, each adapter, each salt and adapter: no two share a block


def test_same_prompt_under_two_adapters_shares_no_blocks():
    """Block manager level, exact block ids: the base prompt's full blocks are cached; the same tokens under
    adapter "a" match none of them and get blocks of their own; a second "a" request hits "a"'s blocks."""
    scheduler = make_scheduler(num_blocks=12, block_size=4)
    manager = scheduler.block_manager
    tokens = list(range(1, 10))  # two full blocks and one token
    requests = [make_request("base", tokens), make_request("a1", tokens, lora_name="a"),
                make_request("a2", tokens, lora_name="a")]
    tables = {}
    for request in requests:
        prefix = manager.match_prefix(request)
        manager.allocate(request, 9 - prefix.num_tokens, prefix)
        tables[request.request_id] = (prefix.block_ids, manager.block_table(request.request_id))
        request.num_computed_tokens = 9
        manager.cache_full_blocks(request)
    assert tables == {"base": ((), [0, 1, 2]), "a1": ((), [3, 4, 5]), "a2": ((3, 4), [3, 4, 6])}
    hasher = BlockHasher(4, seed=0)
    assert [manager.cached_block_id(h) for h in hasher.hash_prefix(tokens)] == [0, 1]
    assert [manager.cached_block_id(h) for h in hasher.hash_prefix(tokens, lora_name="a")] == [3, 4]
    assert [manager.cached_block_id(h) for h in hasher.hash_prefix(tokens, lora_name="b")] == [None, None]


def test_engine_caches_each_adapters_prompt_apart(tiny_llama_dir, adapters):
    engine = EngineCore(tiny_llama_dir, EngineConfig(enable_lora=True, max_loras=2, **LORA_POOL))
    prompt = list(range(1, 34))  # two full blocks of 16 and one token
    cached = []
    for request_id, request in (("base", None), ("all-1", lora(adapters, "all", 1)),
                                ("some", lora(adapters, "some", 2)), ("all-2", lora(adapters, "all", 1))):
        engine.add_request(request_id, prompt, greedy(1), lora_request=request)
        while engine.has_unfinished_requests():
            cached.extend((d.request_id, d.num_cached_tokens) for d in engine.step() if d.finished)
    assert cached == [("base", 0), ("all-1", 0), ("some", 0), ("all-2", 32)]
    hasher = BlockHasher(16, seed=0)
    for name in (None, "all", "some"):
        assert set(hasher.hash_prefix(prompt, lora_name=name)) <= engine.block_manager.cached_block_hashes()


def test_load_report_names_the_adapters_of_running_and_waiting_requests(tiny_llama_dir, adapters):
    """max_loras=1: "all"'s first request runs; "some"'s waits at the head of the queue, the base request and
    "all"'s second behind it (arrival order), so "all" is both running and waiting. What lora_requests_info
    exports; an engine without enable_lora reports None."""
    engine = EngineCore(tiny_llama_dir, EngineConfig(enable_lora=True, max_loras=1, **LORA_POOL))
    for request_id, request in (("all-1", lora(adapters, "all", 1)), ("some", lora(adapters, "some", 2)),
                                ("base", None), ("all-2", lora(adapters, "all", 1))):
        engine.add_request(request_id, list(PROMPTS[0]), greedy(2), lora_request=request)
    assert engine.load_report().lora == LoraLoad(max_loras=1, running=(), waiting=("all", "some"))
    engine.step()
    assert engine.load_report().lora == LoraLoad(max_loras=1, running=("all",), waiting=("all", "some"))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.load_report().lora == LoraLoad(max_loras=1, running=(), waiting=())
    assert EngineCore(tiny_llama_dir, EngineConfig(**LORA_POOL)).load_report().lora is None


# ---- the scheduler and residency -----------------------------------------------------------------------------
def test_a_ready_remote_request_of_another_adapter_waits_for_its_turn():
    """max_loras=1, consumer role: "b"'s pulled request stays in `ready` while "a"'s request runs, and joins the
    batch once it finished."""
    scheduler = make_scheduler(num_blocks=32, max_loras=1)
    scheduler.add_request(make_request("a1", [1, 2, 3], lora_name="a"))
    run_fake_step(scheduler)  # a1 prefilled, decoding from now on
    remote = make_request("b1", [4, 5, 6], lora_name="b")
    scheduler.block_manager.allocate(remote, 3)
    scheduler.add_remote(remote)
    scheduler.remote_kv_ready("b1")
    assert [(c.request_id, c.start_position) for c in scheduler.schedule().chunks] == [("a1", 3)]
    assert [r.request_id for r in scheduler.ready] == ["b1"]
    scheduler.finish("a1", RequestStatus.FINISHED_STOPPED)
    assert [(c.request_id, c.lora_name, c.start_position) for c in scheduler.schedule().chunks] == [("b1", "b", 3)]


def test_scheduler_runs_at_most_max_loras_adapters_per_step():
    """max_loras=1: "b"'s request waits at the head of the queue (and the base request behind it too: arrival
    order is kept) until "a"'s finishes; a second "a" request joins a's batch."""
    scheduler = make_scheduler(num_blocks=32, max_loras=1)
    for request in (make_request("a1", [1, 2, 3], lora_name="a"), make_request("a2", [4, 5], lora_name="a"),
                    make_request("b1", [6, 7], lora_name="b"), make_request("base", [8, 9])):
        scheduler.add_request(request)
    output = scheduler.schedule()
    assert [(c.request_id, c.lora_name) for c in output.chunks] == [("a1", "a"), ("a2", "a")]
    assert [r.request_id for r in scheduler.waiting] == ["b1", "base"]
    scheduler.advance(output)
    scheduler.finish("a1", RequestStatus.FINISHED_STOPPED)
    scheduler.finish("a2", RequestStatus.FINISHED_STOPPED)
    assert [(c.request_id, c.lora_name) for c in scheduler.schedule().chunks] == [("b1", "b"), ("base", None)]


def test_adapters_beyond_max_loras_evict_the_least_recently_used(tiny_llama_dir, tmp_path):
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=2, **LORA_POOL)
    requests = {name: LoRARequest(name, index, str(save_random_lora_adapter(tiny_llama_dir, tmp_path / name, index)))
                for index, name in enumerate("abc", start=1)}
    residency = []
    for name in "abcba":
        llm.generate([list(PROMPTS[0])], greedy(2), lora_request=requests[name])
        residency.append((llm.engine.lora.resident_names, llm.engine.lora.num_loads))
    assert residency == [(("a",), 1), (("a", "b"), 2), (("b", "c"), 3), (("c", "b"), 3), (("b", "a"), 4)]


def test_a_step_reloads_an_adapter_evicted_while_its_request_waited(tiny_llama_dir, adapters):
    """max_loras=1: registering "some" evicts "all" while "all"'s request is queued; its step reloads "all"
    (evicting "some", which that step does not run), and its tokens are the ones "all" alone gives."""
    llm = LLM(tiny_llama_dir, enable_lora=True, max_loras=1, **LORA_POOL)
    alone = llm.generate([list(PROMPTS[1])], greedy(), lora_request=lora(adapters, "all", 1))
    both = llm.generate([list(PROMPTS[1]), list(PROMPTS[1])], greedy(),
                        lora_request=[lora(adapters, "all", 1), lora(adapters, "some", 2)])
    assert both[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert both[1].outputs[0].token_ids != alone[0].outputs[0].token_ids
    assert llm.engine.lora.resident_names == ("some",)


# ---- refusals ------------------------------------------------------------------------------------------------
def test_lora_request_without_enable_lora_is_refused(tiny_llama_dir, adapters):
    llm = LLM(tiny_llama_dir, **LORA_POOL)
    with pytest.raises(InvalidRequestError, match="lora_request: LoRA is not enabled on this engine"):
        llm.generate([list(PROMPTS[0])], greedy(), lora_request=lora(adapters, "all", 1))


def _edited_adapter(source: Path, out_dir: Path, **config_fields) -> Path:
    out_dir.mkdir()
    (out_dir / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    config = json.loads((source / "adapter_config.json").read_text())
    (out_dir / "adapter_config.json").write_text(json.dumps({**config, **config_fields}))
    return out_dir


@pytest.mark.parametrize("config_fields, message", [
    (dict(r=32), "rank 32 exceeds max_lora_rank 16"),
    (dict(bias="all"), "bias 'all' is not supported"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "target module 'embed_tokens' is not supported"),
    (dict(use_dora=True), "use_dora is not supported"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(r=4), r"layer 0 down_proj: lora_A \[8, 192\] and lora_B \[64, 8\], expected \[4, 192\] and \[64, 4\]"),
])
def test_adapters_the_engine_cannot_run_are_refused(lora_llm, adapters, tmp_path, config_fields, message):
    bad = _edited_adapter(adapters["all"], tmp_path / "bad", **config_fields)
    with pytest.raises(InvalidRequestError, match=message) as raised:
        lora_llm.generate([list(PROMPTS[0])], greedy(), lora_request=LoRARequest("bad", 9, str(bad)))
    assert raised.value.field == "lora_request"
    assert "bad" not in lora_llm.engine.lora.resident_names


def test_bad_adapter_directories_are_refused(lora_llm, adapters, tmp_path, tiny_llama_dir):
    (tmp_path / "empty").mkdir()
    lm_head = save_random_lora_adapter(tiny_llama_dir, tmp_path / "lm_head", seed=4, targets=("q_proj",))
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(lm_head / "adapter_model.safetensors"))
    tensors["base_model.model.lm_head.lora_A.weight"] = tensors["base_model.model.model.layers.0.self_attn.q_proj"
                                                                ".lora_A.weight"].clone()
    save_file(tensors, str(lm_head / "adapter_model.safetensors"))
    cases = [(tmp_path / "missing", "no such directory"), (tmp_path / "empty", "no adapter_config.json"),
             (lm_head, "tensor 'base_model.model.lm_head.lora_A.weight' is not a decoder layer's")]
    for index, (path, message) in enumerate(cases, start=10):
        with pytest.raises(InvalidRequestError, match=message):
            lora_llm.generate([list(PROMPTS[0])], greedy(), lora_request=LoRARequest(f"x{index}", index, str(path)))
    lora_llm.generate([list(PROMPTS[0])], greedy(1), lora_request=lora(adapters, "all", 1))
    with pytest.raises(InvalidRequestError, match="adapter 'all' is already known as"):
        lora_llm.generate([list(PROMPTS[0])], greedy(), lora_request=LoRARequest("all", 1, str(adapters["some"])))
    with pytest.raises(InvalidRequestError, match="lora_request: must be a LoRARequest"):
        lora_llm.generate([list(PROMPTS[0])], greedy(), lora_request=[{"lora_name": "all"}])
    with pytest.raises(InvalidRequestError, match="lora_request: got 2 for 1 prompts"):
        lora_llm.generate([list(PROMPTS[0])], greedy(), lora_request=[None, None])
    with pytest.raises(InvalidRequestError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("x", 0, "/tmp")


def test_engines_that_cannot_run_lora_refuse_enable_lora(tiny_llama_dir, tmp_path):
    with pytest.raises(UnsupportedModelError, match="enable_lora: LoRA adapters do not run on quantized weights"):
        EngineCore(tiny_llama_dir, EngineConfig(enable_lora=True, quantization="int8", **LORA_POOL))
    moe = save_random_hf_model(tmp_path / "moe", "mixtral")
    with pytest.raises(UnsupportedModelError, match="enable_lora: LoRA adapters are not supported for "
                                                    "mixture-of-experts models"):
        EngineCore(moe, EngineConfig(enable_lora=True, **LORA_POOL))
    with pytest.raises(ValueError, match="enable_lora: LoRA adapters do not run with speculative decoding"):
        EngineConfig(enable_lora=True, speculative=SpeculativeConfig())
