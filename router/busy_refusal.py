"""Which connections the HTTP API's acceptor process may answer itself, and the bytes of that answer.

A pure core (bytes in, a typed decision out) for router/acceptor_process.py, which accepts the API's
connections in a process of its own and peeks at each new one's first bytes (MSG_PEEK: nothing is
consumed). `decide` says what they hold:

- GatedRequest: exactly one complete HTTP/1.1 request (head and Content-Length body, nothing after it),
  a POST to one of the admission-gated paths (GENERATION_PATHS), with no header that a layer before
  admission acts on (Origin: CORS; Expect, Upgrade, Transfer-Encoding: framing) and, when the API needs
  a key, the right key (router/auth.py's check; else the loop answers 401). What the admission gate would
  admit or refuse for capacity and nothing else: the acceptor hands it to the router with its slot taken
  while the router has one free, and refuses it with `answer` while it has none.
- HandOff: anything else, the router's loop serves (or refuses) it as it always did.
- NeedMore: not all there yet.

The rule is to hand off whenever in doubt. The refusal is the router's own: what its middleware stack
sends for a full router's refusal on that path (RefusalTemplate, rendered by the router through the same
layers at startup), with the request's own ids in place, uvicorn's headers and `connection: close`.

Standard library only: the acceptor process imports nothing else.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from functools import cached_property
from http import HTTPStatus

from splitserve.router.auth import check_api_key

MAX_PEEK_BYTES = 64 << 10
"""The most a request's bytes may be for the acceptor to refuse it: a head and body that did not arrive
whole within this many bytes go to the loop."""
HANDOFF_HEADERS = frozenset({b"origin", b"expect", b"upgrade", b"transfer-encoding"})
"""Headers that a layer before admission (CORS) or the HTTP framing acts on: such a request goes to the loop."""
REQUEST_ID_HEADER = b"x-request-id"
ANTHROPIC_REQUEST_ID_HEADER = b"request-id"


@dataclass(frozen=True)
class RefusalTemplate:
    """The router's answer to a refused request on one path, as its admission gate renders it."""

    status_line: bytes
    """b"HTTP/1.1 429 Too Many Requests\\r\\n"."""
    headers: tuple[tuple[bytes, bytes], ...]
    """The headers the router's middleware stack sends with it, in its order, lower-case names (retry-after,
    content-length, content-type, vary...). The values of X-Request-Id and Anthropic's request-id, when
    present, are the ids of the request it was rendered for: `answer` puts each request's own in their place."""
    body: bytes


@dataclass(frozen=True)
class RefusalRules:
    """What the acceptor needs to decide and answer like the router; sent to it as JSON (to_wire)."""

    templates: dict[str, RefusalTemplate]
    """path -> its answer, for every admission-gated path."""
    api_key: str | None
    """The key /v1/* needs (None: open)."""
    uvicorn_headers: tuple[tuple[bytes, bytes], ...]
    """What uvicorn puts after `date` on every answer (its config's encoded_headers: `server: uvicorn`)."""

    @cached_property
    def gated_paths(self) -> dict[bytes, str]:
        """The templates' paths, by their bytes on the wire."""
        return {path.encode("latin-1"): path for path in self.templates}

    @cached_property
    def fixed_answers(self) -> dict[str, tuple[bytes, bytes]]:
        """path -> the refusal's bytes before and after its date, for the templates that carry no id (the same
        for every request)."""
        fixed = {}
        for path, template in self.templates.items():
            if all(name not in (REQUEST_ID_HEADER, ANTHROPIC_REQUEST_ID_HEADER) for name, _ in template.headers):
                rest = [*self.uvicorn_headers, *template.headers, (b"connection", b"close")]
                fixed[path] = (template.status_line + b"date: ", b"\r\n" + _head_and_body(rest, template.body))
        return fixed

    def to_wire(self) -> bytes:
        return json.dumps({"templates": {path: _template_json(t) for path, t in self.templates.items()},
                           "api_key": self.api_key, "uvicorn_headers": _headers_json(self.uvicorn_headers)}).encode()

    @staticmethod
    def from_wire(data: bytes) -> RefusalRules:
        value = json.loads(data)
        return RefusalRules({path: _template_from_json(t) for path, t in value["templates"].items()}, value["api_key"],
                            _headers_from_json(value["uvicorn_headers"]))


