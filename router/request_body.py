"""A request body, bytes in, parsed request out: JSON decoding and the API's field parser, small
bodies on the event loop, large ones (and middling ones that may carry a grammar to compile) in a
separate process.

Why a process: `json.loads` holds the GIL for the whole body (about 3 ms per MB here), and so does
the parser's size check of each prompt, so in a thread it stalls the event loop just as long. A
body large enough to matter (LARGE_BODY_BYTES) is sent to one spawned process, which decodes and
parses it and returns only the parsed request or the refusal: twenty 4 MB bodies at once then
cost the router's loop their reading and a copy each, not ~20 ms of held GIL apiece, so the
streams it is serving keep their pace.

How much waits for the process is bounded by admission: a body is read and parsed only by a
request holding an admission slot (router.routing.max_in_flight_requests), and no body is over
RequestLimits.max_body_bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from splitserve.router.child_process import follow_router
from splitserve.router.request_limits import RequestLimits
from splitserve.router.structured_output import LARGE_GRAMMAR_BYTES, STRUCTURED_OUTPUT_FIELDS

logger = logging.getLogger(__name__)

T = TypeVar("T")
Parse = Callable[[Mapping[str, Any], RequestLimits], T]
"""An API's field parser (e.g. openai_protocol.parse_completion_request): a module-level function,
or a functools.partial of one binding picklable arguments (the server's sampling defaults), so the
process can be told which one by name."""

LARGE_BODY_BYTES = 128 << 10
"""A body of more bytes is decoded in the process: on the loop it would hold the GIL for about
0.4 ms or more, while the trip to the process and back costs about that much."""
GRAMMAR_FIELD_NAMES = tuple(f'"{name}"'.encode() for name in (*STRUCTURED_OUTPUT_FIELDS, "tools", "format"))
"""A body over LARGE_GRAMMAR_BYTES that names one of these fields (as JSON keys, quoted; "format":
the Responses API's text.format) may carry a grammar to compile, and goes to the process too. The
test is on the raw bytes, before decoding, so a prompt that quotes one of them (or a schema's
"format" keyword) only costs the trip."""

PARSER_NICENESS = 10
"""The parser process's CPU priority below the router's: where cores are scarce, parsing a large
body waits for the streams' work, not the other way round."""


class MalformedBodyError(ValueError):
    """A body that is not a JSON object (HTTP 400, code invalid_json); the message says why."""


def json_object(body: bytes) -> dict[str, Any]:
    """The body decoded as JSON, which must be an object."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError) as error:
        # ValueError: not UTF-8, not JSON, or an integer literal past Python's 4300-digit limit;
        # RecursionError: arrays or objects nested too deep to parse.
        raise MalformedBodyError(f"request body is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise MalformedBodyError(f"request body must be a JSON object, got {type(value).__name__}")
    return value


def parse_body(parse: Parse[T], body: bytes, limits: RequestLimits) -> T:
    """`parse` of the decoded body: MalformedBodyError, or the parser's InvalidRequestError."""
    return parse(json_object(body), limits)


class BodyParser:
    """Parses one API's request bodies within `limits`; owns the process that parses the large ones
    (started at construction, so the first large body does not wait for it; replaced if it dies)."""

    def __init__(self, limits: RequestLimits, large_body_bytes: int = LARGE_BODY_BYTES) -> None:
        self.limits = limits
        self._large_body_bytes = large_body_bytes
        self._executor = self._start_process()

    async def parse(self, parse: Parse[T], body: bytes) -> T:
        """The parsed request; MalformedBodyError or InvalidRequestError when it is not one.
        Cancelling the await (the client went away) lets a running parse end in its process."""
        if not self._is_costly(body):
            return parse_body(parse, body, self.limits)
        executor = self._executor
        try:
            return await asyncio.wrap_future(executor.submit(parse_body, parse, body, self.limits))
        except BrokenProcessPool:
            # The process died (killed, out of memory): this body is parsed here, later ones in a new process.
            # Every body that was with the dead process ends here; only the first replaces it (shutting down
            # a replacement would cancel the bodies already sent to it).
            if self._executor is executor:
                logger.warning("the request body parser process died; starting another")
                executor.shutdown(wait=False, cancel_futures=True)
                self._executor = self._start_process()
            return parse_body(parse, body, self.limits)

    def _is_costly(self, body: bytes) -> bool:
        """Whether parsing `body` could hold the loop long enough to be worth the process's trip."""
        if len(body) > self._large_body_bytes:
            return True
        return len(body) > LARGE_GRAMMAR_BYTES and any(name in body for name in GRAMMAR_FIELD_NAMES)

    def close(self) -> None:
        """Drop queued bodies and end the process once its current one is parsed."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _start_process() -> ProcessPoolExecutor:
        # spawn, not fork: the router's process runs threads (gRPC, Ray, the tokenizer pool), and a
        # forked child can inherit a lock one of them held and block forever.
        executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                       initializer=_start_parser_process, initargs=(os.getpid(),))
        executor.submit(int)  # starts the process now, not on the first large body
        return executor


def _start_parser_process(router_pid: int) -> None:
    """In the parser process: below the router's CPU priority, and ended with the router (follow_router)."""
    follow_router(router_pid)
    os.nice(PARSER_NICENESS)
