"""The router's gRPC front: the Generation service, the Triton-compatible inference service
(router/triton_server.py), grpc.health.v1 and server reflection.

Translates proto messages to the orchestrator's typed inputs and back, and maps errors to
status codes: InvalidRequestError -> INVALID_ARGUMENT (message names the field), RouterError
-> its own code. A request is admitted (O(1)) and held to router/request_limits.py's table
before it is tokenized, in router/tokenizer_pool.py's pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from splitserve.common.block_hash import check_cache_salt
from splitserve.common.config import check_priority
from splitserve.common.errors import InvalidRequestError
from splitserve.common.generation_config import NO_REQUEST_DEFAULTS, RequestDefaults
from splitserve.common.log_escape import quote_for_log
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.token_logprobs import TokenLogprobs
from splitserve.proto.inference import grpc_service_pb2 as triton_pb
from splitserve.proto.inference import grpc_service_pb2_grpc as triton_pb_grpc
from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.proto.splitserve.v1 import generation_pb2_grpc as pb_grpc
from splitserve.router.access_log import grpc_refusal_fields, log_refusal
from splitserve.router.api_common import grpc_deadline, grpc_status, log_grpc_refusal
from splitserve.router.auth import check_authorization
from splitserve.router.lora_adapters import AdapterRegistry
from splitserve.router.malformed_requests import MalformedRequestInterceptor, service_of
from splitserve.router.api_types import GenerationInput, RouterError, StreamChunk
from splitserve.router.orchestrator import Orchestrator
from splitserve.router.request_ids import ReservedRequestId
from splitserve.router.request_limits import MAX_BODY_BYTES
from splitserve.router.structured_output import LARGE_GRAMMAR_BYTES, structured_output_from_proto
from splitserve.router.tokenizer_pool import TokenizerPool
from splitserve.router.triton_server import SERVICE_NAME as TRITON_SERVICE_NAME
from splitserve.router.triton_server import TritonServicer
from splitserve.router.tls import TlsConfig, bind_grpc_port

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
GENERATE_RPC = f"/{SERVICE_NAME}/Generate"
MAX_MESSAGE_BYTES = MAX_BODY_BYTES
_SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                    "presence_penalty", "seed", "ignore_eos", "logprobs", "skip_special_tokens",
                    "min_tokens", "include_stop_str_in_output", "prompt_logprobs")
DEFAULT_MAX_TOKENS = SamplingParams.max_tokens
"""max_tokens of a request that sets none (as a completion's: the server's defaults never change it)."""


async def sampling_params_of(message: pb.SamplingParams,
                             defaults: RequestDefaults = NO_REQUEST_DEFAULTS) -> SamplingParams:
    """sampling_params_from_proto, in a thread when the structured output is large (LARGE_GRAMMAR_BYTES)."""
    if message.structured_output.ByteSize() > LARGE_GRAMMAR_BYTES:
        return await asyncio.to_thread(sampling_params_from_proto, message, defaults)
    return sampling_params_from_proto(message, defaults)


def sampling_params_from_proto(message: pb.SamplingParams,
                               defaults: RequestDefaults = NO_REQUEST_DEFAULTS) -> SamplingParams:
    """Unset optional fields take the server's `defaults` (--generation-config), else SamplingParams'
    own; max_tokens is cut to the defaults' limit. Values are validated by SamplingParams."""
    given = {name: getattr(message, name) for name in _SAMPLING_FIELDS if message.HasField(name)}
    max_tokens = message.max_tokens if message.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    return SamplingParams(stop=tuple(message.stop), stop_token_ids=tuple(message.stop_token_ids),
                          structured_output=structured_output_from_proto(message.structured_output),
                          logit_bias=dict(message.logit_bias), bad_words=tuple(message.bad_words),
                          allowed_token_ids=tuple(message.allowed_token_ids) or None,
                          max_tokens=defaults.limited(max_tokens), **defaults.sampling_fields(given))


