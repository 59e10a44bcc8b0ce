"""use_beam_search on the OpenAI API, end to end on the tiny model: the beams equal an independent
reference (vLLM's algorithm over transformers' fp32 logits) token for token, beam width 1 is greedy,
a chat streams each beam whole, a streamed completion is answered with one JSON response (both as
vLLM does), fields a beam search cannot honour are 400s, each step's beams take admission slots, a
client that goes away and a deadline stop every beam's requests, and a search is one request in the router's
metrics and access log (its beams are internal steps)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import torch

from splitserve.common.beam_search import BeamSearchParams, start
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.slo import SloConfig, SloOutcome
from splitserve.router.api_types import GenerationInput, RouterError
from splitserve.router.beam_search_run import run_beam_search
from splitserve.router.policy import RoutingConfig
from splitserve.router.records import StepwiseRequest
from tests.factories import (capture_access_log, eos_model, hf_logits, http_request, make_request_record,
                             reference_beam_search, served_apis)

MODEL = "tiny-llama"
PROMPT = "The river runs"


def _post(served, path: str, body: dict) -> tuple[int, dict, bytes]:
    return http_request(served.http_port, "POST", path, json.dumps({"model": MODEL, **body}).encode())


def _completion(served, **body) -> dict:
    status, _, raw = _post(served, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True,
                                                       "return_token_ids": True, **body})
    assert status == 200, raw
    return json.loads(raw)


def _beams(response: dict) -> list[tuple[list[int], str]]:
    return [(choice["token_ids"], choice["finish_reason"]) for choice in response["choices"]]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, router_options={"enable_prompt_tokens_details": True}) as served:
        yield served


@pytest.fixture(scope="module")
def prompt_ids(served) -> list[int]:
    return list(served.cluster.tokenizer.backend.encode(PROMPT).ids)


# ---- the beams ---------------------------------------------------------------------------------

def test_beam_width_one_is_greedy(served):
    status, _, raw = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                                       "ignore_eos": True, "return_token_ids": True})
    greedy = json.loads(raw)["choices"][0]
    beam = _completion(served, max_tokens=8, ignore_eos=True)["choices"]
    assert status == 200 and len(beam) == 1
    assert (beam[0]["token_ids"], beam[0]["text"], beam[0]["finish_reason"]) == (
        greedy["token_ids"], greedy["text"], "length")


@pytest.mark.parametrize("beam_width", [2, 3, 4])
def test_beams_equal_the_reference_over_transformers_logits(served, prompt_ids, tiny_llama_dir, beam_width):
    response = _completion(served, n=beam_width, max_tokens=5, temperature=0)
    expected = reference_beam_search(tiny_llama_dir, prompt_ids, beam_width, 5, eos=0)
    assert _beams(response) == expected
    assert [c["index"] for c in response["choices"]] == list(range(beam_width))
    assert response["choices"][0]["text"] == served.cluster.tokenizer.decode(expected[0][0])
    usage = response["usage"]  # the prompt once, every returned beam's tokens
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt_ids), 5 * beam_width)


def test_a_batch_of_prompts_gets_each_prompts_beams_prompt_major(served, prompt_ids, tiny_llama_dir):
    other = [5, 77, 300]
    response = _completion(served, prompt=[prompt_ids, other], n=2, max_tokens=3, temperature=0)
    assert _beams(response) == (reference_beam_search(tiny_llama_dir, prompt_ids, 2, 3, eos=0)
                                + reference_beam_search(tiny_llama_dir, other, 2, 3, eos=0))


def test_chat_beams_equal_the_reference_and_stream_whole(served, tiny_llama_dir):
    messages = [{"role": "user", "content": "Tell me about rivers"}]
    body = {"messages": messages, "use_beam_search": True, "n": 2, "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    status, _, raw = _post(served, "/v1/chat/completions", body)
    response = json.loads(raw)
    expected = reference_beam_search(tiny_llama_dir, response["prompt_token_ids"], 2, 4, eos=0)
    assert status == 200
    assert [(c["token_ids"], c["finish_reason"]) for c in response["choices"]] == expected
    status, headers, raw = _post(served, "/v1/chat/completions", {**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert raw.endswith(b"data: [DONE]\n\n")
    deltas = [(c["index"], c["delta"], c["finish_reason"]) for e in events for c in e["choices"]]
    assert deltas == [(0, {"role": "assistant", "content": ""}, None),
                      (0, {"content": response["choices"][0]["message"]["content"]}, "length"),
                      (1, {"role": "assistant", "content": ""}, None),
                      (1, {"content": response["choices"][1]["message"]["content"]}, "length")]
    assert events[-1]["usage"]["completion_tokens"] == 8


def test_beams_through_remote_prefill_and_kv_transfer_equal_the_reference(tiny_llama_dir, prompt_ids):
    """Every step's beams prefilled on one of two prefill workers and pulled by the decode worker."""
    with served_apis(tiny_llama_dir, MODEL, num_prefill=2, routing=RoutingConfig(disaggregation="always")) as served:
        response = _completion(served, n=3, max_tokens=4, temperature=0)
        prefill = [served.loop.run(w.stats()).engine for w in served.cluster.prefill_workers]
        decoded = served.loop.run(served.cluster.decode_workers[0].stats()).engine
    assert _beams(response) == reference_beam_search(tiny_llama_dir, prompt_ids, 3, 4, eos=0)
    length = len(prompt_ids)  # step prompts: the prompt, then 3 beams of the prompt + 1, + 2 and + 3 tokens
    assert (sum(e.num_prompt_tokens for e in prefill), decoded.num_prompt_tokens) == (length + 3 * (3 * length + 6), 0)
    assert sum(e.prefix_cache_hits for e in prefill) > 0  # later steps reuse the earlier steps' prompt blocks


