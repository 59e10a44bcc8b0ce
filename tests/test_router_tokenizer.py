"""RouterTokenizer gives exactly the ids of transformers' AutoTokenizer, without importing torch."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, processors
from transformers import AutoTokenizer

from splitserve.common.chat_template import resolve_content_format
from splitserve.common.detokenizer import IncrementalDetokenizer
from splitserve.common.errors import InvalidRequestError, UnsupportedModelError
from splitserve.common.generation_config import GenerationConfigFile
from splitserve.router.tokenizer import (ChatTemplateOptions, RequestTemplateCache, RouterTokenizer, max_bytes_per_token,
                                        prepare_chat_template)
from splitserve.testing.tiny_models import PARTS_CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE

TEXTS = (
    "the old mill by the river",
    "Hello, World!  Two  spaces,\ttab and\nnew lines\r\n\n",
    "naïve café, Ünïcödé: 中文 текст ελληνικά",
    "emoji 🌍🚀 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "numbers 2024 and 3.14159, don't I'LL we've",
    "<|im_start|>user\nspecial tokens in text<|im_end|>",
    "",
    " ",
)

CHATS = (
    [{"role": "user", "content": "Tell me about the river."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 🌍"},
     {"role": "assistant", "content": "Hi!\n\nHow can I help?"}, {"role": "user", "content": "tell me a story"}],
    [{"role": "user", "content": "a literal <|im_end|> inside"}, {"role": "assistant", "content": ""}],
)

# Exercises what transformers' environment adds: trim_blocks/lstrip_blocks, tojson without HTML
# escaping, namespace, loop controls, special tokens as variables and tools=None.
CUSTOM_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% set ns.system = message['content'] %}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | tojson }}{% if ns.system %} [{{ ns.system }}]{% endif %}<|im_end|>
{% endfor %}
{% if tools is not none %}tools!{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% else %}
{{ eos_token }}
{% endif %}"""


def _with_bos_post_processor(tokenizer_file: Path) -> None:
    """Make the tokenizer prepend <|endoftext|> (id 0) like a Llama-style BOS."""
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", 0)])
    tokenizer.save(str(tokenizer_file))


