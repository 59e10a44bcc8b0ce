"""Requests that share a client's request id while they run, as vLLM serves them (router/request_ids.py): each is
answered under the client's id with its full output, the router knows a later one by the id with a ` #<k>` suffix
(its access-log line names both), cancelling one leaves the other running, and nothing stays held."""

from __future__ import annotations

import grpc
import openai
import pytest

from splitserve.common.errors import InvalidRequestError
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.proto.splitserve.v1 import generation_pb2_grpc as pb_grpc
from splitserve.router.request_ids import RequestIds
from tests.factories import ServedApis, capture_access_log, served_apis

MODEL = "tiny-llama"
PROMPT = "The river runs"
TOKENS = 400
"""Greedy tokens per request: long enough that the first request still runs when the second arrives (the access
log's ids show they overlapped)."""
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
CHAT = [{"role": "user", "content": PROMPT}]


class Served(ServedApis):
    channel: grpc.Channel

    def client(self, request_id: str) -> openai.OpenAI:
        """An SDK client that sends every request under one X-Request-Id (openai's default_headers)."""
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key="none", max_retries=0,
                             timeout=60, default_headers={"X-Request-Id": request_id})

    def stream(self, endpoint: str, request_id: str, **kwargs):
        """A greedy stream of TOKENS tokens, started (its first chunk is in); its X-Request-Id response header
        (--enable-request-id-headers) is the client's id."""
        client = self.client(request_id)
        if endpoint == "chat":
            raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=CHAT, max_tokens=TOKENS,
                                                                   stream=True, **GREEDY, **kwargs)
        else:
            raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS,
                                                              stream=True, **GREEDY, **kwargs)
        assert raw.headers["X-Request-Id"] == request_id
        return raw.parse()

    def generate(self, request_id: str):
        return pb_grpc.GenerationStub(self.channel).Generate(pb.GenerateRequest(
            request_id=request_id, text=PROMPT.encode(),
            sampling=pb.SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)), timeout=60)

    def idle(self) -> None:
        """Every worker idle and nothing of the router's held: requests, slots, reserved ids."""
        self.loop.run(self.cluster.wait_idle())
        assert self.cluster.orchestrator.admission.in_flight == 0


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, served_class=Served,
                     router_options={"enable_request_id_headers": True}) as served:
        with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
            served.channel = channel
            yield served


