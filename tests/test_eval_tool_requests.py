"""The exact request bodies third-party evaluation and load tools send (recorded through a proxy from
lm-evaluation-harness 0.4.13, vLLM 0.32's `vllm bench serve` and guidellm 0.8.1 against `splitserve serve`;
docs/http_api.md#evaluation-and-load-tools), answered as each tool reads them: lm-eval's loglikelihoods and
greedy flags equal transformers' (fp32), its stop lists cut its generations, and the benchmark clients' token
counts (streamed chunks, usage) equal max_tokens. The tools themselves are not needed."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.testing.workloads import GreedyCase
from tests.factories import hf_greedy, hf_logits, http_request, post_json, served_apis, sse_json_events

MODEL = "tiny-llama"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL) as served:
        yield served


def post(served, path: str, body: dict) -> tuple[int, dict]:
    return post_json(served.http_port, path, body)


def stream(served, path: str, body: dict) -> list[dict]:
    return sse_json_events(served.http_port, path, body)


def lm_eval_parse_logprobs(response: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4.13's LocalCompletionsAPI.parse_logprobs: per choice (by index), the sum of the
    continuation's token logprobs (positions ctxlen .. the generated token, left out) and whether each
    continuation token was the most likely one."""
    results = []
    for choice, ctxlen in zip(sorted(response["choices"], key=lambda c: c["index"]), ctxlens):
        logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        results.append((sum(logprobs), all(lp == max(top.values()) for lp, top in zip(logprobs, tops))))
    return results


def reference_loglikelihood(model_dir, prompt: list[int], ctxlen: int) -> tuple[float, bool]:
    """transformers' (fp32) log p(prompt[ctxlen:] | prompt[:ctxlen]) and whether it is the greedy continuation."""
    rows = torch.log_softmax(hf_logits(model_dir, prompt), dim=-1)[ctxlen - 1:-1]
    continuation = torch.tensor(prompt[ctxlen:])
    picked = rows[torch.arange(len(continuation)), continuation]
    return float(picked.sum()), bool((rows.argmax(dim=-1) == continuation).all())


