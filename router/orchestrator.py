"""Per-request orchestration at the router: prefill -> KV transfer -> decode, streamed.

Runs on the router's event loop and never blocks it: every worker call is awaited. The
router owns stop strings and detokenization (workers get sampling params without stop
strings), and ends a request on every path — finish, stop string, client cancel, deadline,
worker fault — by aborting whatever the workers still hold for it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from splitserve.common.detokenizer import Decoder, IncrementalDetokenizer
from splitserve.common.errors import InvalidRequestError
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.token_logprobs import TokenLogprobs
from splitserve.common.worker_messages import DecodeRequest, PrefillRequest, PrefillResult, TokenDelta, WorkerInfo
from splitserve.router.dispatcher import OutputDispatcher
from splitserve.router.policy import WorkerLoad, pick_least_loaded
from splitserve.router.worker_client import WorkerClient

T = TypeVar("T")
logger = logging.getLogger(__name__)
MODES = ("disaggregated", "colocated")


class RouterError(Exception):
    """Ends a stream with a gRPC status code name and a message for the client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class GenerationInput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    deadline: float | None = None
    """time.monotonic() after which the request ends with DEADLINE_EXCEEDED."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Timing:
    queue_s: float
    prefill_s: float
    transfer_s: float
    first_token_s: float
    total_s: float


@dataclass(frozen=True)
class StreamChunk:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: Usage | None = None
    timing: Timing | None = None


class WorkerPool:
    """Worker clients of one role and this router's in-flight count on each."""

    def __init__(self, clients: Sequence[WorkerClient]) -> None:
        self.clients = {client.worker_id: client for client in clients}
        self._in_flight = dict.fromkeys(self.clients, 0)
        self._turn = 0

    def acquire(self) -> WorkerClient:
        if not self.clients:
            raise RouterError("UNAVAILABLE", "no healthy worker in the pool")
        loads = [WorkerLoad(worker_id, count) for worker_id, count in self._in_flight.items()]
        worker_id = pick_least_loaded(loads, self._turn)
        self._turn += 1
        self._in_flight[worker_id] += 1
        return self.clients[worker_id]

    def release(self, client: WorkerClient) -> None:
        self._in_flight[client.worker_id] -= 1


class _Run:
    """One request's progress at the router."""

    def __init__(self, inp: GenerationInput, tokenizer: Decoder, worker_request_id: str) -> None:
        self.inp = inp
        self.worker_request_id = worker_request_id
        """The id workers know the request by: unique across routers and clients (a client's own
        id may repeat after it finishes, or collide with another client's)."""
        self.arrival = time.monotonic()
        params = inp.sampling_params
        self.detokenizer = IncrementalDetokenizer(tokenizer, list(inp.prompt_token_ids), params.stop,
                                                  params.skip_special_tokens)
        self.workers: list[WorkerClient] = []
        self.worker_finished = False
        self.finish_reason: str | None = None
        self.output_token_ids: list[int] = []
        self.num_cached_tokens = 0
        self.queue_s = self.prefill_s = self.transfer_s = 0.0
        self.first_token_at: float | None = None

    async def bounded(self, awaitable: Awaitable[T]) -> T:
        """Await within the request's deadline."""
        if self.inp.deadline is None:
            return await awaitable
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + self.inp.deadline - time.monotonic()):
                return await awaitable
        except TimeoutError:
            raise RouterError("DEADLINE_EXCEEDED", "the request's deadline passed") from None

    def on_tokens(self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], finish_reason: str | None,
                  stop_reason: int | str | None) -> StreamChunk:
        """Detokenize new tokens, cutting at a stop string; a finish here ends the stream."""
        emitted = []
        for token_id in token_ids:
            emitted.append(token_id)
            stop_string = self.detokenizer.append(token_id)
            if stop_string is not None:
                finish_reason, stop_reason = "stop", stop_string
                break
        self.output_token_ids.extend(emitted)
        if self.first_token_at is None and emitted:
            self.first_token_at = time.monotonic()
        self.finish_reason = finish_reason
        text = self.detokenizer.take_delta(finish_reason is not None)
        if finish_reason is None:
            return StreamChunk(self.inp.request_id, tuple(emitted), text, tuple(logprobs[:len(emitted)]))
        return StreamChunk(self.inp.request_id, tuple(emitted), text, tuple(logprobs[:len(emitted)]),
                           finish_reason, stop_reason, self._usage(), self._timing())

    def _usage(self) -> Usage:
        return Usage(len(self.inp.prompt_token_ids), self.num_cached_tokens, len(self.output_token_ids))

    def _timing(self) -> Timing:
        now = time.monotonic()
        first = (self.first_token_at or now) - self.arrival
        return Timing(self.queue_s, self.prefill_s, self.transfer_s, first, now - self.arrival)