def _headers_json(headers: tuple[tuple[bytes, bytes], ...]) -> list[list[str]]:
    return [[name.decode("latin-1"), value.decode("latin-1")] for name, value in headers]


def _headers_from_json(value: list[list[str]]) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((name.encode("latin-1"), v.encode("latin-1")) for name, v in value)


def _template_json(template: RefusalTemplate) -> dict[str, object]:
    return {"status_line": template.status_line.decode("latin-1"), "headers": _headers_json(template.headers),
            "body": template.body.decode("latin-1")}


def _template_from_json(value: dict) -> RefusalTemplate:
    return RefusalTemplate(value["status_line"].encode("latin-1"), _headers_from_json(value["headers"]),
                           value["body"].encode("latin-1"))


@dataclass(frozen=True)
class GatedRequest:
    """A complete request the admission gate would admit, or refuse for capacity (then with its path's template,
    after consuming its `request_bytes`)."""

    path: str
    request_bytes: int
    client_request_id: bytes | None
    """The request's own X-Request-Id header, if it sent one."""


@dataclass(frozen=True)
class HandOff:
    """The router's loop serves this connection (nothing was read from it)."""

    reason: str


@dataclass(frozen=True)
class NeedMore:
    """The request has not arrived whole yet: peek again when more bytes come."""


NEED_MORE = NeedMore()
Decision = GatedRequest | HandOff | NeedMore


_HEADER_NAME = rb"[-!#$%&'*+.^_`|~0-9a-z]+"
"""A lower-cased RFC 9110 token (so no folded line, no space before the colon)."""
_HEADER_VALUE = rb"[\t\x20-\x7e\x80-\xff]*"
"""No control characters but tab (the loop's parser answers those 400, and uvicorn would not send one back as an id)."""
_HEADER_LINES = re.compile(rb"(?:\r\n" + _HEADER_NAME + b":" + _HEADER_VALUE + rb")*\r\n")
"""A lower-cased header block, from the request line's CRLF to the last header's: every line `name:value`."""
_GATEABLE_HEADER_LINES = re.compile(rb"(?:\r\n(?!(?:" + b"|".join(re.escape(name) for name in sorted(HANDOFF_HEADERS))
                                    + rb"):)" + _HEADER_NAME + b":" + _HEADER_VALUE + rb")*\r\n")
"""_HEADER_LINES with no HANDOFF_HEADERS line: both checks in one pass (decide runs once per connection of a burst;
the first tells the reason when this one fails)."""
_REQUEST_LINE = re.compile(rb"POST (/[\x21-\x7e]*) HTTP/1\.1")
"""A POST in origin form (a target of visible ASCII: anything else is the loop's parser's to judge), HTTP/1.1."""
_CONTENT_LENGTH = b"\r\ncontent-length:"
_AUTHORIZATION = b"\r\nauthorization:"
_API_KEY = b"\r\nx-api-key:"
_REQUEST_ID = b"\r\n" + REQUEST_ID_HEADER + b":"


