"""vLLM's frontend flags that shape the OpenAI HTTP layer (router/http_options.py): the flag, the
config key it sets, and what a client sees."""

from __future__ import annotations

import json
import re

import pytest

from splitserve.deploy.cli import build_parser, serve_config
from splitserve.router.http_options import CorsPolicy, HttpOptions
from tests.factories import capture_access_log, http_request, served_apis

MODEL = "tiny-llama"
COMPLETION = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 1}).encode()


def _config(*flags: str):
    return serve_config(build_parser().parse_args(["serve", "m", *flags]))


def _header(headers: dict[str, str], name: str) -> str | None:
    return {key.lower(): value for key, value in headers.items()}.get(name.lower())


# ---- --enable-request-id-headers ------------------------------------------------------------

def test_request_id_header_echoes_the_clients_or_is_a_fresh_uuid(tiny_llama_dir, monkeypatch, caplog):
    """A refused request's access-log line names the X-Request-Id its answer carries, a fresh one too."""
    with served_apis(tiny_llama_dir, MODEL, router_options={"enable_request_id_headers": True}) as served:
        access_log = capture_access_log(served, monkeypatch, caplog)
        echoed = http_request(served.http_port, "POST", "/v1/completions", COMPLETION,
                              headers={"X-Request-Id": "trace-42"})
        fresh = http_request(served.http_port, "GET", "/v1/models")
        unknown = http_request(served.http_port, "GET", "/nowhere", headers={"X-Request-Id": "trace-43"})
        fresh_unknown = http_request(served.http_port, "GET", "/nowhere")
    fresh_unknown_id = _header(fresh_unknown[1], "X-Request-Id")
    assert (echoed[0], _header(echoed[1], "X-Request-Id")) == (200, "trace-42")
    assert (fresh[0], bool(re.fullmatch("[0-9a-f]{32}", _header(fresh[1], "X-Request-Id")))) == (200, True)
    assert (unknown[0], _header(unknown[1], "X-Request-Id")) == (404, "trace-43")
    assert (fresh_unknown[0], bool(re.fullmatch("[0-9a-f]{32}", fresh_unknown_id))) == (404, True)
    assert [(line.get("request_id"), line.get("path"), line.get("client_request_id")) for line in access_log()] == [
        ("trace-42", None, None), (None, "/nowhere", "trace-43"), (None, "/nowhere", fresh_unknown_id)]


def test_without_the_flag_there_is_no_request_id_header(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL) as served:
        status, headers, _ = http_request(served.http_port, "GET", "/v1/models", headers={"X-Request-Id": "trace-42"})
    assert (status, _header(headers, "X-Request-Id")) == (200, None)


@pytest.mark.parametrize("enable_request_id_headers", [True, False])
def test_the_request_id_header_is_the_completions_id_as_vllm(tiny_llama_dir, enable_request_id_headers):
    """vLLM's _base_request_id: X-Request-Id, over the body's request_id, is the id of a completion
    (`cmpl-<id>`) and of a chat completion (`chatcmpl-<id>`), with or without the flag; without the header
    the body's request_id is."""
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                       "request_id": "from-body"}).encode()
    body_only = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 1, "request_id": "from-body"}).encode()
    options = {"enable_request_id_headers": enable_request_id_headers}
    with served_apis(tiny_llama_dir, MODEL, router_options=options) as served:
        completion = http_request(served.http_port, "POST", "/v1/completions", COMPLETION,
                                  headers={"X-Request-Id": "trace-42"})
        chatted = http_request(served.http_port, "POST", "/v1/chat/completions", chat,
                               headers={"X-Request-Id": "trace-43"})
        from_body = http_request(served.http_port, "POST", "/v1/completions", body_only)
    assert [(status, json.loads(answer)["id"]) for status, _, answer in (completion, chatted, from_body)] == [
        (200, "cmpl-trace-42"), (200, "chatcmpl-trace-43"), (200, "cmpl-from-body")]


def test_a_request_id_header_no_request_id_could_be_is_a_400_naming_it(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL) as served:
        status, _, answer = http_request(served.http_port, "POST", "/v1/completions", COMPLETION,
                                         headers={"X-Request-Id": "two words"})
    assert (status, json.loads(answer)["error"]["param"], json.loads(answer)["error"]["message"]) == (
        400, "X-Request-Id", "X-Request-Id: must be printable ASCII without spaces (0x21-0x7E), got \"two words\"")


