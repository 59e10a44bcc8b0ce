"""Parallel sampling (n, best_of), echo and batched prompts on the OpenAI API, through the official
`openai` SDK: each choice equals the single request it stands for (seed + index when seeded, as
vLLM derives per-sequence seeds), choices are indexed prompt-major, usage counts each prompt once
and every generated token, the siblings of n share their prompt's KV on one prefill worker, and a
client that goes away cancels every sequence."""

from __future__ import annotations

import json

import openai
import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.router.api_types import GenerationInput, RouterError
from splitserve.router.policy import RoutingConfig
from tests.factories import ServedApis, capture_access_log, http_request, served_apis

MODEL = "tiny-llama"
PROMPT = "The river runs"
OTHER = "A quiet town"
SAMPLED = {"temperature": 1.0, "extra_body": {"ignore_eos": True}}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
LONG = 2000
"""max_tokens of requests a test cancels (the tiny model decodes about 1000 tokens/s)."""


class Served(ServedApis):
    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="none", max_retries=0,
                             timeout=60)

    def single(self, prompt: str | list[int], **kwargs) -> openai.types.Completion:
        completion = self.client().completions.create(model=MODEL, prompt=prompt, **kwargs)
        assert len(completion.choices) == 1
        return completion

    def engine_stats(self, workers) -> list:
        return [self.loop.run(w.stats()).engine for w in workers]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served) as served:
        yield served


@pytest.fixture(scope="module")
def two_prefill(tiny_llama_dir):
    """Two prefill workers and remote prefill for every prompt: where siblings prefill shows (usage reports
    cached tokens)."""
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, num_prefill=2,
                     routing=RoutingConfig(disaggregation="always"),
                     router_options={"enable_prompt_tokens_details": True}) as served:
        yield served


def _texts(completion) -> list[tuple[int, str]]:
    return [(choice.index, choice.text) for choice in completion.choices]


def _stream_texts(stream) -> tuple[dict[int, str], list]:
    """Each choice's streamed text by index, and the chunks."""
    chunks = list(stream)
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + delta
    return texts, chunks


# ---- n -------------------------------------------------------------------------------------

def test_greedy_n_choices_equal_one_request_and_usage_counts_the_prompt_once(served):
    single = served.single(PROMPT, max_tokens=6, **GREEDY)
    completion = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=3, temperature=0,
                                                    extra_body={"ignore_eos": True, "request_id": "three"})
    assert completion.id == "cmpl-three"  # the request's id, not one of its sequences'
    assert _texts(completion) == [(i, single.choices[0].text) for i in range(3)]
    assert [c.finish_reason for c in completion.choices] == ["length"] * 3
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        single.usage.prompt_tokens, 18, single.usage.prompt_tokens + 18)


def test_seeded_sequence_i_samples_with_seed_plus_i(served):
    singles = [served.single(PROMPT, max_tokens=8, seed=41 + i, **SAMPLED).choices[0].text for i in range(4)]
    assert len(set(singles)) > 1  # the seeds sample different texts, so the mapping below is checked
    completion = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, n=4, seed=41,
                                                    **SAMPLED)
    assert _texts(completion) == list(enumerate(singles))


def test_chat_n_streams_each_choice_under_its_index(served):
    chat = [{"role": "user", "content": "Tell me about the river."}]
    client = served.client()
    singles = [client.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, seed=7 + i, **SAMPLED)
               .choices[0].message.content for i in range(3)]
    stream = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, seed=7, n=3, stream=True,
                                            stream_options={"include_usage": True}, **SAMPLED)
    texts, chunks = _stream_texts(stream)
    assert texts == dict(enumerate(singles))
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks if c.choices and c.choices[0].delta.role]
    assert sorted(roles) == [(0, "assistant"), (1, "assistant"), (2, "assistant")]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    whole = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, seed=7, n=3, **SAMPLED)
    assert [(c.index, c.message.content) for c in whole.choices] == list(enumerate(singles))
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


@pytest.mark.parametrize("cache_salt", [None, "user-a"])
def test_n_siblings_prefill_where_the_first_left_the_prompts_kv(two_prefill, cache_salt):
    """Salted, after the unsalted run of the same prompt: every sibling has the salt, so the first misses
    the unsalted blocks and the others hit its salted ones."""
    prompt = list(range(5, 42))  # 37 tokens: 4 full blocks of 8, then 5 tokens to compute per sibling
    workers = two_prefill.cluster.prefill_workers
    before = two_prefill.engine_stats(workers)
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    completion = two_prefill.client().completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=4, temperature=0,
                                                         extra_body={"ignore_eos": True, **salt})
    assert len(completion.choices) == 4
    after = two_prefill.engine_stats(workers)
    queries = [a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before)]
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before)]
    assert sorted(queries) == [0, 4 * 37]  # all four prefilled on one worker
    assert sorted(hits) == [0, 3 * 32]  # the three siblings reused the first one's four full blocks
    assert completion.usage.prompt_tokens_details.cached_tokens == 0  # the first sequence's own hit