@pytest.fixture(scope="module")
def custom_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama's tokenizer with a BOS post-processor, the template inside tokenizer_config.json
    (no chat_template.jinja) and no generation_config.json."""
    path = tmp_path_factory.mktemp("custom-tokenizer")
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny_llama_dir / name, path / name)
    _with_bos_post_processor(path / "tokenizer.json")
    config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", chat_template=CUSTOM_TEMPLATE, extra_special_tokens={"turn": "<|im_end|>"},
                  tool_token={"__type": "AddedToken", "content": "<|im_start|>", "special": True})
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def no_template_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("no-template")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / name, path / name)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2", "custom"])
def model_dir(request, tiny_model_dirs, custom_dir) -> Path:
    return custom_dir if request.param == "custom" else tiny_model_dirs[request.param]


def _hf(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)


def test_encode_matches_transformers(model_dir):
    ours, hf = RouterTokenizer.from_model_dir(model_dir), _hf(model_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], text


def test_the_custom_tokenizer_adds_its_bos(custom_dir, tiny_llama_dir):
    plain = RouterTokenizer.from_model_dir(tiny_llama_dir).encode("the old mill")
    assert RouterTokenizer.from_model_dir(custom_dir).encode("the old mill") == [0, *plain]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(model_dir, add_generation_prompt):
    ours, hf = RouterTokenizer.from_model_dir(model_dir), _hf(model_dir)
    for messages in CHATS:
        expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          return_dict=False)
        assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("content", ["end", "im", "|>", "Once upon a time", "ends with a space ", "user"])
def test_continue_final_message_cuts_where_transformers_does(model_dir, content):
    """The prompt ends right after the final message's content, as transformers' apply_chat_template
    (which marks the content and cuts at the mark), also when the content is part of what the template
    closes the turn with ("end" in "<|im_end|>") or of an earlier message ("user")."""
    ours, hf = RouterTokenizer.from_model_dir(model_dir), _hf(model_dir)
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": content}]
    options = ChatTemplateOptions(continue_final_message=True)
    expected = hf.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True,
                                      tokenize=False)
    assert ours.render_chat_template(messages, add_generation_prompt=False, options=options) == expected


TEXT_PARTS = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]


@pytest.mark.parametrize("template, content_format", [
    (PARTS_CHAT_TEMPLATE, "openai"),
    ("{% for m in messages[1:] %}{% for p in m.content | list %}{{ p.text }}{% endfor %}{% endfor %}", "openai"),
    ("{% set rest = messages %}{% set more = rest %}{% for m in more %}{% for p in m['content'] %}{% endfor %}"
     "{% endfor %}", "openai"),
    (TOOLS_CHAT_TEMPLATE, "string"),
    ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% endif %}{% endfor %}", "string"),
    ("{% for d in documents %}{% for p in d['content'] %}{% endfor %}{% endfor %}", "string"),
    ("{% for p in message['content'] %}{% endfor %}", "string"),
    ("{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}", "string"),
])
def test_content_format_is_detected_from_the_template(template, content_format):
    """vLLM's "auto": "openai" only for a loop over the content of a message of `messages` (or of a
    name assigned from it)."""
    assert prepare_chat_template(template, "auto").detected_format == content_format


def test_a_template_that_does_not_parse_reads_as_string():
    assert resolve_content_format("auto", None) == "string"


def test_a_template_that_loops_over_content_gets_the_parts_as_transformers_renders_them(tiny_llama_dir):
    ours, hf = RouterTokenizer.from_model_dir(tiny_llama_dir, PARTS_CHAT_TEMPLATE), _hf(tiny_llama_dir)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": TEXT_PARTS}]
    text = ours.render_chat_template(messages)
    # A string content reaches the template as one text part too, as vLLM passes it.
    assert text == "<|im_start|>system\n[S]<|im_end|>\n<|im_start|>user\n[hi][there]<|im_end|>\n<|im_start|>assistant\n"
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "S"}]}, messages[1]]
    assert text == hf.apply_chat_template(as_parts, chat_template=PARTS_CHAT_TEMPLATE, add_generation_prompt=True,
                                          tokenize=False)
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        as_parts, chat_template=PARTS_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False)


def test_a_template_that_does_not_loop_over_content_gets_the_parts_joined(tiny_llama_dir):
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir)
    assert ours.content_format == "string"
    with_empty = [TEXT_PARTS[0], {"type": "text", "text": ""}, TEXT_PARTS[1]]  # vLLM leaves an empty text out
    assert ours.render_chat_template([{"role": "user", "content": with_empty}]) == (
        "<|im_start|>user\nhi\nthere<|im_end|>\n<|im_start|>assistant\n")


def test_the_content_format_option_overrides_the_detected_one(tiny_llama_dir):
    joined = RouterTokenizer.from_model_dir(tiny_llama_dir, PARTS_CHAT_TEMPLATE, "string")
    assert joined.render_chat_template([{"role": "user", "content": TEXT_PARTS}], add_generation_prompt=False) == (
        "<|im_start|>user\nhi\nthere<|im_end|>\n")
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    listed = RouterTokenizer.from_model_dir(tiny_llama_dir, plain, "openai")
    assert listed.render_chat_template([{"role": "user", "content": "hi"}]) == "[{'type': 'text', 'text': 'hi'}]"
    with pytest.raises(ValueError, match="must be one of auto, string, openai, got 'parts'"):
        RouterTokenizer.from_model_dir(tiny_llama_dir, plain, "parts")


@pytest.mark.parametrize("template, option, logged", [
    (None, "auto", [("INFO", "Detected the chat template content format to be 'string'. You can set "
                             "`--chat-template-content-format` to override this.")]),
    (PARTS_CHAT_TEMPLATE, "auto", [("INFO", "Detected the chat template content format to be 'openai'. You can "
                                            "set `--chat-template-content-format` to override this.")]),
    (PARTS_CHAT_TEMPLATE, "string", [("WARNING", "You specified `--chat-template-content-format string` which is "
                                                 "different from the detected format 'openai'; the one given is "
                                                 "used.")]),
    (PARTS_CHAT_TEMPLATE, "openai", []),
])
def test_the_server_template_s_content_format_is_logged_once_at_start_up(tiny_llama_dir, caplog, template, option,
                                                                         logged):
    """vLLM's lines: the format "auto" detected, or a warning when the one given differs from it."""
    from splitserve.deploy.router_app import log_content_format

    tokenizer = RouterTokenizer.from_model_dir(tiny_llama_dir, template, option)
    with caplog.at_level(logging.INFO, logger="splitserve.deploy.router_app"):
        log_content_format(tokenizer, option)
    assert [(record.levelname, record.getMessage()) for record in caplog.records] == logged


