"""Optional API-key auth (router.api_key_env): the shared check, the gRPC interceptor (on the
Generation and the Triton-compatible API, the latter driven by `tritonclient`), the HTTP guard
(driven by the official `openai` SDK), the config field and the CLI's --api-key-env."""

from __future__ import annotations

import http.client
import json

import queue

import grpc
import numpy as np
import openai
import pytest
import tritonclient.grpc as triton
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from splitserve.deploy.cli import main as cli_main
from splitserve.deploy.cluster_config import ClusterConfigError, parse_cluster_config
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.proto.splitserve.v1 import generation_pb2_grpc as pb_grpc
from splitserve.router.auth import INVALID, MISSING, api_key_from_env, check_authorization
from splitserve.router.http_options import CorsPolicy
from tests.factories import ServedApis, capture_access_log, http_request, served_apis

MODEL = "tiny-llama"
KEY = "sk-test-0123456789"
ENV = "SPLITSERVE_TEST_API_KEY"


# ---- the shared check ---------------------------------------------------------------------

@pytest.mark.parametrize(("header", "reason"), [
    (f"Bearer {KEY}", None), (f"bearer {KEY}", None), (f"Bearer {KEY}".encode(), None), (f"  Bearer  {KEY} ", None),
    (None, MISSING), ("", MISSING), ("Bearer", MISSING), ("Bearer   ", MISSING), (f"Basic {KEY}", MISSING),
    (KEY, MISSING), ("Bearer wrong", INVALID), (f"Bearer {KEY}x", INVALID), (f"Bearer {KEY[:-1]}", INVALID),
    ("Bearer sk-tëst".encode(), INVALID), ("Bearer sk-tëst", INVALID),
])
def test_check_authorization(header, reason):
    assert check_authorization(header, KEY) == reason


def test_api_key_from_env():
    assert api_key_from_env(ENV, {ENV: f" {KEY}\n"}) == KEY
    with pytest.raises(ValueError, match=rf"api_key_env='{ENV}'.*{ENV} is not set$"):
        api_key_from_env(ENV, {})
    with pytest.raises(ValueError, match=rf"{ENV} is empty$"):
        api_key_from_env(ENV, {ENV: " "})


# ---- config -------------------------------------------------------------------------------

def test_config_names_the_variable_not_the_key():
    assert parse_cluster_config("model: m\n").router.api_key_env is None
    assert parse_cluster_config(f"model: m\nrouter: {{api_key_env: {ENV}}}\n").router.api_key_env == ENV


@pytest.mark.parametrize("value", ["''", "'A B'", "'A=B'"])
def test_config_rejects_a_bad_variable_name(value):
    with pytest.raises(ClusterConfigError) as caught:
        parse_cluster_config(f"model: m\nrouter: {{api_key_env: {value}}}\n")
    assert str(caught.value).startswith("router.api_key_env: must name an environment variable (non-empty, "
                                        "no whitespace or '='), or be null; got ")


# ---- the servers --------------------------------------------------------------------------

class Served(ServedApis):
    def client(self, api_key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.http_port}/v1", api_key=api_key, max_retries=0,
                             timeout=60)

    def generate(self, metadata=None) -> list[int]:
        request = pb.GenerateRequest(model=MODEL, text=b"The river runs",
                                     sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}") as channel:
            responses = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60, metadata=metadata))
        return [t for r in responses for t in r.token_ids]


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    """Both APIs over one in-process cluster, each requiring KEY."""
    with served_apis(tiny_llama_dir, MODEL, api_key=KEY, served_class=Served) as served:
        yield served


@pytest.mark.parametrize(("metadata", "details"), [
    (None, MISSING), ((("authorization", "Bearer wrong"),), INVALID), ((("authorization", KEY),), MISSING),
    ((("x-api-key", KEY),), MISSING),
])
def test_grpc_without_the_key_is_unauthenticated(served, metadata, details):
    with pytest.raises(grpc.RpcError) as caught:
        served.generate(metadata)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, details)


def test_grpc_with_the_key_generates(served):
    assert len(served.generate((("authorization", f"Bearer {KEY}"),))) == 4


def test_grpc_health_needs_no_key(served):
    with grpc.insecure_channel(f"127.0.0.1:{served.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "splitserve.v1.Generation", "inference.GRPCInferenceService"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


def _triton_prompt() -> list[triton.InferInput]:
    prompt = triton.InferInput("text_input", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"The river runs"], dtype=np.object_))
    return [prompt]