def test_a_client_disconnecting_cancels_every_sequence(served):
    before = sum(s.num_generation_tokens for s in served.engine_stats(served.cluster.decode_workers))
    stream = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=LONG, n=3, stream=True,
                                                **GREEDY)
    indexes = {next(stream).choices[0].index for _ in range(12)}
    stream.close()
    served.loop.run(served.cluster.wait_idle())
    generated = sum(s.num_generation_tokens for s in served.engine_stats(served.cluster.decode_workers)) - before
    assert indexes == {0, 1, 2}
    assert generated < 3 * LONG // 2
    assert served.cluster.orchestrator.admission.in_flight == 0
    assert served.cluster.orchestrator.num_in_flight == 0


# ---- best_of ---------------------------------------------------------------------------------

def test_a_fan_out_the_router_cannot_hold_whole_is_a_429_before_any_sequence_runs(tiny_llama_dir, monkeypatch,
                                                                                     caplog):
    """Every sequence takes an admission slot before the first one starts: with room for two, 2 prompts x n=2
    and n=3 are refused whole (streamed too: a 429 with Retry-After, not a 200 whose stream fails after the
    first sequence's tokens), nothing runs, no slot leaks, and n=2 is served. Each refusal is recorded once,
    as the client's request (its sequences never ran): one access-log line under its id, with its prompts'
    tokens (each once), status RESOURCE_EXHAUSTED and rejection reason too_many_requests; one failure and one
    SLO miss; one admission rejection."""
    routing = RoutingConfig(disaggregation="always", max_in_flight_requests=2)
    with served_apis(tiny_llama_dir, MODEL, served_class=Served, routing=routing) as served:
        access_log = capture_access_log(served, monkeypatch, caplog)
        before = served.per_request_series()
        workers = [*served.cluster.prefill_workers, *served.cluster.decode_workers]
        refused = ({"prompt": [PROMPT, OTHER], "n": 2, "request_id": "wide-batch"},
                   {"prompt": PROMPT, "n": 3, "stream": True, "request_id": "wide-stream"})
        for body in refused:
            status, headers, raw = http_request(served.http_port, "POST", "/v1/completions", json.dumps(
                {**body, "max_tokens": 3}).encode())
            assert (status, headers["retry-after"], json.loads(raw)["error"]["code"]) == (
                429, "1", "resource_exhausted")
        assert [s.num_generation_tokens for s in served.engine_stats(workers)] == [0, 0]
        assert dict(served.cluster.orchestrator.routing_stats().rejections) == {"too_many_requests": 2}
        assert served.cluster.orchestrator.admission.in_flight == 0
        assert served.per_request_changes(before) == {"splitserve_request_failure_total{RESOURCE_EXHAUSTED}": 2,
                                                      "splitserve_slo_requests_total": 2}
        prompt_tokens, other_tokens = (len(served.cluster.tokenizer.encode(text)) for text in (PROMPT, OTHER))
        lines = access_log()
        assert all(0 <= line.pop("e2e_s") < 1 for line in lines)
        assert lines == [{"request_id": request_id, "status": "RESOURCE_EXHAUSTED", "finish_reason": None,
                          "rejection_reason": "too_many_requests", "prompt_tokens": tokens, "cached_tokens": 0,
                          "output_tokens": 0, "ttft_s": None, "tpot_s": None, "prefill_worker": None,
                          "decode_worker": None, "migrations": 0}
                         for request_id, tokens in (("wide-batch", prompt_tokens + other_tokens),
                                                    ("wide-stream", prompt_tokens))]
        texts, _ = _stream_texts(served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=2,
                                                                    stream=True, **GREEDY))
        assert sorted(texts) == [0, 1] and texts[0] == texts[1]