def test_no_content_format_is_logged_without_a_template(no_template_dir, caplog):
    from splitserve.deploy.router_app import log_content_format

    tokenizer = RouterTokenizer.from_model_dir(no_template_dir)
    with caplog.at_level(logging.INFO, logger="splitserve.deploy.router_app"):
        log_content_format(tokenizer, "auto")
    assert (tokenizer.detected_content_format, caplog.records) == (None, [])


def test_continue_final_message_with_parts_cuts_after_the_last_part_as_transformers(tiny_llama_dir):
    ours, hf = RouterTokenizer.from_model_dir(tiny_llama_dir, PARTS_CHAT_TEMPLATE), _hf(tiny_llama_dir)
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": TEXT_PARTS}]
    text = ours.render_chat_template(messages, False, ChatTemplateOptions(continue_final_message=True))
    assert text == "<|im_start|>user\n[Tell a story]<|im_end|>\n<|im_start|>assistant\n[hi][there"
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Tell a story"}]}, messages[1]]
    assert text == hf.apply_chat_template(as_parts, chat_template=PARTS_CHAT_TEMPLATE, continue_final_message=True,
                                          tokenize=False)
    with pytest.raises(InvalidRequestError) as error:
        ours.render_chat_template([{"role": "assistant", "content": []}], False,
                                  ChatTemplateOptions(continue_final_message=True))
    assert (error.value.field, error.value.message) == ("continue_final_message",
                                                        "the final message has no text to continue")


def test_chatml_rendering_is_exact(tiny_llama_dir):
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir)
    text = ours.render_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}])[:1] == [1]  # <|im_start|>, not split


@pytest.mark.parametrize(("messages", "rendered"), [
    ([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
     "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"),
    # a system message after the first, or several: merged into one first system message (blank-line joined)
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "developer", "content": "D"},
      {"role": "system", "content": ""}],
     "<|im_start|>system\nS\n\nD<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"),
    ([{"role": "user", "content": "hi"}, {"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                           {"type": "text", "text": "b"}]}],
     "<|im_start|>system\na\nb<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"),
    # without a developer message nothing moves, a late system message included
    ([{"role": "user", "content": "hi"}, {"role": "system", "content": "S"}],
     "<|im_start|>user\nhi<|im_end|>\n<|im_start|>system\nS<|im_end|>\n"),
])
def test_a_template_without_the_developer_role_gets_developer_messages_as_system_as_vllm(tiny_llama_dir, messages,
                                                                                         rendered):
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir)
    assert ours.render_chat_template(messages, add_generation_prompt=False) == rendered


def test_a_template_that_names_the_developer_role_gets_it_as_sent(tiny_llama_dir):
    template = ("{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}<|im_start|>{{ m.role }}\n"
                "{{ m.content }}<|im_end|>\n{% endfor %}")
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir, chat_template=template)
    messages = [{"role": "user", "content": "hi"}, {"role": "developer", "content": "D"}]
    assert ours.render_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\nD:<|im_start|>developer\nD<|im_end|>\n")


def test_custom_template_rendering_is_exact(custom_dir):
    ours = RouterTokenizer.from_model_dir(custom_dir)
    text = ours.render_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "a<b>\"q\""}],
                                     add_generation_prompt=False)
    assert text == '<|endoftext|><|im_start|>user\n"a<b>\\"q\\"" [S]<|im_end|>\n<|endoftext|>\n'
    # The template writes the BOS itself; none is added on top.
    assert ours.apply_chat_template([{"role": "user", "content": "x"}])[:2] == [0, 1]