@pytest.mark.parametrize(("headers", "details"), [(None, MISSING), ({"authorization": "Bearer wrong"}, INVALID)])
def test_triton_api_without_the_key_is_unauthenticated(served, headers, details):
    received: queue.Queue = queue.Queue()
    with triton.InferenceServerClient(f"127.0.0.1:{served.grpc_port}") as client:
        with pytest.raises(InferenceServerException) as live:
            client.is_server_live(headers=headers)
        with pytest.raises(InferenceServerException) as infer:
            client.infer(MODEL, _triton_prompt(), headers=headers)
        # The stream is refused as it opens, before any request is sent on it.
        client.start_stream(callback=lambda result, error: received.put(error or result), headers=headers)
        streamed = received.get(timeout=60)
        client.stop_stream(cancel_requests=True)
    for error in (live.value, infer.value, streamed):
        assert (error.status(), error.message()) == ("StatusCode.UNAUTHENTICATED", details)


def test_triton_api_with_the_key_generates(served):
    headers = {"authorization": f"Bearer {KEY}"}
    with triton.InferenceServerClient(f"127.0.0.1:{served.grpc_port}") as client:
        assert client.is_server_live(headers=headers) and client.is_model_ready(MODEL, headers=headers)
        result = client.infer(MODEL, _triton_prompt(), headers=headers)
    assert result.as_numpy("text_output")[0].startswith(b"The river runs")


