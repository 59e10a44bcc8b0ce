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
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from splitserve.common.block_hash import BlockHasher
from splitserve.common.detokenizer import Decoder, IncrementalDetokenizer
from splitserve.common.errors import InvalidRequestError
from splitserve.common.kv_events import LoadReport
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.slo import SloConfig
from splitserve.common.stats import RoutingStats
from splitserve.common.token_logprobs import TokenLogprobs
from splitserve.common.worker_messages import DecodeRequest, PrefillRequest, PrefillResult, TokenDelta, WorkerInfo
from splitserve.router.dispatcher import OutputDispatcher
from splitserve.router.policy import (DecodeCandidate, PrefillCandidate, Rejection, RouteDecision, RoutingConfig,
                                      RoutingRequest, route)
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.reports import WorkerMonitor
from splitserve.router.worker_client import WorkerClient

T = TypeVar("T")
logger = logging.getLogger(__name__)
MODES = ("disaggregated", "colocated")
HASH_IN_THREAD_TOKENS = 4096
"""Prompts longer than this are block-hashed off the event loop (about 0.5 ms per 4k tokens)."""


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
    ttft_slo_s: float | None = None
    """The request's TTFT target for admission control; None takes the router's default."""


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
    """Worker clients of one role and what this router assigned to each and has not seen
    finish, so routing sees its own assignments before the workers' reports do."""

    def __init__(self, clients: Sequence[WorkerClient]) -> None:
        self.clients = {client.worker_id: client for client in clients}
        self._requests = dict.fromkeys(self.clients, 0)
        self._prefill_tokens = dict.fromkeys(self.clients, 0)

    def num_requests(self, worker_id: str) -> int:
        return self._requests[worker_id]

    def num_prefill_tokens(self, worker_id: str) -> int:
        """Prompt tokens this router sent to the worker that it has not yet seen prefilled."""
        return self._prefill_tokens[worker_id]

    def assign(self, worker_id: str, prefill_tokens: int) -> _Assignment:
        self._requests[worker_id] += 1
        self._prefill_tokens[worker_id] += prefill_tokens
        return _Assignment(self, self.clients[worker_id], prefill_tokens)

    def prefilled(self, assignment: _Assignment) -> None:
        self._prefill_tokens[assignment.client.worker_id] -= assignment.prefill_tokens
        assignment.prefill_tokens = 0

    def release(self, assignment: _Assignment) -> None:
        self.prefilled(assignment)
        self._requests[assignment.client.worker_id] -= 1


@dataclass
class _Assignment:
    """One request's claim on one worker, released exactly once when the request ends."""

    pool: WorkerPool
    client: WorkerClient
    prefill_tokens: int
    """Uncached prompt tokens still to be prefilled there (0 once the first token is back)."""


