"""The config.json, generation_config.json and chat template that six published instruct models ship, with only
their sizes shrunk (hidden_size, intermediate_size, layers, heads, vocab_size where the published special ids
allow, sliding windows so the prompts cross them): the engine loads each as a new user would and matches transformers.

Every other field is the Hub repo's as published (legacy rope_scaling / rope_local_base_freq /
sliding_window_pattern names, torch_dtype, EOS lists, auto_map, transformers_version ...), head_dim included, so the
longrope factor lists are the published ones, whole; the tokenizer is the tiny models' with the tokens the
templates write added after its 512. The Gemmas are 72 wide (Gemma 3 1B's 1152 / 16): like the published widths,
one whose square root (Gemma's embedding scale, rounded to the model's dtype) is no power of two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.factories import (assert_pool_idle, hf_greedy, hf_logits, http_request, save_published_model,
                             served_apis)
from splitserve.common.config import EngineConfig
from splitserve.common.errors import InvalidRequestError
from splitserve.engine import EngineCore, SamplingParams
from splitserve.engine.llm import LLM
from splitserve.testing.workloads import GreedyCase

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
"""google/gemma-2b-it's and gemma-2-2b-it's: a system message is refused."""

GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n")
"""google/gemma-3-1b-it's: a system message is prepended to the first user turn."""

PHI35_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")

PHI4_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
    "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
    "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{% else %}{{ eos_token }}{% endif %}")

GRANITE_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content'] %}\n"
    "    {%- set loop_messages = messages[1:] %}\n{%- else %}\n"
    "    {%- set system_message = \"Knowledge Cutoff Date: April 2024.\nToday's Date: \" + strftime_now('%B %d, %Y') + "
    "\".\nYou are Granite, developed by IBM.\" %}\n    {%- if thinking %}\n"
    "        {%- set system_message = system_message + \" You are a helpful AI assistant. Write your thoughts between "
    "<think></think> and write your response between <response></response> for each user query.\" %}\n"
    "    {%- else %}\n        {%- set system_message = system_message + \" You are a helpful AI assistant.\" %}\n"
    "    {%- endif %}\n    {%- set loop_messages = messages %}\n{%- endif %}\n"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}\n"
    "{%- for message in loop_messages %}\n"
    "    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}\n"
    "    {%- if loop.last and add_generation_prompt %}\n        {{- '<|start_of_role|>assistant' }}\n"
    "        {%- if controls %}\n            {{- ' ' + controls | tojson()}}\n        {%- endif %}\n"
    "        {{- '<|end_of_role|>' }}\n    {%- endif %}\n{%- endfor %}")
"""ibm-granite/granite-3.3-2b-instruct's, without its tools / documents / citations branches."""


PHI35_SHORT_FACTOR = [1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842,
                      1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
                      1.0699999332427979, 1.0999999046325684, 1.1099998950958252, 1.1599998474121094,
                      1.1599998474121094, 1.1699998378753662, 1.2899998426437378, 1.339999794960022,
                      1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
                      1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745,
                      2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
                      2.0199997425079346, 2.0199997425079346, 2.0299997329711914, 2.0299997329711914,
                      2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
                      2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
                      2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533,
                      2.729999542236328, 2.749999523162842, 2.8399994373321533]
PHI35_LONG_FACTOR = [1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601,
                     1.5899999141693115, 1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863,
                     3.2300000190734863, 4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789,
                     12.199999809265137, 17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578,
                     30.840002059936523, 32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992,
                     50.340003967285156, 50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992,
                     60.1400032043457, 62.61000442810059, 62.62000274658203, 62.71000289916992, 63.1400032043457,
                     63.1400032043457, 63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125,
                     64.02999877929688, 64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938,
                     64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999969482422]
PHI4_FACTOR = [1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649,
               2.446418898, 2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533,
               5.984965424, 6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651,
               14.64173252, 16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03,
               32.1, 32.13, 32.23, 32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16,
               47.77]
"""Phi-4-mini-instruct ships this list as both short_factor and long_factor."""

GEMMA_TOKENS = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                    additional_special_tokens=["<start_of_turn>", "<end_of_turn>"])
PHI_TOKENS = dict(bos_token="<s>", eos_token="<|endoftext|>", additional_special_tokens=[
    "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"])
GRANITE_TOKENS = dict(bos_token="<|end_of_text|>", eos_token="<|end_of_text|>", additional_special_tokens=[
    "<|start_of_role|>", "<|end_of_role|>"])

@dataclass(frozen=True)
class PublishedModel:
    """What a Hub repo ships that decides how a model is served, sizes shrunk."""

    config: dict
    """config.json, written verbatim."""
    generation_config: dict
    """generation_config.json, written verbatim."""
    chat_template: str
    special_tokens: dict
    """The tokenizer's bos_token, eos_token ... and the other tokens the template writes."""