def test_decode_matches_transformers(model_dir):
    ours, hf = RouterTokenizer.from_model_dir(model_dir), _hf(model_dir)
    for text in TEXTS:
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_decode_round_trips_byte_level_text(tiny_llama_dir):
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir)
    text = "emoji 🌍🚀 and a family 👨‍👩‍👧, naïve"
    assert ours.decode(ours.encode(text)) == text


def test_backend_drives_incremental_detokenization(tiny_llama_dir):
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir)
    ids = ours.encode("río 🌍 flows")
    detokenizer = IncrementalDetokenizer(ours.backend, [], stop=(), skip_special_tokens=True)
    streamed = []
    for token_id in ids:
        detokenizer.append(token_id)
        streamed.append(detokenizer.take_delta(finished=False))
    assert "".join(streamed) + detokenizer.take_delta(finished=True) == "río 🌍 flows"


# transformers 5 loads model_type qwen2 with Qwen2Tokenizer, which rebuilds the normalizer/pre-tokenizer
# (NFC + the Qwen regex) instead of reading tokenizer.json's; the tiny builder saves that same pipeline.
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_encode_matches_transformers_on_decomposed_unicode(arch, tiny_model_dirs):
    text = "cafe\u0301 (e + combining acute)"
    ours, hf = RouterTokenizer.from_model_dir(tiny_model_dirs[arch]), _hf(tiny_model_dirs[arch])
    assert ours.encode(text) == hf(text)["input_ids"]


def test_special_tokens_vocab_and_eos(tiny_llama_dir, custom_dir):
    ours, hf = RouterTokenizer.from_model_dir(tiny_llama_dir), _hf(tiny_llama_dir)
    assert ours.special_tokens == hf.special_tokens_map == {"eos_token": "<|endoftext|>",
                                                           "pad_token": "<|endoftext|>"}
    assert ours.vocab_size == len(hf) == 512
    assert ours.eos_token_ids == frozenset({0, 2})  # generation_config.json: <|endoftext|> and <|im_end|>
    custom = RouterTokenizer.from_model_dir(custom_dir)
    assert custom.eos_token_ids == frozenset({0})  # config.json's int
    assert custom.special_tokens == _hf(custom_dir).special_tokens_map == {
        "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "tool_token": "<|im_start|>", "turn": "<|im_end|>"}


def test_split_special_tokens_encodes_them_as_text(no_template_dir, tmp_path):
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(no_template_dir / name, tmp_path / name)
    config = json.loads((no_template_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    text = "<|im_start|>user"
    ours = RouterTokenizer.from_model_dir(tmp_path)
    assert ours.encode(text) == _hf(tmp_path)(text)["input_ids"]
    assert 1 not in ours.encode(text) and RouterTokenizer.from_model_dir(no_template_dir).encode(text)[0] == 1


@pytest.mark.parametrize("template", [
    "{% for m in messages %}[{{ m.content }}]{% endfor %}",
    # assistant-mask markup some templates carry
    "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
])
def test_chat_template_from_the_jinja_file_wins_over_the_config(custom_dir, tmp_path, template):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(custom_dir / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(template)
    ours = RouterTokenizer.from_model_dir(tmp_path)
    assert ours.render_chat_template([{"role": "user", "content": "a"}]) == "[a]"
    assert ours.apply_chat_template([{"role": "user", "content": "a"}]) == _hf(tmp_path).apply_chat_template(
        [{"role": "user", "content": "a"}], tokenize=True, return_dict=False)


@pytest.mark.parametrize(("messages", "field"), [
    ([], "messages"),
    ("hello", "messages"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user", "content": "hi"}, {"role": "user"}], "messages[1].content"),
    ([{"role": "user", "content": 3}], "messages[0].content"),
    (["hi"], "messages[0]"),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": "a\udfff"}], "messages[1].content"),
    ([{"role": "\ud800", "content": "hi"}], "messages[0].role"),
])
def test_malformed_messages_are_invalid_requests(tiny_llama_dir, messages, field):
    with pytest.raises(InvalidRequestError) as raised:
        RouterTokenizer.from_model_dir(tiny_llama_dir).apply_chat_template(messages)
    assert raised.value.field == field


def test_lone_surrogates_are_invalid_requests(tiny_llama_dir):
    """A JSON string can escape one ("\\ud800"); the tokenizer itself would raise TypeError."""
    tokenizer = RouterTokenizer.from_model_dir(tiny_llama_dir)
    with pytest.raises(InvalidRequestError) as raised:
        tokenizer.encode("ok \ud800")
    assert str(raised.value) == "prompt: is not valid Unicode (lone surrogate '\\ud800' at index 3)"
    with pytest.raises(InvalidRequestError) as raised:
        tokenizer.apply_chat_template([{"role": "user", "content": "\udc80"}])
    assert str(raised.value) == "messages[0].content: is not valid Unicode (lone surrogate '\\udc80' at index 0)"



@pytest.mark.parametrize(("message", "tools", "error"), [
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "f", "arguments": {"a": "\ud800"}}}]},
     None, "messages: the chat as rendered is not valid Unicode (lone surrogate '\\ud800')"),
    ({"role": "tool", "content": "4", "tool_call_id": "\udc80"}, None,
     "messages: the chat as rendered is not valid Unicode (lone surrogate '\\udc80')"),
    ({"role": "user", "content": "Hi"}, ({"type": "function", "function": {"name": "f", "description": "\ud800"}},),
     "tools: is not valid Unicode (lone surrogate '\\ud800')"),
])
def test_lone_surrogates_the_template_renders_are_invalid_requests(tiny_qwen2_dir, message, tools, error):
    """Besides the contents, a template writes tools, tool calls and their ids: the tokenizer would
    raise TypeError on a lone surrogate there too (a 500)."""
    tokenizer = RouterTokenizer.from_model_dir(tiny_qwen2_dir, TOOLS_CHAT_TEMPLATE)
    with pytest.raises(InvalidRequestError) as raised:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, message], True,
                                      ChatTemplateOptions(tools=tools))
    assert str(raised.value) == error

