"""End-to-end behaviour of the offline API and EngineCore on the tiny Llama (exact values)."""

from __future__ import annotations

import io
import math
import re

import pytest
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from tests.factories import _hf_model, assert_pool_idle, copy_with_generation_config, hf_greedy
from splitserve.common.config import SpeculativeConfig
from splitserve.common.errors import InvalidRequestError
from splitserve.common.structured_output import StructuredOutput
from splitserve.common.token_logprobs import Logprob, TokenLogprobs
from splitserve.engine import LLM, EngineConfig, EngineCore, SamplingParams, StructuredOutputsParams
from splitserve.testing.tiny_models import PARTS_CHAT_TEMPLATE, THINKING_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE
from splitserve.testing.workloads import GreedyCase

PROMPT = "Tell me about the river and the old mill by the village road."


SMALL_POOL = dict(block_size=16, max_model_len=512, num_kv_blocks=256)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir) -> LLM:
    return LLM(tiny_llama_dir, **SMALL_POOL)


@pytest.fixture(autouse=True)
def pool_idle_after(request):
    """Every test leaves the engine with nothing allocated (cached-free blocks allowed)."""
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished_requests()
        assert_pool_idle(engine.block_manager)


def greedy(max_tokens: int | None = 24, **overrides) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **overrides)


def test_string_prompt_is_tokenized_like_the_tokenizer(llm, tiny_llama_dir):
    output = llm.generate(PROMPT, greedy())[0]
    prompt_ids = llm.tokenizer.encode(PROMPT)
    assert output.prompt_token_ids == prompt_ids
    assert output.prompt == PROMPT
    assert output.token_ids == hf_greedy(tiny_llama_dir, GreedyCase(tuple(prompt_ids), 24, ignore_eos=True))
    assert output.text == llm.tokenizer.decode(output.token_ids, skip_special_tokens=True)
    assert output.finish_reason == "length"


def test_get_tokenizer_is_the_tokenizer_prompts_are_encoded_with(llm):
    # vLLM scripts render chat prompts and count tokens with llm.get_tokenizer().
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    assert llm.generate(PROMPT, greedy(1))[0].prompt_token_ids == tokenizer.encode(PROMPT)


def test_vllm_structured_outputs_constrain_the_offline_output(llm):
    # vLLM's offline structured-output example: SamplingParams(structured_outputs=StructuredOutputsParams(...)).
    sentiment = StructuredOutputsParams(choice=["Positive", "Negative"])
    choice = SamplingParams(temperature=0.0, structured_outputs=sentiment)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    as_json = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputsParams(json=schema))
    picked, answer = llm.generate(["Classify: what a day", PROMPT], [choice, as_json])
    assert picked.text in ("Positive", "Negative") and picked.finish_reason == "stop"
    assert answer.outputs[0].text == llm.generate(PROMPT, SamplingParams(
        temperature=0.0, max_tokens=12, structured_output=StructuredOutput.json_schema(schema)))[0].text


SQL_GBNF = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""
"""vLLM's offline structured-output example grammar: GBNF (xgrammar's), not Lark."""