def test_a_streamed_completion_is_answered_with_one_json_response(served, prompt_ids, tiny_llama_dir):
    status, headers, raw = _post(served, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 2,
                                                             "max_tokens": 3, "temperature": 0, "stream": True,
                                                             "return_token_ids": True})
    assert status == 200 and headers["content-type"] == "application/json"
    assert _beams(json.loads(raw)) == reference_beam_search(tiny_llama_dir, prompt_ids, 2, 3, eos=0)


@pytest.fixture(scope="module")
def eos_served(tiny_llama_dir, tmp_path_factory, served, prompt_ids):
    """The model whose tokenizer EOS is the prompt's second-best next token."""
    logprobs = torch.log_softmax(hf_logits(tiny_llama_dir, prompt_ids)[-1], dim=-1)
    eos = int(logprobs.topk(2).indices[1])
    model_dir = eos_model(tiny_llama_dir, tmp_path_factory.mktemp("eos") / "model", eos)
    with served_apis(model_dir, MODEL) as eos_served:
        yield eos_served, model_dir, eos


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0, -1.0])
def test_eos_completes_beams_and_the_length_penalty_ranks_them(eos_served, prompt_ids, length_penalty):
    served, model_dir, eos = eos_served
    response = _completion(served, n=3, max_tokens=6, temperature=0, length_penalty=length_penalty)
    expected = reference_beam_search(model_dir, prompt_ids, 3, 6, eos, length_penalty)
    assert _beams(response) == expected
    assert "stop" in {reason for _, reason in expected}
    stopped = [c for c in response["choices"] if c["finish_reason"] == "stop"]
    assert [c["stop_reason"] for c in stopped] == [eos] * len(stopped)
    assert all(eos not in c["token_ids"] for c in response["choices"])


def test_include_stop_str_in_output_keeps_eos_in_token_ids_only(eos_served, prompt_ids):
    served, model_dir, eos = eos_served
    response = _completion(served, n=3, max_tokens=6, temperature=0, include_stop_str_in_output=True)
    expected = reference_beam_search(model_dir, prompt_ids, 3, 6, eos)
    assert _beams(response) == [(ids + [eos] if reason == "stop" else ids, reason) for ids, reason in expected]
    for choice, (ids, _) in zip(response["choices"], expected):
        assert choice["text"] == served.cluster.tokenizer.decode(ids)


def test_ignore_eos_runs_every_beam_to_max_tokens(eos_served, prompt_ids):
    served, model_dir, eos = eos_served
    response = _completion(served, n=2, max_tokens=4, temperature=0, ignore_eos=True)
    assert _beams(response) == reference_beam_search(model_dir, prompt_ids, 2, 4, eos, ignore_eos=True)
    assert {c["finish_reason"] for c in response["choices"]} == {"length"}


