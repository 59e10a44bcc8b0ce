"""The openai_gptoss reasoning parser and the openai tool call parser on the served chat API
(--reasoning-parser openai_gptoss, --tool-call-parser openai), through the official openai SDK: a tiny
random model whose tokenizer has GPT-OSS's harmony tokens, asked with a logit_bias towards them so
that its output is made of harmony markers (SEED's opens an analysis message, ends it and says more).
The expected message is the parsers' reading (tests/test_harmony_parsers.py) of the same request's
raw output, served by a second HTTP front without parsers over the same cluster (same seed: same tokens)."""

from __future__ import annotations

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from splitserve.router.openai_server import start_http_server
from splitserve.router.reasoning_parsers import HarmonyParser, ReasoningFormat, parse_reasoning
from splitserve.router.tool_parsers import HarmonyToolParser, parse_output
from splitserve.testing.tiny_models import build_harmony_model
from tests.factories import served_apis

MODEL = "m"
SEED = 113
HARMONY_BIAS = {"<|channel|>": 6, "analysis": 6, "<|message|>": 6, "<|end|>": 4, "<|start|>": 4, "final": 4,
                " to=functions.get_time": 3, '{"tz": "UTC"}': 3}
CALL_SEED = 240
"""With CALL_BIAS, a seed whose output calls get_time first (then writes text after the call's JSON)."""
CALL_BIAS = {**HARMONY_BIAS, " to=functions.get_time": 6, '{"tz": "UTC"}': 6}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = build_harmony_model(tmp_path_factory.mktemp("harmony") / "model")
    with served_apis(model_dir, MODEL, tool_call_parser="openai", reasoning_parser="openai_gptoss") as served:
        plain = served.loop.run(start_http_server(served.cluster.orchestrator, served.tokenizers, MODEL, port=0))
        served.plain_port = plain.port
        try:
            yield served
        finally:
            served.loop.run(plain.stop())


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


def request(served, seed: int = SEED, bias: dict[str, int] = HARMONY_BIAS) -> dict:
    token_id = served.tokenizers.tokenizer.backend.token_to_id
    return {"model": MODEL, "messages": [{"role": "user", "content": "Time?"}], "max_tokens": 30,
            "temperature": 1.0, "seed": seed, "logit_bias": {str(token_id(t)): v for t, v in bias.items()}}


def test_a_chat_returns_the_analysis_as_reasoning_and_the_rest_as_content(served):
    raw = client(served.plain_port).chat.completions.create(**request(served), extra_body={
        "skip_special_tokens": False, "return_token_ids": True}).choices[0]
    tokens = ReasoningFormat.for_tokenizer("openai_gptoss", served.tokenizers.tokenizer.backend.token_to_id).tags
    reasoner = HarmonyParser(tokens, False)
    split = parse_reasoning(reasoner, raw.message.content, raw.model_extra["token_ids"])
    expected = parse_output(HarmonyToolParser(None, False), split.content)
    assert raw.message.content.startswith("<|channel|>analysis<|message|><|channel|>=")  # SEED's output
    assert (split.reasoning, expected.content, expected.tool_calls) == (
        "<|channel|>=<|channel|><|channel|>analysisanalysisberanalysis<|message|>analysis",
        raw.message.content.split("<|end|>", 1)[1], ())
    response = client(served.http_port).chat.completions.create(**request(served))
    message = response.choices[0].message
    assert (message.model_extra["reasoning"], message.content, message.tool_calls) == (
        split.reasoning, expected.content, None)
    assert response.usage.completion_tokens_details.reasoning_tokens == reasoner.reasoning_tokens == 10


def test_a_stream_accumulates_to_the_message(served):
    whole = client(served.http_port).chat.completions.create(**request(served)).choices[0]
    state = ChatCompletionStreamState()
    for chunk in client(served.http_port).chat.completions.create(**request(served), stream=True):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]
    assert (streamed.message.model_extra["reasoning"], streamed.message.content, streamed.finish_reason) == (
        whole.message.model_extra["reasoning"], whole.message.content, whole.finish_reason) != (None, None, "length")


def test_a_response_has_a_reasoning_item_and_a_message(served):
    chat = request(served)
    message = client(served.http_port).chat.completions.create(**chat).choices[0].message
    response = client(served.http_port).responses.create(
        model=MODEL, input=chat["messages"], max_output_tokens=30, temperature=1.0,
        extra_body={"seed": SEED, "logit_bias": chat["logit_bias"]})
    assert [(item.type, [part.text for part in item.content]) for item in response.output] == [
        ("reasoning", [message.model_extra["reasoning"]]), ("message", [message.content])]


def test_a_call_is_returned_as_a_tool_call_streamed_and_whole(served):
    call = request(served, CALL_SEED, CALL_BIAS)
    raw = client(served.plain_port).chat.completions.create(**call, extra_body={"skip_special_tokens": False})
    assert raw.choices[0].message.content.startswith('<|channel|>\x17 to=functions.get_time<|message|>{"tz": "UTC"}a')
    whole = client(served.http_port).chat.completions.create(**call, tools=TOOLS).choices[0]
    assert (whole.message.model_extra["reasoning"], whole.message.content, whole.finish_reason) == (
        None, None, "tool_calls")
    assert [(c.type, c.function.name, c.function.arguments) for c in whole.message.tool_calls] == [
        ("function", "get_time", '{"tz": "UTC"}')]
    state = ChatCompletionStreamState()
    for chunk in client(served.http_port).chat.completions.create(**call, tools=TOOLS, stream=True):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        ("get_time", '{"tz": "UTC"}')]
    assert (streamed.message.content, streamed.finish_reason) == ("", "tool_calls")  # the role chunk's ""