def test_a_gbnf_grammar_is_converted_to_lark_offline_as_the_router_converts_it(llm):
    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(grammar=SQL_GBNF))
    output = llm.generate("Generate an SQL query:", params)[0].outputs[0]
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", output.text), output.text
    assert output.finish_reason == "stop"
    with pytest.raises(InvalidRequestError, match="^grammar: is not a valid GBNF grammar"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= (")))


def test_stop_string_cuts_text_exactly(llm):
    full = llm.generate(PROMPT, greedy(40))[0]
    stop = full.text[10:13]
    cut = full.text.find(stop)
    output = llm.generate(PROMPT, greedy(40, stop=[stop]))[0]
    assert output.text == full.text[:cut]
    assert output.finish_reason == "stop" and output.stop_reason == stop
    assert output.token_ids == full.token_ids[: len(output.token_ids)]


def test_stop_token_id_ends_at_first_occurrence(llm):
    full = llm.generate(PROMPT, greedy(30))[0]
    stop_token = full.token_ids[5]
    first = full.token_ids.index(stop_token)
    output = llm.generate(PROMPT, greedy(30, stop_token_ids=[stop_token]))[0]
    assert output.token_ids == full.token_ids[: first + 1]
    assert output.finish_reason == "stop" and output.stop_reason == stop_token
    # The stop token's text is not output (vLLM's include_stop_str_in_output false), whatever it decodes to.
    assert output.text == llm.tokenizer.decode(full.token_ids[:first]) != llm.tokenizer.decode(output.token_ids)


def test_eos_stops_unless_ignored(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, EngineConfig(block_size=16, num_kv_blocks=64, max_model_len=256),
                        Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")))
    probe = _run(engine, {"probe": ([5, 6, 7, 8], greedy(20))})["probe"]
    engine.eos_token_ids = frozenset({probe[6]})
    texts = {}
    outputs = _run(engine, {"eos": ([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=20)),
                            "ignore": ([5, 6, 7, 8], greedy(20))}, texts)
    end = probe.index(probe[6])
    assert outputs["eos"] == probe[: end + 1]
    assert texts["eos"] == engine.tokenizer.decode(probe[:end])  # EOS ends the text without its own
    assert outputs["ignore"] == probe
    assert_pool_idle(engine.block_manager)


def _run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]],
         texts: dict[str, str] | None = None) -> dict[str, list[int]]:
    """Each request's output token ids; `texts` gets each one's text."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs = {request_id: [] for request_id in requests}
    text = dict.fromkeys(requests, "")
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
            text[delta.request_id] += delta.text_delta
    if texts is not None:
        texts.update(text)
    return outputs


def test_seeded_sampling_is_independent_of_batch_mates(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(PROMPT, seeded)[0].token_ids
    mates = ["a different prompt", "another one, longer than the others by a fair margin", "x"]
    mate_params = [SamplingParams(temperature=0.9, seed=i, max_tokens=30, ignore_eos=True) for i in range(3)]
    in_batch = llm.generate(mates[:2] + [PROMPT] + mates[2:], mate_params[:2] + [seeded] + mate_params[2:])
    unseeded_mates = llm.generate([PROMPT, *mates], [seeded] + [SamplingParams(temperature=1.0)] * 3)
    assert in_batch[2].token_ids == alone
    assert unseeded_mates[0].token_ids == alone
    other_seed = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=99, max_tokens=24, ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_top_k_one_equals_greedy(llm):
    sampled = llm.generate(PROMPT, SamplingParams(temperature=1.5, top_k=1, seed=3, max_tokens=24, ignore_eos=True))
    assert sampled[0].token_ids == llm.generate(PROMPT, greedy())[0].token_ids


def test_logprobs_match_transformers(llm, tiny_llama_dir):
    output = llm.generate(PROMPT, greedy(8, logprobs=3))[0]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    ids = torch.tensor([output.prompt_token_ids + output.token_ids])
    with torch.inference_mode():
        reference = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    first = len(output.prompt_token_ids) - 1
    assert len(output.logprobs) == 8
    for step, entry in enumerate(output.logprobs):
        row = reference[first + step]
        assert entry.token_id == output.token_ids[step]
        assert entry.rank == 1
        assert math.isclose(entry.logprob, float(row[entry.token_id]), abs_tol=1e-4)
        assert [t for t, _ in entry.top] == torch.topk(row, 3).indices.tolist()


def test_chat_takes_one_conversation_or_many_and_returns_a_list_like_vllm(llm, tiny_llama_dir):
    hello = [{"role": "user", "content": "hello"}]
    mill = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the old mill."}]
    templated = [list(llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False)) for conversation in (hello, mill)]
    expected = [hf_greedy(tiny_llama_dir, GreedyCase(tuple(ids), 8, ignore_eos=True)) for ids in templated]
    one, two = llm.chat(hello, greedy(8)), llm.chat([hello, mill], greedy(8))
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in one] == [(templated[0], expected[0])]
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in two] == list(zip(templated, expected))


def test_chat_output_prompt_is_the_rendered_conversation_like_vllm(llm):
    # vLLM's LLM.chat reports the templated text as RequestOutput.prompt (scripts print it next to the answer).
    hello = [{"role": "user", "content": "hello"}]
    text = llm.tokenizer.apply_chat_template(hello, add_generation_prompt=True, tokenize=False)
    output = llm.chat(hello, greedy(2))[0]
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert (output.prompt, output.prompt_token_ids) == (text, llm.tokenizer.encode(text, add_special_tokens=False))


def test_chat_and_generate_of_an_empty_list_return_no_outputs_like_vllm(llm):
    """vLLM reads an empty list as no conversations (no prompts), not as one conversation of no
    messages (one prompt of no tokens)."""
    prompt_tokens = llm.stats().num_prompt_tokens
    assert llm.chat([], greedy(8)) == []
    assert llm.generate([], greedy(8)) == []
    assert llm.stats().num_prompt_tokens == prompt_tokens


MILL_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the old mill."},
             {"role": "assistant", "content": "The old mill stands"}]


def _templated(llm: LLM, conversation, **options) -> list[int]:
    """transformers' apply_chat_template token ids of `conversation` (the reference chat() must match)."""
    return list(llm.tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False, **options))


def test_chat_without_a_generation_prompt_runs_the_conversation_as_transformers_renders_it(llm):
    expected = _templated(llm, MILL_CHAT, add_generation_prompt=False)
    output = llm.chat(MILL_CHAT, greedy(8), add_generation_prompt=False)[0]
    assert output.prompt_token_ids == expected != _templated(llm, MILL_CHAT, add_generation_prompt=True)
    assert llm.tokenizer.decode(expected).endswith("The old mill stands<|im_end|>\n")
    assert output.outputs[0].token_ids == llm.generate([expected], greedy(8))[0].outputs[0].token_ids


def test_chat_continue_final_message_ends_the_prompt_inside_the_last_message_like_transformers(llm):
    expected = _templated(llm, MILL_CHAT, add_generation_prompt=False, continue_final_message=True)
    output = llm.chat(MILL_CHAT, greedy(8), add_generation_prompt=False, continue_final_message=True)[0]
    assert output.prompt_token_ids == expected
    assert llm.tokenizer.decode(expected).endswith("<|im_start|>assistant\nThe old mill stands")
    assert output.outputs[0].token_ids == llm.generate([expected], greedy(8))[0].outputs[0].token_ids
    # Any role's message may be continued: transformers (which vLLM's chat renders with) checks none.
    user_turn = MILL_CHAT[:2]
    continued = llm.chat(user_turn, greedy(8), add_generation_prompt=False, continue_final_message=True)[0]
    assert continued.prompt_token_ids == _templated(llm, user_turn, continue_final_message=True)
    assert llm.tokenizer.decode(continued.prompt_token_ids).endswith("<|im_start|>user\nTell me about the old mill.")


def test_chat_refuses_continue_final_message_with_a_generation_prompt_in_transformers_words(llm):
    with pytest.raises(ValueError, match="^continue_final_message: continue_final_message and add_generation_prompt "
                                         "are not compatible: pass add_generation_prompt=False to continue the final "
                                         "message$"):
        llm.chat(MILL_CHAT, greedy(8), continue_final_message=True)


def test_chat_renders_with_a_chat_template_given_as_a_string(llm):
    template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}[assistant] {% endif %}")
    output = llm.chat([{"role": "user", "content": "hello"}], greedy(8), chat_template=template)[0]
    assert output.prompt_token_ids == llm.tokenizer.encode("[user] hello\n[assistant] ", add_special_tokens=False)