def _token_ids(chunks) -> dict[int, list[int]]:
    """Each choice's streamed token ids (return_token_ids) by index."""
    ids: dict[int, list[int]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            ids.setdefault(choice.index, []).extend(getattr(choice, "token_ids", None) or [])
    return ids


def _lines(access_log) -> list[tuple[str, str | None, str, int]]:
    return sorted((line["request_id"], line.get("client_request_id"), line["status"], line["output_tokens"])
                  for line in access_log())


# ---- the ids ---------------------------------------------------------------------------------

def test_a_taken_id_gets_the_first_free_suffix_and_its_sequences_are_reserved_with_it():
    ids = RequestIds()
    first, second, third = (ids.reserve("abc") for _ in range(3))
    assert [(r.request_id, r.renamed_from) for r in (first, second, third)] == [
        ("abc", None), ("abc #2", "abc"), ("abc #3", "abc")]
    fan_out = ids.reserve("fan", 2)
    assert fan_out.ids == ("fan", "fan-0", "fan-1")
    assert ids.reserve("fan-1").request_id == "fan-1 #2"  # a client's id that is one of a running fan-out's sequences
    ids.reserve("one-0")
    assert ids.reserve("one", 2).ids == ("one #2", "one #2-0", "one #2-1")  # its sequence "one-0" is taken
    second.release()
    second.release()  # idempotent: it frees nothing of another's
    assert (ids.reserve("abc").request_id, ids.num_reserved) == ("abc #2", 11)


def test_a_library_callers_id_that_is_running_is_refused_and_taken_from_clients():
    ids = RequestIds()
    ids.start("lib")
    with pytest.raises(InvalidRequestError, match="^request_id: 'lib' is already in flight$"):
        ids.start("lib")
    assert ids.reserve("lib").request_id == "lib #2"
    ids.stop("lib")
    assert (ids.num_running, ids.reserve("lib").request_id) == (0, "lib")


# ---- served ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("endpoint", "prefix"), [("completions", "cmpl"), ("chat", "chatcmpl")])
def test_two_streams_under_one_x_request_id_both_finish_with_the_undisturbed_output(served, monkeypatch, caplog,
                                                                                  endpoint, prefix):
    expected = _token_ids(served.stream(endpoint, f"alone-{endpoint}"))[0]
    access_log = capture_access_log(served, monkeypatch, caplog)
    first = served.stream(endpoint, endpoint)
    first_chunks = [next(first)]  # in flight
    second_chunks = list(served.stream(endpoint, endpoint))
    first_chunks.extend(first)
    assert (_token_ids(first_chunks), _token_ids(second_chunks)) == ({0: expected}, {0: expected})
    assert len(expected) == TOKENS
    assert {chunk.id for chunk in first_chunks + second_chunks} == {f"{prefix}-{endpoint}"}
    served.idle()
    assert _lines(access_log) == [(endpoint, None, "OK", TOKENS), (f"{endpoint} #2", endpoint, "OK", TOKENS)]


def test_two_grpc_generates_under_one_request_id_both_finish_with_the_undisturbed_output(served, monkeypatch, caplog):
    expected = [t for response in served.generate("alone-grpc") for t in response.token_ids]
    access_log = capture_access_log(served, monkeypatch, caplog)
    first = served.generate("grpc")
    first_responses = [next(first)]
    second_responses = list(served.generate("grpc"))
    first_responses.extend(first)
    assert [[t for r in responses for t in r.token_ids] for responses in (first_responses, second_responses)] == [
        expected, expected]
    assert {r.request_id for r in first_responses + second_responses} == {"grpc"}
    assert [r.finish_reason for r in (first_responses[-1], second_responses[-1])] == ["length", "length"]
    served.idle()
    assert _lines(access_log) == [("grpc", None, "OK", TOKENS), ("grpc #2", "grpc", "OK", TOKENS)]


def test_a_fan_outs_id_and_its_sequences_ids_are_served_again_while_it_runs(served, monkeypatch, caplog):
    """While an n=2 request `fan` runs (sequences `fan-0`, `fan-1`), another n=2 request under `fan` and a request
    under `fan-1` (a client's id equal to one of its sequences') run too, each under a unique internal id."""
    expected = _token_ids(served.stream("completions", "alone-fan"))[0]
    access_log = capture_access_log(served, monkeypatch, caplog)
    streams = [served.stream("completions", "fan", n=2), served.stream("completions", "fan", n=2),
               served.stream("completions", "fan-1")]
    first_chunks = [[next(stream)] for stream in streams]  # each starts while the first runs
    first, second, third = (chunks + list(stream) for chunks, stream in zip(first_chunks, streams))
    assert [_token_ids(chunks) for chunks in (first, second, third)] == [
        {0: expected, 1: expected}, {0: expected, 1: expected}, {0: expected}]
    assert [{chunk.id for chunk in chunks} for chunks in (first, second, third)] == [
        {"cmpl-fan"}, {"cmpl-fan"}, {"cmpl-fan-1"}]
    served.idle()
    assert _lines(access_log) == [("fan #2-0", "fan", "OK", TOKENS), ("fan #2-1", "fan", "OK", TOKENS),
                                  ("fan-0", None, "OK", TOKENS), ("fan-1", None, "OK", TOKENS),
                                  ("fan-1 #2", "fan-1", "OK", TOKENS)]


def test_cancelling_one_of_two_duplicates_leaves_the_other_running_to_its_end(served, monkeypatch, caplog):
    expected = _token_ids(served.stream("completions", "alone-twin"))[0]
    access_log = capture_access_log(served, monkeypatch, caplog)
    first = served.stream("completions", "twin")
    next(first)
    second = served.stream("completions", "twin")
    second_chunks = [next(second)]
    first.close()  # the client goes away: the router cancels `twin`, not `twin #2`
    second_chunks.extend(second)
    assert (_token_ids(second_chunks), {chunk.id for chunk in second_chunks}) == ({0: expected}, {"cmpl-twin"})
    served.idle()
    cancelled, renamed = access_log()  # in the order they ended
    assert ((cancelled["request_id"], cancelled.get("client_request_id"), cancelled["status"]),
            (renamed["request_id"], renamed["client_request_id"], renamed["status"], renamed["output_tokens"])) == (
        ("twin", None, "CANCELLED"), ("twin #2", "twin", "OK", TOKENS))