def test_request_id_headers_flag_sets_the_config_key():
    assert (_config().router.enable_request_id_headers,
            _config("--enable-request-id-headers").router.http_options.request_id_headers) == (False, True)


# ---- --root-path ------------------------------------------------------------------------------

def test_under_a_root_path_the_routes_key_check_and_admission_see_the_path_without_it(tiny_llama_dir):
    key = "sk-root-path"
    with served_apis(tiny_llama_dir, MODEL, api_key=key, router_options={"root_path": "/llm"}) as served:
        auth = {"Authorization": f"Bearer {key}"}
        without_key = http_request(served.http_port, "GET", "/v1/models")
        models = http_request(served.http_port, "GET", "/v1/models", headers=auth)
        completion = http_request(served.http_port, "POST", "/v1/completions", COMPLETION, headers=auth)
        served.cluster.orchestrator.admission.stop_accepting()
        draining = http_request(served.http_port, "POST", "/v1/completions", COMPLETION, headers=auth)
    assert (without_key[0], models[0], json.loads(models[2])["data"][0]["id"]) == (401, 200, MODEL)
    assert (completion[0], json.loads(completion[2])["usage"]["completion_tokens"]) == (200, 1)
    assert draining[0] == 503


def test_root_path_flag_and_its_check():
    from splitserve.deploy.cluster_config import ClusterConfigError

    assert (_config().router.http_options.root_path, _config("--root-path", "/llm").router.root_path) == ("", "/llm")
    with pytest.raises(ClusterConfigError) as caught:
        _config("--root-path", "llm/")
    assert str(caught.value) == "router.root_path: must start with '/' and not end with one (e.g. /llm), or be null; got 'llm/'"


# ---- --uvicorn-log-level ----------------------------------------------------------------------

def test_uvicorn_log_level_sets_uvicorns_loggers(tiny_llama_dir):
    import logging

    with served_apis(tiny_llama_dir, MODEL, router_options={"uvicorn_log_level": "warning"}):
        levels = [logging.getLogger(name).level for name in ("uvicorn.error", "uvicorn.asgi")]
    assert levels == [logging.WARNING, logging.WARNING]


def test_uvicorn_log_level_flag_and_its_check():
    assert (_config().router.uvicorn_log_level,
            _config("--uvicorn-log-level", "debug").router.http_options.uvicorn_log_level) == ("info", "debug")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--uvicorn-log-level", "loud"])


# ---- accepted, nothing to do: --disable-uvicorn-access-log, --disable-fastapi-docs, --disable-log-stats

def test_flags_with_nothing_to_disable_are_accepted_and_change_no_config():
    assert _config("--disable-uvicorn-access-log", "--disable-fastapi-docs", "--disable-log-stats") == _config()


