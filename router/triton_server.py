"""The Triton / KServe v2 gRPC inference API (`inference.GRPCInferenceService`) on the router's gRPC
port, so unmodified `tritonclient[grpc]` clients of Triton's vLLM backend work.

A thin adapter over the same Orchestrator as the other APIs; tensors are parsed and rendered by
router/triton_protocol.py. RPCs: ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata,
ModelConfig, ModelInfer (one response with the whole output) and ModelStreamInfer (decoupled: a stream's requests run
concurrently; with `stream` true each gets one response per text delta, else one with the whole
output; the last response to a request carries the parameter triton_final_response = true, or,
when the request set triton_enable_empty_final_response, an empty response does).

Errors: unary RPCs end with a status (INVALID_ARGUMENT naming the input or parameter, NOT_FOUND for
a model or version not served, a RouterError's code: RESOURCE_EXHAUSTED, UNAVAILABLE,
DEADLINE_EXCEEDED, ...); in ModelStreamInfer a failed request gets a response whose error_message
reads "<CODE>: <message>" and the stream carries on.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
from google.protobuf.message import DecodeError

from splitserve.common.errors import InvalidRequestError
from splitserve.common.log_escape import quote_for_log
from splitserve.proto.inference import grpc_service_pb2 as pb
from splitserve.proto.inference import grpc_service_pb2_grpc as pb_grpc
from splitserve.router.api_common import grpc_deadline, grpc_status, log_grpc_refusal
from splitserve.router.api_types import GenerationInput, RouterError, StreamChunk
from splitserve.router.malformed_requests import unparsable_request
from splitserve.router.orchestrator import Orchestrator
from splitserve.router.tokenizer_pool import TokenizerPool
from splitserve.router.triton_protocol import (InferRequest, OutputValues, ServedModel, empty_final_response,
                                               infer_response, model_config, model_metadata, parse_infer_request,
                                               stream_error)
from splitserve.router.version import SERVER_VERSION

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
MODEL_METADATA_RPC = f"/{SERVICE_NAME}/ModelMetadata"
MODEL_CONFIG_RPC = f"/{SERVICE_NAME}/ModelConfig"
MODEL_INFER_RPC = f"/{SERVICE_NAME}/ModelInfer"
MODEL_STREAM_INFER_RPC = f"/{SERVICE_NAME}/ModelStreamInfer"
MODEL_VERSION = "1"
PLATFORM = "splitserve"
SERVER_NAME = "splitserve"
EXTENSIONS = ("parameters",)
"""The KServe v2 protocol extensions served: request and response parameters (sampling options,
triton_final_response); not the model repository, statistics, trace, logging or shared memory."""


class TritonServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, orchestrator: Orchestrator, tokenizers: TokenizerPool, model_name: str,
                 request_timeout_s: float | None = None, log_refusals: bool = False) -> None:
        self.orchestrator = orchestrator
        self.tokenizers = tokenizers
        self.model = ServedModel(model_name, MODEL_VERSION, PLATFORM)
        self.request_timeout_s = request_timeout_s
        """Server-side limit on a request's total time (router.request_timeout_s); None: no limit."""
        self.log_refusals = log_refusals
        """Write the access log's `refused` line of a request refused before it ran (router.access_log)."""

    # ---- health and metadata -------------------------------------------------------------
    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext
                          ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.orchestrator.is_ready)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext
                             ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION,
                                         extensions=EXTENSIONS)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ModelReadyResponse:
        return pb.ModelReadyResponse(ready=self.model.serves(request.name, request.version)
                                     and self.orchestrator.is_ready)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
                            ) -> pb.ModelMetadataResponse:
        try:
            self._check_model(request.name, request.version)
        except RouterError as error:
            self._refused(MODEL_METADATA_RPC, error, "")
            await context.abort(*grpc_status(error))
        return model_metadata(self.model)

    async def ModelConfig(self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
                          ) -> pb.ModelConfigResponse:
        try:
            self._check_model(request.name, request.version)
        except RouterError as error:
            self._refused(MODEL_CONFIG_RPC, error, "")
            await context.abort(*grpc_status(error))
        return model_config(self.model)

    # ---- inference -----------------------------------------------------------------------
    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
                         ) -> pb.ModelInferResponse:
        admission = None
        ran = False
        try:
            admission = self.orchestrator.admit()
            parsed, inp = await self._input(request, context)
            if parsed.stream:
                raise InvalidRequestError("stream", "must be false in ModelInfer (one response per request); "
                                                    "stream with ModelStreamInfer")
            ran = True  # _input checked what generate() checks first: its record writes the access line
            chunks = [chunk async for chunk in self.orchestrator.generate(inp, admission)]
        except (InvalidRequestError, RouterError) as error:
            logger.info("[%s] ModelInfer ended with %s", quote_for_log(request.id), quote_for_log(error))
            if not ran:
                self._refused(MODEL_INFER_RPC, error, request.id)
            if admission is not None:
                admission.release()  # before the status goes out (the HTTP acceptor learns of free slots from it)
            await context.abort(*grpc_status(error))
        finally:
            if admission is not None:
                admission.release()  # refused while parsed or tokenized, else already released
        return self._whole(parsed, inp, chunks, final=None)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[pb.ModelInferRequest],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Runs each request as it arrives; ends once the client has stopped sending and every
        request has ended. A cancelled call cancels the requests still running. `request_iterator` is left unread:
        _read reads the messages."""
        responses = _StreamResponses()
        requests: set[asyncio.Task] = set()
        responses.open()  # the reader, before anything can be consumed
        reader = asyncio.create_task(self._read(context, responses, requests))
        try:
            async for response in responses:
                yield response
        finally:
            for task in (reader, *requests):
                task.cancel()
            await asyncio.gather(reader, *requests, return_exceptions=True)

    async def _read(self, context: grpc.aio.ServicerContext, responses: _StreamResponses,
                    requests: set[asyncio.Task]) -> None:
        """Starts each request as it arrives. Messages are read with context.read(), not the request iterator: a
        message that does not parse ends the iterator (the stream ended OK, the rest unread), where here it is
        refused as ModelInfer refuses it (an error_message response, a `refused` line) and the stream reads on."""
        try:
            while True:
                try:
                    request = await context.read()
                except DecodeError as error:
                    self._refuse_streamed(unparsable_request(error), "", responses, logged=True)
                    continue
                if request is grpc.aio.EOF:
                    return
                responses.open()
                task = asyncio.create_task(self._serve_streamed(request, context, responses))
                requests.add(task)
                task.add_done_callback(requests.discard)
        finally:
            responses.close()

    async def _serve_streamed(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext,
                              responses: _StreamResponses) -> None:
        """One request of a stream: its responses, or the error that ended it."""
        ran = asyncio.Event()
        try:
            async for response in self._stream_responses(request, context, ran):
                responses.put(pb.ModelStreamInferResponse(infer_response=response))
        except (InvalidRequestError, RouterError) as error:
            self._refuse_streamed(error, request.id, responses, logged=not ran.is_set())
        except Exception as error:  # a bug: report it on this request, keep the stream's others going
            logger.exception("[%s] ModelStreamInfer request failed", quote_for_log(request.id))
            responses.put(stream_error(self.model, request.id, f"INTERNAL: {type(error).__name__}: {error}"))
        finally:
            responses.close()

    async def _stream_responses(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext,
                                ran: asyncio.Event) -> AsyncIterator[pb.ModelInferResponse]:
        """`ran` is set once the request is the orchestrator's (its record writes its access line)."""
        admission = self.orchestrator.admit()
        try:
            parsed, inp = await self._input(request, context)
            ran.set()
            flag_last = not parsed.empty_final_response
            if parsed.stream:
                tokens = 0  # generated since the last response (whose text may have been held back)
                async for chunk in self.orchestrator.generate(inp, admission):
                    last = chunk.finish_reason is not None
                    tokens += len(chunk.token_ids)
                    if chunk.text or last:  # a token whose text is still held back is no delta
                        output = OutputValues(chunk.text, chunk.finish_reason, len(inp.prompt_token_ids), tokens)
                        yield infer_response(self.model, parsed, output, last and flag_last)
                        tokens = 0
            else:
                chunks = [chunk async for chunk in self.orchestrator.generate(inp, admission)]
                yield self._whole(parsed, inp, chunks, final=flag_last)
        finally:
            admission.release()  # refused while parsed or tokenized, else already released
        if parsed.empty_final_response:
            yield empty_final_response(self.model, parsed.id)

    # ---- shared steps --------------------------------------------------------------------
    async def _input(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
                     ) -> tuple[InferRequest, GenerationInput]:
        """After admission (the caller's): the request held to the limits and tokenized, checked as
        Orchestrator.generate checks it before it records it (a Triton request's priority is always 0)."""
        self._check_model(request.model_name, request.model_version)
        limits = self.tokenizers.limits
        parsed = parse_infer_request(request, limits)
        parsed = replace(parsed, sampling=await self.tokenizers.tokenize_bad_words(parsed.sampling))
        request_id = _router_request_id(request.id)
        token_ids = await self.tokenizers.encode(parsed.text)
        self.orchestrator.validate_prompt(token_ids, "text_input")  # else the error would name "prompt"
        return parsed, GenerationInput(request_id, token_ids, parsed.sampling,
                                       grpc_deadline(context, self.request_timeout_s))

    def _refuse_streamed(self, error: InvalidRequestError | RouterError, request_id: str, responses: _StreamResponses,
                         logged: bool) -> None:
        """A stream's request that `error` ended: its error_message response, and its `refused` line when `logged`
        (it ended before it ran: else its record writes its line)."""
        logger.info("[%s] ModelStreamInfer request ended with %s", quote_for_log(request_id), quote_for_log(error))
        if logged:
            self._refused(MODEL_STREAM_INFER_RPC, error, request_id)
        code, message = grpc_status(error)
        responses.put(stream_error(self.model, request_id, f"{code.name}: {message}"))

    def _refused(self, rpc: str, error: InvalidRequestError | RouterError, request_id: str) -> None:
        """A call (or a stream's request) that `error` ended before it ran: its access-log line, if logged."""
        if self.log_refusals:
            log_grpc_refusal(rpc, error, request_id)

    def _check_model(self, name: str, version: str) -> None:
        if not self.model.serves(name, version):
            wanted = f"{name!r}" + (f" version {version!r}" if version else "")
            raise RouterError("NOT_FOUND", f"unknown model {wanted}; this server serves {self.model.name!r} "
                                           f"version {self.model.version!r}")

    def _whole(self, parsed: InferRequest, inp: GenerationInput, chunks: list[StreamChunk], final: bool | None
               ) -> pb.ModelInferResponse:
        text = "".join(chunk.text for chunk in chunks)
        if parsed.prepend_prompt:
            text = parsed.text + text
        output = OutputValues(text, chunks[-1].finish_reason, len(inp.prompt_token_ids),
                              sum(len(chunk.token_ids) for chunk in chunks))
        return infer_response(self.model, parsed, output, final)


def _router_request_id(client_id: str) -> str:
    """The id the router knows a request by: unique, because a Triton request id is the client's tag
    and several in flight may share one (the vLLM backend's sample client numbers its requests from
    "0", so two of them send the same ids at once); led by the client's id so the router's logs
    still name it."""
    unique = uuid.uuid4().hex
    return f"{client_id}-{unique}" if client_id else unique


class _StreamResponses:
    """The responses of one stream's concurrent producers (its request reader and each request), in
    the order they are put; iteration ends once every producer that was opened has closed."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        self._open = 0

    def open(self) -> None:
        """A new producer; call before whatever opened it closes, so the count never falls to 0 early."""
        self._open += 1

    def put(self, response: pb.ModelStreamInferResponse) -> None:
        self._queue.put_nowait(response)

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[pb.ModelStreamInferResponse]:
        while self._open:
            response = await self._queue.get()
            if response is None:
                self._open -= 1
            else:
                yield response