def test_http_with_a_wrong_key_is_401(served):
    client = served.client("wrong")
    with pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model=MODEL, prompt="The river runs", max_tokens=4)
    assert caught.value.status_code == 401
    assert caught.value.body == {"message": INVALID, "type": "invalid_request_error", "param": None,
                                 "code": "invalid_api_key"}
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_http_without_a_key_is_401(served):
    """The SDK refuses to send no key at all, so raw HTTP; the SDK's own `Authorization` header
    is replaced by another scheme."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key="unused", max_retries=0,
                           timeout=60, default_headers={"Authorization": f"Basic {KEY}"})
    with pytest.raises(openai.AuthenticationError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert (caught.value.status_code, caught.value.body["message"]) == (401, MISSING)
    connection = http.client.HTTPConnection("127.0.0.1", served.http_port, timeout=60)
    try:
        connection.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": "x"}),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        status, body = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert (status, body) == (401, {"error": {"message": MISSING, "type": "invalid_request_error", "param": None,
                                              "code": "invalid_api_key"}})


def test_http_with_the_key_works(served):
    client = served.client(KEY)
    completion = client.completions.create(model=MODEL, prompt="The river runs", max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 4
    assert [m.id for m in client.models.list()] == [MODEL]


def _raw_get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_http_health_and_metrics_need_no_key(served):
    assert _raw_get(served.http_port, "/health")[0] == 200
    assert _raw_get(served.http_port, "/metrics")[0] == 200
    status, headers, body = _raw_get(served.http_port, "/v1/models")
    assert (status, headers.get("www-authenticate"), json.loads(body)["error"]["message"]) == (401, "Bearer", MISSING)


def test_cli_sends_the_key_from_the_named_variable(served, monkeypatch, capsys):
    target = f"127.0.0.1:{served.grpc_port}"
    args = ["generate", "--target", target, "--max-tokens", "3", "--ignore-eos", "The river runs"]
    monkeypatch.setenv(ENV, KEY)
    assert cli_main([*args[:3], "--api-key-env", ENV, *args[3:]]) == 0
    assert "completion_tokens=3" in capsys.readouterr().err
    assert cli_main(args) == 1
    assert f"UNAUTHENTICATED: {MISSING}" in capsys.readouterr().err
    monkeypatch.delenv(ENV)
    assert cli_main([*args[:3], "--api-key-env", ENV, *args[3:]]) == 2
    assert f"--api-key-env {ENV}: the environment variable is not set" in capsys.readouterr().err


def test_serving_refuses_to_start_without_the_key(monkeypatch):
    """Before any worker or Ray starts: a server configured for auth never comes up open."""
    import asyncio

    from splitserve.deploy.cluster_config import apply_overrides, default_cluster_config
    from splitserve.deploy.local import LocalCluster

    monkeypatch.delenv(ENV, raising=False)
    config = apply_overrides(default_cluster_config("default"), {"router.api_key_env": ENV})
    with pytest.raises(ValueError, match=rf"environment variable {ENV} is not set$"):
        asyncio.run(LocalCluster(config).start())


# ---- browsers (CORS, router.cors_allowed_origins) -----------------------------------------

PAGE = "http://chat-ui.example:3000"


def _lowercase(headers: dict[str, str]) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def test_a_browser_preflight_is_answered_before_the_key_check(served):
    status, headers, _ = http_request(served.http_port, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": PAGE, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    headers = _lowercase(headers)
    assert (status, headers["access-control-allow-origin"]) == (200, "*")
    assert "POST" in headers["access-control-allow-methods"].split(", ")
    assert headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in headers


@pytest.mark.parametrize(("authorization", "expected"), [(None, 401), (f"Bearer {KEY}", 200)])
def test_a_cross_origin_answer_carries_the_cors_header_refused_or_not(served, authorization, expected):
    headers = {"Origin": PAGE, **({"Authorization": authorization} if authorization else {})}
    status, answer, body = http_request(served.http_port, "GET", "/v1/models", headers=headers)
    assert (status, _lowercase(answer)["access-control-allow-origin"]) == (expected, "*")
    if expected == 200:
        assert [model["id"] for model in json.loads(body)["data"]] == [MODEL]


def test_without_allowed_origins_there_is_no_cors_and_a_preflight_is_refused_as_vllm(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, cors_allowed_origins=()) as served:
        status, headers, _ = http_request(served.http_port, "GET", "/v1/models", headers={"Origin": PAGE})
        preflight, _, body = http_request(served.http_port, "OPTIONS", "/v1/models", headers={
            "Origin": PAGE, "Access-Control-Request-Method": "GET"})
    assert (status, "access-control-allow-origin" in _lowercase(headers)) == (200, False)
    assert (preflight, body) == (400, b"Disallowed CORS origin")


def test_cors_methods_headers_and_credentials_as_configured(tiny_llama_dir, monkeypatch, caplog):
    policy = {"cors_allowed_methods": ("POST",), "cors_allowed_headers": ("authorization",),
              "cors_allow_credentials": True}
    with served_apis(tiny_llama_dir, MODEL, cors_allowed_origins=(PAGE,), router_options=policy) as served:
        access_log = capture_access_log(served, monkeypatch, caplog)
        preflight = http_request(served.http_port, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
        refused = http_request(served.http_port, "OPTIONS", "/v1/chat/completions", headers={
            "Origin": PAGE, "Access-Control-Request-Method": "DELETE", "Access-Control-Request-Headers": "x-custom"})
        simple = http_request(served.http_port, "GET", "/v1/models", headers={"Origin": PAGE})
        other_page = http_request(served.http_port, "GET", "/v1/models", headers={"Origin": "http://elsewhere"})
        rejections = served.cluster.orchestrator.routing_stats().rejections
    status, headers, _ = preflight
    assert (status, _lowercase(headers)) == (200, {
        "access-control-allow-origin": PAGE, "access-control-allow-methods": "POST",
        "access-control-allow-headers": "Accept, Accept-Language, Content-Language, Content-Type, authorization",
        "access-control-allow-credentials": "true", "access-control-max-age": "600",
        "vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
                "Access-Control-Request-Private-Network",
        "content-length": "2", "content-type": "text/plain; charset=utf-8", **_server_headers(headers)})
    assert (refused[0], refused[2]) == (400, b"Disallowed CORS method, headers")
    simple_headers = _lowercase(simple[1])
    assert (simple[0], simple_headers["access-control-allow-origin"], simple_headers["access-control-allow-credentials"],
            simple_headers["vary"]) == (200, PAGE, "true", "Origin")
    assert (other_page[0], "access-control-allow-origin" in _lowercase(other_page[1])) == (200, False)
    # A preflight is no API request: not admitted, not refused, not logged.
    assert (access_log(), rejections) == ([], ())


def _server_headers(headers: dict[str, str]) -> dict[str, str]:
    """The date and server headers uvicorn adds to every answer."""
    return {name: value for name, value in _lowercase(headers).items() if name in ("date", "server")}


def test_config_cors():
    router = parse_cluster_config("model: m\n").router
    assert (router.cors_allowed_origins, router.cors_allowed_methods, router.cors_allowed_headers,
            router.cors_allow_credentials) == ((), ("*",), ("*",), False)
    assert parse_cluster_config("model: m\nrouter: {cors_allowed_origins: []}\n").router.cors_allowed_origins == ()
    assert parse_cluster_config(f"model: m\nrouter: {{cors_allowed_origins: ['{PAGE}']}}\n"
                                ).router.cors_allowed_origins == (PAGE,)
    with pytest.raises(ClusterConfigError) as caught:
        parse_cluster_config("model: m\nrouter: {cors_allowed_origins: [' ']}\n")
    assert str(caught.value) == "router.cors_allowed_origins: must hold non-empty strings, got [' ']"


def test_serve_cors_flags_parse_json_lists_as_vllm():
    from splitserve.deploy.cli import build_parser, serve_config

    args = build_parser().parse_args(["serve", "m", "--allowed-origins", f'["{PAGE}"]', "--allowed-methods",
                                      '["GET", "POST"]', "--allowed-headers", '["authorization"]', "--allow-credentials"])
    router = serve_config(args).router
    assert router.http_options.cors == CorsPolicy((PAGE,), ("GET", "POST"), ("authorization",), True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--allowed-origins", PAGE])