PUBLISHED = {
    "google/gemma-3-1b-it": PublishedModel(dict(
        architectures=["Gemma3ForCausalLM"], attention_bias=False, attention_dropout=0.0, attn_logit_softcapping=None,
        bos_token_id=2, cache_implementation="hybrid", eos_token_id=[1, 106], final_logit_softcapping=None,
        head_dim=256, hidden_activation="gelu_pytorch_tanh", hidden_size=72, initializer_range=0.02,
        intermediate_size=128, max_position_embeddings=32768, model_type="gemma3_text", num_attention_heads=4,
        num_hidden_layers=7, num_key_value_heads=1, pad_token_id=0, query_pre_attn_scalar=256, rms_norm_eps=1e-06,
        rope_local_base_freq=10000, rope_scaling=None, rope_theta=1000000, sliding_window=32,
        sliding_window_pattern=6, torch_dtype="bfloat16", transformers_version="4.50.0.dev0", use_cache=True,
        vocab_size=640), dict(
        bos_token_id=2, cache_implementation="hybrid", do_sample=True, eos_token_id=[1, 106], pad_token_id=0,
        top_k=64, top_p=0.95, transformers_version="4.50.0.dev0"), GEMMA3_TEMPLATE, GEMMA_TOKENS),
    "google/gemma-2-2b-it": PublishedModel(dict(
        architectures=["Gemma2ForCausalLM"], attention_bias=False, attention_dropout=0.0, attn_logit_softcapping=50.0,
        bos_token_id=2, cache_implementation="hybrid", eos_token_id=[1, 107], final_logit_softcapping=30.0,
        head_dim=256, hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", hidden_size=72,
        initializer_range=0.02, intermediate_size=128, max_position_embeddings=8192, model_type="gemma2",
        num_attention_heads=4, num_hidden_layers=3, num_key_value_heads=2, pad_token_id=0, query_pre_attn_scalar=256,
        rms_norm_eps=1e-06, rope_theta=10000.0, sliding_window=24, torch_dtype="float32",
        transformers_version="4.42.4", use_cache=True, vocab_size=640), dict(
        bos_token_id=2, cache_implementation="hybrid", eos_token_id=[1, 107], pad_token_id=0,
        transformers_version="4.42.4"), GEMMA_TEMPLATE, GEMMA_TOKENS),
    "google/gemma-2b-it": PublishedModel(dict(
        architectures=["GemmaForCausalLM"], attention_bias=False, attention_dropout=0.0, bos_token_id=2,
        eos_token_id=1, head_dim=256, hidden_act="gelu", hidden_activation=None, hidden_size=72,
        initializer_range=0.02, intermediate_size=128, max_position_embeddings=8192, model_type="gemma",
        num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=1, pad_token_id=0, rms_norm_eps=1e-06,
        rope_scaling=None, rope_theta=10000.0, torch_dtype="bfloat16", transformers_version="4.38.0.dev0",
        use_cache=True, vocab_size=640), dict(
        bos_token_id=2, eos_token_id=1, pad_token_id=0, transformers_version="4.38.0.dev0"), GEMMA_TEMPLATE,
        GEMMA_TOKENS),
    "microsoft/Phi-3.5-mini-instruct": PublishedModel(dict(
        _name_or_path="Phi-3.5-mini-instruct", architectures=["Phi3ForCausalLM"], attention_dropout=0.0,
        auto_map={"AutoConfig": "configuration_phi3.Phi3Config",
                  "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
        bos_token_id=1, embd_pdrop=0.0, eos_token_id=32000, hidden_act="silu", hidden_size=192,
        initializer_range=0.02, intermediate_size=128, max_position_embeddings=131072, model_type="phi3",
        num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=2, original_max_position_embeddings=4096,
        pad_token_id=32000, resid_pdrop=0.0, rms_norm_eps=1e-05,
        rope_scaling={"long_factor": PHI35_LONG_FACTOR, "short_factor": PHI35_SHORT_FACTOR, "type": "longrope"},
        rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=False, torch_dtype="bfloat16",
        transformers_version="4.43.3", use_cache=True, attention_bias=False, vocab_size=32064), dict(
        bos_token_id=1, eos_token_id=[32007, 32001, 32000], pad_token_id=32000, transformers_version="4.43.3"),
        PHI35_TEMPLATE, PHI_TOKENS),
    "microsoft/Phi-4-mini-instruct": PublishedModel(dict(
        architectures=["Phi3ForCausalLM"], attention_bias=False, attention_dropout=0.0,
        auto_map={"AutoConfig": "configuration_phi3.Phi3Config",
                  "AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM",
                  "AutoTokenizer": "Xenova/gpt-4o"},
        bos_token_id=199999, embd_pdrop=0.0, eos_token_id=199999, full_attn_mod=1, hidden_act="silu",
        hidden_size=256, initializer_range=0.02, intermediate_size=128, interpolate_factor=1, lm_head_bias=False,
        max_position_embeddings=131072, mlp_bias=False, model_type="phi3", num_attention_heads=2,
        num_hidden_layers=2, num_key_value_heads=1, original_max_position_embeddings=4096, pad_token_id=199999,
        partial_rotary_factor=0.75, resid_pdrop=0.0, rms_norm_eps=1e-05,
        rope_scaling={"long_factor": PHI4_FACTOR, "short_factor": PHI4_FACTOR, "type": "longrope"},
        rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=True, torch_dtype="bfloat16",
        transformers_version="4.45.0", use_cache=True, vocab_size=200064), dict(
        bos_token_id=199999, eos_token_id=[200020, 199999], pad_token_id=199999, transformers_version="4.45.0"),
        PHI4_TEMPLATE, PHI_TOKENS),
    "ibm-granite/granite-3.3-2b-instruct": PublishedModel(dict(
        architectures=["GraniteForCausalLM"], attention_bias=False, attention_dropout=0.0,
        attention_multiplier=0.015625, bos_token_id=0, embedding_multiplier=12.0, eos_token_id=0, hidden_act="silu",
        hidden_size=256, initializer_range=0.02, intermediate_size=128, logits_scaling=8.0,
        max_position_embeddings=131072, mlp_bias=False, model_type="granite", num_attention_heads=4,
        num_hidden_layers=2, num_key_value_heads=1, pad_token_id=0, residual_multiplier=0.22, rms_norm_eps=1e-05,
        rope_scaling=None, rope_theta=10000000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
        transformers_version="4.49.0", use_cache=True, vocab_size=640), dict(
        bos_token_id=0, eos_token_id=0, pad_token_id=0, transformers_version="4.49.0"), GRANITE_TEMPLATE,
        GRANITE_TOKENS),
}


@pytest.fixture(scope="module")
def published_dirs(tmp_path_factory) -> dict[str, Path]:
    """Every published model's directory, built once for the module (about 3 s)."""
    root = tmp_path_factory.mktemp("published")
    return {name: save_published_model(root / name.replace("/", "--"), model.config, model.generation_config,
                                       model.chat_template, model.special_tokens, seed=3)
            for name, model in PUBLISHED.items()}


def step_to_end(engine: EngineCore) -> dict[str, list[int]]:
    """Each request's new token ids, the engine stepped until it has no unfinished request."""
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    return outputs


# 90 tokens: past Gemma 3's (32) and Gemma 2's (24) windows, 6 chunks of the 16-token step budget. The second
# prompt shares the first's 72 leading tokens: 4 full blocks of 16 come from the prefix cache.
LONG_PROMPT = tuple((7 * i + 3) % 500 + 3 for i in range(90))
SHARED_PREFIX_PROMPT = LONG_PROMPT[:72] + (9, 8, 7, 6, 5)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_model_matches_transformers_with_chunked_prefill_and_a_prefix_cache_hit(published_dirs, name):
    model_dir = published_dirs[name]
    engine = EngineCore(model_dir, EngineConfig(dtype="float32", block_size=16, max_num_batched_tokens=16,
                                                max_model_len=256, num_kv_blocks=16))
    cases = [GreedyCase(prompt, 8, ignore_eos=True) for prompt in (LONG_PROMPT, SHARED_PREFIX_PROMPT)]
    outputs = []
    for index, case in enumerate(cases):  # one after the other: the second finds the first's blocks cached
        engine.add_request(str(index), list(case.prompt_token_ids), case.params())
        outputs.append(step_to_end(engine)[str(index)])
    assert outputs == [hf_greedy(model_dir, case) for case in cases]
    assert engine.stats().prefix_cache_hits == 64
    assert_pool_idle(engine.block_manager)


PUBLISHED_DTYPES = {"google/gemma-2-2b-it": torch.float32}
"""torch_dtype of the published configs that are not bfloat16."""


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_dtype_auto_runs_the_published_torch_dtype_as_close_to_float32_as_transformers_does(published_dirs, name):
    """bfloat16 (the published torch_dtype of all but gemma-2-2b-it): the engine's prompt logits are within twice
    the largest distance of transformers' own bfloat16 logits from its float32 ones (40 tokens: past both Gemma
    windows)."""
    model_dir = published_dirs[name]
    dtype = PUBLISHED_DTYPES.get(name, torch.bfloat16)
    prompt = list(LONG_PROMPT[:40])
    engine = EngineCore(model_dir, EngineConfig(block_size=16, max_num_batched_tokens=16, max_model_len=64,
                                                num_kv_blocks=4))
    assert engine.model.embed_tokens.weight.dtype == dtype
    reference = hf_logits(model_dir, prompt)
    with torch.inference_mode():
        transformers_logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)(
            torch.tensor([prompt])).logits[0].float()
    transformers_error = (transformers_logits - reference).abs().max().item()
    engine_error = (engine.prompt_logits(prompt).float() - reference).abs().max().item()
    assert engine_error <= max(2 * transformers_error, 1e-4)
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(step_to_end(engine)["r"]) == 4


