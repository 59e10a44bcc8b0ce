"""vLLM's additions to the OpenAI API: /tokenize, /detokenize, /version, system_fingerprint,
--served-model-name aliases, and the request extensions implemented here (min_tokens,
continue_final_message, chat_template_kwargs, documents, request_id, add_special_tokens)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil

import openai
import pytest

from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.router.version import SERVER_VERSION, UNINSTALLED_VERSION, installed_version
from splitserve.testing.tiny_models import PARTS_CHAT_TEMPLATE
from tests.factories import ServedApis, http_request, served_apis, stream_tokens

MODEL = "tiny-llama"
ALIAS = "tiny-alias"
PROMPT = "The river runs by the old mill"
TEMPLATE = ("{% for document in documents or [] %}[doc {{ document['title'] }}]{% endfor %}"
            "{% if greeting is defined %}{{ greeting }}|{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML that also renders documents and an optional `greeting` variable."""


class Served(ServedApis):
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="none", max_retries=0,
                             timeout=60)

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        status, _, raw = http_request(self.http_port, "POST", path, json.dumps(body).encode())
        return status, json.loads(raw)


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path_factory.mktemp("model") / "m")
    (model_dir / "chat_template.jinja").write_text(TEMPLATE)
    with served_apis(model_dir, MODEL, served_class=Served, aliases=(ALIAS,)) as served:
        yield served


# ---- /tokenize, /detokenize, /version -----------------------------------------------------

def test_tokenize_detokenize_round_trip_and_the_sdk_takes_the_ids(served):
    tokenizer = served.cluster.tokenizer
    status, body = served.post("/tokenize", {"model": MODEL, "prompt": PROMPT, "return_token_strs": True})
    ids = tokenizer.encode(PROMPT)
    assert status == 200
    assert body == {"count": len(ids), "max_model_len": served.cluster.orchestrator.max_model_len, "tokens": ids,
                    "token_strs": [tokenizer.backend.id_to_token(t) for t in ids]}
    assert served.post("/detokenize", {"model": MODEL, "tokens": ids}) == (200, {"prompt": PROMPT})
    client = served.client()
    by_ids = client.completions.create(model=MODEL, prompt=body["tokens"], max_tokens=8, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == body["count"]


def test_tokenize_a_chat_as_the_chat_endpoint_would(served):
    messages = [{"role": "user", "content": "Hello"}]
    status, body = served.post("/tokenize", {"messages": messages})
    expected = served.cluster.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert status == 200 and body["tokens"] == expected and body["token_strs"] is None
    chat = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens == body["count"]


def test_a_template_that_loops_over_content_gets_the_parts_on_every_api(tiny_llama_dir):
    """vLLM's --chat-template-content-format auto: chat, /tokenize and Responses hand such a template
    each content as its list of text parts, as transformers renders that list (not the texts joined)."""
    from transformers import AutoTokenizer

    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": parts}]
    expected = AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True).apply_chat_template(
        as_parts, chat_template=PARTS_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True, return_dict=False)
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, chat_template=PARTS_CHAT_TEMPLATE) as served:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
        assert served.post("/tokenize", {"messages": messages})[1]["tokens"] == expected
        status, chat = served.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                             "return_token_ids": True})
        assert (status, chat["prompt_token_ids"]) == (200, expected)
        status, response = served.post("/v1/responses", {
            "model": MODEL, "instructions": "Be brief.", "max_output_tokens": 2,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"},
                                                   {"type": "input_text", "text": "there"}]}]})
        assert (status, response["usage"]["input_tokens"]) == (200, len(expected))


# ---- a request's own chat template (--trust-request-chat-template) -----------------------------

REQUEST_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                    "{% if greeting is defined %}{{ greeting }}{% endif %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant:{% endif %}")
UNTRUSTED = ("chat_template: this server does not trust request chat templates (start it with "
             "--trust-request-chat-template to render a request's own template)")


@pytest.fixture(scope="module")
def trusting(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, trust_request_chat_template=True) as served:
        yield served


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_request_chat_template_is_refused_unless_the_server_trusts_them(served, path):
    """vLLM's default: 400, whether the template is valid or not."""
    for template in (REQUEST_TEMPLATE, "{% for %}"):
        status, reply = served.post(path, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                           "chat_template": template})
        assert (status, reply["error"]["param"], reply["error"]["message"]) == (400, "chat_template", UNTRUSTED)


