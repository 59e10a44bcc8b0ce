"""The router's OpenAI-compatible HTTP front: /v1/completions, /v1/chat/completions and
/v1/responses (JSON or server-sent events), Anthropic's /v1/messages (and its count_tokens),
/v1/models, vLLM's /tokenize, /detokenize and /version, /health (and vLLM's /ping), and optionally /metrics.

A Starlette app served by uvicorn on the router's event loop (router/http_server.py: its connections
accepted by the acceptor process, which answers a full router's 429s itself), beside the gRPC server and
over the same Orchestrator. Errors use the OpenAI error object with an HTTP status per cause:
InvalidRequestError -> 400 (`param` names the field), an unknown model or URL -> 404, and a
RouterError by its code (RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504, else
500); on the Messages API's paths, Anthropic's error object for the same status
(router/anthropic_protocol.py). A streamed request reports errors before its first token as an
HTTP status and errors after it as an error event. A client that disconnects cancels its request: the orchestrator's
stream is closed, which aborts the request on the workers. A request is admitted (O(1), before its
body is read: a full router answers 429 with Retry-After whatever the body holds) and held to
router/request_limits.py's table before it is tokenized, in router/tokenizer_pool.py's pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.common.beam_search import STOP, Beam, BeamSearchParams, start
from splitserve.common.config import check_priority
from splitserve.common.errors import ContextLengthExceededError, InvalidRequestError
from splitserve.common.generation_config import NO_REQUEST_DEFAULTS, RequestDefaults
from splitserve.common.log_escape import quote_for_log
from splitserve.common.lora import LoRARequest
from splitserve.common.pooling import ModelPooling, PoolingParams, check_cross_encoder
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.stats import RequestParamsRecord
from splitserve.router.acceptor_process import RefusedRequest
from splitserve.router.access_log import log_refusal, refusal_fields
from splitserve.router.admission import RETRY_AFTER_S, TOO_MANY_REQUESTS, Admission
from splitserve.router.anthropic_protocol import (COUNT_TOKENS_PATH, INLINE_SYSTEM_PROBE, MESSAGES_PATH,
                                                  MessageHeader, MessagesRenderer, has_inline_system,
                                                  is_messages_path, merged_inline_system,
                                                  parse_count_tokens_request, parse_messages_request,
                                                  prompt_too_long_message)
from splitserve.router.anthropic_protocol import error_body as anthropic_error_body
from splitserve.router.anthropic_request_id import anthropic_request_id
from splitserve.router.auth import check_api_key
from splitserve.router.busy_refusal import RefusalRules, RefusalTemplate, uvicorn_status_line
from splitserve.router.openai_protocol import (ChatCompletionRequest, ChatInput, ChatRenderer, CompletionRenderer,
                                               CompletionRequest, EmbeddingRequest, ResponseHeader, error_body,
                                               parse_chat_request, parse_completion_request, parse_detokenize_request,
                                               parse_embedding_request, parse_tokenize_request)
from splitserve.router.api_types import GenerationInput, RouterError, StreamChunk, Usage
from splitserve.router.beam_search_run import BeamSearchResult, run_beam_search
from splitserve.router.embeddings import EmbeddingRenderer
from splitserve.router.http_access import RAN_REQUEST_ID_SCOPE_KEY, RefusalLog, header, route_path
from splitserve.router.pooling_api import (ClassifyRenderer, ClassifyRequest, PoolingRenderer, PoolingRequest,
                                           ScoreRenderer, ScoreRequest, parse_classify_request,
                                           parse_pooling_request, parse_rerank_request, parse_score_request)
from splitserve.router.fanout import IndexedChunk, best_of, by_choice, client_fan_out, merged_usage, sequence_inputs
from splitserve.router.http_options import HttpOptions
from splitserve.router.http_server import TAKEN_SLOT_STATE_KEY, AcceptorSetup, HttpServer, TakenSlot
from splitserve.router.lora_adapters import AdapterRegistry, UnknownAdapterError
from splitserve.router.orchestrator import Orchestrator
from splitserve.router.reasoning_parsers import ReasoningFormat, ReasoningOutput
from splitserve.router.request_body import BodyParser, MalformedBodyError, Parse, json_object
from splitserve.router.request_id_header import request_id_header, with_header_request_id
from splitserve.router.request_ids import ReservedRequestId
from splitserve.common.prompt_truncation import PromptTruncation
from splitserve.router.responses_protocol import ResponsesRenderer, ResponsesRequest, parse_responses_request
from splitserve.router.stream_interval import every_interval
from splitserve.router.tls import TlsConfig
from splitserve.router.tokenizer_pool import TokenizerPool
from splitserve.router.tool_parsers import ToolOutput
from splitserve.router.version import SERVER_VERSION

T = TypeVar("T")
logger = logging.getLogger(__name__)

_STATUS_BY_CODE = {"INVALID_ARGUMENT": 400, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
"""HTTP status of a RouterError by its gRPC code name; any other code is 500."""
_ERROR_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error", 504: "server_error"}
"""The error object's `type` by status; every 4xx not listed is an invalid_request_error."""
_DONE = b"data: [DONE]\n\n"
RESPONSES_INPUT_TOKENS_PATH = "/v1/responses/input_tokens"
CLIENT_CLOSED_STATUS = 499
"""Status recorded for a request whose client went away (nobody receives it)."""
CLIENT_CLOSED_MESSAGE = "the client closed the connection before its request was answered"


