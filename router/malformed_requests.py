"""Request bytes that do not parse end a gRPC call with INVALID_ARGUMENT, not UNKNOWN.

grpc.aio parses a request with the method's deserializer before the handler runs, and a
DecodeError there (a corrupt or truncated message, a string field that is not UTF-8) escapes
as UNKNOWN "Unexpected <class 'DecodeError'>". MalformedRequestInterceptor gives every
unary-request method a deserializer that keeps the error instead, and a handler that ends the
call with INVALID_ARGUMENT naming `request` (the documented code for bad input) before the
method's own handler sees anything. Request-streaming methods are left alone (reflection's; Triton's
ModelStreamInfer reads its messages itself and refuses one that does not parse alike, unparsable_request). A call to a
service in `logged_services` refused so gets the access log's `refused` line (its handler, which writes the
others, never runs).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from splitserve.common.errors import InvalidRequestError
from splitserve.router.api_common import grpc_status, log_grpc_refusal


@dataclass(frozen=True)
class _Malformed:
    """Bytes that did not parse as the method's request message: its refusal."""

    error: InvalidRequestError


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each unary-request method's handler (every handler of this server is async)."""

    def __init__(self, logged_services: frozenset[str] = frozenset()) -> None:
        self.logged_services = logged_services
        """Full service names whose refused calls are written to the access log (router.access_log)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        rpc = handler_call_details.method
        return _checking(handler, rpc if service_of(rpc) in self.logged_services else None)


def unparsable_request(error: DecodeError) -> InvalidRequestError:
    """The refusal of request bytes that do not parse as the method's message (INVALID_ARGUMENT naming `request`)."""
    return InvalidRequestError("request", f"cannot be parsed ({error})")


def service_of(rpc: str) -> str:
    """The full service name of a full method name (`splitserve.v1.Generation` of
    `/splitserve.v1.Generation/Generate`)."""
    return rpc.lstrip("/").partition("/")[0]


def _checking(handler: grpc.RpcMethodHandler, logged_rpc: str | None) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that cannot raise and a behavior that rejects what it kept (and logs the
    refusal of `logged_rpc`, unless None)."""
    deserialize = handler.request_deserializer

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as error:
            return _Malformed(unparsable_request(error))

    if not handler.response_streaming:
        return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary, logged_rpc), request_deserializer=parse,
                                                   response_serializer=handler.response_serializer)
    behavior = handler.unary_stream
    checked = (_streaming(behavior, logged_rpc) if inspect.isasyncgenfunction(behavior)
               else _unary(behavior, logged_rpc))
    return grpc.unary_stream_rpc_method_handler(checked, request_deserializer=parse,
                                                response_serializer=handler.response_serializer)


async def _reject_malformed(request: Any, context: grpc.aio.ServicerContext, logged_rpc: str | None) -> None:
    if isinstance(request, _Malformed):
        if logged_rpc is not None:
            log_grpc_refusal(logged_rpc, request.error, "")  # "": the unparsed message sent no id
        await context.abort(*grpc_status(request.error))


def _unary(behavior: Callable, logged_rpc: str | None) -> Callable:
    """A coroutine behavior (or a response-streaming one that writes with context.write)."""

    async def serve(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _reject_malformed(request, context, logged_rpc)
        return await behavior(request, context)

    return serve


def _streaming(behavior: Callable, logged_rpc: str | None) -> Callable:
    """An async-generator behavior (Generation/Generate, health's Watch)."""

    async def serve(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _reject_malformed(request, context, logged_rpc)
        async for response in behavior(request, context):
            yield response

    return serve