def test_template_refusal_is_an_invalid_request(custom_dir):
    with pytest.raises(InvalidRequestError, match="unknown role: tool") as raised:
        RouterTokenizer.from_model_dir(custom_dir).apply_chat_template([{"role": "tool", "content": "x"}])
    assert raised.value.field == "messages"


@pytest.mark.parametrize("template_kwargs, error", [
    ({"namespace": 1}, "TypeError: 'int' object is not callable"),
    ({"raise_exception": "no"}, "TypeError: 'str' object is not callable"),
    ({"bos_token": 5}, "TypeError: unsupported operand type(s) for +: 'int' and 'str'"),
])
def test_chat_template_kwargs_that_break_the_template_s_own_calls_are_invalid_requests(tiny_llama_dir, template_kwargs,
                                                                                      error):
    """A client's variables can replace the helpers real templates call (Qwen3's namespace(), Llama 3's
    raise_exception) or the special tokens they concatenate: the template then raises TypeError, which
    vLLM answers with 400, not a 500."""
    template = ("{%- set ns = namespace(turns=0) %}{%- if messages | length > 4 %}{{ raise_exception('long') }}"
                "{%- endif %}{{ bos_token + messages[0]['content'] }}")
    tokenizer = RouterTokenizer.from_model_dir(tiny_llama_dir, template)
    chat = [{"role": "user", "content": "Hi"}] * (5 if "raise_exception" in template_kwargs else 1)
    with pytest.raises(InvalidRequestError) as raised:
        tokenizer.apply_chat_template(chat, True, ChatTemplateOptions(template_kwargs=template_kwargs))
    assert raised.value.field == "messages"
    assert str(raised.value) == f"messages: rejected by the chat template: {error}"


