"""The access log's `refused` lines (router/http_access.py, router/api_common.py's log_grpc_refusal): an HTTP,
gRPC Generate or Triton inference request answered with an error before it ran has exactly one, with the answer's
status and error; a request that ran has only its record's line; probes and a server started without the access
log have none."""

from __future__ import annotations

import json
import logging
import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.proto.inference import grpc_service_pb2 as triton_pb
from splitserve.proto.inference import grpc_service_pb2_grpc as triton_pb_grpc
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.proto.splitserve.v1 import generation_pb2_grpc as pb_grpc
from splitserve.common.log_format import JsonLinesFormatter
from splitserve.router.access_log import log_refusal, refusal_fields
from tests.factories import capture_access_log, http_request, served_apis

MODEL = "tiny-llama"
KEY = "sk-refusal-log-0123"
PRIORITY_REFUSED = ("priority: is 5, but priority scheduling is not enabled: the scheduling policy is 'fcfs' (set "
                    "scheduling_policy, --scheduling-policy, to 'priority')")


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, api_key=KEY) as served:
        yield served


def _post(served, path: str, body: dict | bytes, **headers: str) -> int:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, _ = http_request(served.http_port, "POST", path, data,
                                headers={"Authorization": f"Bearer {KEY}", **headers})
    return status


def _refused(method: str, path: str, http_status: int, error: str | None, param: str | None = None,
             client_request_id: str | None = None) -> dict[str, object]:
    return {"method": method, "path": path, "http_status": http_status, "client_request_id": client_request_id,
            "param": param, "error": error}


def test_each_refusal_has_one_line_with_its_status_and_error(served, monkeypatch, caplog):
    access_log = capture_access_log(served, monkeypatch, caplog)
    statuses = [
        _post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, **{"X-Request-Id": "c-1"}),
        _post(served, "/v1/completions", b"{not json"),
        http_request(served.http_port, "POST", "/v1/completions", b"{}")[0],  # no key
        http_request(served.http_port, "GET", "/v1/nowhere", headers={"Authorization": f"Bearer {KEY}"})[0],
        http_request(served.http_port, "GET", "/v1/completions", headers={"Authorization": f"Bearer {KEY}"})[0],
    ]
    messages_answer = http_request(served.http_port, "POST", "/v1/messages", json.dumps(
        {"model": MODEL, "max_tokens": 4, "messages": "hi"}).encode(), headers={"Authorization": f"Bearer {KEY}"})
    statuses += [messages_answer[0], _post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "priority": 5})]
    assert statuses == [400, 400, 401, 404, 405, 400, 400]
    assert access_log() == [
        _refused("POST", "/v1/completions", 400, "max_tokens: must be an integer >= 1, got -1", "max_tokens", "c-1"),
        _refused("POST", "/v1/completions", 400, "request body is not valid JSON: Expecting property name enclosed in "
                                                 "double quotes: line 1 column 2 (char 1)"),
        _refused("POST", "/v1/completions", 401, "missing API key"),
        _refused("GET", "/v1/nowhere", 404, "Invalid URL (GET /v1/nowhere)"),
        _refused("GET", "/v1/completions", 405, "Method Not Allowed"),
        # The Messages API answers with Anthropic's error object; its message is read all the same, and its
        # request-id (what an Anthropic client quotes) is named.
        {**_refused("POST", "/v1/messages", 400, 'messages: must be a non-empty list of {role, content} objects, got '
                                                 '"hi"'), "anthropic_request_id": messages_answer[1]["request-id"]},
        # Refused by the check generate() makes before it records a request: made before the request runs.
        _refused("POST", "/v1/completions", 400, PRIORITY_REFUSED, "priority"),
    ]


def test_a_client_that_leaves_before_its_request_ran_is_refused_499_saying_so(served, monkeypatch, caplog):
    """Its body cut short by the client closing the connection: nobody receives the answer, but the line says why."""
    access_log = capture_access_log(served, monkeypatch, caplog)
    with socket.create_connection(("127.0.0.1", served.http_port), timeout=10) as connection:
        connection.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                           "X-Request-Id: gone-1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                           '{"prompt": '.encode())
    deadline = time.monotonic() + 30
    while not access_log() and time.monotonic() < deadline:
        time.sleep(0.01)  # the server notices the closed connection on its own time
    assert access_log() == [_refused("POST", "/v1/completions", 499, "the client closed the connection before its "
                                                                     "request was answered", client_request_id="gone-1")]


