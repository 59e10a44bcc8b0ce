"""Reasoning parsers on the served OpenAI APIs (--reasoning-parser qwen3), through the official
openai SDK, with a tiny model whose tokenizer has `<think>` / `</think>` tokens (it writes `</think>`
after a few dozen tokens of most seeds). The expected split is read off the same request served by
a second HTTP front without a reasoning parser over the same cluster (same seed: same tokens)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from splitserve.common.errors import InvalidRequestError
from splitserve.router.openai_protocol import parse_chat_request
from splitserve.router.openai_server import start_http_server
from splitserve.router.responses_protocol import parse_responses_request
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.testing.tiny_models import build_thinking_model
from tests.factories import http_request, make_request_limits, served_apis
from tests.test_reasoning_parsers import reference
from tests.test_tool_calling import FORCED_CALL, TOOLS, calls_of

MODEL = "m"
USER = [{"role": "user", "content": "Why?"}]
SEED = 0
"""A seed whose output ends its reasoning after some text and then says more (checked by the tests)."""
TOOLS_SEED = 7
"""Such a seed for the prompt with TOOLS (its reasoning ends after 37 tokens)."""


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_an_assistant_messages_reasoning_reaches_the_template_under_both_names(key, tiny_llama_dir):
    """As vLLM hands it over (for templates that render earlier turns' reasoning), and as GPT-OSS's `thinking`."""
    messages = [*USER, {"role": "assistant", "content": "4.", key: "Two and two."}, *USER]
    parsed = parse_chat_request({"messages": messages}, make_request_limits())
    assert [m.template_message() for m in parsed.messages] == [
        *USER, {"role": "assistant", "content": "4.", "reasoning": "Two and two.", "reasoning_content": "Two and two.",
                "thinking": "Two and two."}, *USER]
    template = "{% for m in messages %}[{{ m.reasoning }}|{{ m.reasoning_content }}|{{ m.thinking }}]{% endfor %}"
    assert RouterTokenizer.from_model_dir(tiny_llama_dir, template).render_chat_template(
        [m.template_message() for m in parsed.messages]) == "[||][Two and two.|Two and two.|Two and two.][||]"
    with pytest.raises(InvalidRequestError) as error:
        parse_chat_request({"messages": [{"role": "assistant", "content": "", key: 5}]}, make_request_limits())
    assert (error.value.field, error.value.message) == (f"messages[0].{key}", "must be a string, got 5")
    with pytest.raises(InvalidRequestError) as error:
        parse_chat_request({"messages": [{"role": "assistant", "content": "ab", key: "x" * 99}]},
                           make_request_limits(max_prompt_bytes=100))
    assert (error.value.field, error.value.excess) == ("messages", "has 101 bytes (UTF-8); at most 100 can be served "
                                                                   "(router.max_prompt_bytes)")


def test_a_responses_reasoning_item_sent_back_joins_its_turns_assistant_message():
    """An earlier response's output items as the next request's input (what the Agents SDK sends):
    the reasoning, text and calls of one turn are one assistant message, as vLLM joins them."""
    items = [{"role": "user", "content": "Why?"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "12:00"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Noon."}]}]
    parsed = parse_responses_request({"input": items}, make_request_limits())
    assert [m.template_message() for m in parsed.chat.messages] == [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}], "reasoning": "Hm.",
         "reasoning_content": "Hm.",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "c1"},
        {"role": "assistant", "content": [], "reasoning": "Noon.", "reasoning_content": "Noon.", "thinking": "Noon."}]
    # (Content stays in text parts until the tokenizer renders it in its template's content format.)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_thinking_model(tmp_path_factory.mktemp("thinking") / "model")
    with served_apis(model_dir, MODEL, tool_call_parser="hermes", reasoning_parser="qwen3") as served:
        plain = served.loop.run(start_http_server(served.cluster.orchestrator, served.tokenizers, MODEL, port=0))
        deepseek = served.loop.run(start_http_server(served.cluster.orchestrator, served.tokenizers, MODEL, port=0,
                                                     reasoning_parser="deepseek_r1"))
        served.plain_port, served.deepseek_port = plain.port, deepseek.port
        try:
            yield served
        finally:
            served.loop.run(plain.stop())
            served.loop.run(deepseek.stop())


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def request(**fields) -> dict:
    return {"model": MODEL, "messages": USER, "max_tokens": 60, "temperature": 1.0, "seed": SEED, **fields}


def raw_output(served, **fields):
    """The choice as the front without a reasoning parser serves it (special tokens kept, as qwen3 reads them)."""
    extra = {"skip_special_tokens": False, **fields.pop("extra_body", {})}
    return client(served.plain_port).chat.completions.create(**request(**fields), extra_body=extra).choices[0]


def expected_split(text: str) -> tuple[str | None, str | None]:
    reasoning, content = reference(text, True)
    return reasoning or None, content or None


def reasoning_of(message) -> str | None:
    return message.model_extra.get("reasoning")


def stream_chat(port: int, **fields):
    """The openai SDK's accumulation of a streamed chat, and its chunks."""
    state = ChatCompletionStreamState()
    chunks = list(client(port).chat.completions.create(**request(**fields), stream=True))
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.current_completion_snapshot, chunks


def test_a_chat_message_holds_the_reasoning_apart_from_the_content(served):
    raw = raw_output(served, logprobs=True)
    reasoning, content = expected_split(raw.message.content)
    assert reasoning and content and raw.message.content.startswith(reasoning + "</think>")
    response = client(served.http_port).chat.completions.create(**request(logprobs=True))
    message = response.choices[0].message
    assert (reasoning_of(message), message.content) == (reasoning, content)
    tokens = [entry.token for entry in raw.logprobs.content]
    assert response.usage.completion_tokens_details.reasoning_tokens == tokens.index("</think>")
    assert [entry.token for entry in response.choices[0].logprobs.content] == tokens


def test_a_stream_sends_reasoning_deltas_then_content_and_accumulates_to_the_message(served):
    whole = client(served.http_port).chat.completions.create(**request(n=2)).choices
    streamed, chunks = stream_chat(served.http_port, n=2)
    assert [(reasoning_of(c.message), c.message.content, c.finish_reason) for c in streamed.choices] == \
        [(reasoning_of(c.message), c.message.content, c.finish_reason) for c in whole]
    deltas = [(chunk.choices[0].delta.model_extra.get("reasoning") is not None, bool(chunk.choices[0].delta.content))
              for chunk in chunks if chunk.choices and chunk.choices[0].index == 0]
    kinds = [kind for kind in deltas if kind != (False, False)]
    first_content = kinds.index((False, True))
    assert kinds[:first_content] == [(True, False)] * first_content and (True, False) not in kinds[first_content:]


def test_usage_counts_the_reasoning_tokens_of_each_chunk_and_of_the_whole(served):
    whole = client(served.http_port).chat.completions.create(**request()).usage
    _, chunks = stream_chat(served.http_port,
                            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [chunk.usage.completion_tokens_details.reasoning_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == whole.completion_tokens_details.reasoning_tokens
    assert whole.completion_tokens_details.reasoning_tokens > 0


def test_deepseek_r1_splits_alike_and_follows_a_template_that_closed_the_reasoning(served):
    qwen3 = client(served.http_port).chat.completions.create(**request()).choices[0].message
    deepseek = client(served.deepseek_port).chat.completions.create(**request()).choices[0].message
    assert (reasoning_of(deepseek), deepseek.content) == (reasoning_of(qwen3), qwen3.content)
    closed = {"chat_template_kwargs": {"enable_thinking": False}}
    message = client(served.deepseek_port).chat.completions.create(**request(), extra_body=closed).choices[0].message
    assert (reasoning_of(message), message.content) == (None, raw_output(served, extra_body=closed).message.content)


def test_include_reasoning_false_drops_the_reasoning_and_the_logprobs(served):
    _, content = expected_split(raw_output(served).message.content)
    response = client(served.http_port).chat.completions.create(**request(logprobs=True),
                                                                extra_body={"include_reasoning": False})
    choice = response.choices[0]
    assert (reasoning_of(choice.message), choice.message.content, choice.logprobs) == (None, content, None)
    streamed, chunks = stream_chat(served.http_port, extra_body={"include_reasoning": False})
    assert (reasoning_of(streamed.choices[0].message), streamed.choices[0].message.content) == (None, content)
    assert not any(chunk.choices[0].delta.model_extra.get("reasoning") for chunk in chunks if chunk.choices)


@pytest.mark.parametrize("extra", [{"chat_template_kwargs": {"enable_thinking": False}},
                                   {"reasoning_effort": "none"}])
def test_a_prompt_that_closed_the_reasoning_makes_the_output_all_content(served, extra):
    """Also the `</think>` this output writes is content then."""
    raw = raw_output(served, extra_body=extra).message.content
    message = client(served.http_port).chat.completions.create(**request(), extra_body=extra).choices[0].message
    assert "</think>" in raw and (reasoning_of(message), message.content) == (None, raw)


def test_structured_output_constrains_the_content_after_the_reasoning(served):
    reasoning, _ = expected_split(raw_output(served).message.content)
    choice = client(served.http_port).chat.completions.create(
        **request(max_tokens=80), extra_body={"structured_outputs": {"choice": ["Sunny.", "Rain."]}}).choices[0]
    assert (reasoning_of(choice.message), choice.message.content in ("Sunny.", "Rain."), choice.finish_reason) == \
        (reasoning, True, "stop")


def test_tool_calls_are_read_from_the_content_after_the_reasoning(served):
    raw = raw_output(served, tools=TOOLS, tool_choice="none", max_tokens=120, seed=TOOLS_SEED).message.content
    reasoning, _ = expected_split(raw)
    fields = dict(tools=TOOLS, max_tokens=120, seed=TOOLS_SEED,
                  extra_body={"structured_outputs": {"regex": FORCED_CALL}})
    choice = client(served.http_port).chat.completions.create(**request(**fields)).choices[0]
    [(kind, name, _)] = calls_of(choice.message)
    assert (reasoning_of(choice.message), choice.message.content, kind, name, choice.finish_reason) == \
        (reasoning, "Checking.\n", "function", "get_weather", "tool_calls")
    streamed, _ = stream_chat(served.http_port, **fields)
    message = streamed.choices[0].message
    assert (reasoning_of(message), message.content, calls_of(message), streamed.choices[0].finish_reason) == \
        (reasoning, "Checking.\n", calls_of(choice.message), "tool_calls")


def responses_body(**fields) -> dict:
    return {"model": MODEL, "input": "Why?", "max_output_tokens": 60, "temperature": 1.0, "extra_body": {"seed": SEED},
            **fields}


def test_a_response_has_a_reasoning_item_before_its_message(served):
    reasoning, content = expected_split(raw_output(served).message.content)
    raw_tokens = [entry.token for entry in raw_output(served, logprobs=True).logprobs.content]
    response = client(served.http_port).responses.create(**responses_body(reasoning={"effort": "high"}))
    [thinking, message] = response.output
    assert (thinking.type, thinking.summary, [(p.type, p.text) for p in thinking.content], thinking.status) == \
        ("reasoning", [], [("reasoning_text", reasoning)], "completed")
    assert (message.type, message.content[0].text) == ("message", content)
    assert response.usage.output_tokens_details.reasoning_tokens == raw_tokens.index("</think>")
    assert (response.reasoning.effort, response.reasoning.summary) == ("high", None)
    follow_up = client(served.http_port).responses.create(**responses_body(
        input=[{"role": "user", "content": "Why?"}, *[item.model_dump() for item in response.output],
               {"role": "user", "content": "And?"}]))
    assert follow_up.status in ("completed", "incomplete")


def test_a_streamed_response_sends_the_reasoning_events_first(served):
    reasoning, content = expected_split(raw_output(served).message.content)
    events = list(client(served.http_port).responses.create(**responses_body(), stream=True))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.reasoning_text.delta")
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + deltas + 4] == ["response.reasoning_text.delta"] * deltas + [
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == content
    assert [e.output_index for e in events if e.type == "response.output_text.delta"][0] == 1
    final = events[-1].response
    assert ([item.type for item in final.output], final.output[0].content[0].text) == (["reasoning", "message"],
                                                                                       reasoning)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_without_a_reasoning_parser_the_output_is_never_split(served):
    raw = raw_output(served)
    assert "reasoning" not in raw.message.model_extra
    plain = client(served.plain_port).chat.completions.create(**request(), extra_body={"include_reasoning": False})
    assert (plain.choices[0].message.content, plain.usage.completion_tokens_details) == (raw.message.content, None)
    status, _, body = http_request(served.plain_port, "POST", "/v1/chat/completions",
                                   json.dumps({**request(), "thinking_token_budget": 10}).encode())
    assert (status, json.loads(body)["error"]["param"]) == (400, "thinking_token_budget")
    assert json.loads(body)["error"]["message"] == ("thinking_token_budget: is not supported by this server: "
                                                    "reasoning is never cut short (no thinking budgets) (got 10)")
    response = client(served.plain_port).responses.create(**responses_body(reasoning={"effort": "low"}))
    assert [item.type for item in response.output] == ["message"]


def test_hidden_reasoning_returns_no_output_token_ids(served):
    """return_token_ids with include_reasoning false: the prompt's ids, not the output's (they would
    show the reasoning), streamed or not, as vLLM suppresses them; with the reasoning shown, both."""
    def body(include_reasoning: bool, stream: bool) -> bytes:
        fields = request(return_token_ids=True, include_reasoning=include_reasoning, stream=stream)
        status, _, raw = http_request(served.http_port, "POST", "/v1/chat/completions", json.dumps(fields).encode())
        assert status == 200
        return raw

    hidden, shown = json.loads(body(False, False)), json.loads(body(True, False))
    assert hidden["prompt_token_ids"] == shown["prompt_token_ids"] and "token_ids" not in hidden["choices"][0]
    assert len(shown["choices"][0]["token_ids"]) == shown["usage"]["completion_tokens"]
    events = [json.loads(line[6:]) for line in body(False, True).decode().splitlines()
              if line.startswith("data: {")]
    assert events[0]["prompt_token_ids"] == shown["prompt_token_ids"]
    assert not any("token_ids" in choice for event in events for choice in event["choices"])


def test_where_the_output_starts_is_read_off_the_prompt_as_truncated(served):
    """truncate_prompt_tokens with truncation_side right keeps the rendered chat's first tokens: the
    `</think>` a template closed the reasoning with (enable_thinking false) is cut off, so for
    deepseek_r1 (which reads only the prompt) the output starts in the reasoning, as the engine sees it."""
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "truncate_prompt_tokens": 3,
             "truncation_side": "right"}
    raw = raw_output(served, extra_body=extra).message.content
    message = client(served.deepseek_port).chat.completions.create(**request(), extra_body=extra).choices[0].message
    assert (reasoning_of(message), message.content) == expected_split(raw)