def test_the_orchestrator_holds_a_fan_outs_slots_and_records_a_refusal_while_draining_once(tiny_llama_dir,
                                                                                           monkeypatch, caplog):
    """Orchestrator.fan_out: its other sequences' slots are taken at its start and released at its end; once the
    router drains, a fan-out refused its other slots ends UNAVAILABLE, recorded once, with no rejection reason
    (draining is not admission control). (A fan-out's id and its sequences' are the caller's reservation,
    Orchestrator.new_request_id: tests/test_duplicate_request_ids.py.)"""
    with served_apis(tiny_llama_dir, MODEL, served_class=Served) as served:
        orchestrator = served.cluster.orchestrator
        access_log = capture_access_log(served, monkeypatch, caplog)
        before = served.per_request_series()
        client = GenerationInput("fan", (5, 6, 7), SamplingParams())

        async def slots_held() -> tuple[int, int]:
            with orchestrator.fan_out(client, 3, 2) as others:
                return len(others), orchestrator.admission.in_flight

        assert served.loop.run(slots_held()) == (1, 1)
        assert orchestrator.admission.in_flight == 0
        orchestrator.admission.stop_accepting()

        async def refused() -> str:
            with pytest.raises(RouterError) as error, orchestrator.fan_out(client, 3, 2):
                pass
            return error.value.code

        assert served.loop.run(refused()) == "UNAVAILABLE"
        assert served.per_request_changes(before) == {"splitserve_request_failure_total{UNAVAILABLE}": 1,
                                                      "splitserve_slo_requests_total": 1}
        assert [(line["request_id"], line["status"], line["rejection_reason"], line["prompt_tokens"])
                for line in access_log()] == [("fan", "UNAVAILABLE", None, 3)]


def test_best_of_returns_the_sequences_of_highest_cumulative_logprob(served):
    singles = [served.single(PROMPT, max_tokens=5, seed=3 + i, logprobs=0, **SAMPLED).choices[0] for i in range(4)]
    ranked = sorted(singles, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    before = served.per_request_series()
    completion = served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2, best_of=4, seed=3,
                                                    **SAMPLED)
    assert _texts(completion) == [(0, ranked[0].text), (1, ranked[1].text)]
    assert completion.choices[0].logprobs is None  # ranked by logprobs the client did not ask for
    assert completion.usage.completion_tokens == 20  # every generated sequence is counted
    changes = served.per_request_changes(before)
    # each sequence is a request; the client's request params are observed once, with its n (not best_of)
    assert changes["splitserve_request_success_total{length}"] == 4
    assert {name: value for name, value in changes.items() if "params" in name or "max_num" in name} == {
        "splitserve_request_params_n_count": 1, "splitserve_request_params_n_sum": 2,
        "splitserve_request_params_max_tokens_count": 1, "splitserve_request_params_max_tokens_sum": 5,
        "splitserve_request_max_num_generation_tokens_count": 1, "splitserve_request_max_num_generation_tokens_sum": 5}


@pytest.mark.parametrize(("body", "message"), [
    ({"n": 2, "best_of": 1}, "best_of: must be >= n (2), got 1"),
    ({"best_of": 2, "stream": True}, "best_of: cannot stream: the best 1 of 2 sequences are known only once all "
                                     "finished (set best_of to n, or stream to false)"),
    ({"n": 129}, "n: must be an integer in [1, 128], got 129"),
    ({"prompt": ["a"] * 65, "best_of": 2}, "prompt: 65 prompts x 2 sequences each exceed 128 sequences per request"),
    ({"prompt": ["a", 5]}, "prompt: must be a string or a non-empty list of token ids"),
    ({"prompt": ["a", []]}, "prompt[1]: must be a string or a non-empty list of token ids"),
])
def test_bad_fan_outs_are_400_naming_the_field(served, body, message):
    status, _, raw = http_request(served.http_port, "POST", "/v1/completions",
                                  json.dumps({"prompt": PROMPT, "max_tokens": 2, **body}).encode())
    assert (status, json.loads(raw)["error"]["message"]) == (400, message)


# ---- batched prompts and echo ------------------------------------------------------------------

def test_batched_prompts_index_choices_prompt_major(served, tiny_llama_dir):
    token_prompt = served.cluster.tokenizer.encode(OTHER)
    expected = [served.single(p, max_tokens=4, seed=5 + s, **SAMPLED) for p in (PROMPT, token_prompt) for s in (0, 1)]
    completion = served.client().completions.create(model=MODEL, prompt=[PROMPT, OTHER], max_tokens=4, n=2, seed=5,
                                                    **SAMPLED)
    assert _texts(completion) == [(i, e.choices[0].text) for i, e in enumerate(expected)]
    prompt_tokens = expected[0].usage.prompt_tokens + expected[2].usage.prompt_tokens
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (prompt_tokens, 16)
    as_ids = served.client().completions.create(model=MODEL, prompt=[served.cluster.tokenizer.encode(PROMPT),
                                                                     token_prompt], max_tokens=4, n=2, seed=5,
                                                **SAMPLED)
    assert _texts(as_ids) == _texts(completion)