@pytest.mark.parametrize("key, reason", [
    ("chat_template", "is not a template variable (send a request's own template as its chat_template field)"),
    ("tokenize", "is not a template variable (vLLM refuses it here too)"),
    ("continue_final_message", "is set by the request's own field continue_final_message"),
    ("add_generation_prompt", "is set by the request's own fields"),
])
def test_chat_template_kwargs_that_vllm_refuses_or_reads_as_options_are_refused(key, reason):
    """vLLM refuses chat_template and tokenize here and takes continue_final_message as the option; a
    template variable of that name would be ignored without a word."""
    with pytest.raises(InvalidRequestError) as raised:
        ChatTemplateOptions(template_kwargs={key: True})
    assert str(raised.value) == f"chat_template_kwargs.{key}: {reason}"


# ---- a request's own chat template (vLLM's chat_template, --trust-request-chat-template) ----------------

REQUEST_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")


def test_a_request_template_renders_in_place_of_the_server_s_as_transformers_renders_it(tiny_llama_dir):
    ours, hf = RouterTokenizer.from_model_dir(tiny_llama_dir, trust_request_chat_template=True), _hf(tiny_llama_dir)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    options = ChatTemplateOptions(chat_template=REQUEST_TEMPLATE)
    text = ours.render_chat_template(chat, True, options)
    assert text == "<|im_start|>user: hi<|im_end|><|im_start|>assistant: yo<|im_end|><|im_start|>assistant:"
    ids = ours.apply_chat_template(chat, True, options)
    assert ids == hf.apply_chat_template(chat, chat_template=REQUEST_TEMPLATE, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
    assert ids[:1] == [1] and ids.count(1) == 3  # <|im_start|> is one token, as the server's template writes it
    # The server's own template is untouched by it.
    assert ours.render_chat_template(chat[:1]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_a_request_template_is_refused_unless_the_server_trusts_them(tiny_llama_dir):
    """vLLM's default: without --trust-request-chat-template a request's template is a 400."""
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir)
    with pytest.raises(InvalidRequestError) as raised:
        ours.apply_chat_template([{"role": "user", "content": "hi"}], True,
                                 ChatTemplateOptions(chat_template=REQUEST_TEMPLATE))
    assert str(raised.value) == ("chat_template: this server does not trust request chat templates (start it with "
                                 "--trust-request-chat-template to render a request's own template)")
    assert not ours.compiles_template(ChatTemplateOptions(chat_template=REQUEST_TEMPLATE))


def test_a_model_without_a_template_renders_a_trusted_request_s_own(no_template_dir):
    ours = RouterTokenizer.from_model_dir(no_template_dir, trust_request_chat_template=True)
    assert not ours.has_chat_template
    assert ours.render_chat_template([{"role": "user", "content": "hi"}], False,
                                     ChatTemplateOptions(chat_template=REQUEST_TEMPLATE)) == (
        "<|im_start|>user: hi<|im_end|>")


@pytest.mark.parametrize("option, rendered", [
    ("auto", "<|im_start|>user\n[hi][there]<|im_end|>\n"),  # detected from the request's template: openai
    ("string", "<|im_start|>user\nhi\nthere<|im_end|>\n"),  # the server's option wins, as in vLLM
])
def test_content_format_detection_runs_on_the_request_template(tiny_llama_dir, option, rendered):
    """The server's template (ChatML) reads as "string"; PARTS_CHAT_TEMPLATE, sent by a request, loops over
    a message's content: under "auto" its messages get their parts."""
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir, None, option, trust_request_chat_template=True)
    assert ours.content_format == "string"
    options = ChatTemplateOptions(chat_template=PARTS_CHAT_TEMPLATE)
    assert ours.render_chat_template([{"role": "user", "content": TEXT_PARTS}], False, options) == rendered


def test_chat_template_kwargs_and_special_tokens_reach_a_request_template(custom_dir):
    ours = RouterTokenizer.from_model_dir(custom_dir, trust_request_chat_template=True)
    options = ChatTemplateOptions(template_kwargs={"greeting": "hello"},
                                  chat_template="{{ bos_token }}{{ greeting }}, {{ messages[0]['content'] }}")
    assert ours.render_chat_template([{"role": "user", "content": "river"}], True, options) == (
        "<|endoftext|>hello, river")