class ApiError(Exception):
    """Ends a request with an OpenAI error object and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 anthropic_message: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.anthropic_message = anthropic_message
        """The message in Anthropic's words where its API has its own (a prompt too long); None: `message`."""

    @classmethod
    def of(cls, error: Exception) -> ApiError:
        """The API error for anything a request's handling raised (unexpected ones are logged: 500)."""
        if isinstance(error, ApiError):
            return error
        if isinstance(error, MalformedBodyError):
            return cls(400, str(error), code="invalid_json")
        if isinstance(error, ContextLengthExceededError):
            return cls(400, str(error), error.field, error.code, prompt_too_long_message(error))
        if isinstance(error, InvalidRequestError):
            return cls(400, str(error), error.field, error.code)
        if isinstance(error, RouterError):
            return cls(_STATUS_BY_CODE.get(error.code, 500), error.message, code=error.code.lower())
        logger.error("request failed", exc_info=error)
        return cls(500, f"internal error: {type(error).__name__}: {error}", code="internal")

    def body(self) -> dict:
        error_type = _ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return error_body(self.message, error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        """A 429 carries Retry-After (as OpenAI's API does; its SDK and vLLM's clients back off by it)."""
        return self._response(self.body())

    def anthropic_body(self) -> dict:
        """The same error as Anthropic's error object (the Messages API's paths)."""
        return anthropic_error_body(self.status, self.anthropic_message or self.message)

    def anthropic_response(self) -> JSONResponse:
        return self._response(self.anthropic_body())

    def _response(self, body: dict) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else None
        return _AsciiJSONResponse(body, status_code=self.status, headers=headers)


def json_bytes(content: Any, separators: tuple[str, str] | None = (",", ":")) -> bytes:
    """`content` as UTF-8 JSON (what vLLM writes); one that echoes a lone surrogate a client sent (JSON's
    "\\ud800", which has no UTF-8 form: Responses' metadata or user) with every non-ASCII character
    escaped instead, valid JSON either way, never a 500."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=separators).encode()
    except UnicodeEncodeError:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=separators).encode("ascii")


class _JSONResponse(JSONResponse):
    """Starlette's JSON response, rendered by json_bytes."""

    def render(self, content: Any) -> bytes:
        return json_bytes(content)


class _AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error message may quote what the client sent
    (an unknown model name), and a lone surrogate from a JSON escape ("\\ud800") has no UTF-8 form,
    so JSONResponse's UTF-8 rendering would fail with a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


@dataclass(frozen=True)
class _Job:
    """A validated request, ready for the orchestrator."""

    ids: ReservedRequestId
    """The request's ids: the client's (responses carry it) and the internal one (each input's is it, or
    `<it>-<choice index>`: router/fanout.py); released when the request ends."""
    inputs: tuple[GenerationInput, ...]
    """One per sequence, prompt-major (router/fanout.py)."""
    num_sequences: int
    """Sequences generated per prompt (best_of)."""
    n: int
    """Choices returned per prompt: the best n of its sequences when fewer than num_sequences."""
    renderer: (CompletionRenderer | ChatRenderer | ResponsesRenderer | MessagesRenderer | EmbeddingRenderer
               | ClassifyRenderer | ScoreRenderer | PoolingRenderer)
    stream: bool
    beam_search: BeamSearchParams | None = None
    """use_beam_search: each prompt's n choices are its best n beams (inputs[::n] are the prompts')."""
    stream_interval: int = 1
    """A streamed sequence's tokens are sent every this many (router/stream_interval.py)."""

    def response(self, chunks: list[IndexedChunk]) -> dict:
        """The non-streaming response from every sequence's chunks."""
        sequences = by_choice(chunks, len(self.inputs))
        usage = merged_usage([sequence[-1].usage for sequence in sequences], self.num_sequences)
        choices = sequences if self.n == self.num_sequences else best_of(sequences, self.n, self.num_sequences)
        return self.renderer.response(choices, usage)

    def events(self, first: IndexedChunk, stream: AsyncGenerator[IndexedChunk, None]) -> AsyncGenerator[bytes, None]:
        """The streamed response's SSE body: Responses API events, Messages API events, or chat / completion chunks."""
        if isinstance(self.renderer, ResponsesRenderer):
            return _response_events(first, stream, self.renderer)
        if isinstance(self.renderer, MessagesRenderer):
            return _message_events(first, stream, self.renderer)
        return _events(first, stream, self)


@dataclass(frozen=True)
class _ChatInputs:
    """A chat request ready to run, and how its output is read."""

    ids: ReservedRequestId
    inputs: tuple[GenerationInput, ...]
    tool_output: ToolOutput | None
    reasoning_output: ReasoningOutput | None


class OpenAIServing:
    """The endpoints' handlers over one Orchestrator serving one model."""

    def __init__(self, orchestrator: Orchestrator, tokenizers: TokenizerPool, bodies: BodyParser, model_name: str,
                 request_timeout_s: float | None = None, aliases: tuple[str, ...] = (),
                 tool_call_parser: str | None = None, reasoning: ReasoningFormat | None = None,
                 defaults: RequestDefaults = NO_REQUEST_DEFAULTS, adapters: AdapterRegistry | None = None,
                 runtime_lora_updating: bool = False, options: HttpOptions = HttpOptions(),
                 pooling: ModelPooling | None = None) -> None:
        self.orchestrator = orchestrator
        self.pooling = pooling
        """How the model pools on a server whose workers run it as a pooling model (--runner pooling), which serves
        the pooling endpoints instead of the generation ones (_runner_routes); None on a generating server."""
        self.options = options
        """The server-wide choices in responses (--response-role ...)."""
        self.tokenizers = tokenizers
        self.bodies = bodies
        """Parses request bodies within the tokenizers' limits (the large ones in its process)."""
        self.model_name = model_name
        """What /v1/models lists and responses carry as `model`."""
        self.model_names = frozenset((model_name, *aliases))
        """Every name a request may give as `model` (--served-model-name)."""
        self.adapters = adapters or AdapterRegistry((), self.model_names)
        """LoRA adapters by name (--lora-modules; shared with the gRPC API): a request naming one as `model` runs
        it (vLLM's)."""
        self.runtime_lora_updating = runtime_lora_updating
        """Serve /v1/load_lora_adapter and /v1/unload_lora_adapter (router/lora_adapters.py's env gate)."""
        self.request_timeout_s = request_timeout_s
        """Server-side limit on a request's total time (router.request_timeout_s); None: no limit."""
        self.tool_call_parser = tool_call_parser
        """What reads tool calls out of a tool_choice "auto" output (a TOOL_CALL_PARSERS name); None:
        auto tool choice is off (a request asking for it is a 400, as in vLLM)."""
        self.reasoning = reasoning
        """What splits a chat's output into reasoning and content (--reasoning-parser); None: nothing does."""
        # The parsers with the server's sampling defaults bound (partials of module functions: the
        # body parser's process can still be told which one by name).
        self._parse_completion = functools.partial(parse_completion_request, defaults=defaults)
        self._parse_chat = functools.partial(parse_chat_request, defaults=defaults)
        self._parse_responses = functools.partial(parse_responses_request, defaults=defaults)
        self._parse_messages = functools.partial(parse_messages_request, defaults=defaults)
        self.created = int(time.time())

    # ---- endpoints ---------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, self._parse_completion, lambda parsed: self._completion_job(
            with_header_request_id(parsed, request.headers, self.bodies.limits)))

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, self._parse_chat, lambda parsed: self._chat_job(
            with_header_request_id(parsed, request.headers, self.bodies.limits)))

    async def responses(self, request: Request) -> Response:
        return await self._serve(request, self._parse_responses, self._responses_job)

    async def responses_input_tokens(self, request: Request) -> Response:
        """OpenAI's /v1/responses/input_tokens (the openai SDK's responses.input_tokens.count): a Responses
        request's prompt, as the chat template renders it for /v1/responses, counted."""
        try:
            chat = (await self._read_request(request, parse_responses_request)).chat
            self._check_model(chat.model)
            token_ids = await self.tokenizers.apply_chat_template([m.template_message() for m in chat.messages],
                                                                  chat.add_generation_prompt, chat.template)
            return _JSONResponse({"object": "response.input_tokens", "input_tokens": len(token_ids)})
        except ClientDisconnected:
            return _client_closed(request.scope)
        except Exception as error:
            return ApiError.of(error).response()

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API over the chat path (router/anthropic_protocol.py)."""
        return await self._serve(request, self._parse_messages, self._messages_job)

    async def count_tokens(self, request: Request) -> Response:
        """Anthropic's /v1/messages/count_tokens: {"input_tokens": the rendered chat's token count}."""
        try:
            parsed = await self._read_request(request, parse_count_tokens_request)
            self._check_model(parsed.model)
            parsed = await self._with_inline_system(parsed)
            token_ids = await self.tokenizers.apply_chat_template([m.template_message() for m in parsed.messages],
                                                                  parsed.add_generation_prompt, parsed.template)
            return _JSONResponse({"input_tokens": len(token_ids)})
        except ClientDisconnected:
            return _client_closed(request.scope)
        except Exception as error:
            return ApiError.of(error).anthropic_response()

    async def embeddings(self, request: Request) -> Response:
        return await self._serve(request, parse_embedding_request, self._embedding_job)

    async def classify(self, request: Request) -> Response:
        """vLLM's /classify (a sequence-classification model): router/pooling_api.py."""
        return await self._serve(request, parse_classify_request, self._classify_job)

    async def score(self, request: Request) -> Response:
        """vLLM's /score and /v1/score: router/pooling_api.py."""
        return await self._serve(request, parse_score_request, functools.partial(self._score_job, rerank=False))

    async def pooling_endpoint(self, request: Request) -> Response:
        """vLLM's /pooling (task embed or classify): router/pooling_api.py."""
        return await self._serve(request, parse_pooling_request, self._pooling_job)

    async def rerank(self, request: Request) -> Response:
        """vLLM's /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's shape): router/pooling_api.py."""
        return await self._serve(request, parse_rerank_request, functools.partial(self._score_job, rerank=True))

    async def models(self, request: Request) -> Response:
        cards = [self._model_card(), *(self._adapter_card(adapter) for adapter in self.adapters.loaded())]
        return _JSONResponse({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        try:
            adapter = self._adapter(request.path_params["model"])
        except ApiError as error:
            return error.response()
        return _JSONResponse(self._model_card() if adapter is None else self._adapter_card(adapter))

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's: {"lora_name", "lora_path"} -> 200 and a line of text; 400 naming the field it refuses."""
        try:
            body = json_object(await _read_body(request, self.bodies.limits.max_body_bytes))
            adapter = self.adapters.load(body.get("lora_name"), body.get("lora_path"))
        except Exception as error:
            return ApiError.of(error).response()
        logger.info("LoRA adapter %s loaded from %s (id %d)", quote_for_log(adapter.lora_name),
                    quote_for_log(adapter.lora_path), adapter.lora_int_id)
        return Response(f"Success: LoRA adapter '{adapter.lora_name}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's: {"lora_name"} -> 200 and a line of text; 404 when no adapter of that name is loaded."""
        try:
            body = json_object(await _read_body(request, self.bodies.limits.max_body_bytes))
            adapter = self.adapters.unload(body.get("lora_name"))
        except UnknownAdapterError as error:
            return ApiError(404, str(error), "lora_name", "model_not_found").response()
        except Exception as error:
            return ApiError.of(error).response()
        logger.info("LoRA adapter %s unloaded", quote_for_log(adapter.lora_name))
        return Response(f"Success: LoRA adapter '{adapter.lora_name}' removed successfully.", media_type="text/plain")

    async def version(self, request: Request) -> Response:
        return _JSONResponse({"version": SERVER_VERSION})

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a completion's `prompt` or a chat's `messages` (through the chat
        template, with the chat extensions) -> {count, max_model_len, tokens, token_strs}."""
        try:
            parsed = await self._read_request(request, parse_tokenize_request)
            self._check_model(parsed.model)
            if parsed.messages is None:
                token_ids = await self.tokenizers.encode(parsed.prompt, parsed.add_special_tokens)
            else:
                messages = [m.template_message() for m in parsed.messages]
                token_ids = await self.tokenizers.apply_chat_template(messages, parsed.add_generation_prompt,
                                                                      parsed.template)
            strings = self.tokenizers.tokenizer.token_strings(token_ids) if parsed.return_token_strs else None
            return _JSONResponse({"count": len(token_ids), "max_model_len": self.orchestrator.max_model_len,
                                 "tokens": list(token_ids), "token_strs": strings})
        except ClientDisconnected:
            return _client_closed(request.scope)
        except Exception as error:
            return ApiError.of(error).response()

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: {tokens} -> {prompt}, the text of the ids (special tokens kept)."""
        try:
            parsed = await self._read_request(request, parse_detokenize_request)
            self._check_model(parsed.model)
            return _JSONResponse({"prompt": self.tokenizers.tokenizer.decode(parsed.tokens, skip_special_tokens=False)})
        except ClientDisconnected:
            return _client_closed(request.scope)
        except Exception as error:
            return ApiError.of(error).response()

    async def health(self, request: Request) -> Response:
        """200 while new requests can be served (Orchestrator.is_ready), else 503 saying why."""
        orchestrator = self.orchestrator
        if orchestrator.is_ready:
            return Response(status_code=200)
        reason = "the router is draining (shutting down)" if not orchestrator.accepting else \
            "no decode worker is answering"
        return ApiError(503, reason, code="unavailable").response()

    async def _read_request(self, request: Request, parse: Parse[T]) -> T:
        """The body parsed by `parse`, refused by its size before it is read (RequestLimits.max_body_bytes);
        a large body is decoded and parsed in the body parser's process (router/request_body.py)."""
        body = await _read_body(request, self.bodies.limits.max_body_bytes)
        return await self.bodies.parse(parse, body)

    def _model_card(self) -> dict:
        """vLLM's card of the served model: `root` is the model directory, where `vllm bench serve` run
        without --model loads its tokenizer from (vLLM's is the model as given to `vllm serve`)."""
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "splitserve",
                "root": self.tokenizers.tokenizer.name, "parent": None,
                "max_model_len": self.orchestrator.max_model_len}

    def _adapter_card(self, adapter: LoRARequest) -> dict:
        """vLLM's card of a LoRA adapter: its name, its directory as `root`, the base model as `parent`."""
        return {"id": adapter.lora_name, "object": "model", "created": self.created, "owned_by": "splitserve",
                "root": adapter.lora_path, "parent": self.model_name, "max_model_len": self.orchestrator.max_model_len}

    # ---- one generation request --------------------------------------------------------
    async def _serve(self, request: Request, parse: Parse[T], prepare: Callable[[T], Awaitable[_Job]]) -> Response:
        """Run a request _AdmissionGate admitted; its admission slot is the orchestrator stream's to
        release once that stream started."""
        admission: Admission = request.scope[ADMISSION_SCOPE_KEY]
        job = None
        try:
            job = await prepare(await self._read_request(request, parse))
            request.scope[RAN_REQUEST_ID_SCOPE_KEY] = job.ids.client_request_id  # its record writes its access line
            logger.info("[%s] %s: %d prompt tokens, %d sequences", quote_for_log(job.inputs[0].request_id),
                        request.url.path, sum(len(inp.prompt_token_ids) for inp in job.inputs[::job.num_sequences]),
                        len(job.inputs))
            if job.beam_search is not None:
                return await self._respond_beam_search(request, job, admission)
            return await self._respond(request, job, admission)
        except BaseException as error:
            admission.release()  # refused while parsed, or its stream never started (else a no-op)
            if job is not None:
                job.ids.release()  # likewise
            if isinstance(error, ClientDisconnected):
                return _client_closed(request.scope)
            if isinstance(error, Exception):  # every failure is an error response; the server carries on
                return _error_response(request.scope, ApiError.of(error))
            raise

    async def _respond(self, request: Request, job: _Job, admission: Admission) -> Response:
        """Run the request; a streamed one starts its response once the first chunk is in, so an
        error before it (a bad prompt, a routing rejection) still gets its HTTP status."""
        stream = client_fan_out(self.orchestrator, job.ids, job.inputs, job.num_sequences, admission, job.n)
        if job.stream and job.stream_interval > 1:
            stream = every_interval(stream, job.stream_interval)
        try:
            if not job.stream:
                chunks = await _until_disconnect(request, _collect(stream))
                return _JSONResponse(job.response(chunks))
            first = await _until_disconnect(request, anext(stream))
        except BaseException:
            await stream.aclose()
            raise
        return _EventStream(job.events(first, stream))

    async def _respond_beam_search(self, request: Request, job: _Job, admission: Admission) -> Response:
        """Run each prompt's beam search (one after the other) while holding the request's slot, then answer
        with the best beams; a stream (chat's, as vLLM streams it) carries each beam whole in one chunk."""
        try:
            chunks = await _until_disconnect(request, self._beam_chunks(job))
        finally:
            admission.release()
            job.ids.release()
        if not job.stream:
            return _JSONResponse(job.response(chunks))
        return _EventStream(job.events(chunks[0], _replayed(chunks[1:])))

    async def _beam_chunks(self, job: _Job) -> list[IndexedChunk]:
        """Every choice as one finished chunk, prompt-major (choice p * n + i: prompt p's beam i, best first).
        The searches are the one request the client sent in the router's records, their beams its steps."""
        bases = job.inputs[::job.n]
        client = dataclasses.replace(bases[0], request_id=job.ids.request_id)
        with self.orchestrator.stepwise(client, sum(len(base.prompt_token_ids) for base in bases)) as recorded:
            chunks = []
            for prompt_index, base in enumerate(bases):
                chunks.extend(await self._beam_search(job, prompt_index, base))
            usage = merged_usage([item.chunk.usage for item in chunks], job.n)  # the response's
            longest = max(len(item.chunk.token_ids) for item in chunks)
            recorded.on_finished(chunks[0].chunk.finish_reason, usage.cached_tokens, usage.completion_tokens,
                                 time.monotonic(), RequestParamsRecord(job.n, job.beam_search.max_tokens, longest))
        return chunks

    async def _beam_search(self, job: _Job, prompt_index: int, base: GenerationInput) -> list[IndexedChunk]:
        """One prompt's best beams as its choices' chunks."""
        room = self.orchestrator.max_model_len - len(base.prompt_token_ids)  # the prompt leaves >= 1
        params = dataclasses.replace(job.beam_search, max_tokens=min(job.beam_search.max_tokens, room))
        result = await run_beam_search(self.orchestrator, base, start(params, base.prompt_token_ids,
                                                                      self._eos_token_id()), job.ids.request_id)
        return [IndexedChunk(prompt_index * job.n + i, self._beam_chunk(base, beam, result))
                for i, beam in enumerate(result.search.best())]

    def _beam_chunk(self, base: GenerationInput, beam: Beam, result: BeamSearchResult) -> StreamChunk:
        """A returned beam as its choice's only chunk: its text leaves out the EOS that completed it (vLLM's)."""
        ends_with_eos = beam.finish_reason == STOP and beam.token_ids[-1:] == (beam.stop_reason,)
        text_ids = beam.token_ids[:-1] if ends_with_eos else beam.token_ids  # include_stop_str_in_output kept it
        text = self.tokenizers.tokenizer.decode(text_ids, skip_special_tokens=base.sampling_params.skip_special_tokens)
        usage = Usage(len(base.prompt_token_ids), result.num_cached_tokens, len(beam.token_ids))
        return StreamChunk(base.request_id, beam.token_ids, text, (), beam.finish_reason, beam.stop_reason, usage)

    def _eos_token_id(self) -> int | None:
        """The tokenizer's EOS, which completes a beam (vLLM's tokenizer.eos_token_id); None when it has none."""
        tokenizer = self.tokenizers.tokenizer
        eos = tokenizer.special_tokens.get("eos_token")
        return None if eos is None else tokenizer.backend.token_to_id(eos)

    async def _completion_job(self, parsed: CompletionRequest) -> _Job:
        adapter = self._adapter(parsed.model)
        prompts = await self._token_ids(parsed.prompts, parsed.add_special_tokens)
        params = parsed.sampling
        if parsed.best_of > parsed.n and params.logprobs is None:  # best_of ranks by the sampled tokens' logprobs
            params = dataclasses.replace(params, logprobs=0)
        ids, inputs = await self._inputs(prompts, params, "prompt", parsed.request_id, parsed.best_of,
                                         parsed.truncation, parsed.cache_salt, parsed.priority, adapter)
        echo = [self._prompt_text(p) for p in parsed.prompts] if parsed.echo else ()
        renderer = CompletionRenderer(self._header("cmpl", ids.client_request_id, adapter),
                                      self._token_text(parsed.tokens_as_ids),
                                      parsed.include_usage, parsed.sampling.logprobs is not None, echo, parsed.n,
                                      _prompt_lengths(inputs) if parsed.continuous_usage else None,
                                      _echoed_token_ids(inputs, len(prompts), parsed.best_of) if parsed.echo else (),
                                      parsed.echo_only)
        renderer.with_prompt_tokens_details(self.options.enable_prompt_tokens_details)
        if parsed.return_token_ids:  # choice i is one of prompt i // n's sequences: inputs i // n * best_of on
            renderer.with_token_ids([inputs[i // parsed.n * parsed.best_of].prompt_token_ids
                                     for i in range(len(prompts) * parsed.n)])
        return _Job(ids, inputs, parsed.best_of, parsed.n, renderer, parsed.stream, parsed.beam_search,
                    parsed.stream_interval)

    async def _embedding_job(self, parsed: EmbeddingRequest) -> _Job:
        """Each input a pooling request of its own (fanned out as a completion's batched prompts are), its prompt
        tokenized (a chat's `messages`: rendered by the chat template), cut by truncate_prompt_tokens and checked (it
        may fill max_model_len)."""
        adapter = self._adapter(parsed.model)
        self.pooling.check_dimensions(parsed.pooling.dimensions, self.model_name)
        prompts, field = await self._pooled_prompts(parsed.inputs, parsed.add_special_tokens, parsed.chat)
        ids, inputs = await self._inputs(prompts, SamplingParams(max_tokens=1), field, parsed.request_id, 1,
                                         parsed.truncation, priority=parsed.priority, lora_request=adapter,
                                         pooling_params=parsed.pooling)
        renderer = EmbeddingRenderer(ids.client_request_id, int(time.time()), self._served_name(adapter),
                                     parsed.encoding_format)
        return _Job(ids, inputs, 1, 1, renderer, stream=False)

    async def _pooling_job(self, parsed: PoolingRequest) -> _Job:
        """/v1/embeddings' job with the model's task checked and vLLM's PoolingResponse."""
        model_task = "embed" if self.pooling.classifier is None else "classify"
        if parsed.task != model_task:
            raise InvalidRequestError("task", f"this model pools for {model_task!r} only, got {parsed.task!r}")
        job = await self._embedding_job(parsed.embedding)
        request = parsed.embedding
        renderer = PoolingRenderer(job.ids.client_request_id, int(time.time()), job.renderer.model,
                                   request.encoding_format, self.pooling.classifier, request.pooling.use_activation)
        return dataclasses.replace(job, renderer=renderer)

    async def _classify_job(self, parsed: ClassifyRequest) -> _Job:
        """Each input a pooling request whose vector is the classifier's logits; the renderer activates them."""
        adapter = self._adapter(parsed.model)
        prompts, field = await self._pooled_prompts(parsed.inputs, parsed.add_special_tokens, parsed.chat)
        ids, inputs = await self._inputs(prompts, SamplingParams(max_tokens=1), field, parsed.request_id, 1,
                                         parsed.truncation, priority=parsed.priority, lora_request=adapter,
                                         pooling_params=PoolingParams())
        renderer = ClassifyRenderer(ids.client_request_id, int(time.time()), self._served_name(adapter),
                                    self.pooling.classifier, parsed.use_activation)
        return _Job(ids, inputs, 1, 1, renderer, stream=False)

    async def _score_job(self, parsed: ScoreRequest, rerank: bool) -> _Job:
        """A cross-encoder (a classifier of one label) runs each pair as one prompt, its pair encoding; an embedding
        model embeds each first text and each second one (pooling_api.ScoreRenderer pairs them)."""
        adapter = self._adapter(parsed.model)
        classifier = self.pooling.classifier
        if classifier is not None:
            check_cross_encoder(classifier)
            prompts = [await self.tokenizers.encode_pair(first, second) for first, second in parsed.pairs]
        else:
            prompts = await self._token_ids([*parsed.firsts, *parsed.seconds], True)
        fields = parsed.input_fields(pairs=classifier is not None)
        ids, inputs = await self._inputs(prompts, SamplingParams(max_tokens=1), fields, parsed.request_id, 1,
                                         parsed.truncation, priority=parsed.priority, lora_request=adapter,
                                         pooling_params=PoolingParams())
        pad = self.tokenizers.tokenizer.pad_token_id
        renderer = ScoreRenderer(parsed, ids.client_request_id, int(time.time()), self._served_name(adapter),
                                 classifier, tuple(len(inp.prompt_token_ids) for inp in inputs), int(pad is not None),
                                 rerank)
        return _Job(ids, inputs, 1, 1, renderer, stream=False)

    async def _pooled_prompts(self, inputs: Sequence[str | tuple[int, ...]], add_special_tokens: bool,
                              chat: ChatInput | None) -> tuple[list[tuple[int, ...] | list[int]], str]:
        """A pooling request's prompts and the field they came from: its inputs tokenized, or its chat rendered by the
        chat template (one prompt)."""
        if chat is None:
            return await self._token_ids(inputs, add_special_tokens), "input"
        messages = [message.template_message() for message in chat.messages]
        return [await self.tokenizers.apply_chat_template(messages, chat.add_generation_prompt, chat.template)], \
            "messages"

    async def _chat_job(self, parsed: ChatCompletionRequest) -> _Job:
        chat = await self._chat_inputs(parsed, "messages")
        renderer = ChatRenderer(self._header("chatcmpl", chat.ids.client_request_id, chat.inputs[0].lora_request),
                                self._token_text(parsed.tokens_as_ids),
                                self.tokenizers.tokenizer.token_bytes, parsed.include_usage,
                                parsed.sampling.logprobs is not None,
                                _prompt_lengths(chat.inputs) if parsed.continuous_usage else None, chat.tool_output,
                                chat.reasoning_output, parsed.response_role(self.options.response_role),
                                parsed.echoed_text(self.options.response_role))
        renderer.with_prompt_tokens_details(self.options.enable_prompt_tokens_details)
        if parsed.return_token_ids:
            renderer.with_token_ids([chat.inputs[0].prompt_token_ids] * parsed.n)
        return _Job(chat.ids, chat.inputs, parsed.n, parsed.n, renderer, parsed.stream, parsed.beam_search,
                    parsed.stream_interval)

    async def _responses_job(self, parsed: ResponsesRequest) -> _Job:
        chat = await self._chat_inputs(parsed.chat, "input")
        header = ResponseHeader(f"resp_{chat.ids.client_request_id}", int(time.time()),
                                self._served_name(chat.inputs[0].lora_request), self.system_fingerprint)
        renderer = ResponsesRenderer(header, parsed.chat, parsed.settings, chat.tool_output, chat.reasoning_output)
        return _Job(chat.ids, chat.inputs, 1, 1, renderer, parsed.chat.stream)

    async def _messages_job(self, parsed: ChatCompletionRequest) -> _Job:
        chat = await self._chat_inputs(await self._with_inline_system(parsed), "messages")
        header = MessageHeader(f"msg_{chat.ids.client_request_id}", self._served_name(chat.inputs[0].lora_request),
                               len(chat.inputs[0].prompt_token_ids), self.options.enable_prompt_tokens_details)
        return _Job(chat.ids, chat.inputs, 1, 1, MessagesRenderer(header, chat.tool_output, chat.reasoning_output),
                    parsed.stream)

    async def _with_inline_system(self, parsed: ChatCompletionRequest) -> ChatCompletionRequest:
        """A Messages chat's system messages after the first merged into one first when its template refuses them
        there (vLLM's probe and fallback); else as it is."""
        if not has_inline_system(parsed):
            return parsed
        try:
            await self.tokenizers.apply_chat_template(INLINE_SYSTEM_PROBE, False, parsed.template)
            return parsed
        except InvalidRequestError:
            return merged_inline_system(parsed)

    async def _chat_inputs(self, parsed: ChatCompletionRequest, prompt_param: str) -> _ChatInputs:
        """A chat's inputs and how its output is read; `prompt_param`: the field its messages came
        from, named by a prompt that does not fit."""
        adapter = self._adapter(parsed.model)
        harmony_content = self.reasoning is not None and self.reasoning.writes_harmony_calls
        tool_output = None if parsed.tool_calling is None else ToolOutput.for_request(parsed.tool_calling,
                                                                                      self.tool_call_parser,
                                                                                      harmony_content)
        messages = [m.template_message() for m in parsed.messages]
        token_ids = await self.tokenizers.apply_chat_template(messages, parsed.add_generation_prompt, parsed.template)
        if parsed.truncation is not None:  # before the reasoning parser reads where the prompt ends
            token_ids = parsed.truncation.applied(token_ids)
        sampling = parsed.sampling if tool_output is None else tool_output.sampling(parsed.sampling)
        reasoning_output = None
        if self.reasoning is not None:
            reasoning_output = self.reasoning.for_request(token_ids, parsed.template.template_kwargs,
                                                          parsed.include_reasoning)
            sampling = reasoning_output.sampling(sampling)
        ids, inputs = await self._inputs([token_ids], sampling, prompt_param, parsed.request_id, parsed.n,
                                         cache_salt=parsed.cache_salt, priority=parsed.priority, lora_request=adapter)
        return _ChatInputs(ids, inputs, tool_output, reasoning_output)

    def _prompt_text(self, prompt: str | tuple[int, ...]) -> str:
        """What echo repeats: a text prompt as sent, token ids as their text (special tokens kept)."""
        return prompt if isinstance(prompt, str) else self.tokenizers.tokenizer.decode(prompt,
                                                                                        skip_special_tokens=False)

    def _check_model(self, model: str | None) -> None:
        """404 unless `model` is None (the served model), one of its names, or a LoRA adapter's."""
        self._adapter(model)

    def _adapter(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names, None for the base model (or no model named); 404 for anything else."""
        adapter = self.adapters.get(model)
        if adapter is not None:
            return adapter
        if model is not None and model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                           "model", "model_not_found")
        return None

    def _served_name(self, adapter: LoRARequest | None) -> str:
        """What a response carries as `model`: the adapter's name when one ran (vLLM's), else the model's."""
        return self.model_name if adapter is None else adapter.lora_name

    async def _inputs(self, prompts: list[tuple[int, ...]], params: SamplingParams,
                      prompt_param: str | Sequence[str], request_id: str, num_sequences: int,
                      truncation: PromptTruncation | None = None, cache_salt: str | None = None,
                      priority: int = 0,
                      lora_request: LoRARequest | None = None,
                      pooling_params: PoolingParams | None = None
                      ) -> tuple[ReservedRequestId, tuple[GenerationInput, ...]]:
        """Cut each prompt as `truncation` says, check it (`prompt_param`: the body field it came
        from; `[i]` names one of a batch; a sequence: each prompt's own field);
        then (the request's ids, reserved last: nothing after can fail before the
        caller holds them; one input per sequence). A max_tokens longer than the context leaves ends there (vLLM's).
        `request_id`: the client's ("": new);
        `cache_salt`: the request's (every sequence's) prefix-cache salt; `priority`: its (every
        sequence's) scheduling priority; `lora_request`: the adapter every sequence runs with (None: the
        base model); `pooling_params`: an embedding request's (each prompt may then fill max_model_len)."""
        params = await self.tokenizers.tokenize_bad_words(params)
        if truncation is not None:
            prompts = [truncation.applied(tuple(p)) for p in prompts]
        for index, token_ids in enumerate(prompts):
            field = prompt_param[index] if not isinstance(prompt_param, str) else \
                prompt_param if len(prompts) == 1 else f"{prompt_param}[{index}]"
            self.orchestrator.validate_prompt(token_ids, field, pools=pooling_params is not None)
        check_priority(priority, self.orchestrator.scheduling_policy)  # as generate() does, before the request runs
        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        ids = self.orchestrator.new_request_id(request_id, len(prompts) * num_sequences)
        base = GenerationInput(ids.request_id, prompts[0], params, deadline, cache_salt=cache_salt, priority=priority,
                               lora_request=lora_request, client_request_id=ids.renamed_from,
                               pooling_params=pooling_params)
        return ids, sequence_inputs(base, prompts, num_sequences)

    async def _token_ids(self, prompts: Sequence[str | tuple[int, ...]], add_special_tokens: bool
                         ) -> list[tuple[int, ...] | list[int]]:
        """Each prompt's token ids: a text prompt tokenized (in the tokenizer pool), token ids as they are."""
        return [prompt if isinstance(prompt, tuple) else await self.tokenizers.encode(prompt, add_special_tokens)
                for prompt in prompts]

    def _header(self, prefix: str, request_id: str, adapter: LoRARequest | None = None) -> ResponseHeader:
        return ResponseHeader(f"{prefix}-{request_id}", int(time.time()), self._served_name(adapter),
                              self.system_fingerprint)

    @functools.cached_property
    def system_fingerprint(self) -> str:
        """`fp_` and a hash of what decides the output besides the request: the server's version
        and the workers' KV layout (which names the model's fingerprint, dtype and block size)."""
        layout = self.orchestrator.layout
        digest = hashlib.sha256(f"{SERVER_VERSION}|{self.model_name}|{layout!r}".encode()).hexdigest()
        return f"fp_{digest[:12]}"

    def _token_text(self, as_ids: bool | None) -> Callable[[int], str]:
        """How a logprob's token reads: "token_id:<id>" when the request asks (None: the server's
        --return-tokens-as-token-ids says), else its text."""
        if self.options.return_tokens_as_token_ids if as_ids is None else as_ids:
            return lambda token_id: f"token_id:{token_id}"
        return lambda token_id: self.tokenizers.tokenizer.decode([token_id], skip_special_tokens=False)


# ---- request and response plumbing ----------------------------------------------------------

def _echoed_token_ids(inputs: Sequence[GenerationInput], num_prompts: int, best_of: int) -> list[tuple[int, ...]]:
    """Each prompt's token ids as its sequences run them (prompt i's are inputs i * best_of on)."""
    return [inputs[i * best_of].prompt_token_ids for i in range(num_prompts)]


def _prompt_lengths(inputs: Sequence[GenerationInput]) -> list[int]:
    """Each choice's prompt tokens (inputs are one per choice when a stream reports usage per chunk:
    best_of above n does not stream)."""
    return [len(inp.prompt_token_ids) for inp in inputs]


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) as soon as it is known to exceed `limit` bytes: by its
    Content-Length before anything is read, else by the bytes received so far."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    body = bytearray()
    try:
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise _too_large(len(body), limit)
    except ClientDisconnect:
        raise ClientDisconnected() from None
    return bytes(body)


def _too_large(num_bytes: int, limit: int) -> ApiError:
    return ApiError(413, f"request body has {num_bytes} bytes; a servable request has at most {limit} (its prompts "
                         "are bounded by router.max_prompt_bytes and max_model_len)", code="request_too_large")


async def _collect(stream: AsyncIterator[T]) -> list[T]:
    return [chunk async for chunk in stream]


async def _replayed(items: Sequence[T]) -> AsyncGenerator[T, None]:
    """Items already at hand as a stream."""
    for item in items:
        yield item


async def _wait_for_disconnect(request: Request) -> None:
    """Returns once the client has gone (call after the body was read: nothing else is received)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (which closes the orchestrator's
    stream it is reading, aborting the request on the workers) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()  # no-op when done
        watcher.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task in done:
        return task.result()
    raise ClientDisconnected()


def _sse(body: dict) -> bytes:
    return b"data: " + json_bytes(body, separators=None) + b"\n\n"


async def _events(first: IndexedChunk, stream: AsyncGenerator[IndexedChunk, None],
                  job: _Job) -> AsyncGenerator[bytes, None]:
    """The SSE body: every choice's chunk events as they come, the usage event if asked for, an
    error event if the request fails mid-stream, then [DONE]. Closing it closes every sequence."""
    renderer = job.renderer
    usages: dict[int, Usage] = {}
    try:
        for body in renderer.stream_chunks(first.index, first.chunk):
            yield _sse(body)
        if first.chunk.usage is not None:
            usages[first.index] = first.chunk.usage
        async for item in stream:
            for body in renderer.stream_chunks(item.index, item.chunk):
                yield _sse(body)
            if item.chunk.usage is not None:
                usages[item.index] = item.chunk.usage
        if renderer.include_usage:
            yield _sse(renderer.usage_chunk(merged_usage([usages[i] for i in sorted(usages)], job.num_sequences)))
    except Exception as error:
        yield _sse(ApiError.of(error).body())
    finally:
        await stream.aclose()
    yield _DONE


def _named_sse(event: dict) -> bytes:
    """A Responses or Messages API event: its type as the SSE event name (OpenAI's and Anthropic's framing)."""
    return f"event: {event['type']}\n".encode() + _sse(event)


async def _named_events(first: IndexedChunk, stream: AsyncGenerator[IndexedChunk, None],
                        renderer: ResponsesRenderer | MessagesRenderer,
                        error_event: Callable[[ApiError], dict]) -> AsyncGenerator[bytes, None]:
    """The SSE body of the APIs whose events are named (the Responses API, Anthropic's Messages API): the
    renderer's opening events, its chunks' events (the last one ends the response), or `error_event` of the
    error if the request fails mid-stream. No [DONE] (neither OpenAI nor Anthropic sends one there). Closing
    it closes the request's stream."""
    try:
        for event in renderer.opening_events() + renderer.stream_events(first.chunk):
            yield _named_sse(event)
        async for item in stream:
            for event in renderer.stream_events(item.chunk):
                yield _named_sse(event)
    except Exception as error:
        yield _named_sse(error_event(ApiError.of(error)))
    finally:
        await stream.aclose()


def _response_events(first: IndexedChunk, stream: AsyncGenerator[IndexedChunk, None],
                     renderer: ResponsesRenderer) -> AsyncGenerator[bytes, None]:
    """The Responses API's SSE body; a failure mid-stream is OpenAI's `error` event."""
    return _named_events(first, stream, renderer, lambda error: {
        "type": "error", "code": error.code, "message": error.message, "param": error.param,
        "sequence_number": renderer.next_sequence_number})


def _message_events(first: IndexedChunk, stream: AsyncGenerator[IndexedChunk, None],
                    renderer: MessagesRenderer) -> AsyncGenerator[bytes, None]:
    """The Messages API's SSE body; a failure mid-stream is Anthropic's `error` event."""
    return _named_events(first, stream, renderer, ApiError.anthropic_body)


def _error_response(scope: Scope, error: ApiError) -> JSONResponse:
    """Anthropic's error object on the Messages API's paths, OpenAI's everywhere else."""
    return error.anthropic_response() if is_messages_path(route_path(scope)) else error.response()


def _client_closed(scope: Scope) -> JSONResponse:
    """The answer to a request whose client went away: nobody receives it, but its message is the error of the
    access log's `refused` line when the request had not run yet (router/http_access.py reads it from the body)."""
    return _error_response(scope, ApiError(CLIENT_CLOSED_STATUS, CLIENT_CLOSED_MESSAGE, code="cancelled"))


class _EventStream(StreamingResponse):
    """text/event-stream whose body is always closed, however the response ends: on a client
    disconnect Starlette cancels the sending loop, which would otherwise leave the body (and the
    orchestrator's stream inside it) suspended until garbage collection."""

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Starlette's own errors (unknown URL, wrong method) as OpenAI (or, on the Messages API's paths,
    Anthropic) error objects."""
    if error.status_code == 404:
        return _error_response(request.scope, ApiError(404, f"Invalid URL ({request.method} {request.url.path})",
                                                       code="unknown_url"))
    response = _error_response(request.scope, ApiError(error.status_code, str(error.detail)))
    response.headers.update(error.headers or {})
    return response


class _AsgiRoute:
    """An ASGI app as a Route endpoint: Route treats a plain function as a request handler, and
    prometheus_client's app is one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
CLASSIFY_PATH = "/classify"
POOLING_PATH = "/pooling"
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", MESSAGES_PATH,
                              "/v1/embeddings", CLASSIFY_PATH, POOLING_PATH, *SCORE_PATHS, *RERANK_PATHS})