def test_a_trusting_server_renders_the_request_s_template_for_chat_and_tokenize(trusting, tiny_llama_dir):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "more"}]
    expected = AutoTokenizer.from_pretrained(tiny_llama_dir, local_files_only=True).apply_chat_template(
        messages, chat_template=REQUEST_TEMPLATE, add_generation_prompt=True, greeting="hey", tokenize=True,
        return_dict=False)
    extras = {"chat_template": REQUEST_TEMPLATE, "chat_template_kwargs": {"greeting": "hey"}}
    status, body = trusting.post("/tokenize", {"model": MODEL, "messages": messages, **extras})
    assert (status, body["tokens"]) == (200, expected)
    assert trusting.cluster.tokenizer.decode(expected, skip_special_tokens=False) == (
        "<|im_start|>user: hi<|im_end|><|im_start|>assistant: yo<|im_end|><|im_start|>user: more<|im_end|>hey"
        "<|im_start|>assistant:")
    for _ in range(2):  # the second time from the compiled template
        status, chat = trusting.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                              "return_token_ids": True, **extras})
        assert (status, chat["prompt_token_ids"]) == (200, expected)
    status, chat = trusting.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                          "return_token_ids": True})
    assert (status, chat["prompt_token_ids"]) == (200, trusting.cluster.tokenizer.apply_chat_template(messages))


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/chat/completions", {"chat_template": "{% for m in messages %}"}, "chat_template",
     "chat_template: does not compile: Unexpected end of template. Jinja was looking for the following tags: 'endfor' "
     "or 'else'. The innermost block that needs to be closed is 'for'. (line 1)"),
    ("/tokenize", {"chat_template": "{{ 1 / 0 }}"}, "chat_template",
     "chat_template: rejected by the chat template: ZeroDivisionError: division by zero"),
    ("/v1/chat/completions", {"chat_template": "{{ raise_exception('no') }}"}, "chat_template",
     "chat_template: rejected by the chat template: no"),
    ("/tokenize", {"chat_template": 5}, "chat_template", "chat_template: must be a string (a Jinja template), got 5"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
     "chat_template_kwargs.chat_template", "chat_template_kwargs.chat_template: is not a template variable (send a "
                                           "request's own template as its chat_template field)"),
    ("/v1/responses", {"chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
     "chat_template_kwargs.chat_template", "chat_template_kwargs.chat_template: is not a template variable (send a "
                                           "request's own template as its chat_template field)"),
])
def test_request_template_errors_are_400s_naming_the_field(trusting, path, body, param, message):
    chat = {"input": "hi"} if path == "/v1/responses" else {"messages": [{"role": "user", "content": "hi"}]}
    status, reply = trusting.post(path, {"model": MODEL, **chat, **body})
    assert (status, reply["error"]["param"], reply["error"]["message"]) == (400, param, message)


def test_responses_ignore_a_chat_template_as_vllm_s_responses_model_has_none(trusting):
    """vLLM's Responses request declares no chat_template: the field is ignored, the server's template renders."""
    status, response = trusting.post("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 1,
                                                       "chat_template": "{% for %}"})
    prompt = trusting.cluster.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert (status, response["usage"]["input_tokens"]) == (200, len(prompt))


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "tools": [{"type": "function"}]}, "tools"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, "continue_final_message"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": [10**6]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_requests_are_400_naming_the_field(served, path, body, param):
    status, reply = served.post(path, body)
    assert status == 400 and reply["error"]["param"] == param


def test_tokenize_knows_the_served_names(served):
    assert served.post("/tokenize", {"model": ALIAS, "prompt": "x"})[0] == 200
    status, reply = served.post("/detokenize", {"model": "other", "tokens": [1]})
    assert (status, reply["error"]["code"]) == (404, "model_not_found")


def test_version(served):
    status, _, body = http_request(served.http_port, "GET", "/version")
    assert (status, json.loads(body)) == (200, {"version": SERVER_VERSION}) and SERVER_VERSION == "0.1.0"


def test_a_source_tree_without_distribution_metadata_reports_an_unknown_version(monkeypatch):
    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert installed_version() == UNINSTALLED_VERSION == "0+unknown"


# ---- responses ----------------------------------------------------------------------------