@pytest.mark.parametrize("template, error", [
    ("{% for m in messages %}", "does not compile: Unexpected end of template. Jinja was looking for the following "
                                "tags: 'endfor' or 'else'. The innermost block that needs to be closed is 'for'. "
                                "(line 1)"),
    ("{{ x | nosuch }}", "does not compile: No filter named 'nosuch'. (line 1)"),
    ("{{ " + "(" * 3000 + "1" + ")" * 3000 + " }}", "does not compile: nested too deeply"),
    ("{{ 1 / 0 }}", "rejected by the chat template: ZeroDivisionError: division by zero"),
    ("{{ raise_exception('no ' + messages[0]['content']) }}", "rejected by the chat template: no hi"),
    ("{{ messages.append(1) }}", "rejected by the chat template: access to attribute 'append' of 'list' object is "
                                 "unsafe."),
    ("{{ 'a' + 1 }}", 'rejected by the chat template: TypeError: can only concatenate str (not "int") to str'),
])
def test_request_template_compile_and_render_errors_are_invalid_requests(tiny_llama_dir, template, error):
    """Jinja's message, never a 500: vLLM answers any error of a template with 400."""
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir, trust_request_chat_template=True)
    with pytest.raises(InvalidRequestError) as raised:
        ours.apply_chat_template([{"role": "user", "content": "hi"}], True, ChatTemplateOptions(chat_template=template))
    assert (raised.value.field, raised.value.message) == ("chat_template", error)


def test_request_templates_are_compiled_once_in_a_bounded_lru():
    cache = RequestTemplateCache("auto", max_size=2)
    first = cache.get("{{ 'a' }}")
    assert cache.get("{{ 'a' }}") is first  # not compiled again
    cache.get("{{ 'b' }}")
    assert cache.get("{{ 'a' }}") is first  # used last: "b" is now the least recently used
    cache.get("{{ 'c' }}")
    assert len(cache) == 2 and "{{ 'b' }}" not in cache and "{{ 'a' }}" in cache and "{{ 'c' }}" in cache
    assert cache.get("{{ 'b' }}") is not first and first.template.render() == "a"
    assert (first.content_format, cache.get(PARTS_CHAT_TEMPLATE).content_format) == ("string", "openai")
    with pytest.raises(ValueError, match="must be one of auto, string, openai, got 'parts'"):
        RequestTemplateCache("parts")


def test_compiles_template_says_whether_a_request_template_is_new(tiny_llama_dir):
    ours = RouterTokenizer.from_model_dir(tiny_llama_dir, trust_request_chat_template=True)
    options = ChatTemplateOptions(chat_template=REQUEST_TEMPLATE)
    assert (ours.compiles_template(options), ours.compiles_template(ChatTemplateOptions())) == (True, False)
    ours.render_chat_template([{"role": "user", "content": "hi"}], True, options)
    assert not ours.compiles_template(options)


