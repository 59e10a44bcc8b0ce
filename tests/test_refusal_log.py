"""The access log's `refused` lines (router/http_access.py): an HTTP request answered with an error before it
ran has exactly one, with the answer's status and error; a request that ran has only its record's line;
probes and a server started without the access log have none."""

from __future__ import annotations

import json
import logging

import pytest

from splitserve.router.access_log import log_refusal, refusal_fields
from tests.factories import capture_access_log, http_request, served_apis

MODEL = "tiny-llama"
KEY = "sk-refusal-log-0123"


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
        _post(served, "/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": "hi"}),
    ]
    assert statuses == [400, 400, 401, 404, 405, 400]
    assert access_log() == [
        _refused("POST", "/v1/completions", 400, "max_tokens: must be an integer >= 1, got -1", "max_tokens", "c-1"),
        _refused("POST", "/v1/completions", 400, "request body is not valid JSON: Expecting property name enclosed in "
                                                 "double quotes: line 1 column 2 (char 1)"),
        _refused("POST", "/v1/completions", 401, "missing API key"),
        _refused("GET", "/v1/nowhere", 404, "Invalid URL (GET /v1/nowhere)"),
        _refused("GET", "/v1/completions", 405, "Method Not Allowed"),
        # The Messages API answers with Anthropic's error object; its message is read all the same.
        _refused("POST", "/v1/messages", 400, 'messages: must be a non-empty list of {role, content} objects, got "hi"'),
    ]


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
    assert [entry for entry in caplog.records if entry.name == "splitserve.access"] == []


def test_a_hostile_path_and_error_stay_on_one_bounded_line(caplog):
    hostile = '/v1/x\nINFO forged\x00"' + "y" * 1000
    with caplog.at_level(logging.INFO, logger="splitserve.access"):
        log_refusal(refusal_fields("GET", hostile, 404, f"Invalid URL (GET {hostile})", None, None))
    [entry] = caplog.records
    line = entry.getMessage()
    assert "\n" not in line and "\x00" not in line and len(line) < 800
    assert line.startswith('refused method="GET" path="/v1/x\\nINFO forged\\u0000\\"yyy')
    assert len(entry.fields["path"]) == 256