def test_system_fingerprint_in_every_response_and_chunk(served):
    client = served.client()
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True}))
    fingerprints = {completion.system_fingerprint, chat.system_fingerprint, *(c.system_fingerprint for c in chunks)}
    assert fingerprints == {served.post("/v1/completions", {"prompt": "x", "max_tokens": 1})[1]["system_fingerprint"]}
    (fingerprint,) = fingerprints
    assert fingerprint.startswith("fp_") and len(fingerprint) == 15


def test_served_model_names(served):
    client = served.client()
    assert [model.id for model in client.models.list()] == [MODEL]
    completion = client.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2)
    assert completion.model == MODEL
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="other", prompt=PROMPT, max_tokens=2)
    assert error.value.body["message"] == f"The model `other` does not exist; this server serves `{MODEL}`."
    token_ids, _, _ = stream_tokens(served.grpc_port, pb.GenerateRequest(
        model=ALIAS, text=PROMPT.encode(), sampling=pb.SamplingParams(max_tokens=2)))
    assert len(token_ids) == 2


def test_request_id_names_the_response(served):
    completion = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                                    extra_body={"request_id": "client-7"})
    assert completion.id == "cmpl-client-7"
    status, reply = served.post("/v1/completions", {"prompt": PROMPT, "request_id": "has space"})
    assert status == 400 and reply["error"]["param"] == "request_id"


# ---- request extensions -------------------------------------------------------------------

def test_min_tokens_holds_back_a_stop_token_on_both_apis(served):
    client = served.client()
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                      logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    stop_token = int(first.choices[0].logprobs.tokens[0].removeprefix("token_id:"))
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body={"stop_token_ids": [stop_token]})
    assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens) == ("stop", 1)
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                     extra_body={"stop_token_ids": [stop_token], "min_tokens": 4, "ignore_eos": True,
                                                 "return_tokens_as_token_ids": True})
    held_ids = [int(t.removeprefix("token_id:")) for t in held.choices[0].logprobs.tokens]
    assert len(held_ids) >= 4 and stop_token not in held_ids[:4]
    grpc_ids, _, _ = stream_tokens(served.grpc_port, pb.GenerateRequest(
        text=PROMPT.encode(), sampling=pb.SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token],
                                                         min_tokens=4, ignore_eos=True)))
    assert grpc_ids == held_ids


def test_a_stop_token_ends_the_output_without_its_text(served):
    """vLLM's stop_token_ids (and EOS): the token is counted, streamed as an id and has its logprob,
    but its text is not output (include_stop_str_in_output false), on every API."""
    client, tokenizer = served.client(), served.cluster.tokenizer
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in full.choices[0].logprobs.tokens]
    stop_at = next(i for i in range(1, 6) if ids[i] not in ids[:i] and tokenizer.decode([ids[i]]))
    expected = tokenizer.decode(ids[:stop_at])
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "extra_body": {"stop_token_ids": [ids[stop_at]], "skip_special_tokens": False}}
    whole = client.completions.create(**body, logprobs=0)
    (choice,) = whole.choices
    assert (choice.text, choice.finish_reason, choice.model_extra["stop_reason"]) == (expected, "stop", ids[stop_at])
    assert (len(choice.logprobs.tokens), whole.usage.completion_tokens) == (stop_at + 1, stop_at + 1)
    streamed = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    grpc_ids, grpc_text, _ = stream_tokens(served.grpc_port, pb.GenerateRequest(
        text=PROMPT.encode(), sampling=pb.SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[ids[stop_at]])))
    assert (grpc_ids, grpc_text) == (ids[:stop_at + 1], expected)
    assert served.cluster.orchestrator.eos_token_ids == tokenizer.eos_token_ids != frozenset()


def test_min_tokens_defers_stop_strings_at_the_router(served):
    client = served.client()
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[:2]
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True}).choices[0].text == ""
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "min_tokens": 6})
    assert held.choices[0].text.startswith(stop) and full.startswith(held.choices[0].text)
    assert held.usage.completion_tokens >= 6


def test_min_tokens_above_max_tokens_is_400(served):
    status, reply = served.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "min_tokens": 3})
    assert status == 400 and reply["error"]["param"] == "min_tokens"


def test_continue_final_message_leaves_the_turn_open(served):
    messages = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "The river "}]
    status, body = served.post("/tokenize", {"messages": messages, "add_generation_prompt": False,
                                             "continue_final_message": True})
    text = "<|im_start|>user\nTell me<|im_end|>\n<|im_start|>assistant\nThe river "
    assert status == 200 and body["tokens"] == served.cluster.tokenizer.encode_rendered(text)
    chat = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    assert chat.usage.prompt_tokens == body["count"]