ADMISSION_SCOPE_KEY = "splitserve.admission"
"""The ASGI scope key under which _AdmissionGate hands an admitted request's slot to its handler."""


class _AdmissionGate:
    """Admits a generation request (POST on GENERATION_PATHS) before any framework work: a full or
    draining router answers 429 / 503 from here, without routing, a Request object or reading the
    body, which is most of what a rejection cost under a burst (bench/admission_burst.py).

    An admitted request's slot rides in the scope to OpenAIServing._serve, which hands it to the
    request's stream. The gate releases it too, as the answer's last part goes out and when the app
    returns: nothing on the paths where the stream or the handler's failure released it already
    (release is idempotent), the slot itself on those that never do (a 404 of a path this server does
    not serve). Never after the answer's end: a client may send its next request the moment it has it,
    and the acceptor process, which learns of free slots from releases, must know this one is free."""

    def __init__(self, app: ASGIApp, orchestrator: Orchestrator) -> None:
        self.app = app
        self._orchestrator = orchestrator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        taken: TakenSlot | None = scope.get("state", {}).get(TAKEN_SLOT_STATE_KEY)
        admission = None if taken is None else taken.take()
        try:
            if admission is None:
                admission = self._orchestrator.admit()
        except RouterError as error:
            await _error_response(scope, ApiError.of(error))(scope, receive, send)
            return
        scope[ADMISSION_SCOPE_KEY] = admission

        async def release_before_the_end(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                admission.release()
            await send(message)

        try:
            await self.app(scope, receive, release_before_the_end)
        finally:
            admission.release()


async def busy_refusal_rules(orchestrator: Orchestrator, api_key: str | None, options: HttpOptions) -> RefusalRules:
    """What the acceptor process needs to refuse a full router's requests as the app does: the answer on each
    gated path, rendered by the same layers build_app puts around _AdmissionGate (for a request without
    headers: no Origin, no ids), and the key (uvicorn's own headers are HttpServer's to fill in)."""
    rejection = orchestrator.admission.capacity_rejection()
    error = ApiError.of(RouterError(rejection.code, rejection.message, rejection.reason))

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        await _error_response(scope, error)(scope, receive, send)

    app = _edge_layers(refuse, None, dataclasses.replace(options, access_log=False))
    templates = {path: await _rendered_refusal(app, options.root_path, path) for path in sorted(GENERATION_PATHS)}
    return RefusalRules(templates, api_key, uvicorn_headers=())


async def _rendered_refusal(app: ASGIApp, root_path: str, path: str) -> RefusalTemplate:
    """`app`'s answer to a header-less POST on `path`, as uvicorn's scope would carry it."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "root_path": root_path, "path": root_path + path, "raw_path": (root_path + path).encode(),
             "query_string": b"", "headers": [], "client": None, "server": None}
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start, body = sent[0], b"".join(message.get("body", b"") for message in sent[1:])
    return RefusalTemplate(uvicorn_status_line(start["status"]), tuple(start["headers"]), body)


def account_busy_refusals(orchestrator: Orchestrator, access_log: bool, refused: list[RefusedRequest],
                          unlogged: int) -> None:
    """What _AdmissionGate's layers do for a request the acceptor process refused (its 429 already sent):
    count the rejection and write the refused line; for the `unlogged` refusals the acceptor held no record of
    (the router did not read them in time: acceptor_process.MAX_HELD_REFUSALS), count them and say so once."""
    orchestrator.count_rejection(TOO_MANY_REQUESTS, len(refused) + unlogged)
    if not access_log:
        return
    message = orchestrator.admission.capacity_rejection().message
    for request in refused:
        log_refusal(refusal_fields("POST", request.path, 429, message, None, request.request_id,
                                   request.anthropic_request_id))
    if unlogged:
        logger.warning("%d requests the HTTP acceptor refused (429) have no line in the access log: the router did "
                       "not take their records in time", unlogged)


GUARDED_PATHS = frozenset({"/v1", "/tokenize", "/detokenize", CLASSIFY_PATH, POOLING_PATH, "/score", "/rerank",
                           "/v2/rerank"})
"""Paths outside /v1/ that need the API key: they run the tokenizer or the model (vLLM leaves them open)."""


class _ApiKeyGuard:
    """Requires `Authorization: Bearer <key>` or `x-api-key: <key>` (what the Anthropic SDKs send) on /v1/*,
    /tokenize and /detokenize (401 with an error object otherwise); /health, /ping, /version and /metrics
    stay open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if path in GUARDED_PATHS or path.startswith("/v1/"):
            reason = check_api_key(header(scope, b"authorization"), header(scope, b"x-api-key"), self._api_key)
            if reason is not None:
                response = _error_response(scope, ApiError(401, reason, code="invalid_api_key"))
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(serving: OpenAIServing, metrics_app: ASGIApp | None = None, api_key: str | None = None,
              options: HttpOptions = HttpOptions()) -> ASGIApp:
    """The HTTP API's routes; `metrics_app` (the router's Prometheus exposition) is served on /metrics.
    With `api_key`, /v1/* needs `Authorization: Bearer <api_key>`. options.cors says which origins'
    browsers may call it; CORS is outermost, as vLLM's, so a preflight is answered (200, or 400 for an
    origin not allowed) before the API-key check and admission (it is no request of the API: never
    429, never in the access log), and even a 401 or 429 carries the CORS headers."""
    routes = [*_runner_routes(serving),
              Route("/v1/models", serving.models, methods=["GET"]),
              Route("/v1/models/{model:path}", serving.model, methods=["GET"]),
              Route("/tokenize", serving.tokenize, methods=["POST"]),
              Route("/detokenize", serving.detokenize, methods=["POST"]),
              Route("/version", serving.version, methods=["GET"]),
              Route("/health", serving.health, methods=["GET"]),
              Route("/ping", serving.health, methods=["GET", "POST"])]  # vLLM's /health for SageMaker
    if serving.runtime_lora_updating:  # vLLM serves these only when its environment variable allows it
        routes += [Route("/v1/load_lora_adapter", serving.load_lora_adapter, methods=["POST"]),
                   Route("/v1/unload_lora_adapter", serving.unload_lora_adapter, methods=["POST"])]
    if metrics_app is not None:
        routes.append(Route("/metrics", _AsgiRoute(metrics_app), methods=["GET"]))
    app = _AdmissionGate(Starlette(routes=routes, exception_handlers={HTTPException: _http_error}),
                         serving.orchestrator)
    return _edge_layers(app, api_key, options)


def _edge_layers(app: ASGIApp, api_key: str | None, options: HttpOptions) -> ASGIApp:
    """The layers around the admission gate, innermost first: the API key, the ids, the refused line, CORS."""
    app = _ApiKeyGuard(app, api_key) if api_key else app
    app = anthropic_request_id(app)
    app = RefusalLog(app) if options.access_log else app
    cors = options.cors
    app = CORSMiddleware(app, allow_origins=list(cors.allowed_origins), allow_methods=list(cors.allowed_methods),
                         allow_headers=list(cors.allowed_headers), allow_credentials=cors.allow_credentials)
    return request_id_header(app) if options.request_id_headers else app


def _runner_routes(serving: OpenAIServing) -> list[Route]:
    """The endpoints of what the workers run the model as: generation (completions, chat, responses) or, with
    --runner pooling, the pooling endpoints: /v1/embeddings, /score and /rerank on an embedding model, /classify,
    /score and /rerank on a sequence-classification one. The others answer 404 as vLLM's (which does not serve them
    either), saying why."""
    generation = [Route("/v1/completions", serving.completions, methods=["POST"]),
                  Route("/v1/chat/completions", serving.chat_completions, methods=["POST"]),
                  Route("/v1/responses", serving.responses, methods=["POST"]),
                  Route(RESPONSES_INPUT_TOKENS_PATH, serving.responses_input_tokens, methods=["POST"]),
                  Route(MESSAGES_PATH, serving.messages, methods=["POST"]),
                  Route(COUNT_TOKENS_PATH, serving.count_tokens, methods=["POST"])]
    embeddings = [Route("/v1/embeddings", serving.embeddings, methods=["POST"])]
    classify = [Route(CLASSIFY_PATH, serving.classify, methods=["POST"])]
    scores = [*(Route(path, serving.score, methods=["POST"]) for path in SCORE_PATHS),
              *(Route(path, serving.rerank, methods=["POST"]) for path in RERANK_PATHS),
              Route(POOLING_PATH, serving.pooling_endpoint, methods=["POST"])]
    if serving.pooling is None:
        return generation + [_not_served(route.path, "this server generates (--runner generate); start it with "
                                                     "--runner pooling to serve pooling endpoints")
                             for route in [*embeddings, *classify, *scores]]
    pooling = "this server runs its model as a pooling model (--runner pooling), which serves"
    if serving.pooling.classifier is None:
        return embeddings + scores + [_not_served(route.path, f"{pooling} /v1/embeddings, /score, /rerank and /pooling")
                                      for route in [*generation, *classify]]
    return classify + scores + [_not_served(route.path, f"{pooling} /classify, /score, /rerank and "
                                                        f"/pooling (a sequence-classification model)")
                                for route in [*generation, *embeddings]]


def _not_served(path: str, reason: str) -> Route:
    async def refuse(request: Request) -> Response:
        error = ApiError(404, f"Invalid URL (POST {path}): {reason}", code="unknown_url")
        return _error_response(request.scope, error)

    return Route(path, refuse, methods=["POST"])


async def start_http_server(orchestrator: Orchestrator, tokenizers: TokenizerPool, model_name: str,
                            host: str = "127.0.0.1", port: int = 8000, request_timeout_s: float | None = None,
                            metrics_app: ASGIApp | None = None, api_key: str | None = None,
                            tls: TlsConfig | None = None, aliases: tuple[str, ...] = (),
                            reuse_port: bool = False, options: HttpOptions = HttpOptions(),
                            tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                            defaults: RequestDefaults = NO_REQUEST_DEFAULTS,
                            adapters: AdapterRegistry | None = None, runtime_lora_updating: bool = False,
                            pooling: ModelPooling | None = None) -> HttpServer:
    """Start the OpenAI-compatible API on the running loop; the server's `port` is the bound one.
    With `api_key`, /v1/* needs `Authorization: Bearer <api_key>`; with `tls`, it is HTTPS only.
    Requests may name the model `model_name` or one of `aliases`. `reuse_port`: share the port
    with other routers (SO_REUSEPORT). `options`: the HTTP layer's settings (CORS...). `tool_call_parser`: the
    parser of tool_choice "auto" outputs (router/tool_parsers.py); None turns auto tool choice off.
    `reasoning_parser`: splits chat outputs into reasoning and content (router/reasoning_parsers.py);
    ValueError when the tokenizer lacks its tags. `defaults`: what the sampling fields a generation
    request leaves unset take (--generation-config). `adapters`: the LoRA adapters a request may name as
    `model` (--lora-modules; the workers' engines need enable_lora); `runtime_lora_updating`: also serve
    /v1/load_lora_adapter and /v1/unload_lora_adapter (router/lora_adapters.py). `pooling`: the workers run the model
    as a pooling model (--runner pooling): the pooling endpoints are served instead of the generation ones."""
    reasoning = None if reasoning_parser is None else ReasoningFormat.for_tokenizer(
        reasoning_parser, tokenizers.tokenizer.backend.token_to_id)
    bodies = BodyParser(tokenizers.limits)
    serving = OpenAIServing(orchestrator, tokenizers, bodies, model_name, request_timeout_s, aliases, tool_call_parser,
                            reasoning, defaults, adapters, runtime_lora_updating, options, pooling)
    acceptor = None
    if options.acceptor_process and tls is None and orchestrator.admission.max_in_flight is not None:
        # with TLS the loop accepts (HttpServer: the acceptor would have to do the handshake); with no limit the
        # acceptor would only hand everything on
        acceptor = AcceptorSetup(await busy_refusal_rules(orchestrator, api_key, options), orchestrator.admission,
                                 orchestrator.take_free_slot,
                                 functools.partial(account_busy_refusals, orchestrator, options.access_log))
    server = HttpServer(build_app(serving, metrics_app, api_key, options), tls=tls, on_stop=bodies.close,
                        root_path=options.root_path, log_level=options.uvicorn_log_level, acceptor=acceptor)
    try:
        await server.start(host, port, reuse_port)
    except BaseException:
        bodies.close()
        raise
    return server