# ---- what is refused ---------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"n": 11}, "n"),
    ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"stop": ["."]}, "stop"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"repetition_penalty": 1.2}, "repetition_penalty"),
    ("/v1/completions", {"use_beam_search": "sure"}, "use_beam_search"),  # "yes" is true, as pydantic reads it
    ("/v1/completions", {"length_penalty": None}, "length_penalty"),
    ("/v1/completions", {"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
    ("/v1/completions", {"length_penalty": 2**31}, "length_penalty"),  # was a 500: the ranking's power overflowed
    ("/v1/completions", {"length_penalty": -1e308}, "length_penalty"),  # was a 500: a division by zero
    ("/v1/chat/completions", {"length_penalty": 10**400}, "length_penalty"),  # was a 500: no float holds it
    ("/v1/chat/completions", {"n": 11}, "n"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_combinations_are_400s_naming_the_field(served, path, body, param):
    prompt = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    status, _, raw = _post(served, path, {**prompt, "use_beam_search": True, "max_tokens": 3, **body})
    assert (status, json.loads(raw)["error"]["param"]) == (400, param)


def test_n_above_the_widest_beam_says_why(served):
    status, _, raw = _post(served, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 11})
    assert status == 400
    assert json.loads(raw)["error"]["message"] == (
        "n: is the beam width with use_beam_search: an integer in [1, 10] (each step asks for 2 x n logprobs, at "
        "most 20), got 11")


# ---- admission, cancellation, deadlines -----------------------------------------------------------

def test_a_search_the_router_cannot_hold_whole_is_a_429_before_any_step_runs(tiny_llama_dir):
    """Room for two requests: width three (the request's slot and two more, held for every step) is refused
    at once, nothing runs and no slot leaks; width two is served."""
    routing = RoutingConfig(max_in_flight_requests=2)
    with served_apis(tiny_llama_dir, MODEL, routing=routing) as served:
        status, headers, raw = _post(served, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 3,
                                                                 "max_tokens": 3, "temperature": 0})
        assert (status, headers["retry-after"], json.loads(raw)["error"]["code"]) == (429, "1", "resource_exhausted")
        assert _generated_tokens(served) == 0
        assert dict(served.cluster.orchestrator.routing_stats().rejections) == {"too_many_requests": 1}
        assert served.cluster.orchestrator.admission.in_flight == 0
        assert (served.requests_ended("request_failure", code="RESOURCE_EXHAUSTED"),
                served.requests_ended("internal_step_requests")) == (1, 0)
        status, _, raw = _post(served, "/v1/completions", {"prompt": PROMPT, "use_beam_search": True, "n": 2,
                                                           "max_tokens": 3})
        assert status == 200 and len(json.loads(raw)["choices"]) == 2
        assert served.cluster.orchestrator.admission.in_flight == 0


def _generated_tokens(served) -> int:
    return sum(served.loop.run(w.stats()).engine.num_generation_tokens for w in served.cluster.decode_workers)


def test_a_client_going_away_stops_every_beam(served):
    cancelled = served.requests_ended("request_failure", code="CANCELLED")
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "use_beam_search": True, "n": 3, "max_tokens": 2000,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", served.http_port)) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(1.0)
    deadline = time.monotonic() + 10.0
    while served.requests_ended("request_failure", code="CANCELLED") == cancelled:  # the search's one record
        assert time.monotonic() < deadline, "the search did not end after its client went away"
        time.sleep(0.05)
    served.loop.run(served.cluster.wait_idle())
    stopped_at = _generated_tokens(served)
    time.sleep(0.5)
    assert _generated_tokens(served) == stopped_at < 3 * 2000
    assert served.cluster.orchestrator.admission.in_flight == 0
    assert served.cluster.orchestrator.num_in_flight == 0
    assert served.requests_ended("request_failure", code="CANCELLED") == cancelled + 1  # the search, once


def test_the_deadline_ends_the_search(served, prompt_ids):
    orchestrator = served.cluster.orchestrator
    search = start(BeamSearchParams(beam_width=2, max_tokens=2000, ignore_eos=True), prompt_ids, 0)
    base = GenerationInput("deadline", tuple(prompt_ids), SamplingParams(), time.monotonic() + 0.5)
    with pytest.raises(RouterError) as error:
        served.loop.run(run_beam_search(orchestrator, base, search, "deadline"))
    assert error.value.code == "DEADLINE_EXCEEDED"
    served.loop.run(served.cluster.wait_idle())
    assert orchestrator.num_in_flight == 0



# ---- one request in the router's records ----------------------------------------------------------

@pytest.fixture
def access_log(served, monkeypatch, caplog):
    return capture_access_log(served, monkeypatch, caplog)


def test_a_beam_search_is_one_request_in_the_metrics_and_the_access_log(served, prompt_ids, access_log):
    """Width 3, 4 steps: 1 + 3 x 3 one-token step requests, counted as internal steps only; the search is one
    finished request with 12 output tokens, all reaching the client with its response (TTFT = e2e)."""
    before = served.per_request_series()
    response = _completion(served, n=3, max_tokens=4, temperature=0, ignore_eos=True, request_id="beams-1")
    changes = served.per_request_changes(before)
    [line] = access_log()
    e2e_s = line["e2e_s"]
    assert line == {"request_id": "beams-1", "status": "OK", "finish_reason": "length", "rejection_reason": None,
                    "prompt_tokens": len(prompt_ids),
                    "cached_tokens": response["usage"]["prompt_tokens_details"]["cached_tokens"], "output_tokens": 12,
                    "ttft_s": e2e_s, "tpot_s": 0.0, "e2e_s": e2e_s, "prefill_worker": None, "decode_worker": None,
                    "migrations": 0}
    seconds = {name: changes.pop(name) for name in ("splitserve_time_to_first_token_seconds_sum",
                                                    "splitserve_e2e_request_latency_seconds_sum")}
    assert seconds == {name: pytest.approx(e2e_s, abs=1e-6) for name in seconds}
    assert changes == {
        "splitserve_request_success_total{length}": 1, "splitserve_time_to_first_token_seconds_count": 1,
        "splitserve_e2e_request_latency_seconds_count": 1, "splitserve_inter_token_latency_seconds_count": 11,
        "splitserve_time_per_output_token_seconds_count": 1, "splitserve_request_decode_time_seconds_count": 1,
        "splitserve_request_prompt_tokens_count": 1, "splitserve_request_prompt_tokens_sum": len(prompt_ids),
        "splitserve_request_generation_tokens_count": 1, "splitserve_request_generation_tokens_sum": 12,
        "splitserve_slo_requests_total": 1, "splitserve_slo_ttft_met_requests_total": 1,
        "splitserve_slo_tpot_met_requests_total": 1, "splitserve_slo_met_requests_total": 1,
        "splitserve_goodput_tokens_total": 12, "splitserve_internal_step_requests_total": 10,
        # once, as the client's request: its n (the width), max_tokens and longest returned beam
        "splitserve_request_params_n_count": 1, "splitserve_request_params_n_sum": 3,
        "splitserve_request_params_max_tokens_count": 1, "splitserve_request_params_max_tokens_sum": 4,
        "splitserve_request_max_num_generation_tokens_count": 1, "splitserve_request_max_num_generation_tokens_sum": 4}


def test_an_ordinary_request_is_still_one_request_with_its_own_phases(served, prompt_ids, access_log):
    before = served.per_request_series()
    status, _, raw = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                                       "ignore_eos": True, "request_id": "plain-1"})
    changes = served.per_request_changes(before)
    [line] = access_log()
    assert status == 200
    assert (line["request_id"], line["status"], line["prompt_tokens"], line["output_tokens"]) == (
        "plain-1", "OK", len(prompt_ids), 4)
    assert line["decode_worker"] == "decode-0" and line["ttft_s"] < line["e2e_s"]
    counts = {name: value for name, value in changes.items()
              if name.split("{")[0].endswith(("_count", "_total")) and "ttft_breakdown" not in name}
    assert counts == {
        "splitserve_request_success_total{length}": 1, "splitserve_time_to_first_token_seconds_count": 1,
        "splitserve_e2e_request_latency_seconds_count": 1, "splitserve_inter_token_latency_seconds_count": 3,
        "splitserve_time_per_output_token_seconds_count": 1, "splitserve_request_queue_time_seconds_count": 1,
        "splitserve_request_prefill_time_seconds_count": 1, "splitserve_request_decode_time_seconds_count": 1,
        "splitserve_request_prompt_tokens_count": 1, "splitserve_request_generation_tokens_count": 1,
        "splitserve_slo_requests_total": 1, "splitserve_slo_ttft_met_requests_total": 1,
        "splitserve_slo_tpot_met_requests_total": 1, "splitserve_slo_met_requests_total": 1,
        "splitserve_goodput_tokens_total": 4, "splitserve_request_params_n_count": 1,
        "splitserve_request_params_max_tokens_count": 1, "splitserve_request_max_num_generation_tokens_count": 1}
    assert changes["splitserve_ttft_breakdown_seconds_count{prefill_compute}"] == 1