@pytest.mark.parametrize("messages, add_generation_prompt, role", [
    ([{"role": "user", "content": "Tell me"}], True, "assistant"),
    ([{"role": "user", "content": "Tell me"}], False, "user"),
    ([{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "The river "}], False, "assistant"),
    ([{"role": "system", "content": "Be brief."}], False, "system"),
])
def test_without_a_generation_prompt_the_reply_has_the_last_messages_role(served, messages, add_generation_prompt,
                                                                          role):
    # vLLM's rule (get_chat_request_role): the output continues the last message, so it has its role.
    extra = {"add_generation_prompt": add_generation_prompt}
    chat = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)
    assert chat.choices[0].message.role == role
    stream = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                     extra_body=extra)
    assert next(iter(stream)).choices[0].delta.role == role


def test_chat_echo_starts_the_reply_with_the_message_it_continues(served):
    """vLLM's chat echo: the last message's content first, when the reply has that message's role."""
    prefill = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "The river "}]
    continued = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    client = served.client()
    plain = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=3, temperature=0,
                                           extra_body=continued)
    echoed = client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=3, temperature=0,
                                            extra_body={**continued, "echo": True})
    assert echoed.choices[0].message.content == "The river " + plain.choices[0].message.content
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 3
    # as vLLM's, an echo also returns the prompt's logprobs (top_logprobs alternatives: none unset)
    prompt_ids = served.cluster.tokenizer.encode_rendered("<|im_start|>user\nTell me<|im_end|>\n"
                                                          "<|im_start|>assistant\nThe river ")
    prompt_logprobs = echoed.model_extra["prompt_logprobs"]
    assert prompt_logprobs[0] is None and [list(entry) for entry in prompt_logprobs[1:]] == [
        [str(token_id)] for token_id in prompt_ids[1:]]
    assert "prompt_logprobs" not in plain.model_extra
    chunks = list(client.chat.completions.create(model=MODEL, messages=prefill, max_tokens=3, temperature=0,
                                                 stream=True, extra_body={**continued, "echo": True}))
    assert [chunks[0].choices[0].delta.role, chunks[1].choices[0].delta.content] == ["assistant", "The river "]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == echoed.choices[0].message.content
    # After a generation prompt the reply is the assistant's and the last message the user's: nothing to echo.
    question = client.chat.completions.create(model=MODEL, messages=prefill[:1], max_tokens=3, temperature=0,
                                              extra_body={"echo": True, "ignore_eos": True})
    without = client.chat.completions.create(model=MODEL, messages=prefill[:1], max_tokens=3, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert question.choices[0].message.content == without.choices[0].message.content


def test_chat_template_kwargs_and_documents_reach_the_template(served):
    messages = [{"role": "user", "content": "hi"}]
    status, body = served.post("/tokenize", {"messages": messages, "chat_template_kwargs": {"greeting": "hello"},
                                             "documents": [{"title": "a", "text": "b"}]})
    text = "[doc a]hello|<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert status == 200 and body["tokens"] == served.cluster.tokenizer.encode_rendered(text)
    chat = served.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={
        "chat_template_kwargs": {"greeting": "hello"}, "documents": [{"title": "a", "text": "b"}]})
    assert chat.usage.prompt_tokens == body["count"]
    status, reply = served.post("/v1/chat/completions", {"messages": messages,
                                                         "chat_template_kwargs": {"messages": []}})
    assert status == 400 and reply["error"]["param"] == "chat_template_kwargs.messages"


def test_add_special_tokens_chooses_the_encoding(served):
    tokenizer = served.cluster.tokenizer
    for add in (True, False):
        status, body = served.post("/tokenize", {"prompt": PROMPT, "add_special_tokens": add})
        assert status == 200 and body["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=add)


def test_tokenize_needs_the_api_key_and_version_does_not(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, api_key="sekret") as served:
        for path in ("/tokenize", "/detokenize"):
            status, _, body = http_request(served.http_port, "POST", path, b'{"prompt": "x", "tokens": [1]}')
            assert (status, json.loads(body)["error"]["message"]) == (401, "missing API key")
        assert http_request(served.http_port, "GET", "/version")[0] == 200