def test_lm_eval_loglikelihood_batch_equals_transformers(served, tiny_llama_dir):
    """local-completions' loglikelihood request: a batch of token-id prompts (context + continuation; a
    repeated one; a rolling window led by the prefix token 0), echo, logprobs 1, max_tokens 1."""
    context = served.cluster.tokenizer.encode("The river runs past the old mill")
    greedy = hf_greedy(tiny_llama_dir, GreedyCase(tuple(context), 3, ignore_eos=True))
    prompts = [context + greedy, context + [17, 42], context + [17, 42], [0] + context]
    ctxlens = [len(context), len(context), len(context), 1]
    status, response = post(served, "/v1/completions", {"model": MODEL, "prompt": prompts, "temperature": 0,
                                                       "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True})
    assert status == 200, response
    assert [len(c["logprobs"]["token_logprobs"]) for c in response["choices"]] == [len(p) + 1 for p in prompts]
    parsed = lm_eval_parse_logprobs(response, ctxlens)
    for (loglikelihood, is_greedy), prompt, ctxlen in zip(parsed, prompts, ctxlens):
        expected, expected_greedy = reference_loglikelihood(tiny_llama_dir, prompt, ctxlen)
        assert loglikelihood == pytest.approx(expected, abs=1e-4) and is_greedy == expected_greedy
    assert [greedy for _, greedy in parsed] == [True, False, False, False]


def test_lm_eval_generate_until_batch_stops_at_its_until_strings(served, tiny_llama_dir):
    """local-completions' generate_until request: token-id prompts, max_tokens (max_gen_toks), a five-string
    `until` list as `stop` and a seed; each choice is transformers' greedy text cut before the first stop."""
    tokenizer = served.cluster.tokenizer
    prompts = [tokenizer.encode("The river runs"), tokenizer.encode("Once upon a time")]
    outputs = [hf_greedy(tiny_llama_dir, GreedyCase(tuple(p), 24, ignore_eos=False)) for p in prompts]
    stop_text = tokenizer.decode(outputs[0][5:6])
    assert stop_text.strip() and stop_text not in tokenizer.decode(outputs[0][:5])
    until = ["\n\n", "\nclass", "\ndef", "#", stop_text]
    status, response = post(served, "/v1/completions", {"prompt": prompts, "model": MODEL, "max_tokens": 24,
                                                       "temperature": 0, "stop": until, "seed": 1234})
    assert status == 200, response
    texts = [choice["text"] for choice in sorted(response["choices"], key=lambda c: c["index"])]
    expected = [tokenizer.decode(output) for output in outputs]
    for stop in until:
        expected = [text.split(stop)[0] for text in expected]
    assert texts == expected and texts[0] == tokenizer.decode(outputs[0][:5])
    assert response["choices"][0]["finish_reason"] == "stop"


def test_lm_eval_local_chat_completions_few_shot_as_multiturn(served):
    """local-chat-completions with --apply_chat_template --fewshot_as_multiturn --system_instruction and
    gen_kwargs temperature/top_p/seed: four stops at most (lm-eval cuts `until` to 4); the seed makes it repeat."""
    body = {"messages": [{"role": "system", "content": "Continue the Python code."},
                         {"role": "user", "content": "def add(a, b):\n"},
                         {"role": "assistant", "content": "    return a + b"},
                         {"role": "user", "content": "import os\n"}],
            "model": MODEL, "max_tokens": 24, "temperature": 0.7, "stop": ["\n\n", "\nclass", "\ndef", "#"],
            "seed": 3, "top_p": 0.9}
    answers = [post(served, "/v1/chat/completions", body) for _ in range(2)]
    assert [status for status, _ in answers] == [200, 200]
    assert answers[0][1]["choices"][0]["message"] == answers[1][1]["choices"][0]["message"]


def vllm_bench_counts(events: list[dict]) -> tuple[int, int]:
    """What vLLM 0.32's bench client counts: (the chunks with choices, each a token arrival: the first its
    TTFT, the others its ITLs; the last usage's completion_tokens, its output length)."""
    arrivals = [event for event in events if event.get("choices")]
    usage = [event["usage"] for event in events if not event.get("choices") and event.get("usage")]
    return len(arrivals), usage[-1]["completion_tokens"]


def test_vllm_bench_serve_without_model_loads_the_tokenizer_from_root(served, tiny_llama_dir):
    """`vllm bench serve` without --model takes (data[0].id, data[0].root) from GET /v1/models and loads its
    tokenizer from `root` (vLLM's: the model as served); it was the served name, which no tokenizer loads from."""
    from transformers import AutoTokenizer

    status, _, raw = http_request(served.http_port, "GET", "/v1/models")
    card = json.loads(raw)["data"][0]
    assert status == 200 and (card["id"], card["root"]) == (MODEL, str(tiny_llama_dir))
    text = "The river runs past the old mill"
    assert AutoTokenizer.from_pretrained(card["root"]).encode(text, add_special_tokens=False) == \
        served.cluster.tokenizer.encode(text, add_special_tokens=False)


def test_vllm_bench_serve_openai_completions_stream(served):
    """--backend openai --dataset-name random --ignore-eos: one chunk per token (its text may be empty, a special
    token's, as vLLM's server sends it), usage equals max_tokens."""
    events = stream(served, "/v1/completions", {
        "model": MODEL, "prompt": "typ timesdom never seconds requires appropri", "repetition_penalty": 1.0,
        "max_tokens": MAX_TOKENS, "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True})
    assert vllm_bench_counts(events) == (MAX_TOKENS, MAX_TOKENS)


def test_vllm_bench_serve_openai_chat_stream(served):
    """--backend openai-chat --endpoint /v1/chat/completions: text parts, max_completion_tokens; the role
    chunk then one chunk per token (vLLM's server sends the same, so its ITL count is max_tokens)."""
    events = stream(served, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": " special amb now"}]}],
        "max_completion_tokens": MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True})
    assert vllm_bench_counts(events) == (1 + MAX_TOKENS, MAX_TOKENS)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


def test_guidellm_chat_stream_counts_tokens_per_chunk(served):
    """guidellm's openai_http backend: continuous_usage_stats, so every chunk's usage counts the tokens so far."""
    events = stream(served, "/v1/chat/completions", {
        "model": MODEL, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": MAX_TOKENS, "ignore_eos": True,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "1 0 m0 Finish medical want almost"}]}]})
    counts = [event["usage"]["completion_tokens"] for event in events if event["choices"]]
    assert counts == list(range(MAX_TOKENS + 1))  # the role chunk counts 0
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert len({event["usage"]["prompt_tokens"] for event in events}) == 1


def test_guidellm_responses_stream_counts_tokens_in_usage(served):
    """guidellm's /v1/responses request format (input_text parts, max_output_tokens, ignore_eos): it reads the
    output length from response.completed's usage and the text from the deltas (a token without text, such
    as a skipped special token, sends no delta)."""
    events = stream(served, "/v1/responses", {
        "model": MODEL, "stream": True, "max_output_tokens": MAX_TOKENS, "ignore_eos": True,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "1 0 m0 Finish medical"}]}]})
    completed = events[-1]
    assert completed["type"] == "response.completed" and completed["response"]["usage"]["output_tokens"] == MAX_TOKENS
    text = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert text == completed["response"]["output"][0]["content"][0]["text"]