def decide(peeked: bytes, rules: RefusalRules) -> Decision:
    """What to do with a connection whose first bytes are `peeked` (at most MAX_PEEK_BYTES, unconsumed).

    Runs once per connection of a burst, so it is a few C-level searches rather than a header dict: a
    refusal's own Python work costs several times its micro-benchmark here, beside the kernel's work
    (bench/admission_burst.py's p99 is the acceptor's time per connection times the backlog)."""
    head_end = peeked.find(b"\r\n\r\n")
    if head_end < 0:
        return NEED_MORE if len(peeked) < MAX_PEEK_BYTES else HandOff("head larger than the acceptor reads")
    line_end = peeked.find(b"\r\n")
    request_line = _REQUEST_LINE.fullmatch(peeked, 0, line_end)
    if request_line is None:
        return HandOff("not an HTTP/1.1 POST in origin form")
    path = rules.gated_paths.get(request_line[1].partition(b"?")[0])
    if path is None:
        return HandOff("not an admission-gated path")
    block = peeked[line_end:head_end + 2].lower()  # b"\r\nname:value\r\n...\r\n", offsets as in `peeked`
    if _GATEABLE_HEADER_LINES.fullmatch(block) is None:
        return HandOff("a header line the acceptor does not parse" if _HEADER_LINES.fullmatch(block) is None
                       else "a header another layer acts on")
    if rules.api_key is not None and check_api_key(_header(peeked, block, line_end, _AUTHORIZATION),
                                                   _header(peeked, block, line_end, _API_KEY),
                                                   rules.api_key) is not None:
        return HandOff("no valid API key (the loop answers 401)")
    length = _header(peeked, block, line_end, _CONTENT_LENGTH)
    if length is not None and (not length.isdigit() or block.count(_CONTENT_LENGTH) > 1):
        return HandOff("no single decimal Content-Length")
    request_bytes = head_end + 4 + (int(length) if length is not None else 0)
    if request_bytes > MAX_PEEK_BYTES:
        return HandOff("request larger than the acceptor reads")
    if len(peeked) < request_bytes:
        return NEED_MORE
    if len(peeked) > request_bytes:
        return HandOff("bytes after the request (pipelined)")
    return GatedRequest(path, request_bytes, _header(peeked, block, line_end, _REQUEST_ID))


def _header(peeked: bytes, block: bytes, offset: int, needle: bytes) -> bytes | None:
    """The first value of the header whose line starts with `needle` (b"\\r\\n" + lower-case name + b":"), as sent
    (`block` is peeked[offset:...] lower-cased)."""
    start = block.find(needle)
    if start < 0:
        return None
    start += len(needle)
    return peeked[offset + start:offset + block.find(b"\r\n", start)].strip(b" \t")


@dataclass(frozen=True)
class Answer:
    """A refusal's bytes and the ids it carries (for the access log's refused line)."""

    data: bytes
    request_id: str | None
    """The X-Request-Id the answer carries, else the request's own: what the refused line names."""
    anthropic_request_id: str | None = None
    """The Anthropic `request-id` the answer carries (`req_<hex>`), if its template has one."""


def answer(refused: GatedRequest, rules: RefusalRules, date: bytes) -> Answer:
    """The bytes uvicorn would write for the router's refusal of `refused`: its status line, date, its own
    headers, the template's (X-Request-Id: the request's own else a fresh uuid4 hex; request-id: a fresh
    `req_<hex>`), connection: close, the body."""
    fixed = rules.fixed_answers.get(refused.path)
    if fixed is not None:
        client_id = refused.client_request_id
        return Answer(fixed[0] + date + fixed[1], None if client_id is None else client_id.decode("latin-1"))
    template = rules.templates[refused.path]
    request_id, anthropic_request_id = refused.client_request_id, None
    headers = [(b"date", date), *rules.uvicorn_headers]
    for name, value in template.headers:
        if name == REQUEST_ID_HEADER:
            request_id = value = request_id or uuid.uuid4().hex.encode()
        elif name == ANTHROPIC_REQUEST_ID_HEADER:
            anthropic_request_id = f"req_{uuid.uuid4().hex}"
            value = anthropic_request_id.encode()
        headers.append((name, value))
    headers.append((b"connection", b"close"))
    data = template.status_line + _head_and_body(headers, template.body)
    return Answer(data, None if request_id is None else request_id.decode("latin-1"), anthropic_request_id)


def _head_and_body(headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """Header lines, the blank line, the body."""
    return b"".join([*(name + b": " + value + b"\r\n" for name, value in headers), b"\r\n", body])


def uvicorn_status_line(status: int) -> bytes:
    """The status line uvicorn writes for `status` (its STATUS_LINE)."""
    return b"HTTP/1.1 %d %s\r\n" % (status, HTTPStatus(status).phrase.encode())
