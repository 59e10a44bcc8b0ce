"""Request bytes that do not parse end a gRPC call with INVALID_ARGUMENT, not UNKNOWN.

grpc.aio parses a request with the method's deserializer before the handler runs, and a
DecodeError there (a corrupt or truncated message, a string field that is not UTF-8) escapes
as UNKNOWN "Unexpected <class 'DecodeError'>". MalformedRequestInterceptor gives every
unary-request method a deserializer that keeps the error instead, and a handler that ends the
call with INVALID_ARGUMENT naming `request` (the documented code for bad input) before the
method's own handler sees anything. Request-streaming methods (reflection's) are left alone.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError


@dataclass(frozen=True)
class _Malformed:
    """Bytes that did not parse as the method's request message, and why."""

    reason: str


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each unary-request method's handler (every handler of this server is async)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        return _checking(handler)


def _checking(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that cannot raise and a behavior that rejects what it kept."""
    deserialize = handler.request_deserializer

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as error:
            return _Malformed(str(error))

    if not handler.response_streaming:
        return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary), request_deserializer=parse,
                                                   response_serializer=handler.response_serializer)
    behavior = handler.unary_stream
    checked = _streaming(behavior) if inspect.isasyncgenfunction(behavior) else _unary(behavior)
    return grpc.unary_stream_rpc_method_handler(checked, request_deserializer=parse,
                                                response_serializer=handler.response_serializer)


async def _reject_malformed(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: cannot be parsed ({request.reason})")


def _unary(behavior: Callable) -> Callable:
    """A coroutine behavior (or a response-streaming one that writes with context.write)."""

    async def serve(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await _reject_malformed(request, context)
        return await behavior(request, context)

    return serve


def _streaming(behavior: Callable) -> Callable:
    """An async-generator behavior (Generation/Generate, health's Watch)."""

    async def serve(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _reject_malformed(request, context)
        async for response in behavior(request, context):
            yield response

    return serve