def _grpc_refused(rpc: str, grpc_status: str, error: str, param: str | None = None,
                  client_request_id: str | None = None) -> dict[str, object]:
    return {"rpc": rpc, "grpc_status": grpc_status, "client_request_id": client_request_id, "param": param,
            "error": error}


def _triton_request(request_id: str, model: str = MODEL, **inputs: bool) -> triton_pb.ModelInferRequest:
    """A prompt "hi" with BOOL inputs such as stream=True."""
    tensors = [triton_pb.ModelInferRequest.InferInputTensor(
        name="text_input", datatype="BYTES", shape=[1], contents=triton_pb.InferTensorContents(bytes_contents=[b"hi"]))]
    tensors += [triton_pb.ModelInferRequest.InferInputTensor(name=name, datatype="BOOL", shape=[1],
                                                             contents=triton_pb.InferTensorContents(bool_contents=[on]))
                for name, on in inputs.items()]
    return triton_pb.ModelInferRequest(model_name=model, id=request_id, inputs=tensors)


def test_each_grpc_refusal_has_one_line_with_its_status_code_and_error(served, monkeypatch, caplog):
    access_log = capture_access_log(served, monkeypatch, caplog)
    metadata = (("authorization", f"Bearer {KEY}"),)
    codes = []
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        generate = pb_grpc.GenerationStub(channel).Generate
        triton = triton_pb_grpc.GRPCInferenceServiceStub(channel)
        for request in (pb.GenerateRequest(request_id="g-1", model="nope", text=b"hi"),
                        pb.GenerateRequest(text=b"hi", priority=5)):
            with pytest.raises(grpc.RpcError) as refused:
                list(generate(request, metadata=metadata, timeout=60))
            codes.append(refused.value.code())
        for request in (_triton_request("t-1", model="nope"), _triton_request("t-2", stream=True)):
            with pytest.raises(grpc.RpcError) as refused:
                triton.ModelInfer(request, metadata=metadata, timeout=60)
            codes.append(refused.value.code())
        [streamed] = triton.ModelStreamInfer(iter([_triton_request("t-3", model="nope")]), metadata=metadata,
                                             timeout=60)
        # Refused before the handler runs: by the API-key and malformed-bytes interceptors.
        raw_generate = channel.unary_stream("/splitserve.v1.Generation/Generate")
        for call in (lambda: list(generate(pb.GenerateRequest(text=b"hi"), timeout=60)),
                     lambda: list(raw_generate(b"\xff\xff\xff\xff", metadata=metadata, timeout=60)),
                     lambda: triton.ModelMetadata(triton_pb.ModelMetadataRequest(name="nope"), metadata=metadata,
                                                  timeout=60)):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            codes.append(refused.value.code())
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status == (
            health_pb2.HealthCheckResponse.SERVING)  # an open probe: no line
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                     grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAUTHENTICATED,
                     grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND]
    assert streamed.error_message.startswith("NOT_FOUND: unknown model 'nope'")
    generate_rpc, infer_rpc = "/splitserve.v1.Generation/Generate", "/inference.GRPCInferenceService/ModelInfer"
    unknown = "unknown model 'nope'; this server serves 'tiny-llama' version '1'"
    assert access_log() == [
        _grpc_refused(generate_rpc, "INVALID_ARGUMENT", "model: unknown model 'nope'; this server serves 'tiny-llama'",
                      "model", "g-1"),
        _grpc_refused(generate_rpc, "INVALID_ARGUMENT", PRIORITY_REFUSED, "priority"),
        _grpc_refused(infer_rpc, "NOT_FOUND", unknown, client_request_id="t-1"),
        _grpc_refused(infer_rpc, "INVALID_ARGUMENT", "stream: must be false in ModelInfer (one response per request); "
                      "stream with ModelStreamInfer", "stream", "t-2"),
        _grpc_refused("/inference.GRPCInferenceService/ModelStreamInfer", "NOT_FOUND", unknown,
                      client_request_id="t-3"),
        _grpc_refused(generate_rpc, "UNAUTHENTICATED", "missing API key"),
        _grpc_refused(generate_rpc, "INVALID_ARGUMENT", "request: cannot be parsed (Error parsing message with type "
                      "'splitserve.v1.GenerateRequest': Wire format was corrupt)", "request"),
        _grpc_refused("/inference.GRPCInferenceService/ModelMetadata", "NOT_FOUND",
                      "unknown model 'nope'; this server serves 'tiny-llama' version '1'"),
    ]