def test_sandbox_refuses_unsafe_templates(no_template_dir, tmp_path):
    shutil.copy(no_template_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(InvalidRequestError, match="rejected by the chat template"):
        RouterTokenizer.from_model_dir(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_model_without_chat_template_is_a_clear_error(no_template_dir):
    ours = RouterTokenizer.from_model_dir(no_template_dir)
    assert not ours.has_chat_template
    with pytest.raises(InvalidRequestError, match="has no chat template; send a text prompt or token ids"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_tokenizer_file_and_bad_template_are_unsupported(tmp_path, no_template_dir):
    with pytest.raises(UnsupportedModelError, match="missing tokenizer.json"):
        RouterTokenizer.from_model_dir(tmp_path)
    shutil.copy(no_template_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(UnsupportedModelError, match="chat template does not compile"):
        RouterTokenizer.from_model_dir(tmp_path)


def test_importing_the_router_tokenizer_does_not_import_torch(tiny_llama_dir):
    code = ("import sys\n"
            "from splitserve.router.tokenizer import RouterTokenizer\n"
            f"RouterTokenizer.from_model_dir({str(tiny_llama_dir)!r}).apply_chat_template("
            "[{'role': 'user', 'content': 'hi'}])\n"
            "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_tiny_vocabularys_longest_entry_is_13_bytes(tiny_llama_dir):
    assert RouterTokenizer.from_model_dir(tiny_llama_dir).max_bytes_per_token == 13  # "<|endoftext|>"


def test_a_normalizing_tokenizer_bounds_three_times_as_many_bytes_per_token():
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "hello": 2}, unk_token="[UNK]"))
    plain = max_bytes_per_token(backend)
    backend.normalizer = normalizers.NFC()
    assert (plain, max_bytes_per_token(backend)) == (5, 15)


def _sentencepiece_byte_fallback() -> Tokenizer:
    """A Llama-2-style SentencePiece BPE: "▁" for spaces (and one before the text), `<0xNN>` pieces
    for characters outside the vocabulary, and Llama's decoder (Replace, ByteFallback, Fuse, Strip)."""
    vocab = {"<unk>": 0, "<s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    vocab.update({piece: len(vocab) + i for i, piece in enumerate("▁abcdefghijklmnopqrstuvwxyz")})
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens(["</s>"])
    return backend


def test_token_bytes_put_characters_split_across_tokens_back_together(tiny_llama_dir):
    """OpenAI's logprobs `bytes`: each token's own bytes, so a character spread over several tokens
    (each U+FFFD when decoded alone) is whole again once its tokens' bytes are joined."""
    text = "é river 日本 😀"
    byte_level = RouterTokenizer.from_model_dir(tiny_llama_dir)
    ids = byte_level.encode(text, add_special_tokens=False)
    pieces = [byte_level.token_bytes(t) for t in ids]
    assert b"".join(pieces) == text.encode()
    assert pieces[:2] == [b"\xc3", b"\xa9"] and byte_level.decode(ids[:1]) == "\ufffd"  # é is two tokens
    assert byte_level.token_bytes(0) == b"<|endoftext|>"  # an added token: its content
    sentencepiece = _sentencepiece_byte_fallback()
    ids = sentencepiece.encode(text, add_special_tokens=False).ids
    spm = RouterTokenizer(sentencepiece, {}, None, GenerationConfigFile(None, frozenset()), "spm")
    assert [spm.token_bytes(t) for t in ids[:3]] == [b" ", b"\xc3", b"\xa9"]  # "▁", "<0xC3>", "<0xA9>"
    assert b"".join(spm.token_bytes(t) for t in ids) == b" " + text.encode()  # the "▁" put before the text
    assert spm.token_bytes(sentencepiece.token_to_id("</s>")) == b"</s>"
    sentencepiece.decoder = decoders.WordPiece()  # a decoder not read here: the token decoded alone
    wordpiece = RouterTokenizer(sentencepiece, {}, None, GenerationConfigFile(None, frozenset()), "wordpiece")
    assert wordpiece.token_bytes(sentencepiece.token_to_id("<0xC3>")) == b"<0xC3>"


def test_encoding_in_a_thread_leaves_the_event_loop_running(tiny_llama_dir):
    """encode_batch releases the GIL: a 10 ms heartbeat keeps beating while a long prompt is encoded
    in a thread (with Tokenizer.encode it beat twice in 4 s: the loop was stopped)."""
    tokenizer = RouterTokenizer.from_model_dir(tiny_llama_dir)
    text = "the river runs by the old mill " * 32_000  # ~1 MB: about a second of encoding

    async def scenario():
        lags: list[float] = []

        async def beat():
            while True:
                started = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - started - 0.01)

        heartbeat = asyncio.create_task(beat())
        await asyncio.sleep(0.05)
        lags.clear()
        started = time.perf_counter()
        ids = await asyncio.to_thread(tokenizer.encode, text)
        elapsed = time.perf_counter() - started
        heartbeat.cancel()
        return ids, elapsed, lags

    ids, elapsed, lags = asyncio.run(scenario())
    print(f"encoded {len(text)} characters in {elapsed:.2f} s; {len(lags)} beats, longest lag {max(lags):.3f} s")
    assert ids == tokenizer.backend.encode(text).ids
    assert len(lags) >= 20 and max(lags) < elapsed / 2