def test_there_are_no_docs_pages_to_disable_and_no_uvicorn_access_log(tiny_llama_dir, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    with served_apis(tiny_llama_dir, MODEL) as served:
        statuses = [http_request(served.http_port, "GET", path)[0] for path in ("/docs", "/redoc", "/openapi.json")]
    assert (statuses, [entry for entry in caplog.records if entry.name == "uvicorn.access"]) == ([404, 404, 404], [])


# ---- --enable-log-requests / --no-enable-log-requests / --disable-log-requests ---------------

@pytest.mark.parametrize(("flags", "access_log"), [
    ((), True), (("--enable-log-requests",), True), (("--no-enable-log-requests",), False),
    (("--disable-log-requests",), False)])
def test_log_requests_flags_turn_the_access_log_on_and_off(flags, access_log):
    assert _config(*flags).router.access_log is access_log


# ---- --response-role --------------------------------------------------------------------------

def _chat(port: int, stream: bool = False, add_generation_prompt: bool = True) -> tuple[int, bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": stream,
            "add_generation_prompt": add_generation_prompt}
    status, _, answer = http_request(port, "POST", "/v1/chat/completions", json.dumps(body).encode())
    return status, answer


def _stream_events(answer: bytes) -> list[dict]:
    return [json.loads(line[len(b"data: "):]) for line in answer.split(b"\n\n")
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


def test_response_role_names_the_message_after_a_generation_prompt(tiny_llama_dir):
    with served_apis(tiny_llama_dir, MODEL, router_options={"response_role": "bot"}) as served:
        status, answer = _chat(served.http_port)
        stream_status, stream = _chat(served.http_port, stream=True)
        continued_status, continued = _chat(served.http_port, add_generation_prompt=False)
    assert (status, json.loads(answer)["choices"][0]["message"]["role"]) == (200, "bot")
    assert (stream_status, _stream_events(stream)[0]["choices"][0]["delta"]) == (200, {"role": "bot", "content": ""})
    # Without a generation prompt the output continues the last message, so it has that one's role (vLLM).
    assert (continued_status, json.loads(continued)["choices"][0]["message"]["role"]) == (200, "user")


def test_response_role_flag_and_its_default():
    assert (_config().router.response_role,
            _config("--response-role", "bot").router.http_options.response_role) == ("assistant", "bot")


# ---- --return-tokens-as-token-ids -------------------------------------------------------------

def _logprob_tokens(port: int, path: str, **fields) -> tuple[list[str], list[int]]:
    """(the logprob tokens, the output's token ids) of a greedy 3-token request to `path`."""
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **fields}
    if path == "/v1/completions":
        body.update(prompt="Hello", logprobs=0)
    else:
        body.update(messages=[{"role": "user", "content": "Hi"}], logprobs=True)
    status, _, answer = http_request(port, "POST", path, json.dumps(body).encode())
    assert status == 200, answer
    choice = json.loads(answer)["choices"][0]
    tokens = (choice["logprobs"]["tokens"] if path == "/v1/completions"
              else [entry["token"] for entry in choice["logprobs"]["content"]])
    return tokens, choice["token_ids"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_tokens_as_token_ids_is_the_default_a_request_may_override(tiny_llama_dir, path):
    with served_apis(tiny_llama_dir, MODEL, router_options={"return_tokens_as_token_ids": True}) as served:
        as_ids, token_ids = _logprob_tokens(served.http_port, path)
        as_text, _ = _logprob_tokens(served.http_port, path, return_tokens_as_token_ids=False)
    assert as_ids == [f"token_id:{token_id}" for token_id in token_ids]
    assert as_text == [served.cluster.tokenizer.decode([token_id]) for token_id in token_ids]
    assert not any(token.startswith("token_id:") for token in as_text)


def test_return_tokens_as_token_ids_flag():
    assert (_config().router.return_tokens_as_token_ids,
            _config("--return-tokens-as-token-ids").router.http_options.return_tokens_as_token_ids) == (False, True)


# ---- --enable-prompt-tokens-details -----------------------------------------------------------

def _usages(port: int, path: str, stream: bool) -> list[dict]:
    """The usage of two identical 2-token requests (the second finds the first's 5 full blocks of 8 cached)."""
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
            **({"prompt": list(range(200, 243))} if path == "/v1/completions"
               else {"messages": [{"role": "user", "content": "Tell me about the river and the old mill by the road."}]})}
    usages = []
    for _ in range(2):
        status, _, answer = http_request(port, "POST", path, json.dumps(body).encode())
        assert status == 200, answer
        usages.append(_stream_events(answer)[-1]["usage"] if stream else json.loads(answer)["usage"])
    return usages


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_tokens_details_only_with_the_flag(tiny_llama_dir, stream):
    with served_apis(tiny_llama_dir, MODEL) as served:
        plain = _usages(served.http_port, "/v1/completions", stream)
    with served_apis(tiny_llama_dir, MODEL, router_options={"enable_prompt_tokens_details": True}) as served:
        detailed = _usages(served.http_port, "/v1/completions", stream)
        chats = _usages(served.http_port, "/v1/chat/completions", stream)
    assert plain == [{"prompt_tokens": 43, "completion_tokens": 2, "total_tokens": 45}] * 2
    assert detailed == [{"prompt_tokens": 43, "completion_tokens": 2, "total_tokens": 45,
                         "prompt_tokens_details": {"cached_tokens": cached}} for cached in (0, 40)]
    prompt_tokens = chats[0]["prompt_tokens"]
    assert [usage["prompt_tokens_details"]["cached_tokens"] for usage in chats] == [0, (prompt_tokens - 1) // 8 * 8]


def test_prompt_tokens_details_flag():
    assert (_config().router.enable_prompt_tokens_details,
            _config("--enable-prompt-tokens-details").router.http_options.enable_prompt_tokens_details) == (False, True)


# ---- --max-logprobs ---------------------------------------------------------------------------

def _post(port: int, path: str, body: dict) -> tuple[int, dict]:
    status, _, answer = http_request(port, "POST", path, json.dumps({"model": MODEL, **body}).encode())
    return status, json.loads(answer)


def _grpc_logprobs(port: int, logprobs: int) -> tuple[object, str]:
    """(status code, details) of a one-token gRPC Generate asking for `logprobs` top alternatives."""
    import grpc

    from splitserve.proto.splitserve.v1 import generation_pb2 as pb
    from splitserve.proto.splitserve.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(text=b"Hello", sampling=pb.SamplingParams(max_tokens=1, logprobs=logprobs))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
        except grpc.RpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def test_max_logprobs_bounds_every_api_and_the_beam_width(tiny_llama_dir):
    import grpc

    with served_apis(tiny_llama_dir, MODEL, router_options={"max_logprobs": 30}) as served:
        port = served.http_port
        within = _post(port, "/v1/completions", {"prompt": "Hello", "max_tokens": 1, "logprobs": 30, "temperature": 0,
                                                  "return_tokens_as_token_ids": True})
        beyond = _post(port, "/v1/completions", {"prompt": "Hello", "max_tokens": 1, "logprobs": 31})
        chat = _post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                    "logprobs": True, "top_logprobs": 31})
        prompt = _post(port, "/v1/completions", {"prompt": "Hello", "max_tokens": 1, "prompt_logprobs": 31})
        wide_beam = _post(port, "/v1/completions", {"prompt": "Hello", "max_tokens": 1, "n": 16, "use_beam_search": True})
        grpc_within, grpc_beyond = _grpc_logprobs(served.grpc_port, 30), _grpc_logprobs(served.grpc_port, 31)
    assert (within[0], len(within[1]["choices"][0]["logprobs"]["top_logprobs"][0])) == (200, 30)
    assert beyond == (400, {"error": {"message": "logprobs: Requested sample logprobs of 31, which is greater than "
                                                 "max allowed: 30", "type": "invalid_request_error",
                                      "param": "logprobs", "code": None}})
    assert (chat[0], chat[1]["error"]["message"]) == (
        400, "logprobs: Requested sample logprobs of 31, which is greater than max allowed: 30")
    assert (prompt[0], prompt[1]["error"]["message"]) == (
        400, "prompt_logprobs: Requested prompt logprobs of 31, which is greater than max allowed: 30")
    assert (wide_beam[0], wide_beam[1]["error"]["message"]) == (
        400, "n: is the beam width with use_beam_search: an integer in [1, 15] (each step asks for 2 x n logprobs, "
             "at most 30), got 16")
    assert (grpc_within, grpc_beyond) == ((grpc.StatusCode.OK, ""), (
        grpc.StatusCode.INVALID_ARGUMENT, "logprobs: Requested sample logprobs of 31, which is greater than max "
                                          "allowed: 30"))