def test_a_malformed_message_in_a_triton_stream_is_refused_as_a_request_and_the_stream_reads_on(
        served, monkeypatch, caplog):
    """As ModelInfer refuses bytes that do not parse (INVALID_ARGUMENT naming `request`, a `refused` line); the
    request after it is served (here: refused for its model)."""
    access_log = capture_access_log(served, monkeypatch, caplog)
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                       response_deserializer=triton_pb.ModelStreamInferResponse.FromString)
        responses = list(stream(iter([b"\xff\xff\xff\xff", _triton_request("t-5", model="nope").SerializeToString()]),
                                metadata=(("authorization", f"Bearer {KEY}"),), timeout=60))
    unparsable = ("request: cannot be parsed (Error parsing message with type 'inference.ModelInferRequest': Wire "
                  "format was corrupt)")
    unknown = "unknown model 'nope'; this server serves 'tiny-llama' version '1'"
    assert [(r.error_message, r.infer_response.id) for r in responses] == [
        (f"INVALID_ARGUMENT: {unparsable}", ""), (f"NOT_FOUND: {unknown}", "t-5")]
    stream_rpc = "/inference.GRPCInferenceService/ModelStreamInfer"
    assert access_log() == [_grpc_refused(stream_rpc, "INVALID_ARGUMENT", unparsable, "request"),
                            _grpc_refused(stream_rpc, "NOT_FOUND", unknown, client_request_id="t-5")]


def test_a_grpc_request_that_ran_has_its_own_line_only(served, monkeypatch, caplog):
    access_log = capture_access_log(served, monkeypatch, caplog)
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        request = pb.GenerateRequest(request_id="ran-g", text=b"hi",
                                     sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True))
        responses = list(pb_grpc.GenerationStub(channel).Generate(
            request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60))
    [line] = access_log()
    assert (responses[-1].finish_reason, line["request_id"], line["status"], line["output_tokens"]) == (
        "length", "ran-g", "OK", 2)


def test_a_request_that_ran_has_its_own_line_only(served, monkeypatch, caplog):
    access_log = capture_access_log(served, monkeypatch, caplog)
    assert _post(served, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True,
                                             "request_id": "ran-1"}) == 200
    [line] = access_log()
    assert (line["request_id"], line["status"], line["output_tokens"]) == ("ran-1", "OK", 2)


def test_probes_are_not_logged(served, monkeypatch, caplog):
    access_log = capture_access_log(served, monkeypatch, caplog)
    assert http_request(served.http_port, "GET", "/health")[0] == 200
    assert http_request(served.http_port, "POST", "/metrics")[0] == 405
    assert access_log() == []


def test_without_the_access_log_nothing_is_refused_in_it(tiny_llama_dir, caplog):
    with served_apis(tiny_llama_dir, MODEL, router_options={"access_log": False}) as served:
        caplog.set_level(logging.INFO, logger="splitserve.access")
        assert http_request(served.http_port, "GET", "/v1/nowhere")[0] == 404
        with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel, pytest.raises(grpc.RpcError):
            list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(model="nope", text=b"hi"), timeout=60))
    assert [entry for entry in caplog.records if entry.name == "splitserve.access"] == []


def test_a_hostile_path_and_error_stay_on_one_bounded_line(caplog):
    hostile = '/v1/x\nINFO forged\x00"' + "y" * 1000
    with caplog.at_level(logging.INFO, logger="splitserve.access"):
        log_refusal(refusal_fields("GET", hostile, 404, f"Invalid URL (GET {hostile})", "p" * 1000, None, None))
    [entry] = caplog.records
    line = entry.getMessage()
    assert "\n" not in line and "\x00" not in line and len(line) < 900  # three quoted fields of 256
    assert line.startswith('refused method="GET" path="/v1/x\\nINFO forged\\u0000\\"yyy')
    assert len(entry.fields["path"]) == 256
    # The JSON log writes the fields themselves: the error (which quotes the path) and the param are cut too.
    assert (len(entry.fields["error"]), len(entry.fields["param"])) == (256, 256)
    assert entry.fields["error"] == f"Invalid URL (GET {hostile})"[:256]
    assert len(JsonLinesFormatter().format(entry)) < 2000  # the line, then the fields