def test_batched_prompts_stream_with_their_usage(served):
    body = {"model": MODEL, "prompt": [PROMPT, OTHER], "max_tokens": 3, **GREEDY}
    whole = served.client().completions.create(**body)
    texts, chunks = _stream_texts(served.client().completions.create(
        **body, stream=True, stream_options={"include_usage": True}))
    assert texts == dict(_texts(whole))
    assert chunks[-1].usage == whole.usage


def _usage_so_far(chunks, tokens_in) -> list[tuple[int, int, int, int]]:
    """(choice index, tokens streamed for it so far, the chunk's usage: completion and prompt tokens)
    of every chunk that has choices; `tokens_in(choice)` counts a chunk choice's tokens."""
    streamed: dict[int, int] = {}
    rows = []
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, 0) + tokens_in(choice)
            rows.append((choice.index, streamed[choice.index], chunk.usage.completion_tokens,
                         chunk.usage.prompt_tokens))
            assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    return rows


def test_continuous_usage_stats_give_each_chunk_its_choices_usage_so_far(served):
    """vLLM's stream_options.continuous_usage_stats: every chunk's usage counts its own choice's
    prompt and the tokens streamed for that choice up to and including the chunk."""
    prompt_tokens = [served.single(p, max_tokens=1).usage.prompt_tokens for p in (PROMPT, OTHER)]
    chunks = list(served.client().completions.create(
        model=MODEL, prompt=[PROMPT, OTHER], max_tokens=5, n=2, logprobs=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    rows = _usage_so_far(chunks[:-1], lambda choice: len(choice.logprobs.tokens))
    assert {index for index, *_ in rows} == {0, 1, 2, 3}
    assert all(streamed == completion and prompt == prompt_tokens[index // 2]
               for index, streamed, completion, prompt in rows)
    assert {index: streamed for index, streamed, *_ in rows} == {0: 5, 1: 5, 2: 5, 3: 5}  # each choice's last
    assert (chunks[-1].choices, chunks[-1].usage.completion_tokens) == ([], 20)  # the usage chunk as before


def test_continuous_usage_stats_in_a_chat_stream(served):
    chat = [{"role": "user", "content": "Tell me about the river."}]
    client = served.client()
    prompt_tokens = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1).usage.prompt_tokens
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=4, logprobs=True, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    rows = _usage_so_far(chunks[:-1], lambda choice: len(choice.logprobs.content) if choice.logprobs else 0)
    assert rows[0] == (0, 0, 0, prompt_tokens)  # the role chunk: no token yet
    assert all(streamed == completion and prompt == prompt_tokens for _, streamed, completion, prompt in rows)
    assert rows[-1][1] == 4 and chunks[-1].usage.completion_tokens == 4
    # Without include_usage, vLLM sends no usage at all.
    plain = list(client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2, stream=True,
                                                stream_options={"continuous_usage_stats": True}, **GREEDY))
    assert all(chunk.usage is None for chunk in plain)
    status, _, raw = http_request(served.http_port, "POST", "/v1/chat/completions", json.dumps(
        {"messages": chat, "stream": True, "stream_options": {"continuous_usage_stats": 2}}).encode())
    assert (status, json.loads(raw)["error"]["param"]) == (400, "stream_options.continuous_usage_stats")


def test_echo_prepends_each_prompt(served):
    single = served.single(PROMPT, max_tokens=4, **GREEDY).choices[0].text
    other = served.single(OTHER, max_tokens=4, **GREEDY).choices[0].text
    completion = served.client().completions.create(model=MODEL, prompt=[PROMPT, OTHER], max_tokens=4, echo=True,
                                                    **GREEDY)
    assert _texts(completion) == [(0, PROMPT + single), (1, OTHER + other)]
    texts, _ = _stream_texts(served.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True,
                                                                stream=True, **GREEDY))
    assert texts == {0: PROMPT + single}
    ids = served.cluster.tokenizer.encode(PROMPT)
    by_ids = served.client().completions.create(model=MODEL, prompt=ids, max_tokens=4, echo=True, **GREEDY)
    assert by_ids.choices[0].text == served.cluster.tokenizer.decode(ids, skip_special_tokens=False) + single


def test_sequence_seeds_wrap_into_the_seed_range():
    params = SamplingParams(seed=2**64 - 2)
    assert [params.for_sequence(i).seed for i in range(4)] == [2**64 - 2, 2**64 - 1, -2**63, -2**63 + 1]
    assert SamplingParams().for_sequence(3).seed is None
    assert [SamplingParams(n=3, seed=5).for_sequence(i) for i in range(3)] == [SamplingParams(seed=5 + i)
                                                                               for i in range(3)]