def test_max_logprobs_flag_default_and_check():
    from splitserve.deploy.cluster_config import ClusterConfigError

    assert (_config().router.max_logprobs, _config("--max-logprobs", "-1").router.max_logprobs) == (20, -1)
    with pytest.raises(ClusterConfigError) as caught:
        _config("--max-logprobs", "-2")
    assert str(caught.value) == "router.max_logprobs: must be >= -1 (-1: no limit), got -2"


# ---- a vLLM deployment script's command line, pasted whole --------------------------------------

def test_a_pasted_vllm_serve_command_line_is_taken_whole():
    router = _config("--host", "0.0.0.0", "--port", "8000", "--allowed-origins", '["https://chat.example"]',
                     "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization", "content-type"]',
                     "--allow-credentials", "--enable-request-id-headers", "--root-path", "/llm",
                     "--uvicorn-log-level", "warning", "--response-role", "assistant",
                     "--return-tokens-as-token-ids", "--enable-prompt-tokens-details", "--disable-log-requests",
                     "--disable-uvicorn-access-log", "--disable-fastapi-docs", "--max-logprobs", "40").router
    assert (router.host, router.http_port, router.access_log, router.max_logprobs) == ("0.0.0.0", 8000, False, 40)
    assert router.http_options == HttpOptions(
        CorsPolicy(("https://chat.example",), ("GET", "POST"), ("authorization", "content-type"), True),
        request_id_headers=True, root_path="/llm", uvicorn_log_level="warning", access_log=False,
        response_role="assistant", return_tokens_as_token_ids=True, enable_prompt_tokens_details=True)
