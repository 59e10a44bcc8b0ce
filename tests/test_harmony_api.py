"""The openai_gptoss reasoning parser and the openai tool call parser on the served chat API
(--reasoning-parser openai_gptoss, --tool-call-parser openai), through the official openai SDK: a tiny
random model whose tokenizer has GPT-OSS's harmony tokens, asked with a logit_bias towards them so
that its output is made of harmony markers (SEED's opens an analysis message, ends it and says more).
The expected message is the parsers' reading (tests/test_harmony_parsers.py) of the same request's
raw output, served by a second HTTP front without parsers over the same cluster (same seed: same tokens)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from splitserve.router.openai_protocol import parse_chat_request
from splitserve.router.openai_server import start_http_server
from splitserve.router.reasoning_parsers import HarmonyParser, ReasoningFormat, parse_reasoning
from splitserve.router.tokenizer import RouterTokenizer
from splitserve.router.tool_parsers import HarmonyToolParser, parse_output
from splitserve.testing.tiny_models import build_harmony_model
from tests.factories import http_request, make_request_limits, served_apis

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
def harmony_dir(tmp_path_factory):
    return build_harmony_model(tmp_path_factory.mktemp("harmony") / "model")


@pytest.fixture(scope="module")
def served(harmony_dir):
    with served_apis(harmony_dir, MODEL, tool_call_parser="openai", reasoning_parser="openai_gptoss") as served:
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


# ---- earlier turns' analysis in the prompt (the template's `thinking`) -------------------------------------------

ASKED = {"role": "user", "content": "Time?"}
CALLED = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
ANSWERED = {"role": "tool", "tool_call_id": "c1", "content": "12:00"}
CALL_TEXT = ('<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"tz": "UTC"}<|call|>'
             '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"12:00"<|end|>')


def rendered(model_dir, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt the chat API renders for `messages` (its parse, then the template)."""
    parsed = parse_chat_request({"messages": messages}, make_request_limits())
    return RouterTokenizer.from_model_dir(model_dir).render_chat_template(
        [message.template_message() for message in parsed.messages], add_generation_prompt)


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_a_tool_call_turns_reasoning_is_its_analysis_in_the_next_prompt(harmony_dir, key):
    """GPT-OSS's template reads an earlier turn's analysis as `thinking`; a client sends it back as reasoning."""
    chat = [ASKED, {"role": "assistant", "content": None, key: "Check the clock.", "tool_calls": [CALLED]}, ANSWERED]
    assert rendered(harmony_dir, chat) == ("<|start|>user<|message|>Time?<|end|><|start|>assistant<|channel|>analysis"
                                           f"<|message|>Check the clock.<|end|>{CALL_TEXT}<|start|>assistant")


def test_a_tool_call_turn_with_content_and_reasoning_renders_the_content_as_its_analysis(harmony_dir):
    """The template refuses a tool-call turn with both content and thinking: the turn is sent without `thinking`."""
    chat = [ASKED, {"role": "assistant", "content": "Let me look.", "reasoning": "Check the clock.",
                    "tool_calls": [CALLED]}, ANSWERED]
    assert rendered(harmony_dir, chat) == ("<|start|>user<|message|>Time?<|end|><|start|>assistant<|channel|>analysis"
                                           f"<|message|>Let me look.<|end|>{CALL_TEXT}<|start|>assistant")


def test_a_final_answers_reasoning_is_rendered_where_the_template_renders_it(harmony_dir, served):
    """Only for a chat that ends with that answer and no generation prompt (the template drops earlier turns'
    analysis once a final answer follows, the tool-call turn's too); the served chat's prompt is the same text."""
    turns = [ASKED, {"role": "assistant", "content": "", "reasoning": "Check the clock.", "tool_calls": [CALLED]},
             ANSWERED, {"role": "assistant", "content": "Noon.", "reasoning": "It is 12:00."}]
    ended = ("<|start|>user<|message|>Time?<|end|>" + CALL_TEXT + "<|start|>assistant<|channel|>analysis<|message|>"
             "It is 12:00.<|end|><|start|>assistant<|channel|>final<|message|>Noon.<|return|>")
    asked_again = ("<|start|>user<|message|>Time?<|end|>" + CALL_TEXT + "<|start|>assistant<|channel|>final"
                   "<|message|>Noon.<|end|><|start|>user<|message|>Thanks<|end|><|start|>assistant")
    assert rendered(harmony_dir, turns, add_generation_prompt=False) == ended
    chat = [*turns, {"role": "user", "content": "Thanks"}]
    assert rendered(harmony_dir, chat) == asked_again
    status, _, body = http_request(served.http_port, "POST", "/tokenize", json.dumps({"messages": chat}).encode())
    assert (status, json.loads(body)["tokens"]) == (
        200, served.tokenizers.tokenizer.encode_rendered(asked_again))