def test_chat_template_kwargs_are_template_variables(llm):
    hello = [{"role": "user", "content": "hello"}]
    output = llm.chat(hello, greedy(8), chat_template="{{ greeting }}, {{ messages[0]['content'] }}",
                      chat_template_kwargs={"greeting": "good morning"})[0]
    assert output.prompt_token_ids == llm.tokenizer.encode("good morning, hello", add_special_tokens=False)
    # Qwen3's switch, as vLLM scripts pass it: the template writes an empty think block.
    qwen3 = llm.chat(hello, greedy(8), chat_template=THINKING_CHAT_TEMPLATE,
                     chat_template_kwargs={"enable_thinking": False})[0]
    expected = _templated(llm, hello, chat_template=THINKING_CHAT_TEMPLATE, add_generation_prompt=True,
                          enable_thinking=False)
    assert qwen3.prompt_token_ids == expected
    assert llm.tokenizer.decode(expected).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_kwargs_pass_documents_to_the_template_as_vllm_does(llm):
    template = "{% for d in documents %}{{ d['title'] }}; {% endfor %}{{ messages[0]['content'] }}"
    output = llm.chat([{"role": "user", "content": "hello"}], greedy(8), chat_template=template,
                      chat_template_kwargs={"documents": [{"title": "mill", "text": "x"}, {"title": "road", "text": "y"}]})
    assert output[0].prompt_token_ids == llm.tokenizer.encode("mill; road; hello", add_special_tokens=False)