def test_a_stepwise_request_is_recorded_as_its_client_got_it():
    """Its whole output arrives at once (TTFT = e2e, gaps of 0); its steps' moves count on it."""
    request = StepwiseRequest("r", 7, arrival=10.0)
    request.on_step_ended(0)
    request.on_step_ended(2)
    request.on_finished("stop", 4, 6, now=10.5)
    assert request.record(SloConfig(ttft_s=0.4, tpot_s=0.01), now=10.75) == make_request_record(
        "r", finish_reason="stop", routing_reason=None, prefill_worker=None, decode_worker=None, num_prompt_tokens=7,
        num_cached_tokens=4, num_output_tokens=6, ttft_s=0.5, inter_token_latencies=(0.0,) * 5, e2e_s=0.5,
        decode_s=0.0, slo=SloOutcome(False, True), num_migrations=2)
    refused = StepwiseRequest("q", 7, arrival=10.0)
    refused.error_code, refused.rejection_reason = "RESOURCE_EXHAUSTED", "too_many_requests"
    assert refused.record(SloConfig(), now=10.25) == make_request_record(
        "q", finish_reason=None, error_code="RESOURCE_EXHAUSTED", routing_reason=None,
        rejection_reason="too_many_requests", prefill_worker=None, decode_worker=None, num_prompt_tokens=7,
        num_output_tokens=0, ttft_s=None, e2e_s=0.25, slo=SloOutcome(False, False))