class Orchestrator:
    def __init__(self, router_id: str, prefill: Sequence[WorkerClient], decode: Sequence[WorkerClient],
                 tokenizer: Decoder, mode: str = "disaggregated") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not decode or (mode == "disaggregated" and not prefill):
            raise ValueError(f"{mode} mode needs at least one decode worker"
                             + (" and one prefill worker" if mode == "disaggregated" else ""))
        self.router_id = router_id
        self.mode = mode
        self.tokenizer = tokenizer
        self.prefill_pool = WorkerPool(prefill if mode == "disaggregated" else ())
        self.decode_pool = WorkerPool(decode)
        self.dispatcher = OutputDispatcher(router_id, decode)
        self.infos: dict[str, WorkerInfo] = {}
        self.max_model_len = 0
        self.vocab_size = 0
        self._in_flight: set[str] = set()
        self._peers: dict[tuple[str, str], asyncio.Future] = {}
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Learn every worker's limits and start collecting decode outputs."""
        clients = [*self.prefill_pool.clients.values(), *self.decode_pool.clients.values()]
        infos = await asyncio.gather(*(client.call("info") for client in clients))
        self.infos = {info.worker_id: info for info in infos}
        self.max_model_len = min(info.max_model_len for info in infos)
        self.vocab_size = min(info.vocab_size for info in infos)
        self.dispatcher.start()

    async def stop(self) -> None:
        await self.dispatcher.stop()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    # ---- validation ----------------------------------------------------------------------
    def new_request_id(self, requested: str) -> str:
        if not requested:
            return uuid.uuid4().hex
        if requested in self._in_flight:
            raise InvalidRequestError("request_id", f"{requested!r} is already in flight")
        return requested

    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        if not prompt_token_ids:
            raise InvalidRequestError("prompt", "must not be empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"has {len(prompt_token_ids)} tokens; max_model_len is "
                                                f"{self.max_model_len} (including at least one output token)")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError("prompt.token_ids", f"out of vocabulary [0, {self.vocab_size}): {bad[:5]}")

    # ---- a request's life ----------------------------------------------------------------
    async def generate(self, inp: GenerationInput) -> AsyncIterator[StreamChunk]:
        """Stream a request's chunks; the last has finish_reason. Raises RouterError."""
        self.validate_prompt(inp.prompt_token_ids)
        if inp.request_id in self._in_flight:
            raise InvalidRequestError("request_id", f"{inp.request_id!r} is already in flight")
        run = _Run(inp, self.tokenizer, f"{self.router_id}-{uuid.uuid4().hex}")
        self._in_flight.add(inp.request_id)
        stream = self.dispatcher.open(run.worker_request_id)
        try:
            phases = self._colocated(run, stream) if self.mode == "colocated" else self._disaggregated(run, stream)
            async for chunk in phases:
                yield chunk
        finally:
            self._end(run)

    async def _disaggregated(self, run: _Run, stream: asyncio.Queue[TokenDelta]) -> AsyncIterator[StreamChunk]:
        prefill = self._assign(run, self.prefill_pool)
        result = await self._prefill(run, prefill)
        chunk = run.on_tokens(result.token_ids, result.logprobs, result.finish_reason, result.stop_reason)
        yield chunk
        if chunk.finish_reason is not None:
            run.worker_finished = result.finish_reason is not None
            return
        decode = self._assign(run, self.decode_pool)
        self.dispatcher.route(run.worker_request_id, decode.worker_id)
        await run.bounded(self._ensure_peer(decode, prefill))
        await run.bounded(self._call(decode, "submit", self._decode_request(run, result)))
        async for chunk in self._stream(run, stream):
            yield chunk

    async def _colocated(self, run: _Run, stream: asyncio.Queue[TokenDelta]) -> AsyncIterator[StreamChunk]:
        decode = self._assign(run, self.decode_pool)
        self.dispatcher.route(run.worker_request_id, decode.worker_id)
        request = DecodeRequest(run.worker_request_id, self.router_id, run.inp.prompt_token_ids, (),
                                self._worker_params(run), 0, None, None)
        await run.bounded(self._call(decode, "submit", request))
        async for chunk in self._stream(run, stream):
            yield chunk

    def _assign(self, run: _Run, pool: WorkerPool) -> WorkerClient:
        client = pool.acquire()
        run.workers.append(client)
        return client

    async def _prefill(self, run: _Run, prefill: WorkerClient) -> PrefillResult:
        started = time.monotonic()
        request = PrefillRequest(run.worker_request_id, run.inp.prompt_token_ids, self._worker_params(run))
        result: PrefillResult = await run.bounded(self._call(prefill, "prefill", request))
        if result.finish_reason == "abort":
            raise RouterError("UNAVAILABLE", f"prefill worker {prefill.worker_id} aborted the request")
        run.prefill_s = result.compute_s
        run.queue_s = max(time.monotonic() - started - result.compute_s, 0.0) + (started - run.arrival)
        run.num_cached_tokens = result.num_cached_tokens
        return result

    def _decode_request(self, run: _Run, result: PrefillResult) -> DecodeRequest:
        return DecodeRequest(run.worker_request_id, self.router_id, run.inp.prompt_token_ids, result.token_ids,
                             self._worker_params(run), result.num_cached_tokens, result.transfer,
                             result.generator_state)

    async def _stream(self, run: _Run, stream: asyncio.Queue[TokenDelta]) -> AsyncIterator[StreamChunk]:
        while True:
            delta: TokenDelta = await run.bounded(stream.get())
            if delta.error is not None:
                raise RouterError("INTERNAL", delta.error)
            if delta.transfer_s is not None:
                run.transfer_s = delta.transfer_s
            if delta.kv_transfer_failed:
                # Decode recomputed the prompt; the producer may still hold the KV under lease.
                self._abort_in_background(run.workers[0], run.worker_request_id)
            if delta.finish_reason is not None:
                run.worker_finished = True
                run.num_cached_tokens = delta.num_cached_tokens
            chunk = run.on_tokens(delta.token_ids, delta.logprobs, delta.finish_reason, delta.stop_reason)
            if chunk.token_ids or chunk.text or chunk.finish_reason is not None:
                yield chunk
            if chunk.finish_reason is not None:
                return

    def _worker_params(self, run: _Run) -> SamplingParams:
        return dataclasses.replace(run.inp.sampling_params, stop=())

    async def _ensure_peer(self, decode: WorkerClient, prefill: WorkerClient) -> None:
        """Handshake each (decode, prefill agent) pair once; concurrent requests share it."""
        agent = self.infos[prefill.worker_id].agent
        key = (decode.worker_id, agent.agent_name)
        if key not in self._peers:
            self._peers[key] = asyncio.ensure_future(self._call(decode, "add_peer", agent))
        try:
            await asyncio.shield(self._peers[key])
        except RouterError:
            self._peers.pop(key, None)
            raise

    async def _call(self, client: WorkerClient, method: str, *args: Any) -> Any:
        try:
            return await client.call(method, *args)
        except InvalidRequestError:
            raise
        except Exception as error:
            logger.warning("worker %s failed in %s: %s", client.worker_id, method, error)
            raise RouterError("UNAVAILABLE", f"worker {client.worker_id} failed in {method}: "
                                             f"{type(error).__name__}: {error}") from error

    def _end(self, run: _Run) -> None:
        """Release the router's bookkeeping; abort what the workers still hold (not awaited:
        this also runs while the request's task is being cancelled)."""
        self._in_flight.discard(run.inp.request_id)
        request_id = run.worker_request_id
        self.dispatcher.close(request_id)
        for client in run.workers:
            pool = self.prefill_pool if client.worker_id in self.prefill_pool.clients else self.decode_pool
            pool.release(client)
            if not run.worker_finished:
                self._abort_in_background(client, request_id)

    def _abort_in_background(self, client: WorkerClient, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(client, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, client: WorkerClient, request_id: str) -> None:
        try:
            await client.call("abort", request_id)
        except Exception as error:
            logger.warning("[%s] abort on %s failed: %s", request_id, client.worker_id, error)