async def prompt_token_ids(request: pb.GenerateRequest, tokenizers: TokenizerPool,
                           truncated: bool = False) -> tuple[int, ...]:
    """The prompt's token ids; its size is checked before anything is decoded or tokenized (a
    token-id prompt that will be `truncated` may be longer than the context: the message limit bounds it)."""
    limits = tokenizers.limits
    kind = request.WhichOneof("prompt")
    if kind == "token_ids":
        if not truncated:
            limits.check_prompt_token_count(len(request.token_ids.ids), "prompt")
        return tuple(request.token_ids.ids)
    if kind == "text":
        limits.check_prompt_bytes(len(request.text), "prompt")
        try:
            text = request.text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise InvalidRequestError("prompt.text", f"is not valid UTF-8 ({error.reason} at byte {error.start})")
        return await tokenizers.encode(text)
    if kind == "chat":
        limits.check_chat(request.chat.messages)
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        add_prompt = request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
        return await tokenizers.apply_chat_template(messages, add_prompt)
    raise InvalidRequestError("prompt", "one of text, token_ids or chat is required")


def slo_target(request: pb.GenerateRequest, field: str) -> float | None:
    """An optional per-request SLO target (ttft_slo_s, tpot_slo_s): unset, or a finite number > 0."""
    if not request.HasField(field):
        return None
    value = getattr(request, field)
    if not 0 < value < float("inf"):
        raise InvalidRequestError(field, f"must be a finite number > 0, got {value}")
    return value


def _token_logprob(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def chunk_to_proto(chunk: StreamChunk, client_request_id: str) -> pb.GenerateResponse:
    """A chunk as the client's response: under the id it gave (or the router made for it), not the router's own."""
    response = pb.GenerateResponse(request_id=client_request_id, token_ids=chunk.token_ids, text=chunk.text,
                                   finish_reason=chunk.finish_reason or "")
    response.logprobs.extend(_token_logprob(lp) for lp in chunk.logprobs)
    if chunk.prompt_logprobs is not None:  # the first prompt token's entry is None
        response.prompt_logprobs.extend(_token_logprob(lp) for lp in chunk.prompt_logprobs[1:])
    if isinstance(chunk.stop_reason, str):
        response.stop_string = chunk.stop_reason
    elif isinstance(chunk.stop_reason, int):
        response.stop_token_id = chunk.stop_reason
    if chunk.usage is not None:
        response.usage.CopyFrom(pb.Usage(prompt_tokens=chunk.usage.prompt_tokens,
                                         cached_tokens=chunk.usage.cached_tokens,
                                         completion_tokens=chunk.usage.completion_tokens))
    if chunk.timing is not None:
        t = chunk.timing
        response.timing.CopyFrom(pb.Timing(queue_s=t.queue_s, prefill_s=t.prefill_s, transfer_s=t.transfer_s,
                                           first_token_s=t.first_token_s, total_s=t.total_s))
    return response


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, orchestrator: Orchestrator, tokenizers: TokenizerPool, model_name: str,
                 request_timeout_s: float | None = None, aliases: tuple[str, ...] = (),
                 defaults: RequestDefaults = NO_REQUEST_DEFAULTS, adapters: AdapterRegistry | None = None,
                 log_refusals: bool = False) -> None:
        self.orchestrator = orchestrator
        self.tokenizers = tokenizers
        self.model_name = model_name
        self.model_names = frozenset((model_name, *aliases))
        """Every name a request may give (--served-model-name)."""
        self.adapters = adapters or AdapterRegistry((), self.model_names)
        """LoRA adapters a request may name as `model` (the HTTP API's, runtime loads included)."""
        self.request_timeout_s = request_timeout_s
        self.defaults = defaults
        """The sampling values a request leaves unset (--generation-config), as on the OpenAI API."""
        self.log_refusals = log_refusals
        """Write the access log's `refused` line of a request refused before it ran (router.access_log)."""

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        admission = ids = None
        ran = False
        try:
            admission = self.orchestrator.admit()
            ids, inp = await self._input(request, context)
            ran = True  # _input checked what generate() checks first: its record writes the access line
            logger.info("[%s] generate: %d prompt tokens", quote_for_log(inp.request_id), len(inp.prompt_token_ids))
            async for chunk in self.orchestrator.generate(inp, admission):
                yield chunk_to_proto(chunk, ids.client_request_id)
        except (InvalidRequestError, RouterError) as error:
            logger.info("[%s] ended with %s", quote_for_log(request.request_id), quote_for_log(error))
            if not ran and self.log_refusals:
                log_grpc_refusal(GENERATE_RPC, error, request.request_id)
            if admission is not None:
                admission.release()  # before the status goes out (the HTTP acceptor learns of free slots from it)
            await context.abort(*grpc_status(error))
        finally:
            if admission is not None:
                admission.release()  # refused while validated or tokenized, else already released
            if ids is not None:
                ids.release()

    async def _input(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
                     ) -> tuple[ReservedRequestId, GenerationInput]:
        """The request validated and tokenized, and its ids (reserved last: the caller releases them): every check
        Orchestrator.generate makes before it records the request is made here, so a request refused after this
        has its record's access line and one refused here has the caller's `refused` line."""
        limits = self.tokenizers.limits
        limits.check_request_id(request.request_id, "request_id")
        adapter = self.adapters.get(request.model or None)
        if request.model and adapter is None and request.model not in self.model_names:
            raise InvalidRequestError("model", f"unknown model {request.model!r}; this server serves "
                                               f"{self.model_name!r}")
        cache_salt = request.cache_salt if request.HasField("cache_salt") else None
        check_cache_salt(cache_salt)
        check_priority(request.priority, self.orchestrator.scheduling_policy)
        params = await sampling_params_of(request.sampling, self.defaults)
        max_tokens_field = "max_tokens" if request.sampling.HasField("max_tokens") else None
        limits.check_sampling(params, max_tokens_field)
        limits.check_logprobs(params)
        params = await self.tokenizers.tokenize_bad_words(params)
        ttft_slo_s, tpot_slo_s = slo_target(request, "ttft_slo_s"), slo_target(request, "tpot_slo_s")
        truncation = limits.prompt_truncation(*(getattr(request, name) if request.HasField(name) else None
                                                for name in ("truncate_prompt_tokens", "truncation_side")))
        token_ids = await prompt_token_ids(request, self.tokenizers, truncation is not None)
        if truncation is not None:
            token_ids = truncation.applied(token_ids)
        self.orchestrator.validate_prompt(token_ids, ids_field="prompt.token_ids")
        ids = self.orchestrator.new_request_id(request.request_id)
        return ids, GenerationInput(ids.request_id, token_ids, params, grpc_deadline(context, self.request_timeout_s),
                                    ttft_slo_s, tpot_slo_s, cache_salt=cache_salt, priority=request.priority,
                                    lora_request=adapter, client_request_id=ids.renamed_from)


