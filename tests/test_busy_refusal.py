"""The HTTP acceptor's pure core (router/busy_refusal.py): which bytes hold a request it may refuse, and the exact
bytes of its refusal."""

from __future__ import annotations

import re

import pytest

from splitserve.router.busy_refusal import (MAX_PEEK_BYTES, NEED_MORE, GatedRequest, HandOff, RefusalRules,
                                            RefusalTemplate, answer, decide)

BODY = b'{"model": "m", "prompt": "hi"}'
TEMPLATE = RefusalTemplate(b"HTTP/1.1 429 Too Many Requests\r\n",
                           ((b"retry-after", b"1"), (b"content-length", b"4"), (b"vary", b"Origin")), b"full")
IDS_TEMPLATE = RefusalTemplate(TEMPLATE.status_line, ((b"retry-after", b"1"), (b"request-id", b"req_rendered"),
                                                      (b"x-request-id", b"rendered")), b"full")
RULES = RefusalRules({"/v1/completions": TEMPLATE, "/v1/messages": IDS_TEMPLATE}, None, ((b"server", b"uvicorn"),))
KEYED = RefusalRules(RULES.templates, "sesame", RULES.uvicorn_headers)


def request(path: bytes = b"/v1/completions", headers: bytes = b"", body: bytes = BODY, method: bytes = b"POST",
            version: bytes = b"HTTP/1.1") -> bytes:
    return (b"%s %s %s\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (method, path, version, len(body), headers, body))


def test_a_whole_post_on_a_gated_path_is_a_gated_request():
    whole = request(headers=b"X-Request-Id:  abc \r\n")
    assert decide(whole, RULES) == GatedRequest("/v1/completions", len(whole), b"abc")
    assert decide(request(b"/v1/completions?stream=1"), RULES) == GatedRequest("/v1/completions", len(request(
        b"/v1/completions?stream=1")), None)
    no_body = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n\r\n"
    assert decide(no_body, RULES) == GatedRequest("/v1/messages", len(no_body), None)
    no_headers = b"POST /v1/completions HTTP/1.1\r\n\r\n"
    assert decide(no_headers, RULES) == GatedRequest("/v1/completions", len(no_headers), None)
    named_like_a_handoff_header = request(headers=b"Origin-Trace: a\r\nExpected: b\r\nUpgraded: c\r\n")
    assert decide(named_like_a_handoff_header, RULES) == GatedRequest(
        "/v1/completions", len(named_like_a_handoff_header), None)


@pytest.mark.parametrize("peeked", [b"", b"POST /v1/compl", request()[:-1], request(headers=b"X-Request-Id: a")[:60]])
def test_a_request_not_all_there_needs_more(peeked):
    assert decide(peeked, RULES) is NEED_MORE


@pytest.mark.parametrize("peeked, reason", [
    (request(method=b"GET"), "not an HTTP/1.1 POST in origin form"),
    (request(version=b"HTTP/1.0"), "not an HTTP/1.1 POST in origin form"),
    (request(b"http://host/v1/completions"), "not an HTTP/1.1 POST in origin form"),
    (request(b"/v1/completions/"), "not an admission-gated path"),
    (request(b"/v1/%63ompletions"), "not an admission-gated path"),  # the loop decodes it and refuses it itself
    (request(b"/health"), "not an admission-gated path"),
    (request(headers=b"Origin: https://a.example\r\n"), "a header another layer acts on"),
    (request(headers=b"expect: 100-continue\r\n"), "a header another layer acts on"),
    (request(headers=b"Transfer-Encoding: chunked\r\n"), "a header another layer acts on"),
    (request(headers=b"Upgrade: websocket\r\n"), "a header another layer acts on"),
    (request(headers=b"Content-Length: 3\r\n"), "no single decimal Content-Length"),
    (request(headers=b"X-Folded: a\r\n b\r\n"), "a header line the acceptor does not parse"),
    (request(headers=b"no colon\r\n"), "a header line the acceptor does not parse"),
    (request(headers=b"X-Request-Id: a\x00b\r\n"), "a header line the acceptor does not parse"),
    (request(headers=b"X-Other: a\x7fb\r\n"), "a header line the acceptor does not parse"),
    (request(b"/v1/completions?x=\xff"), "not an HTTP/1.1 POST in origin form"),
    (request() + b"POST", "bytes after the request (pipelined)"),
    (request(body=b"x" * MAX_PEEK_BYTES), "request larger than the acceptor reads"),
    (b"POST /v1/completions HTTP/1.1\r\nX-Pad: " + b"x" * MAX_PEEK_BYTES, "head larger than the acceptor reads"),
])
def test_anything_else_is_handed_to_the_loop_saying_why(peeked, reason):
    assert decide(peeked, RULES) == HandOff(reason)


def test_with_an_api_key_only_a_request_carrying_it_is_gated():
    assert decide(request(headers=b"Authorization: Bearer sesame\r\n"), KEYED) == GatedRequest(
        "/v1/completions", len(request(headers=b"Authorization: Bearer sesame\r\n")), None)
    assert isinstance(decide(request(headers=b"x-api-key: sesame\r\n"), KEYED), GatedRequest)
    for headers in (b"", b"Authorization: Bearer open\r\n", b"x-api-key: nope\r\n"):
        assert decide(request(headers=headers), KEYED) == HandOff("no valid API key (the loop answers 401)")


def test_the_refusal_is_the_template_with_uvicorns_headers_and_connection_close():
    refused = answer(GatedRequest("/v1/completions", 10, b"abc"), RULES, b"Sun, 29 Nov 2026 13:40:15 GMT")
    assert refused.data == (b"HTTP/1.1 429 Too Many Requests\r\ndate: Sun, 29 Nov 2026 13:40:15 GMT\r\n"
                            b"server: uvicorn\r\nretry-after: 1\r\ncontent-length: 4\r\nvary: Origin\r\n"
                            b"connection: close\r\n\r\nfull")
    assert refused.request_id == "abc"  # not sent back (no X-Request-Id in the template): the line names it


def test_the_ids_in_the_template_are_each_requests_own():
    own = answer(GatedRequest("/v1/messages", 10, b"abc"), RULES, b"D")
    fresh = answer(GatedRequest("/v1/messages", 10, None), RULES, b"D")
    pattern = (rb"HTTP/1.1 429 Too Many Requests\r\ndate: D\r\nserver: uvicorn\r\nretry-after: 1\r\n"
               rb"request-id: req_([0-9a-f]{32})\r\nx-request-id: (\S+)\r\nconnection: close\r\n\r\nfull")
    own_ids, fresh_ids = re.fullmatch(pattern, own.data).groups(), re.fullmatch(pattern, fresh.data).groups()
    assert own_ids[1] == b"abc" and re.fullmatch(rb"[0-9a-f]{32}", fresh_ids[1])
    assert len({own_ids[0], fresh_ids[0], fresh_ids[1]}) == 3
    assert (own.request_id, fresh.request_id) == ("abc", fresh_ids[1].decode())
    assert (own.anthropic_request_id, fresh.anthropic_request_id) == (f"req_{own_ids[0].decode()}",
                                                                  f"req_{fresh_ids[0].decode()}")


def test_the_rules_cross_to_the_process_unchanged():
    rules = RefusalRules({"/v1/completions": RefusalTemplate(b"HTTP/1.1 429 Too Many Requests\r\n",
                                                             ((b"x-bytes", bytes(range(32, 256))),), "é".encode())},
                         "k\u00e9y", ((b"server", b"uvicorn"),))
    assert RefusalRules.from_wire(rules.to_wire()) == rules