# Each published EOS id, made the greedy choice by a logit_bias: the ids of generation_config.json's list that
# config.json's eos_token_id does not name (Gemma's end-of-turn, Phi's <|end|> / <|endoftext|>) stop too.
EOS_IDS = {"google/gemma-3-1b-it": (1, 106), "google/gemma-2-2b-it": (1, 107), "google/gemma-2b-it": (1,),
           "microsoft/Phi-3.5-mini-instruct": (32000, 32001, 32007), "microsoft/Phi-4-mini-instruct": (199999, 200020),
           "ibm-granite/granite-3.3-2b-instruct": (0,)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_eos_id_of_generation_config_stops_generation(published_dirs, name):
    llm = LLM(published_dirs[name], dtype="float32", block_size=16, max_model_len=64, num_kv_blocks=8)
    assert llm.engine.eos_token_ids == frozenset(EOS_IDS[name])
    for eos_id in EOS_IDS[name]:
        biased = dict(temperature=0.0, max_tokens=3, logit_bias={eos_id: 100.0})
        [stopped, ignored] = llm.generate([list(LONG_PROMPT[:20])] * 2, [
            SamplingParams(**biased), SamplingParams(**biased, ignore_eos=True)])
        assert (stopped.outputs[0].token_ids, stopped.outputs[0].finish_reason) == ([eos_id], "stop")
        assert (ignored.outputs[0].token_ids, ignored.outputs[0].finish_reason) == ([eos_id] * 3, "length")


CONVERSATION = [{"role": "user", "content": "Tell me about the river."}]
WITH_SYSTEM = [{"role": "system", "content": "Answer briefly."}, *CONVERSATION]
GEMMA_REFUSING_SYSTEM = ("google/gemma-2-2b-it", "google/gemma-2b-it")
"""Their template raises on a system message (Gemma 3's folds it into the first user turn)."""


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_offline_generate_and_chat_match_transformers(published_dirs, name):
    model_dir = published_dirs[name]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    llm = LLM(model_dir, dtype="float32", block_size=16, max_model_len=256, num_kv_blocks=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [completion] = llm.generate("Tell me about the river.", greedy)
    assert completion.prompt_token_ids == tokenizer("Tell me about the river.")["input_ids"]
    expected = hf_greedy(model_dir, GreedyCase(tuple(completion.prompt_token_ids), 6, ignore_eos=True))
    assert completion.outputs[0].token_ids == expected
    for messages in (CONVERSATION, WITH_SYSTEM):
        if name in GEMMA_REFUSING_SYSTEM and messages is WITH_SYSTEM:
            with pytest.raises(InvalidRequestError) as error:
                llm.chat(messages, greedy)
            assert str(error.value) == "messages: rejected by the chat template: System role not supported"
            continue
        [chat] = llm.chat(messages, greedy)
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert chat.prompt_token_ids == prompt
        assert chat.outputs[0].token_ids == hf_greedy(model_dir, GreedyCase(tuple(prompt), 6, ignore_eos=True))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_chat_completions_over_http_match_transformers_and_a_refusing_template_is_a_400(published_dirs, name):
    model_dir = published_dirs[name]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with served_apis(model_dir, "m", mode="colocated", max_model_len=256) as served:
        for messages in (CONVERSATION, WITH_SYSTEM):
            body = dict(model="m", messages=messages, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True,
                        return_tokens_as_token_ids=True)
            status, _, answer = http_request(served.http_port, "POST", "/v1/chat/completions",
                                             json.dumps(body).encode())
            if name in GEMMA_REFUSING_SYSTEM and messages is WITH_SYSTEM:
                assert (status, json.loads(answer)["error"]) == (400, {
                    "message": "messages: rejected by the chat template: System role not supported",
                    "type": "invalid_request_error", "param": "messages", "code": None})
                continue
            assert status == 200, answer
            tokens = [int(entry["token"].removeprefix("token_id:"))
                      for entry in json.loads(answer)["choices"][0]["logprobs"]["content"]]
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
            assert tokens == hf_greedy(model_dir, GreedyCase(tuple(prompt), 6, ignore_eos=True))