_OPEN_SERVICES = frozenset({health.SERVICE_NAME, reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"})
"""Services that answer without an API key: probes (health) and discovery (reflection)."""


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call to a service outside _OPEN_SERVICES that lacks metadata
    `authorization: Bearer <key>`, with UNAUTHENTICATED before the handler runs; a call to one of
    `logged_services` refused so gets the access log's `refused` line."""

    def __init__(self, api_key: str, logged_services: frozenset[str] = frozenset()) -> None:
        self._api_key = api_key
        self._logged_services = logged_services

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        rpc = handler_call_details.method
        service = service_of(rpc)
        if handler is None or service in _OPEN_SERVICES:
            return handler
        header = next((value for key, value in handler_call_details.invocation_metadata or ()
                       if key == "authorization"), None)
        reason = check_authorization(header, self._api_key)
        if reason is None:
            return handler
        return _denial(handler, reason, rpc if service in self._logged_services else None)


def _denial(handler: grpc.RpcMethodHandler, reason: str, logged_rpc: str | None) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED (and logs the refusal of
    `logged_rpc`, unless None)."""

    async def deny(request_or_iterator, context: grpc.aio.ServicerContext):
        if logged_rpc is not None:
            log_refusal(grpc_refusal_fields(logged_rpc, grpc.StatusCode.UNAUTHENTICATED.name, reason, None, None))
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(deny, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


def _reflection_pool(files: Iterable[FileDescriptor]) -> descriptor_pool.DescriptorPool:
    """One pool holding `files` and everything they import: reflection answers from a single pool,
    and the Triton API's descriptors live apart from the default one (proto/regenerate.py says why)."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: FileDescriptor) -> None:
        if file.name not in added:
            added.add(file.name)
            for dependency in file.dependencies:  # a file's imports must be in the pool first
                add(dependency)
            pool.AddSerializedFile(file.serialized_pb)

    for file in files:
        add(file)
    return pool


@dataclass(frozen=True)
class GrpcServer:
    """A started gRPC server and its health service.

    Health: service "" (liveness) is SERVING while the server runs; the served APIs (Generation,
    Triton) follow Orchestrator.is_ready, so a readiness probe takes the router out of rotation
    while no decode worker answers, and every service is NOT_SERVING once a drain starts."""

    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    readiness: asyncio.Task
    """Keeps the served APIs' health in step with the orchestrator's readiness."""

    async def stop_serving(self) -> None:
        """Report NOT_SERVING for every service from now on (a drain: probes and load balancers
        stop sending new requests while running ones finish)."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float | None) -> None:
        self.readiness.cancel()
        await self.server.stop(grace_s)


SERVED_APIS = (SERVICE_NAME, TRITON_SERVICE_NAME)


async def _set_readiness(health_servicer: health.aio.HealthServicer, ready: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in SERVED_APIS:
        await health_servicer.set(service, status)


async def _track_readiness(orchestrator: Orchestrator, health_servicer: health.aio.HealthServicer,
                           ready: bool) -> None:
    while True:
        await orchestrator.readiness_changed.wait()
        orchestrator.readiness_changed.clear()
        now_ready = orchestrator.is_ready
        if now_ready != ready:
            ready = now_ready
            await _set_readiness(health_servicer, ready)


async def drain(orchestrator: Orchestrator, server: GrpcServer, timeout_s: float) -> int:
    """Refuse new requests and report NOT_SERVING on every API (gRPC health; HTTP /health and
    Triton readiness read Orchestrator.is_ready), then wait up to timeout_s for the requests in
    flight; returns how many are left."""
    await server.stop_serving()
    return await orchestrator.drain(timeout_s)


async def start_grpc_server(orchestrator: Orchestrator, tokenizers: TokenizerPool, model_name: str,
                            host: str = "127.0.0.1", port: int = 50051,
                            request_timeout_s: float | None = None,
                            api_key: str | None = None,
                            tls: TlsConfig | None = None, aliases: tuple[str, ...] = (),
                            reuse_port: bool = False, defaults: RequestDefaults = NO_REQUEST_DEFAULTS,
                            adapters: AdapterRegistry | None = None, access_log: bool = False) -> GrpcServer:
    """Start serving; returns the server with its bound port (port 0 picks a free one). A
    Generate request may name the model `model_name` or one of `aliases` (Triton knows only
    `model_name`: its model repository has one entry). With
    `api_key`, Generation and Triton calls need metadata `authorization: Bearer <api_key>` (health and
    reflection stay open). With `tls`, every service is served over TLS only (mutual TLS when
    it has a client CA). `reuse_port`: share the port with other routers' servers (SO_REUSEPORT,
    which grpc would otherwise set by default: off, a port in use is an error). `defaults`: what a
    Generate request's unset sampling fields take (--generation-config; the Triton API, like Triton's
    vLLM backend, takes none). `adapters`: the LoRA adapters a Generate request may name as `model` (the HTTP
    API's registry; the Triton API serves the base model only). `access_log`: a call to the Generation or Triton
    service refused before it ran (its key, bytes that do not parse, admission, validation) gets the access log's
    `refused` line (router.access_log; the router's observer writes the line of every request that ran)."""
    # The key is checked first: a caller without it learns nothing, not even whether its bytes parse.
    logged_services = frozenset(SERVED_APIS) if access_log else frozenset()
    interceptors = [*([ApiKeyInterceptor(api_key, logged_services)] if api_key else []),
                    MalformedRequestInterceptor(logged_services)]
    server = grpc.aio.server(interceptors=interceptors,
                             options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", int(reuse_port))])
    pb_grpc.add_GenerationServicer_to_server(
        GenerationServicer(orchestrator, tokenizers, model_name, request_timeout_s, aliases, defaults, adapters,
                           access_log),
        server)
    triton_pb_grpc.add_GRPCInferenceServiceServicer_to_server(
        TritonServicer(orchestrator, tokenizers, model_name, request_timeout_s, access_log), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, TRITON_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server,
        _reflection_pool((pb.DESCRIPTOR, triton_pb.DESCRIPTOR, health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR)))
    bound = bind_grpc_port(server, host, port, tls)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    ready = orchestrator.is_ready
    await _set_readiness(health_servicer, ready)
    readiness = asyncio.get_running_loop().create_task(_track_readiness(orchestrator, health_servicer, ready))
    return GrpcServer(server, bound, health_servicer, readiness)