def test_chat_tools_reach_the_template(llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    hello = [{"role": "user", "content": "hello"}]
    output = llm.chat(hello, greedy(8), chat_template=TOOLS_CHAT_TEMPLATE, tools=tools)[0]
    assert output.prompt_token_ids == _templated(llm, hello, chat_template=TOOLS_CHAT_TEMPLATE, tools=tools,
                                                 add_generation_prompt=True)
    assert ('<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}'
            '\n</tools>') in llm.tokenizer.decode(output.prompt_token_ids)


WEATHER_CALL_CHAT = [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call-1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]


def test_chat_hands_a_tool_call_s_json_arguments_to_the_template_parsed_like_vllm_and_the_router(llm):
    output = llm.chat(WEATHER_CALL_CHAT, greedy(8), chat_template=TOOLS_CHAT_TEMPLATE)[0]
    parsed = [WEATHER_CALL_CHAT[0], {**WEATHER_CALL_CHAT[1], "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        WEATHER_CALL_CHAT[2]]
    assert output.prompt_token_ids == _templated(llm, parsed, chat_template=TOOLS_CHAT_TEMPLATE,
                                                 add_generation_prompt=True)
    assert '"arguments": {"city": "Paris"}}' in llm.tokenizer.decode(output.prompt_token_ids)
    assert WEATHER_CALL_CHAT[1]["tool_calls"][0]["function"]["arguments"] == '{"city":"Paris"}'  # not edited


@pytest.mark.parametrize("arguments", [None, ""])
def test_chat_renders_a_tool_call_without_arguments_as_an_empty_object_like_vllm(llm, arguments):
    call = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    chat = [WEATHER_CALL_CHAT[0], {"role": "assistant", "content": "", "tool_calls": [call]}]
    output = llm.chat(chat, greedy(8), chat_template=TOOLS_CHAT_TEMPLATE)[0]
    assert '"arguments": {}}' in llm.tokenizer.decode(output.prompt_token_ids)


def test_chat_refuses_a_tool_call_s_arguments_that_are_not_json_naming_them(llm):
    broken = [WEATHER_CALL_CHAT[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]
    with pytest.raises(InvalidRequestError) as refused:
        llm.chat([WEATHER_CALL_CHAT, broken], greedy(8), chat_template=TOOLS_CHAT_TEMPLATE)
    assert refused.value.field == "messages[1][1].tool_calls[0].function.arguments"


def test_chat_content_as_text_parts_is_joined_with_newlines_like_the_router(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    output = llm.chat(parts, greedy(8), chat_template_content_format="string", lora_request=None,
                      mm_processor_kwargs=None)[0]
    assert output.prompt_token_ids == _templated(llm, [{"role": "user", "content": "hello\nthere"}],
                                                 add_generation_prompt=True)


def test_chat_passes_content_parts_to_a_template_that_loops_over_them(llm):
    """chat_template_content_format "auto" (the default) reads the template: this one iterates a
    message's content, so it gets the parts (a string content as one part), as vLLM hands them over."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    output = llm.chat(parts, greedy(8), chat_template=PARTS_CHAT_TEMPLATE)[0]
    assert output.prompt_token_ids == _templated(llm, parts, chat_template=PARTS_CHAT_TEMPLATE,
                                                 add_generation_prompt=True)
    assert llm.tokenizer.decode(output.prompt_token_ids) == (
        "<|im_start|>user\n[hello][there]<|im_end|>\n<|im_start|>assistant\n")
    plain = llm.chat([{"role": "user", "content": "hello"}], greedy(8), chat_template=PARTS_CHAT_TEMPLATE)[0]
    assert llm.tokenizer.decode(plain.prompt_token_ids) == "<|im_start|>user\n[hello]<|im_end|>\n<|im_start|>assistant\n"


def test_chat_content_format_given_overrides_the_template_s(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]}]
    joined = llm.chat(parts, greedy(8), chat_template=PARTS_CHAT_TEMPLATE, chat_template_content_format="string")[0]
    assert joined.prompt_token_ids == _templated(llm, [{"role": "user", "content": "hello\nthere"}],
                                                 chat_template=PARTS_CHAT_TEMPLATE, add_generation_prompt=True)
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    listed = llm.chat([{"role": "user", "content": "hi"}], greedy(8), chat_template=plain,
                      chat_template_content_format="openai")[0]
    assert listed.prompt_token_ids == _templated(llm, [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                                                 chat_template=plain)
    assert llm.tokenizer.decode(listed.prompt_token_ids) == "[{'type': 'text', 'text': 'hi'}]"


@pytest.mark.parametrize("options, field", [
    (dict(continue_final_message=True), "continue_final_message"),
    (dict(chat_template_kwargs={"tools": []}), "chat_template_kwargs.tools"),
    (dict(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs.add_generation_prompt"),
    (dict(chat_template_kwargs={"chat_template": "{{ 1 }}"}), "chat_template_kwargs.chat_template"),
    (dict(chat_template_kwargs={"messages": []}), "chat_template_kwargs.messages"),
    (dict(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs.tokenize"),
    (dict(chat_template_kwargs={"return_dict": True}), "chat_template_kwargs.return_dict"),
    (dict(chat_template_kwargs={1: True}), "chat_template_kwargs"),
    (dict(chat_template_kwargs=[("enable_thinking", False)]), "chat_template_kwargs"),
    (dict(chat_template_content_format="strings"), "chat_template_content_format"),
    (dict(add_generation_prompt="no"), "add_generation_prompt"),
    (dict(tools={"type": "function"}), "tools"),
    (dict(chat_template=b"{{ 1 }}"), "chat_template"),
    (dict(chat_template="{% for %}"), "chat_template"),
    (dict(chat_template="{{ raise_exception('no users here') }}"), "messages[0]"),
    (dict(lora_request="adapter"), "lora_request"),
    (dict(mm_processor_kwargs={}), "mm_processor_kwargs"),
    (dict(use_tqdm="yes"), "use_tqdm"),
    (dict(messages={"role": "user", "content": "hello"}), "messages"),
    (dict(messages=[[{"role": "user", "content": "hello"}], ["hello"]]), "messages[1]"),
])
def test_bad_chat_options_are_refused_naming_the_argument_before_anything_runs(llm, options, field):
    prompt_tokens = llm.stats().num_prompt_tokens
    chat = {"messages": [[{"role": "user", "content": "hello"}]] * 2, **options}
    with pytest.raises(InvalidRequestError) as refused:
        llm.chat(sampling_params=greedy(8), **chat)
    assert refused.value.field == field
    assert isinstance(refused.value, ValueError)
    assert llm.stats().num_prompt_tokens == prompt_tokens


def test_chat_template_kwargs_that_break_the_template_s_own_calls_are_refused_as_the_router_does(llm):
    template = "{%- set ns = namespace(turns=0) %}{{ messages[0]['content'] }}"
    with pytest.raises(InvalidRequestError) as refused:
        llm.chat([{"role": "user", "content": "hello"}], greedy(8), chat_template=template,
                 chat_template_kwargs={"namespace": 1})
    assert str(refused.value) == "messages: rejected by the chat template: TypeError: 'int' object is not callable"


def test_chat_refuses_a_non_text_content_part_naming_it(llm):
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(InvalidRequestError) as refused:
        llm.chat([[{"role": "user", "content": "hi"}], image], greedy(8))
    assert refused.value.field == "messages[1][0].content[1]"


def test_use_tqdm_may_be_a_callable_that_makes_the_progress_bar_like_vllm(llm):
    made = []

    def progress_bar(**kwargs) -> tqdm:
        made.append((kwargs, tqdm(file=io.StringIO(), **kwargs)))  # enabled (a disabled bar counts nothing), unseen
        return made[-1][1]

    llm.generate([PROMPT, "another"], greedy(4), use_tqdm=progress_bar)
    llm.chat([{"role": "user", "content": "hello"}], greedy(4, n=3), use_tqdm=progress_bar)
    assert [(kwargs, bar.n) for kwargs, bar in made] == [({"total": 2, "desc": "generate"}, 2),
                                                         ({"total": 3, "desc": "generate"}, 3)]


def test_dict_prompts_run_like_str_and_token_prompts_and_like_transformers(llm, tiny_llama_dir):
    ids, other = llm.tokenizer.encode(PROMPT), [5, 6, 7, 8, 9]
    expected = [hf_greedy(tiny_llama_dir, GreedyCase(tuple(p), 24, ignore_eos=True)) for p in (ids, other)]
    outputs = llm.generate([{"prompt": PROMPT}, {"prompt_token_ids": other}, {"prompt_token_ids": ids, "prompt": "x"},
                            PROMPT, other], greedy())
    assert [o.outputs[0].token_ids for o in outputs] == [expected[0], expected[1], expected[0], expected[0],
                                                         expected[1]]
    assert [o.prompt_token_ids for o in outputs] == [ids, other, ids, ids, other]
    assert [o.prompt for o in outputs] == [PROMPT, None, "x", PROMPT, None]
    (single,) = llm.generate({"prompt_token_ids": other}, greedy())
    assert single.outputs[0].token_ids == expected[1]


def test_stream_and_prompt_logits_take_dict_prompts(llm):
    ids = llm.tokenizer.encode(PROMPT)
    streamed = [t for delta in llm.stream({"prompt_token_ids": ids}, greedy(12)) for t in delta.new_token_ids]
    assert streamed == llm.generate(PROMPT, greedy(12))[0].outputs[0].token_ids
    assert torch.equal(llm.prompt_logits({"prompt": PROMPT}), llm.prompt_logits(ids))


def test_a_cache_salt_shares_the_prefix_cache_only_with_prompts_of_its_own_salt(llm, tiny_llama_dir):
    ids = list(range(300, 340))  # 2 full blocks of 16 (and 8 tokens): no other test runs them
    expected = hf_greedy(tiny_llama_dir, GreedyCase(tuple(ids), 8, ignore_eos=True))
    outputs = [llm.generate(prompt, greedy(8))[0] for prompt in (
        {"prompt_token_ids": ids, "cache_salt": "user-a"}, {"prompt_token_ids": ids, "cache_salt": "user-a"},
        {"prompt_token_ids": ids, "cache_salt": "user-b"}, ids, {"prompt_token_ids": ids, "cache_salt": "user-b"})]
    assert [o.num_cached_tokens for o in outputs] == [0, 32, 0, 0, 32]
    assert all(o.outputs[0].token_ids == expected for o in outputs)
    text_prompt = {"prompt": PROMPT, "cache_salt": "user-c"}
    assert [llm.generate(text_prompt, greedy(4))[0].num_cached_tokens for _ in range(2)] == [0, 16]
    streamed = [delta for delta in llm.stream({"prompt_token_ids": ids, "cache_salt": "user-c"}, greedy(8))]
    assert streamed[-1].num_cached_tokens == 0 and [t for d in streamed for t in d.new_token_ids] == expected
    # An empty salt is no salt, as in vLLM's LLM: it hits the unsalted prompt's blocks.
    unsalted, empty = (llm.generate({"prompt": PROMPT, **salt}, greedy(4))[0] for salt in ({}, {"cache_salt": ""}))
    assert empty.num_cached_tokens == 16 and empty.outputs[0].token_ids == unsalted.outputs[0].token_ids


@pytest.mark.parametrize("prompt, field", [
    ({"prompt": PROMPT, "multi_modal_data": {"image": None}}, "multi_modal_data"),
    ({"prompt_token_ids": [5, 6], "cache_salt": 5}, "cache_salt"),
    ({"prompt_token_ids": [5, 6], "mm_processor_kwargs": {}}, "mm_processor_kwargs"),
    ({"prompt": PROMPT, "promt_token_ids": [5, 6]}, "promt_token_ids"),
    ({}, "prompt"),
    ({"prompt": [5, 6]}, "prompt"),
    ({"prompt_token_ids": [5, 6], "prompt": 7}, "prompt"),
    ({"prompt_token_ids": "5 6"}, "prompt_token_ids"),
])
def test_a_bad_dict_prompt_is_refused_naming_its_key(llm, prompt, field):
    calls = (lambda: llm.generate([PROMPT, prompt], greedy()), lambda: next(llm.stream(prompt, greedy())),
             lambda: llm.prompt_logits(prompt))
    for call in calls:
        with pytest.raises(InvalidRequestError) as error:
            call()
        assert error.value.field == field and str(error.value).startswith(f"{field}: ")


def test_outputs_hold_the_one_completion_like_vllm(llm):
    full = llm.generate(PROMPT, greedy(40))[0]
    stop = full.text[10:13]
    output = llm.generate(PROMPT, greedy(40, stop=[stop], logprobs=2))[0]
    (completion,) = output.outputs
    assert completion.index == 0 and output.finished
    assert completion.text == full.text[:full.text.find(stop)]
    assert completion.token_ids == full.token_ids[:len(completion.token_ids)] and len(completion.token_ids) < 40
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert [entry.token_id for entry in completion.logprobs] == completion.token_ids
    assert completion.cumulative_logprob == sum(entry.logprob for entry in completion.logprobs) < 0
    assert full.outputs[0].logprobs is None and full.outputs[0].cumulative_logprob is None
    shorthands = (output.text, output.token_ids, output.finish_reason, output.stop_reason, output.logprobs)
    assert shorthands == (completion.text, completion.token_ids, "stop", stop, completion.logprobs)
    assert completion.finished() is True  # vLLM's CompletionOutput.finished(): every offline output is finished


def test_logprobs_read_as_vllm_s_dicts_of_logprob(llm):
    # vLLM scripts read each position as {token_id: Logprob}: the sampled token first, then the top ones by rank.
    entry = TokenLogprobs(token_id=9, logprob=-2.5, rank=3, top=((4, -0.5), (7, -1.0)))
    assert list(entry.items()) == [(9, Logprob(-2.5, 3)), (4, Logprob(-0.5, 1)), (7, Logprob(-1.0, 2))]
    assert (entry[4].rank, 8 in entry, len(entry)) == (1, False, 3)
    assert dict(TokenLogprobs(token_id=4, logprob=-0.5, rank=1, top=((4, -0.5), (7, -1.0)))) == {
        4: Logprob(-0.5, 1), 7: Logprob(-1.0, 2)}
    output = llm.generate(PROMPT, greedy(4, logprobs=1, prompt_logprobs=0))[0]
    completion = output.outputs[0]
    assert [position[token].logprob for position, token in zip(completion.logprobs, completion.token_ids)] == [
        entry.logprob for entry in completion.logprobs]
    assert [list(position) for position in output.prompt_logprobs[1:]] == [
        [entry.token_id] for entry in output.prompt_logprobs[1:]]


def test_n_sequences_come_back_as_one_output_each_seeded_seed_plus_index(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=0, n=3)
    prompts = [PROMPT, [5, 6, 7, 8]]
    outputs = llm.generate([prompts[0], {"prompt_token_ids": prompts[1]}], params)
    for prompt, output in zip(prompts, outputs):
        alone = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12, ignore_eos=True,
                                                           logprobs=0) for i in range(3)])
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert [c.token_ids for c in output.outputs] == [a.outputs[0].token_ids for a in alone]
        assert [c.cumulative_logprob for c in output.outputs] == [a.outputs[0].cumulative_logprob for a in alone]
        assert output.prompt_token_ids == alone[0].prompt_token_ids
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) == 3
    with pytest.raises(InvalidRequestError) as error:
        next(llm.stream(PROMPT, params))
    assert error.value.field == "n"


def test_enforce_eager_turns_cuda_graphs_off_and_contradicting_it_is_refused(tiny_llama_dir):
    eager = LLM(tiny_llama_dir, enforce_eager=True, block_size=16, max_model_len=256, num_kv_blocks=32)
    assert eager.engine.config.cuda_graphs is False
    prompt_ids = eager.tokenizer.encode(PROMPT)
    assert eager.generate(PROMPT, greedy())[0].token_ids == hf_greedy(tiny_llama_dir,
                                                                     GreedyCase(tuple(prompt_ids), 24, True))
    assert_pool_idle(eager.engine.block_manager)
    with pytest.raises(ValueError, match="enforce_eager=True and cuda_graphs=True contradict each other"):
        LLM(tiny_llama_dir, enforce_eager=True, cuda_graphs=True)


VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
"""vLLM's offline spelling of n-gram speculation (LLM(model, speculative_config={...}))."""


def test_speculative_config_takes_vllms_dict_and_greedy_tokens_equal_the_plain_run(llm, tiny_llama_dir):
    speculating = LLM(tiny_llama_dir, speculative_config=VLLM_NGRAM, **SMALL_POOL)
    assert speculating.engine.config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                      ngram_min=1, ngram_max=3)
    prompts = [[(11 * i + 5 * (j % (3 + i))) % 500 + 3 for j in range(12)] for i in range(3)]  # repeating motifs
    expected = [output.outputs[0].token_ids for output in llm.generate(prompts, greedy())]
    assert [output.outputs[0].token_ids for output in speculating.generate(prompts, greedy())] == expected
    spec = speculating.engine.stats().spec_decode
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert_pool_idle(speculating.engine.block_manager)


def test_speculative_and_speculative_config_together_are_refused(tiny_llama_dir):
    with pytest.raises(ValueError) as error:
        LLM(tiny_llama_dir, speculative=SpeculativeConfig(), speculative_config=VLLM_NGRAM)
    assert str(error.value) == ("speculative and speculative_config both set speculative decoding; pass one of them "
                                "(speculative_config: vLLM's dict, speculative: a SpeculativeConfig)")
    with pytest.raises(ValueError) as error:
        LLM(tiny_llama_dir, speculative_config={"method": "eagle", "model": "/models/head"})
    assert str(error.value).startswith("speculative.method 'eagle' is not supported: splitserve runs ngram")


@pytest.mark.parametrize("dtype, engine_dtype", [("half", "float16"), ("float", "float32"),
                                                 (torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_dtype_takes_vllms_spellings(tiny_llama_dir, dtype, engine_dtype):
    """vLLM's LLM(dtype=...) takes "half" and "float" (as the CLI's --dtype does) and torch dtypes; they were
    refused ("dtype must be one of ...")."""
    llm = LLM(tiny_llama_dir, dtype=dtype, block_size=16, max_model_len=64, num_kv_blocks=8)
    assert llm.engine.config.dtype == engine_dtype
    assert llm.engine.kv_cache.spec.dtype == getattr(torch, engine_dtype)
    with pytest.raises(ValueError) as error:
        LLM(tiny_llama_dir, dtype=torch.float64)
    assert str(error.value) == "dtype must be one of ('auto', 'float32', 'bfloat16', 'float16'), got 'float64'"


def test_kv_cache_dtype_takes_vllms_fp8(tiny_llama_dir):
    """vLLM's LLM(kv_cache_dtype="fp8") is e4m3, as the CLI's --kv-cache-dtype fp8 (it was refused)."""
    llm = LLM(tiny_llama_dir, kv_cache_dtype="fp8", block_size=16, max_model_len=64, num_kv_blocks=8)
    assert llm.engine.config.kv_cache_dtype == "fp8_e4m3"
    assert llm.engine.kv_cache.spec.quantization.code_dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError) as error:  # not a name: EngineConfig's message, not a TypeError from the aliases
        LLM(tiny_llama_dir, kv_cache_dtype=["fp8"])
    assert "kv_cache_dtype" in str(error.value)


@pytest.mark.parametrize("prompt, field", [
    ([], "prompt"),
    (list(range(3, 515)), "prompt"),  # 512 tokens == max_model_len: no room for output
    ([5, 512], "prompt_token_ids"),
    ([-1, 5], "prompt_token_ids"),
])
def test_invalid_prompt_names_the_field_and_allocates_nothing(llm, prompt, field):
    with pytest.raises(InvalidRequestError) as error:
        llm.generate([[5, 6, 7], prompt], greedy())
    assert error.value.field == field
    assert field in str(error.value)


@pytest.mark.parametrize("call, field", [
    (dict(prompts=None), "prompts"),
    (dict(prompts=123), "prompts"),
    (dict(prompts={PROMPT}), "prompts"),
    (dict(prompts=PROMPT, sampling_params={"max_tokens": 2}), "sampling_params"),
    (dict(prompts=[PROMPT, PROMPT], sampling_params=[greedy(), {"max_tokens": 2}]), "sampling_params"),
    (dict(prompts=PROMPT, sampling_params="greedy"), "sampling_params"),
])
def test_generate_refuses_arguments_of_the_wrong_type_naming_them(llm, call, field):
    with pytest.raises(InvalidRequestError) as error:
        llm.generate(**{"sampling_params": greedy(), **call})
    assert error.value.field == field


def test_stream_refuses_sampling_params_that_are_not_a_sampling_params(llm):
    with pytest.raises(InvalidRequestError) as error:
        next(llm.stream(PROMPT, {"max_tokens": 2}))
    assert error.value.field == "sampling_params"


def test_max_model_len_ends_with_length(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, EngineConfig(block_size=16, num_kv_blocks=8, max_model_len=40))
    outputs = _run(engine, {"long": (list(range(3, 33)), greedy(100))})
    assert len(outputs["long"]) == 10
    assert_pool_idle(engine.block_manager)


def test_pool_smaller_than_max_model_len_is_rejected(tiny_llama_dir):
    with pytest.raises(ValueError, match="enlarge the pool or lower max_model_len"):
        EngineCore(tiny_llama_dir, EngineConfig(block_size=16, num_kv_blocks=4, max_model_len=100))


def test_duplicate_request_id_is_rejected(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, EngineConfig(block_size=16, num_kv_blocks=32, max_model_len=256))
    engine.add_request("same", [5, 6], greedy())
    with pytest.raises(InvalidRequestError) as error:
        engine.add_request("same", [7, 8], greedy())
    assert error.value.field == "request_id"
    engine.abort_request("same")
    engine.step()
    assert_pool_idle(engine.block_manager)


def test_abort_frees_blocks_at_once_and_reports_abort(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, EngineConfig(block_size=16, num_kv_blocks=64, max_model_len=256))
    for name in ("a", "b", "c"):
        engine.add_request(name, list(range(3, 40)), greedy(50))
    engine.step()
    engine.step()
    used_before = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
    assert engine.abort_request("b")
    assert engine.block_manager.num_blocks - engine.block_manager.num_free_blocks == used_before - 3
    finals = [d for d in engine.step() if d.finished]
    assert [(d.request_id, d.finish_reason) for d in finals] == [("b", "abort")]
    assert not engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_idle(engine.block_manager)


def test_stats_count_tokens_exactly(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=16, num_kv_blocks=64, max_model_len=256)
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33)]
    llm.generate(prompts, [greedy(n) for n in (4, 9, 1)])
    stats = llm.stats()
    assert (stats.num_prompt_tokens, stats.num_generation_tokens) == (55, 14)
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (0, 0, 0)
    assert stats.prefix_cache_queries == 55
    assert stats.kv_usage == 0.0
    assert_pool_idle(llm.engine.block_manager)


def test_stream_yields_deltas_that_add_up(llm):
    deltas = list(llm.stream(PROMPT, greedy(12)))
    full = llm.generate(PROMPT, greedy(12))[0]
    assert [t for d in deltas for t in d.new_token_ids] == full.token_ids
    assert "".join(d.text_delta for d in deltas) == full.text
    assert [d.finished for d in deltas] == [False] * 11 + [True]


STREAMED = [PROMPT, "The old mill by the river.", "Hello there"]


def _tokens_and_text(deltas) -> tuple[list[int], str, list[bool]]:
    tokens = [t for d in deltas for t in d.new_token_ids]
    return tokens, "".join(d.text_delta for d in deltas), [d.finished for d in deltas]


def test_streams_read_in_turns_and_a_generate_between_them_each_get_all_their_deltas(llm):
    """A step serves every open request; each call gets exactly its own deltas, those a step made
    for another call's request are kept for it (none dropped, none crossing)."""
    expected = llm.generate(STREAMED, greedy(12))
    first, second = llm.stream(STREAMED[0], greedy(12)), llm.stream(STREAMED[1], greedy(12))
    deltas = {0: [next(first)], 1: [next(second)]}
    assert llm.generate(STREAMED[2], greedy(12))[0].token_ids == expected[2].token_ids
    deltas[0].extend(first)
    deltas[1].extend(second)
    for index in (0, 1):
        want = expected[index]
        assert _tokens_and_text(deltas[index]) == (want.token_ids, want.text, [False] * 11 + [True])


def test_closing_a_stream_aborts_only_its_own_request(llm):
    expected = llm.generate(STREAMED[1], greedy(12))[0]
    first, second = llm.stream(STREAMED[0], greedy(12)), llm.stream(STREAMED[1], greedy(12))
    next(first)
    deltas = [next(second)]
    first.close()
    deltas.extend(second)
    assert _tokens_and_text(deltas) == (expected.token_ids, expected.text, [False] * 11 + [True])


def test_an_interrupted_generate_leaves_nothing_running(llm, monkeypatch):
    """Ctrl-C during generate(): its requests are aborted, and the next call runs as on a fresh engine."""
    expected = llm.generate(STREAMED, greedy(12))
    step = llm.engine.step
    calls = iter(range(3))
    monkeypatch.setattr(llm.engine, "step", lambda: step() if next(calls, None) is not None else _interrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(STREAMED, greedy(12))
    monkeypatch.setattr(llm.engine, "step", step)
    assert not llm.engine.scheduler.requests
    assert [o.token_ids for o in llm.generate(STREAMED, greedy(12))] == [o.token_ids for o in expected]


def test_a_generate_interrupted_while_queueing_leaves_nothing_running(llm, monkeypatch):
    expected = llm.generate(STREAMED, greedy(12))
    add_request = llm.engine.add_request
    calls = iter(range(1))
    monkeypatch.setattr(llm.engine, "add_request",
                        lambda *args, **kwargs: add_request(*args, **kwargs) if next(calls, None) is not None
                        else _interrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(STREAMED, greedy(12))
    monkeypatch.setattr(llm.engine, "add_request", add_request)
    assert not llm.engine.scheduler.requests
    assert [o.token_ids for o in llm.generate(STREAMED, greedy(12))] == [o.token_ids for o in expected]


def _interrupt():
    raise KeyboardInterrupt


def test_min_tokens_bans_stop_tokens_until_reached_like_transformers(llm, tiny_llama_dir):
    full = llm.generate(PROMPT, greedy(20))[0]
    stop_token = full.token_ids[0]  # greedy would stop at once
    output = llm.generate(PROMPT, greedy(20, stop_token_ids=[stop_token], min_tokens=4))[0]
    model = _hf_model(tiny_llama_dir)
    with torch.inference_mode():
        expected = model.generate(torch.tensor([full.prompt_token_ids]), max_new_tokens=20, min_new_tokens=4,
                                  eos_token_id=stop_token, do_sample=False, pad_token_id=0)
    assert output.token_ids == expected[0, len(full.prompt_token_ids):].tolist()
    assert stop_token not in output.token_ids[:4] and len(output.token_ids) > 4


def test_min_tokens_defers_eos_and_stop_strings(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, EngineConfig(block_size=16, num_kv_blocks=64, max_model_len=256),
                        Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")))
    probe = _run(engine, {"probe": ([5, 6, 7, 8], greedy(20))})["probe"]
    engine.eos_token_ids = frozenset({probe[0]})
    outputs = _run(engine, {"eos": ([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=20, min_tokens=3))})
    assert probe[0] not in outputs["eos"][:3] and len(outputs["eos"]) >= 3
    assert_pool_idle(engine.block_manager)


def test_stop_strings_count_only_from_min_tokens(llm):
    full = llm.generate(PROMPT, greedy(30))[0]
    stop = full.text[:2]  # found in the first token's text without min_tokens
    assert llm.generate(PROMPT, greedy(30, stop=[stop]))[0].text == ""
    output = llm.generate(PROMPT, greedy(30, stop=[stop], min_tokens=5))[0]
    assert len(output.token_ids) >= 5 and output.token_ids == full.token_ids[:len(output.token_ids)]
    assert full.text.startswith(output.text) and output.text.startswith(stop)


@pytest.mark.parametrize("budget", [2048, 24], ids=["one-chunk", "chunks-of-24"])
def test_prompt_logits_equal_transformers_at_every_position(tiny_llama_dir, budget):
    from transformers import AutoModelForCausalLM

    prompt = list(range(3, 103))
    llm = LLM(tiny_llama_dir, block_size=16, dtype="float32", max_model_len=256, num_kv_blocks=16,
              max_num_batched_tokens=budget)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = model(torch.tensor([prompt])).logits[0]  # [100, vocab]
    got = llm.prompt_logits(prompt)
    assert got.shape == (100, 512) and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    assert_pool_idle(llm.engine.block_manager)
    assert llm.engine.block_manager.take_events() == [] and llm.stats().prefix_cache_queries == 0


def test_prompt_logits_refuse_a_prompt_longer_than_max_model_len(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, block_size=16, max_model_len=64, num_kv_blocks=8)
    with pytest.raises(InvalidRequestError, match="max_model_len=64"):
        llm.prompt_logits(list(range(3, 68)))
    assert_pool_idle(llm.engine.block_manager)


def test_calls_without_sampling_params_take_the_models_generation_config(tiny_llama_dir, tmp_path):
    model_dir = copy_with_generation_config(tiny_llama_dir, tmp_path / "m", temperature=0.0, top_k=5,
                                            repetition_penalty=1.25, max_new_tokens=6)
    llm = LLM(model_dir, **SMALL_POOL)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty, defaults.max_tokens) == (0.0, 5, 1.25, 6)
    prompt = [5, 9, 14, 20]
    (output,) = llm.generate(prompt)
    (explicit,) = llm.generate(prompt, SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.25, max_tokens=6))
    assert len(output.token_ids) == 6 and output.token_ids == explicit.token_ids
    (given,) = llm.generate(prompt, greedy(9, repetition_penalty=1.0))  # given params are not merged with the defaults
    assert given.token_ids == hf_greedy(model_dir, GreedyCase(prompt, 9, ignore_eos=True))
    assert LLM(model_dir, generation_config="vllm", **SMALL_POOL).get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match=r"^override_generation_config: no such default 'do_sample'; known: "):
        LLM(model_dir, override_generation_config={"do_sample": True}, **SMALL_POOL)
    overridden = LLM(model_dir, override_generation_config={"temperature": 0.5}, **SMALL_POOL)
    assert (overridden.get_default_sampling_params().temperature, overridden.get_default_sampling_params().top_k) == (0.5, 5)


def test_the_offline_llm_applies_vllms_default_logprobs_limit(llm):
    """LLM caps logprobs at vLLM's default --max-logprobs (20), plain requests and beam widths alike."""
    from splitserve.common.beam_search import BeamSearchParams

    with pytest.raises(InvalidRequestError) as refused:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=21))
    with pytest.raises(InvalidRequestError) as too_wide:
        llm.beam_search([[1, 2, 3]], BeamSearchParams(11, 2))
    assert str(refused.value) == "logprobs: Requested sample logprobs of 21, which is greater than max allowed: 20"
    assert str(too_wide.value) == ("n: is the beam width with use_beam_search: an integer in [1, 10] (each step asks "
                                   "for 2 x n logprobs, at most 20), got 11")


def test_truncate_prompt_tokens_keeps_the_last_tokens_like_a_manually_truncated_prompt(llm):
    ids = llm.tokenizer.encode(PROMPT)
    manual = llm.generate([ids[-5:]], greedy(8))[0]
    text, tokens = llm.generate([PROMPT, ids], greedy(8, truncate_prompt_tokens=5))
    assert text.prompt_token_ids == tokens.prompt_token_ids == manual.prompt_token_ids == ids[-5:]
    assert text.token_ids == tokens.token_ids == manual.token_ids and text.text == manual.text
    assert (text.prompt, tokens.prompt) == (PROMPT, None)  # vLLM reports the text given
    (streamed,) = [d for d in llm.stream(PROMPT, greedy(8, truncate_prompt_tokens=5)) if d.finish_reason]
    assert streamed.num_prompt_tokens == 5


def test_truncate_prompt_tokens_minus_one_fits_a_long_prompt_into_the_context(llm):
    long_ids = llm.tokenizer.encode(PROMPT) * 40  # longer than max_model_len (512)
    (output,) = llm.generate([long_ids], greedy(4, truncate_prompt_tokens=-1))
    assert output.prompt_token_ids == long_ids[-511:]
    assert (len(output.token_ids), output.finish_reason) == (1, "length")
    with pytest.raises(InvalidRequestError, match=r"^truncate_prompt_tokens: truncate_prompt_tokens=513 cannot be "
                                                  r"greater than max_model_len = 512. Please request a smaller "
                                                  r"truncation size.$"):
        llm.generate([long_ids], greedy(4, truncate_prompt_tokens=513))


def test_max_tokens_none_generates_to_the_end_of_the_context(llm):
    prompt = (llm.tokenizer.encode(PROMPT) * 40)[:500]
    (output,) = llm.generate([prompt], greedy(None))
    assert (len(prompt) + len(output.token_ids), output.finish_reason) == (512, "length")
    assert output.token_ids == llm.generate([prompt], greedy(12))[0].token_ids
    streamed = [d for d in llm.stream(prompt, greedy(None))]
    assert (sum(len(d.new_token_ids) for d in streamed), streamed[-1].finish_reason) == (12, "length")


def test_the_engine_refuses_max_tokens_none_which_the_llm_resolves(llm):
    with pytest.raises(InvalidRequestError, match=r"^max_tokens: None \(to the end of the context\) must be resolved "
                                                  r"before the request reaches the engine"):
        llm.engine.validate("unresolved", [1, 2, 3], SamplingParams(max_tokens=None))


def test_detokenize_false_returns_token_ids_and_empty_text_like_vllm(llm):
    full = llm.generate(PROMPT, greedy(8))[0]
    (output,) = llm.generate(PROMPT, greedy(8, detokenize=False))
    assert (output.token_ids, output.text) == (full.token_ids, "") and full.text
    deltas = list(llm.stream(PROMPT, greedy(8, detokenize=False)))
    assert [t for d in deltas for t in d.new_token_ids] == full.token_ids
    assert {d.text_delta for d in deltas} == {""}