class _Run:
    """One request's progress at the router."""

    def __init__(self, inp: GenerationInput, tokenizer: Decoder, worker_request_id: str,
                 cached_tokens: dict[str, int]) -> None:
        self.inp = inp
        self.cached_tokens = cached_tokens
        """Prompt tokens each worker's prefix cache held when the request was routed."""
        self.worker_request_id = worker_request_id
        """The id workers know the request by: unique across routers and clients (a client's own
        id may repeat after it finishes, or collide with another client's)."""
        self.arrival = time.monotonic()
        params = inp.sampling_params
        self.detokenizer = IncrementalDetokenizer(tokenizer, list(inp.prompt_token_ids), params.stop,
                                                  params.skip_special_tokens)
        self.assignments: list[_Assignment] = []
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
                 tokenizer: Decoder, mode: str = "disaggregated", routing: RoutingConfig = RoutingConfig(),
                 slo: SloConfig = SloConfig()) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not decode or (mode == "disaggregated" and not prefill):
            raise ValueError(f"{mode} mode needs at least one decode worker"
                             + (" and one prefill worker" if mode == "disaggregated" else ""))
        self.router_id = router_id
        self.mode = mode
        self.routing = routing
        self.slo = slo
        self.tokenizer = tokenizer
        self.prefill_pool = WorkerPool(prefill if mode == "disaggregated" else ())
        self.decode_pool = WorkerPool(decode)
        self.dispatcher = OutputDispatcher(router_id, decode)
        self.index = PrefixIndex()
        self.monitor = WorkerMonitor([*self.prefill_pool.clients.values(), *decode], self.index, self._on_restart)
        self.infos: dict[str, WorkerInfo] = {}
        self.max_model_len = 0
        self.vocab_size = 0
        self._hasher: BlockHasher | None = None
        self._in_flight: set[str] = set()
        self._peers: dict[tuple[str, str], asyncio.Future] = {}
        self._background: set[asyncio.Task] = set()
        self._turn = 0
        self._decisions: Counter[str] = Counter()
        self._rejections: Counter[str] = Counter()

    async def start(self) -> None:
        """Learn every worker's limits, load and prefix cache; start collecting decode outputs."""
        clients = [*self.prefill_pool.clients.values(), *self.decode_pool.clients.values()]
        infos = await asyncio.gather(*(client.call("info") for client in clients))
        self.infos = {info.worker_id: info for info in infos}
        self.max_model_len = min(info.max_model_len for info in infos)
        self.vocab_size = min(info.vocab_size for info in infos)
        layout = infos[0].layout  # the pools agree on block size and hash seed (the handshake checks)
        self._hasher = BlockHasher(layout.block_size, layout.hash_seed)
        await self.monitor.start()
        self.dispatcher.start()

    async def stop(self) -> None:
        await self.monitor.stop()
        await self.dispatcher.stop()

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def routing_stats(self) -> RoutingStats:
        return RoutingStats(tuple(sorted(self._decisions.items())), tuple(sorted(self._rejections.items())))

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

    # ---- routing -------------------------------------------------------------------------
    async def _route(self, inp: GenerationInput) -> tuple[RouteDecision, dict[str, int]]:
        """The policy's choice for this request and the prompt tokens each worker has cached,
        or RESOURCE_EXHAUSTED when admission rejects it."""
        block_size = self._hasher.block_size
        prompt = inp.prompt_token_ids
        hashes = (await asyncio.to_thread(self._hasher.hash_prefix, prompt) if len(prompt) > HASH_IN_THREAD_TOKENS
                  else self._hasher.hash_prefix(prompt))
        cached = {worker_id: blocks * block_size for worker_id, blocks in self.index.matched_blocks(hashes).items()}
        max_tokens = min(inp.sampling_params.max_tokens, self.max_model_len - len(inp.prompt_token_ids))
        slo = inp.ttft_slo_s if inp.ttft_slo_s is not None else self.slo.ttft_s
        request = RoutingRequest(len(inp.prompt_token_ids),
                                 -(-(len(inp.prompt_token_ids) + max_tokens) // block_size), slo)
        # Only workers that answer their report polls are candidates; with no prefill worker
        # answering, decode workers prefill locally.
        prefill = [self._prefill_candidate(worker_id, load, cached.get(worker_id, 0))
                   for worker_id, load in self._reporting(self.prefill_pool)]
        decode = [self._decode_candidate(worker_id, load, cached.get(worker_id, 0))
                  for worker_id, load in self._reporting(self.decode_pool)]
        if not decode:
            raise RouterError("UNAVAILABLE", "no decode worker is answering")
        routing = self.routing if self.mode == "disaggregated" else dataclasses.replace(self.routing,
                                                                                         disaggregation="never")
        decision = route(request, prefill, decode, routing, self._turn)
        self._turn += 1
        if isinstance(decision, Rejection):
            self._rejections[decision.reason] += 1
            raise RouterError("RESOURCE_EXHAUSTED", decision.message)
        self._decisions[decision.reason] += 1
        return decision, cached

    def _reporting(self, pool: WorkerPool) -> list[tuple[str, LoadReport]]:
        loads = ((worker_id, self.monitor.load(worker_id)) for worker_id in pool.clients)
        return [(worker_id, load) for worker_id, load in loads if load is not None]

    def _prefill_candidate(self, worker_id: str, load: LoadReport, num_cached_tokens: int) -> PrefillCandidate:
        pool = self.prefill_pool
        return PrefillCandidate(worker_id, num_cached_tokens,
                                max(load.num_queued_prefill_tokens, pool.num_prefill_tokens(worker_id)),
                                load.prefill_s_per_token, pool.num_requests(worker_id))

    def _decode_candidate(self, worker_id: str, load: LoadReport, num_cached_tokens: int) -> DecodeCandidate:
        pool = self.decode_pool
        own = pool.num_requests(worker_id)
        return DecodeCandidate(
            worker_id, num_cached_tokens, max(load.num_queued_prefill_tokens, pool.num_prefill_tokens(worker_id)),
            load.prefill_s_per_token, max(load.num_running + load.num_waiting, own),
            self.infos[worker_id].max_num_seqs, load.num_free_kv_blocks, load.num_kv_blocks, own)

    async def _on_restart(self, worker_id: str) -> None:
        """A worker came back with a new engine: new limits and a new transfer agent. Raises when
        its info is unavailable (the monitor keeps it unroutable and retries)."""
        client = self.prefill_pool.clients.get(worker_id) or self.decode_pool.clients[worker_id]
        old_agent = self.infos[worker_id].agent.agent_name
        self.infos[worker_id] = await client.call("info")
        # A restarted decode worker knows no peer; nobody can read from a restarted prefill
        # worker's old agent.
        for key in [key for key in self._peers if key[0] == worker_id or key[1] == old_agent]:
            del self._peers[key]

    # ---- a request's life ----------------------------------------------------------------
    async def generate(self, inp: GenerationInput) -> AsyncIterator[StreamChunk]:
        """Stream a request's chunks; the last has finish_reason. Raises RouterError."""
        self.validate_prompt(inp.prompt_token_ids)
        if inp.request_id in self._in_flight:
            raise InvalidRequestError("request_id", f"{inp.request_id!r} is already in flight")
        decision, cached = await self._route(inp)
        run = _Run(inp, self.tokenizer, f"{self.router_id}-{uuid.uuid4().hex}", cached)
        self._in_flight.add(inp.request_id)
        stream = self.dispatcher.open(run.worker_request_id)
        try:
            phases = (self._remote_prefill(run, stream, decision) if decision.prefill_worker_id is not None
                      else self._local_prefill(run, stream, decision))
            async for chunk in phases:
                yield chunk
        finally:
            self._end(run)

    async def _remote_prefill(self, run: _Run, stream: asyncio.Queue[TokenDelta],
                              decision: RouteDecision) -> AsyncIterator[StreamChunk]:
        """Prefill on a prefill worker, then decode pulls the KV and continues. The decode worker
        is claimed up front so routing counts the request there while it is being prefilled."""
        prefill = self._assign(run, self.prefill_pool, decision.prefill_worker_id)
        decode = self._assign(run, self.decode_pool, decision.decode_worker_id, prefill_tokens=0)
        result = await self._prefill(run, prefill)
        chunk = run.on_tokens(result.token_ids, result.logprobs, result.finish_reason, result.stop_reason)
        yield chunk
        if chunk.finish_reason is not None:
            run.worker_finished = result.finish_reason is not None
            return
        self.dispatcher.route(run.worker_request_id, decode.client.worker_id)
        await run.bounded(self._ensure_peer(decode.client, prefill.client))
        await run.bounded(self._call(decode.client, "submit", self._decode_request(run, result)))
        async for chunk in self._stream(run, stream):
            yield chunk

    async def _local_prefill(self, run: _Run, stream: asyncio.Queue[TokenDelta],
                             decision: RouteDecision) -> AsyncIterator[StreamChunk]:
        """The decode worker prefills the prompt itself: no KV moves (colocated mode, or a
        prompt whose uncached part is short)."""
        decode = self._assign(run, self.decode_pool, decision.decode_worker_id)
        self.dispatcher.route(run.worker_request_id, decode.client.worker_id)
        request = DecodeRequest(run.worker_request_id, self.router_id, run.inp.prompt_token_ids, (),
                                self._worker_params(run), 0, None, None)
        await run.bounded(self._call(decode.client, "submit", request))
        async for chunk in self._stream(run, stream):
            yield chunk

    def _assign(self, run: _Run, pool: WorkerPool, worker_id: str, prefill_tokens: int | None = None) -> _Assignment:
        """Claim the worker for the run; by default the prompt's uncached tokens there count as
        queued prefill work until the first token is back."""
        if prefill_tokens is None:
            prefill_tokens = len(run.inp.prompt_token_ids) - run.cached_tokens.get(worker_id, 0)
        assignment = pool.assign(worker_id, prefill_tokens)
        run.assignments.append(assignment)
        return assignment

    async def _prefill(self, run: _Run, prefill: _Assignment) -> PrefillResult:
        started = time.monotonic()
        request = PrefillRequest(run.worker_request_id, run.inp.prompt_token_ids, self._worker_params(run))
        result: PrefillResult = await run.bounded(self._call(prefill.client, "prefill", request))
        prefill.pool.prefilled(prefill)
        if result.finish_reason == "abort":
            raise RouterError("UNAVAILABLE", f"prefill worker {prefill.client.worker_id} aborted the request")
        run.prefill_s = result.compute_s
        run.queue_s = max(time.monotonic() - started - result.compute_s, 0.0) + (started - run.arrival)
        run.num_cached_tokens = result.num_cached_tokens
        return result

    def _decode_request(self, run: _Run, result: PrefillResult) -> DecodeRequest:
        return DecodeRequest(run.worker_request_id, self.router_id, run.inp.prompt_token_ids, result.token_ids,
                             self._worker_params(run), result.num_cached_tokens, result.transfer,
                             result.generator_state)

    async def _stream(self, run: _Run, stream: asyncio.Queue[TokenDelta]) -> AsyncIterator[StreamChunk]:
        decode = run.assignments[-1]
        while True:
            delta: TokenDelta = await run.bounded(stream.get())
            if delta.error is not None:
                raise RouterError("INTERNAL", delta.error)
            if delta.transfer_s is not None:
                run.transfer_s = delta.transfer_s
            if delta.kv_transfer_failed:
                # Decode recomputed the prompt; the producer may still hold the KV under lease.
                self._abort_in_background(run.assignments[0].client, run.worker_request_id)
            if delta.token_ids:
                decode.pool.prefilled(decode)
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
        for assignment in run.assignments:
            assignment.pool.release(assignment)
            if not run.worker_finished:
                self._abort_in_background(assignment.client, request_id)

    def _abort_in_background(self, client: WorkerClient, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort(client, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, client: WorkerClient, request_id: str) -> None:
        try:
            await client.call("abort", request_id)
        except Exception as error:
            logger.warning("[%s] abort on %s failed: %s", request_id, client.worker_id, error)
