"""Per-request orchestration at the router: prefill -> KV transfer -> decode, streamed.

Runs on the router's event loop and never blocks it: every worker call is awaited. The
router owns stop strings and detokenization (workers get sampling params without stop
strings), and ends a request on every path — finish, stop string, client cancel, deadline,
worker fault — by aborting whatever the workers still hold for it.

A request whose worker is lost (Ray reports the actor dead or unreachable, or its polls fail)
moves: the router re-routes it and a decode worker recomputes prompt + the tokens already
streamed, so the client's stream goes on where it stopped (greedy output equals an undisturbed
run's). Each move is a new attempt with a new worker-side request id, so nothing the lost worker
still sends can reach the stream; after routing.max_migrations moves the request fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import TypeVar

from splitserve.common.block_hash import BlockHasher, check_cache_salt
from splitserve.common.config import check_priority
from splitserve.common.detokenizer import Decoder
from splitserve.common.errors import InvalidRequestError
from splitserve.common.kv_events import LoadReport
from splitserve.common.kv_transfer_types import KVLayout, KVLayoutMismatchError
from splitserve.common.log_escape import quote_for_log
from splitserve.common.prompt_truncation import check_prompt_length
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.slo import SloConfig
from splitserve.common.stats import RequestParamsRecord, RequestRecord, RoutingStats, WorkerSnapshot
from splitserve.common.worker_api import DecodeWorkerAPI, PrefillWorkerAPI, WorkerAPI, WorkerLostError
from splitserve.common.worker_messages import (DecodeRequest, LayerwiseProgress, PrefillFirstToken, PrefillRequest,
                                               PrefillResult, TokenDelta, WorkerInfo)
from splitserve.router.admission import TOO_MANY_REQUESTS, Admission, AdmissionControl, AdmissionRejection
from splitserve.router.api_types import GenerationInput, RouterError, StreamChunk
from splitserve.router.dispatcher import OutputDispatcher
from splitserve.router.loop_lag import LoopLagMonitor
from splitserve.router.peers import PeerHandshakes
from splitserve.router.policy import (DecodeCandidate, PrefillCandidate, Rejection, RouteDecision, RoutingConfig,
                                      RoutingRequest, route, route_prefill_only)
from splitserve.router.prefix_index import PrefixIndex
from splitserve.router.records import FanOutParams, StepwiseRequest, refused_record
from splitserve.router.reports import WorkerMonitor
from splitserve.router.request_ids import ReservedRequestId, RequestIds, sequence_request_id
from splitserve.router.request_run import RequestRun
from splitserve.router.worker_link import WorkerLinkConfig
from splitserve.router.worker_pool import Assignment, WorkerPool

T = TypeVar("T")
logger = logging.getLogger(__name__)
MODES = ("disaggregated", "colocated")
HASH_IN_THREAD_TOKENS = 4096
"""Prompts longer than this are block-hashed off the event loop (about 0.5 ms per 4k tokens)."""


class Orchestrator:
    def __init__(self, router_id: str, prefill: Sequence[PrefillWorkerAPI], decode: Sequence[DecodeWorkerAPI],
                 tokenizer: Decoder, mode: str = "disaggregated", routing: RoutingConfig = RoutingConfig(),
                 slo: SloConfig = SloConfig(), observer: Callable[[RequestRecord], None] | None = None,
                 worker_link: WorkerLinkConfig = WorkerLinkConfig(),
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        """`observer` gets every request's RequestRecord when it ends (after validation, on any
        path), on the event loop; it must not block (the metrics server's observe). `worker_link`:
        the timings of report polls and output streams. `eos_token_ids`: the model's (a request
        that ends on one has its text detokenized without it)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not decode or (mode == "disaggregated" and not prefill):
            raise ValueError(f"{mode} mode needs at least one decode worker"
                             + (" and one prefill worker" if mode == "disaggregated" else ""))
        self.router_id = router_id
        self.mode = mode
        self.routing = routing
        self.slo = slo
        self.observer = observer
        self.params_observer: Callable[[RequestParamsRecord], None] | None = None
        """Gets each finished client request's RequestParamsRecord, once however many sequences it ran (set by
        RouterMetrics.watch); on the event loop, must not block."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.prefill_pool = WorkerPool(prefill if mode == "disaggregated" else ())
        self.decode_pool = WorkerPool(decode)
        self.dispatcher = OutputDispatcher(router_id, decode, self._on_worker_lost, worker_link)
        self.index = PrefixIndex()
        self.loop_lag = LoopLagMonitor()
        """The router's own event loop: its lag (a metric) and stalls (which worker polls discount)."""
        self.readiness_changed = asyncio.Event()
        """Set whenever is_ready may have changed (a worker starts or stops answering, joins or
        retires, a drain starts); its one reader, the gRPC health tracker, clears it."""
        self.monitor = WorkerMonitor([*self.prefill_pool.clients.values(), *decode], self.index, self._on_restart,
                                     self._on_worker_lost, self.loop_lag, worker_link, self.readiness_changed.set)
        self.infos: dict[str, WorkerInfo] = {}
        self.max_model_len = 0
        self.vocab_size = 0
        self.scheduling_policy = "fcfs"
        """The workers' scheduling policy ("priority" only when every worker's is: a request with a priority
        other than 0 is refused otherwise, as one engine under fcfs refuses it)."""
        self._hasher: BlockHasher | None = None
        self.layout: KVLayout | None = None
        """The KV layout every worker shares (known once started; a joining worker must match it)."""
        self.request_ids = RequestIds()
        """The internal ids of the client requests (new_request_id) and of the requests in generate() and stepwise()
        (internal steps are not in it; a fan-out's sequences are, under their own ids)."""
        self._stepwise: dict[str, StepwiseRequest] = {}
        """The requests in stepwise() by internal request id: what their steps' ends add to."""
        self._fan_outs: dict[str, FanOutParams] = {}
        """The running fan-outs' parameters by each of their sequences' ids: what the sequences' ends add to."""
        self._idle = asyncio.Event()
        """Set while no request holds an admission slot (drain waits on it)."""
        self._idle.set()
        self.admission = AdmissionControl(routing.max_in_flight_requests, self._idle.set)
        """The requests admitted and not yet ended (from the API's first line, before parsing)."""
        self._runs: dict[str, RequestRun] = {}
        """Current attempts by worker-side request id."""
        self._ended_by: str | None = None
        """Set by end_requests() (the server is stopping): why every request left ends with UNAVAILABLE."""
        self.peers = PeerHandshakes()
        self._background: set[asyncio.Task] = set()
        self._turn = 0
        self._decisions: Counter[str] = Counter()
        self._rejections: Counter[str] = Counter()

    async def start(self) -> None:
        """Learn every worker's limits, load and prefix cache; start collecting decode outputs."""
        clients = [*self.prefill_pool.clients.values(), *self.decode_pool.clients.values()]
        infos = await asyncio.gather(*(client.info() for client in clients))
        self.infos = {info.worker_id: info for info in infos}
        self.max_model_len = min(info.max_model_len for info in infos)
        self.vocab_size = min(info.vocab_size for info in infos)
        self.scheduling_policy = "priority" if all(info.scheduling_policy == "priority" for info in infos) else "fcfs"
        self.layout = infos[0].layout  # the pools agree on it (the handshake checks)
        self._hasher = BlockHasher(self.layout.block_size, self.layout.hash_seed)
        self.loop_lag.start()
        await self.monitor.start()
        await self.dispatcher.start()

    async def stop(self) -> None:
        await self.monitor.stop()
        await self.dispatcher.stop()
        await self.loop_lag.stop()

    @property
    def num_in_flight(self) -> int:
        return self.request_ids.num_running

    @property
    def accepting(self) -> bool:
        """False once drain() started: new requests get UNAVAILABLE, admitted ones finish."""
        return self.admission.accepting

    @property
    def is_ready(self) -> bool:
        """New requests can be served: not draining, and some decode worker answers its polls."""
        return self.accepting and any(self.monitor.load(worker_id) is not None
                                      for worker_id in self.decode_pool.routable())

    async def drain(self, timeout_s: float) -> int:
        """Stop admitting requests and wait up to timeout_s for those admitted to end (those
        still being parsed or tokenized too); returns how many are left (the caller's shutdown
        cancels them, freeing their KV)."""
        self.admission.stop_accepting()
        self.readiness_changed.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            pass
        return self.admission.in_flight

    def end_requests(self, reason: str) -> None:
        """The server stops with requests still in flight (the drain's grace is over): each ends with
        UNAVAILABLE `reason`, as when its worker is lost with no move left (freed on the workers; its client's
        stream ends with that status instead of being cut off with its connection), and none starts again."""
        self._ended_by = reason
        for run in list(self._runs.values()):
            run.lose(WorkerLostError(run.active_worker_id or "(none yet)", reason))

    def routing_stats(self) -> RoutingStats:
        return RoutingStats(tuple(sorted(self._decisions.items())), tuple(sorted(self._rejections.items())))

    def worker_snapshots(self) -> tuple[WorkerSnapshot, ...]:
        """Every worker's role and latest report (prefill pool first), for metrics."""
        roles = [*((worker_id, "prefill") for worker_id in self.prefill_pool.clients),
                 *((worker_id, "decode") for worker_id in self.decode_pool.clients)]
        return tuple(WorkerSnapshot(worker_id, role, self.monitor.load(worker_id), self.monitor.counters(worker_id),
                                    self._layout_of(worker_id)) for worker_id, role in roles)

    def _layout_of(self, worker_id: str) -> KVLayout | None:
        info = self.infos.get(worker_id)
        return None if info is None else info.layout

    def slo_targets(self, inp: GenerationInput) -> SloConfig:
        """The request's own targets, each falling back to the router's default."""
        return SloConfig(self.slo.ttft_s if inp.ttft_slo_s is None else inp.ttft_slo_s,
                         self.slo.tpot_s if inp.tpot_slo_s is None else inp.tpot_slo_s)

    # ---- validation ----------------------------------------------------------------------
    def new_request_id(self, requested: str, num_sequences: int = 1) -> ReservedRequestId:
        """The ids of a client's request (`requested`: the client's id, "": a new one) that runs as `num_sequences`
        sequences: its internal id is the client's unless a request in flight has it (router/request_ids.py). The
        caller releases them when the request ends, on every path."""
        return self.request_ids.reserve(requested or uuid.uuid4().hex, num_sequences)

    def validate_prompt(self, prompt_token_ids: Sequence[int], field: str = "prompt", pools: bool = False,
                        ids_field: str | None = None) -> None:
        """`field` names what the client sent the prompt as (a chat request's `messages`, an embedding's `input[i]`);
        `pools`: a pooling request's prompt, which may fill max_model_len (nothing is generated after it);
        `ids_field`: what an id out of the vocabulary is named (default `field`)."""
        if not prompt_token_ids:
            raise InvalidRequestError(field, "must not be empty")
        check_prompt_length(len(prompt_token_ids), self.max_model_len, field, pools)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(ids_field or field, f"token ids out of vocabulary [0, {self.vocab_size}): "
                                                          f"{bad[:5]}")

    # ---- routing -------------------------------------------------------------------------
    async def _route(self, run: RequestRun) -> tuple[RouteDecision, dict[str, int]]:
        """The policy's choice for this request and the prompt tokens each worker has cached,
        or RESOURCE_EXHAUSTED when admission rejects it (noting why on the run)."""
        inp = run.inp
        block_size = self._hasher.block_size
        context = run.context_token_ids
        lora_name = None if inp.lora_request is None else inp.lora_request.lora_name  # the workers' hash rule
        hashes = (await asyncio.to_thread(self._hasher.hash_prefix, context, inp.cache_salt, lora_name)
                  if len(context) > HASH_IN_THREAD_TOKENS else self._hasher.hash_prefix(context, inp.cache_salt,
                                                                                           lora_name))
        cached = {worker_id: blocks * block_size for worker_id, blocks in self.index.matched_blocks(hashes).items()}
        full_prompt = len(inp.prompt_token_ids) // block_size * block_size
        for worker_id in inp.kv_cached_on:  # a sibling's prefill there, not reported yet
            cached[worker_id] = max(cached.get(worker_id, 0), full_prompt)
        max_tokens = min(inp.sampling_params.max_tokens - len(run.output_token_ids), self.max_model_len - len(context))
        # A resumed request has had its first token: its TTFT target no longer applies.
        request = RoutingRequest(len(context), -(-(len(context) + max_tokens) // block_size),
                                 None if run.resumed else self.slo_targets(inp).ttft_s)
        # Only workers that answer their report polls are candidates; with no prefill worker
        # answering, decode workers prefill locally.
        prefill = [self._prefill_candidate(worker_id, load, cached.get(worker_id, 0))
                   for worker_id, load in self._reporting(self.prefill_pool)]
        # A resumed request is recomputed where it decodes: prefill workers take prompts only.
        local_only = self.mode == "colocated" or run.resumed
        if inp.pooling_params is not None and prefill and not local_only:  # a pooled vector needs only a prefill
            decision = route_prefill_only(request, prefill, self.routing, self._turn)
        else:
            decision = route(request, prefill, self._decode_candidates(cached), dataclasses.replace(
                self.routing, disaggregation="never") if local_only else self.routing, self._turn)
        self._turn += 1
        if isinstance(decision, Rejection):
            self._rejections[decision.reason] += 1
            run.rejection_reason = decision.reason
            raise RouterError("RESOURCE_EXHAUSTED", decision.message, decision.reason)
        self._decisions[decision.reason] += 1
        return decision, cached

    def _decode_candidates(self, cached: dict[str, int]) -> list[DecodeCandidate]:
        """The decode workers answering their report polls (UNAVAILABLE when none does)."""
        decode = [self._decode_candidate(worker_id, load, cached.get(worker_id, 0))
                  for worker_id, load in self._reporting(self.decode_pool)]
        if not decode:
            raise RouterError("UNAVAILABLE", "no decode worker is answering")
        return decode

    def _reporting(self, pool: WorkerPool) -> list[tuple[str, LoadReport]]:
        loads = ((worker_id, self.monitor.load(worker_id)) for worker_id in pool.routable())
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
        client = self.pool_of(worker_id).clients[worker_id]
        old_agent = self.infos[worker_id].agent.agent_name
        self.infos[worker_id] = await client.info()
        # What the worker ran before its restart is gone with its old engine.
        self._lose_runs_on(WorkerLostError(worker_id, "it restarted"))
        # A restarted decode worker knows no peer; nobody can read from a restarted prefill
        # worker's old agent, so decode workers drop it.
        self.peers.forget(worker_id, old_agent)
        if worker_id in self.prefill_pool.clients:
            for decode in self.decode_pool.clients.values():
                self._in_background(self._forget_peer(decode, old_agent))

    async def _forget_peer(self, decode: DecodeWorkerAPI, agent_name: str) -> None:
        try:
            await decode.remove_peer(agent_name)
        except Exception as error:
            logger.warning("decode worker %s could not drop agent %s: %s", decode.worker_id, agent_name, error)

    def worker_unavailable(self, worker_id: str, reason: str) -> None:
        """The worker's runtime reports it dead or restarting (Ray's actor state): unroutable at
        once, its requests move, without waiting for a call or a report poll to fail. A worker no
        longer in a pool (retired) is ignored."""
        if worker_id in self.prefill_pool.clients or worker_id in self.decode_pool.clients:
            logger.warning("worker %s is unavailable: %s", worker_id, reason)
            self._on_worker_lost(worker_id, reason)

    def _on_worker_lost(self, worker_id: str, reason: str) -> None:
        """A worker stopped answering: unroutable until it reports again; requests it was
        computing move elsewhere."""
        self.monitor.forget(worker_id)
        self._lose_runs_on(WorkerLostError(worker_id, reason))

    def _lose_runs_on(self, lost: WorkerLostError) -> None:
        for run in list(self._runs.values()):
            if run.depends_on(lost.worker_id):
                run.lose(lost)

    # ---- membership (the planner) ----------------------------------------------------------
    async def add_worker(self, role: str, client: WorkerAPI) -> None:
        """A worker joins the `role` pool while the router serves; it takes requests once its
        output stream (decode) is open and its first report is in. Raises ValueError when it cannot
        serve next to the others (layout, limits), or what its first calls raised (it is then not
        in the pool)."""
        pool = self.pool(role)
        info = await client.info()
        self._check_joins(info)
        self.infos[client.worker_id] = info
        pool.add(client)
        try:
            if pool is self.decode_pool:
                await self.dispatcher.add(client)
            await self.monitor.add(client)
        except BaseException:
            await self._forget_worker(pool, client.worker_id)
            raise
        logger.info("%s worker %s joined", role, client.worker_id)

    async def retire_worker(self, worker_id: str, timeout_s: float) -> None:
        """The worker leaves its pool: it gets no new request, the requests it serves finish (for
        up to timeout_s; those still on it then move to other workers), and the router forgets it.
        Returns once nothing of this router remains on the worker; the caller then ends it."""
        pool = self.pool_of(worker_id)
        released = pool.retire(worker_id)
        self.readiness_changed.set()
        try:
            await asyncio.wait_for(asyncio.shield(released.wait()), timeout_s)
        except TimeoutError:
            self._detach(worker_id)
            await released.wait()
        await self._forget_worker(pool, worker_id)
        logger.info("worker %s left its pool", worker_id)

    def pool(self, role: str) -> WorkerPool:
        """The `role` pool ('prefill' or 'decode'); a colocated router has no prefill pool."""
        if role == "decode":
            return self.decode_pool
        if role == "prefill" and self.mode == "disaggregated":
            return self.prefill_pool
        raise ValueError(f"a {self.mode} router has no {role!r} pool")

    def pool_of(self, worker_id: str) -> WorkerPool:
        """The pool the worker is in (it must be in one)."""
        return self.prefill_pool if worker_id in self.prefill_pool.clients else self.decode_pool

    def _check_joins(self, info: WorkerInfo) -> None:
        """A joining worker must hash blocks like the others and hold every request they can."""
        mismatches = self.layout.mismatches(info.layout)
        if mismatches:
            raise ValueError(f"worker {info.worker_id}'s KV layout differs from the cluster's: {'; '.join(mismatches)}")
        if info.max_model_len < self.max_model_len or info.vocab_size < self.vocab_size:
            raise ValueError(f"worker {info.worker_id} serves max_model_len {info.max_model_len} and vocabulary "
                             f"{info.vocab_size}; the cluster needs {self.max_model_len} and {self.vocab_size}")
        if info.scheduling_policy != self.scheduling_policy:
            raise ValueError(f"worker {info.worker_id}'s scheduling policy is {info.scheduling_policy!r}; the "
                             f"cluster's is {self.scheduling_policy!r}")
        if info.worker_id in self.infos:
            raise ValueError(f"worker {info.worker_id} is already in the cluster")

    def _detach(self, worker_id: str) -> None:
        """After a retiring worker's grace: the requests it computes move elsewhere; a prefill
        claim of a request that decodes elsewhere is dropped (its KV was handed over)."""
        self._lose_runs_on(WorkerLostError(worker_id, "it is leaving the pool"))
        for run in self._runs.values():
            if run.prefill is not None and run.prefill.client.worker_id == worker_id and run.decode is not None:
                run.prefill.pool.release(run.prefill)
                run.prefill = None

    async def _forget_worker(self, pool: WorkerPool, worker_id: str) -> None:
        """Stop watching the worker and drop it from the pool and from every handshake."""
        self.monitor.remove(worker_id)
        if pool is self.decode_pool:
            await self.dispatcher.remove(worker_id)
        info = self.infos.pop(worker_id, None)
        if info is not None:
            self.peers.forget(worker_id, info.agent.agent_name)
            if pool is self.prefill_pool:
                for decode in self.decode_pool.clients.values():
                    self._in_background(self._forget_peer(decode, info.agent.agent_name))
        pool.remove(worker_id)

    # ---- a request's life ----------------------------------------------------------------
    async def generate(self, inp: GenerationInput, admission: Admission | None = None) -> AsyncIterator[StreamChunk]:
        """Stream a request's chunks; the last has finish_reason. Raises RouterError.

        `admission`: the request's slot from admit(), which the APIs take before parsing it;
        generate() releases it when it ends (the caller too if it never started the stream:
        release is idempotent). None: admitted here, and a rejection is recorded as the request's end."""
        arrival = time.monotonic()
        try:
            # the gRPC API's token ids are its GenerateRequest's prompt.token_ids (the HTTP APIs checked theirs)
            self.validate_prompt(inp.prompt_token_ids, pools=inp.pooling_params is not None,
                                 ids_field="prompt.token_ids")
            check_cache_salt(inp.cache_salt)  # the APIs checked it; a library caller's is hashed next
            check_priority(inp.priority, self.scheduling_policy)
            run = RequestRun(inp, self.tokenizer, arrival, self.eos_token_ids)
            if inp.step_of is None:
                self.request_ids.start(inp.request_id)
            try:
                if admission is None:
                    admission = self._admit(run)
                while True:
                    try:
                        async for chunk in self._attempt(run):
                            yield chunk
                        return
                    except WorkerLostError as lost:
                        self._migrate(run, lost)
            except BaseException as error:  # GeneratorExit too: the consumer closed the stream early
                run.error_code = _error_code(error, inp.deadline)
                raise
            finally:
                self._end(run)
        finally:
            if admission is not None:
                admission.release()

    @contextlib.contextmanager
    def stepwise(self, inp: GenerationInput, num_prompt_tokens: int) -> Iterator[StepwiseRequest]:
        """A client's request that the caller runs as internal steps (generate() of inputs whose step_of is
        inp.request_id; `inp`: the request as the client sent it, its id, deadline and SLO targets): in flight
        under its id meanwhile, and recorded once when the block ends, as the one request the client sent (the
        caller notes its output with on_finished first; an exception is how it failed). Its steps are recorded as
        steps (RequestRecord.step_of); their moves off lost workers count on its record."""
        request = StepwiseRequest(inp.request_id, num_prompt_tokens, time.monotonic(), inp.client_request_id)
        self.request_ids.start(inp.request_id)
        self._stepwise[inp.request_id] = request
        try:
            yield request
        except BaseException as error:
            request.error_code = _error_code(error, inp.deadline)
            request.rejection_reason = error.rejection_reason if isinstance(error, RouterError) else None
            raise
        finally:
            self.request_ids.stop(inp.request_id)
            del self._stepwise[inp.request_id]
            self._observe(request.record(self.slo_targets(inp), time.monotonic()))
            self._observe_params(request.params if request.error_code is None else None)

    @contextlib.contextmanager
    def fan_out(self, client: GenerationInput, num_prompt_tokens: int, num_sequences: int,
                n: int | None = None) -> Iterator[list[Admission]]:
        """A client's request that the caller runs as `num_sequences` requests of its own (its sequences: generate()
        of each, on the request's slot and the num_sequences - 1 slots this yields; `client`: the request as the
        client sent it, its id, deadline and SLO targets; `num_prompt_tokens`: each of its prompts' tokens once).

        The slots are taken all or none before any sequence runs: a refusal (RouterError) ends the client's request
        and is recorded once, as a refused request is (none of its sequences ran, so none has a record); each
        sequence that runs is recorded when it ends. The request's ids (its own and its sequences') are the caller's
        reservation (new_request_id). The caller's sequences release the slots; so does leaving the block. `n`: the
        client's n (fewer than num_sequences with best_of or several prompts; None: num_sequences). Once every
        sequence ended, a request whose sequences all finished is observed once (params_observer)."""
        if num_sequences == 1:
            yield []
            return
        others = self._admit_sequences(client, num_prompt_tokens, num_sequences - 1)
        params = FanOutParams(n or num_sequences, client.sampling_params.max_tokens, num_sequences)
        sequence_ids = [sequence_request_id(client.request_id, index) for index in range(num_sequences)]
        self._fan_outs.update(dict.fromkeys(sequence_ids, params))
        try:
            yield others
        finally:
            for admission in others:
                admission.release()
            for sequence_id in sequence_ids:
                del self._fan_outs[sequence_id]
            self._observe_params(params.record())

    def _admit_sequences(self, client: GenerationInput, num_prompt_tokens: int, count: int) -> list[Admission]:
        """admit_all(count) for a fan-out, recording a refusal as its client's request's end."""
        arrival = time.monotonic()
        try:
            return self.admit_all(count)
        except RouterError as error:
            self._observe(refused_record(client.request_id, num_prompt_tokens, error.code, error.rejection_reason,
                                         self.slo_targets(client), time.monotonic() - arrival,
                                         client.client_request_id))
            raise

    def admit_all(self, count: int) -> list[Admission]:
        """`count` admission slots, all or none (admit()'s RouterError when the router cannot hold them: the one
        refusal counts once)."""
        admissions: list[Admission] = []
        try:
            for _ in range(count):
                admissions.append(self.admit())
        except BaseException:
            for admission in admissions:
                admission.release()
            raise
        return admissions

    def admit(self) -> Admission:
        """O(1), for the APIs' first line, before a request is read, parsed or tokenized: its slot,
        or RouterError UNAVAILABLE while draining, RESOURCE_EXHAUSTED (counted as a
        too_many_requests rejection, the error's rejection_reason) while the router holds
        max_in_flight_requests."""
        decision = self._try_admit()
        if isinstance(decision, AdmissionRejection):
            if decision.reason == TOO_MANY_REQUESTS:
                self.count_rejection(decision.reason)
            raise RouterError(decision.code, decision.message,
                              decision.reason if decision.reason == TOO_MANY_REQUESTS else None)
        return decision

    def take_free_slot(self) -> Admission | None:
        """A slot for a request the HTTP acceptor process hands over whole (router/acceptor_process.py), taken as
        admit() takes one; None when there is none, not counted as a rejection: the request then meets the
        admission gate like any other."""
        decision = self._try_admit()
        return decision if isinstance(decision, Admission) else None

    def _try_admit(self) -> Admission | AdmissionRejection:
        """AdmissionControl.try_admit; a slot handed out makes the router busy (a drain waits for it)."""
        decision = self.admission.try_admit()
        if isinstance(decision, Admission):
            self._idle.clear()
        return decision

    def count_rejection(self, reason: str, count: int = 1) -> None:
        """`count` requests refused by admission at the door (admit(), the tokenizer pool, the HTTP acceptor), for
        routing_stats."""
        self._rejections[reason] += count

    def _admit(self, run: RequestRun) -> Admission:
        """admit(), noting a rejection's reason on the run (its record shows it)."""
        try:
            return self.admit()
        except RouterError as error:
            run.rejection_reason = error.rejection_reason
            raise

    async def _attempt(self, run: RequestRun) -> AsyncIterator[StreamChunk]:
        """Route the request and run it from where it is (the prompt, or after a migration the
        prompt + the tokens streamed so far) to its end."""
        if self._ended_by is not None:
            raise RouterError("UNAVAILABLE", self._ended_by)
        worker_request_id = f"{self.router_id}-{uuid.uuid4().hex}"
        run.begin_attempt(worker_request_id, self.dispatcher.open(worker_request_id))
        self._runs[worker_request_id] = run
        decision, run.cached_tokens = await self._route(run)
        run.decision = decision
        if run.inp.pooling_params is not None and decision.prefill_worker_id is not None:
            phases = self._remote_pool(run, decision)
        elif decision.prefill_worker_id is None:
            phases = self._local_prefill(run, run.stream, decision)
        elif self.infos[decision.prefill_worker_id].layerwise:
            phases = self._layerwise_prefill(run, run.stream, decision)
        else:
            phases = self._remote_prefill(run, run.stream, decision)
        first = not run.resumed
        async for chunk in phases:
            if first:
                first = False
                chunk = dataclasses.replace(chunk, kv_holder=decision.prefill_worker_id or decision.decode_worker_id)
            yield chunk

    def _migrate(self, run: RequestRun, lost: WorkerLostError) -> None:
        """End the attempt on the lost worker; raise UNAVAILABLE once the request has moved
        routing.max_migrations times, or when end_requests() ended it."""
        self._end_attempt(run)
        if self._ended_by is not None:
            raise RouterError("UNAVAILABLE", self._ended_by) from lost
        if run.num_migrations >= self.routing.max_migrations:
            raise RouterError("UNAVAILABLE", f"{lost}; the request already moved {run.num_migrations} times "
                                             f"(router.routing.max_migrations)") from lost
        run.num_migrations += 1
        logger.warning("[%s] %s; moving it (migration %d, %d tokens streamed)", quote_for_log(run.inp.request_id),
                       lost, run.num_migrations, len(run.output_token_ids))

    async def _remote_prefill(self, run: RequestRun, stream: asyncio.Queue[TokenDelta],
                              decision: RouteDecision) -> AsyncIterator[StreamChunk]:
        """Prefill on a prefill worker, then decode pulls the KV and continues. The decode worker
        is claimed up front so routing counts the request there while it is being prefilled."""
        prefill = run.prefill = self._assign(run, self.prefill_pool, decision.prefill_worker_id)
        decode = run.decode = self._assign(run, self.decode_pool, decision.decode_worker_id, prefill_tokens=0)
        result = await self._prefill(run, prefill)
        chunk = run.on_tokens(result.token_ids, result.logprobs, result.finish_reason, result.stop_reason,
                              result.prompt_logprobs)
        yield chunk
        if chunk.finish_reason is not None:
            run.worker_finished = result.finish_reason is not None
            return
        run.active_worker_id = decode.client.worker_id
        await run.call(self._handshake(decode.client, prefill.client))
        self.dispatcher.submit(decode.client.worker_id, self._decode_request(run, result))
        async for chunk in self._stream(run, stream):
            yield chunk

    async def _remote_pool(self, run: RequestRun, decision: RouteDecision) -> AsyncIterator[StreamChunk]:
        """An embedding on a prefill worker: its result is the request's one chunk; no decode worker is claimed and
        no KV moves (the prefill worker holds nothing for it). A layer-wise worker runs it by prefill() too."""
        prefill = run.prefill = self._assign(run, self.prefill_pool, decision.prefill_worker_id)
        result = await self._prefill(run, prefill)
        run.worker_finished = True
        yield dataclasses.replace(run.on_tokens((), (), result.finish_reason, result.stop_reason),
                                  embedding=result.embedding)

    async def _layerwise_prefill(self, run: RequestRun, stream: asyncio.Queue[TokenDelta],
                                 decision: RouteDecision) -> AsyncIterator[StreamChunk]:
        """Layer-wise transfer (the prefill worker's WorkerInfo.layerwise): the decode worker gets
        the request when the prefill starts, and this relays the prefill's progress to it on the
        request's decode stream (TransferParams, then the layers as they are written: its pull
        overlaps the forward), then the first token. One ordered path (a Ray stream in, the
        decode worker's stream out) carries every message of the request, so the decode worker
        sees its TransferParams before its layers, and both before its first token."""
        prefill = run.prefill = self._assign(run, self.prefill_pool, decision.prefill_worker_id)
        decode = run.decode = self._assign(run, self.decode_pool, decision.decode_worker_id, prefill_tokens=0)
        decode_id = decode.client.worker_id
        run.active_worker_id = decode_id
        await run.call(self._handshake(decode.client, prefill.client))
        self.dispatcher.submit(decode_id, DecodeRequest(
            run.worker_request_id, self.router_id, run.inp.prompt_token_ids, (), self._worker_params(run), 0, None,
            None, first_token_pending=True, cache_salt=run.inp.cache_salt, priority=run.inp.priority,
            lora_request=run.inp.lora_request))
        result = await self._prefill(run, prefill, decode_id)
        chunk = run.on_tokens(result.token_ids, result.logprobs, result.finish_reason, result.stop_reason,
                              result.prompt_logprobs)
        if chunk.finish_reason is not None:
            run.worker_finished = result.finish_reason is not None
            if run.worker_finished:  # the prefill worker holds nothing; the decode worker's request ends
                self.dispatcher.abort(decode_id, run.worker_request_id)
            yield chunk  # (a stop string: _end_attempt aborts it on both workers)
            return
        run.active_worker_id = decode_id
        self.dispatcher.relay(decode_id, PrefillFirstToken(run.worker_request_id, result.token_ids,
                                                           result.num_cached_tokens, result.generator_state))
        yield chunk
        async for chunk in self._stream(run, stream):
            yield chunk

    async def _local_prefill(self, run: RequestRun, stream: asyncio.Queue[TokenDelta],
                             decision: RouteDecision) -> AsyncIterator[StreamChunk]:
        """The decode worker prefills the prompt itself: no KV moves (colocated mode, or a
        prompt whose uncached part is short)."""
        decode = run.decode = self._assign(run, self.decode_pool, decision.decode_worker_id)
        run.active_worker_id = decode.client.worker_id
        request = DecodeRequest(run.worker_request_id, self.router_id, run.inp.prompt_token_ids,
                                tuple(run.output_token_ids), self._worker_params(run), 0, None, None,
                                cache_salt=run.inp.cache_salt, priority=run.inp.priority,
                                lora_request=run.inp.lora_request, pooling_params=run.inp.pooling_params)
        self.dispatcher.submit(decode.client.worker_id, request)
        async for chunk in self._stream(run, stream):
            yield chunk

    def _assign(self, run: RequestRun, pool: WorkerPool, worker_id: str,
                prefill_tokens: int | None = None) -> Assignment:
        """Claim the worker for the run's current attempt (the caller names it the run's prefill or
        decode claim); by default the prompt's uncached tokens there count as queued prefill work
        until the first token is back."""
        if prefill_tokens is None:
            prefill_tokens = len(run.context_token_ids) - run.cached_tokens.get(worker_id, 0)
        return pool.assign(worker_id, prefill_tokens)

    async def _prefill(self, run: RequestRun, prefill: Assignment, relay_to: str | None = None) -> PrefillResult:
        """The prefill's result; `relay_to`: a layer-wise prefill, whose progress goes to that decode worker."""
        request = PrefillRequest(run.worker_request_id, run.inp.prompt_token_ids, self._worker_params(run),
                                 self.router_id, run.inp.cache_salt, run.inp.priority, run.inp.lora_request,
                                 run.inp.pooling_params)
        run.active_worker_id = prefill.client.worker_id
        run.relay_worker_id = relay_to
        call = ((lambda: prefill.client.prefill(request)) if relay_to is None
                else (lambda: self._relay_prefill(prefill.client, request, relay_to)))
        result: PrefillResult = await run.call(self._call(prefill.client, "prefill", call))
        run.relay_worker_id = None
        prefill.pool.prefilled(prefill)
        if result.invalid_field is not None:  # its engine ended it for the request's own fault
            raise InvalidRequestError(result.invalid_field, result.error.removeprefix(f"{result.invalid_field}: "))
        if result.finish_reason == "abort":
            raise RouterError("UNAVAILABLE", f"prefill worker {prefill.client.worker_id} aborted the request")
        run.timeline.on_prefilled(result.queue_s, result.compute_s, time.monotonic())
        run.num_cached_tokens = result.num_cached_tokens
        run.transfer = result.transfer
        return result

    async def _relay_prefill(self, prefill: PrefillWorkerAPI, request: PrefillRequest, decode_id: str) -> PrefillResult:
        """Run a layer-wise prefill, relaying each LayerwiseProgress to the decode worker as it comes."""
        result: PrefillResult | None = None
        async with contextlib.aclosing(prefill.prefill_layerwise(request)) as items:  # closed early: aborted there
            async for item in items:
                if isinstance(item, LayerwiseProgress):
                    self.dispatcher.relay(decode_id, item)
                else:
                    result = item
        if result is None:
            raise RuntimeError(f"prefill worker {prefill.worker_id}'s stream ended without a result")
        return result

    def _decode_request(self, run: RequestRun, result: PrefillResult) -> DecodeRequest:
        return DecodeRequest(run.worker_request_id, self.router_id, run.inp.prompt_token_ids, result.token_ids,
                             self._worker_params(run), result.num_cached_tokens, result.transfer,
                             result.generator_state, cache_salt=run.inp.cache_salt, priority=run.inp.priority,
                             lora_request=run.inp.lora_request)

    async def _stream(self, run: RequestRun, stream: asyncio.Queue[TokenDelta]) -> AsyncIterator[StreamChunk]:
        decode = run.decode
        while True:
            delta: TokenDelta | WorkerLostError = await run.bounded(stream.get())
            if isinstance(delta, WorkerLostError):
                raise delta
            run.on_decode_timing(delta)
            if delta.invalid_field is not None:  # refused at admission, or ended by its engine for its own fault
                raise InvalidRequestError(delta.invalid_field, delta.error.removeprefix(f"{delta.invalid_field}: "))
            if delta.error is not None:
                raise RouterError("INTERNAL", delta.error)
            if delta.kv_transfer_failed and run.prefill is not None:
                # Decode recomputed the prompt; the producer may still hold the KV under lease.
                self._abort_in_background(run.prefill.client, run.worker_request_id)
            if delta.token_ids:
                decode.pool.prefilled(decode)
            if delta.finish_reason is not None:
                run.worker_finished = True
                run.num_cached_tokens = delta.num_cached_tokens
            chunk = run.on_tokens(delta.token_ids, delta.logprobs, delta.finish_reason, delta.stop_reason,
                                  delta.prompt_logprobs)
            if delta.embedding is not None:
                chunk = dataclasses.replace(chunk, embedding=delta.embedding)
            if chunk.token_ids or chunk.text or chunk.finish_reason is not None:
                yield chunk
            if chunk.finish_reason is not None:
                return

    def _worker_params(self, run: RequestRun) -> SamplingParams:
        return dataclasses.replace(run.inp.sampling_params, stop=())

    async def _handshake(self, decode: DecodeWorkerAPI, prefill: PrefillWorkerAPI) -> None:
        """_ensure_peer; a handshake that fails for another reason than incompatible layouts means
        the prefill worker's transfer agent is gone (it died holding the KV): the request moves
        on as when its worker is lost, recomputing what it has streamed."""
        try:
            await self._ensure_peer(decode, prefill)
        except RouterError as error:
            if isinstance(error.__cause__, KVLayoutMismatchError):
                raise
            raise WorkerLostError(prefill.worker_id, f"decode worker {decode.worker_id} cannot reach its KV "
                                                     f"({error.message})") from error

    async def _ensure_peer(self, decode: DecodeWorkerAPI, prefill: PrefillWorkerAPI) -> None:
        """Handshake each (decode, prefill agent) pair once; concurrent requests share it."""
        agent = self.infos[prefill.worker_id].agent
        await self.peers.ensure(decode.worker_id, agent.agent_name,
                                lambda: self._call(decode, "add_peer", lambda: decode.add_peer(agent)))

    async def _call(self, client: WorkerAPI, method: str, call: Callable[[], Awaitable[T]]) -> T:
        """Await call(), the worker's `method` (made only once this coroutine runs, so a request
        cancelled first never starts it); a lost worker is reported (its requests move) and
        re-raised, a failure other than an invalid request becomes UNAVAILABLE."""
        try:
            return await call()
        except WorkerLostError as lost:
            self._on_worker_lost(lost.worker_id, lost.reason)
            raise
        except InvalidRequestError:
            raise
        except Exception as error:
            logger.warning("worker %s failed in %s: %s", client.worker_id, method, error)
            raise RouterError("UNAVAILABLE", f"worker {client.worker_id} failed in {method}: "
                                             f"{type(error).__name__}: {error}") from error

    def _end(self, run: RequestRun) -> None:
        """Release the router's bookkeeping; abort what the workers still hold (not awaited:
        this also runs while the request's task is being cancelled)."""
        step_of = run.inp.step_of
        if step_of is None:
            self.request_ids.stop(run.inp.request_id)
        elif step_of in self._stepwise:
            self._stepwise[step_of].on_step_ended(run.num_migrations)
        self._end_attempt(run)
        record = run.record(self.slo_targets(run.inp))
        self._observe(record)
        if step_of is None:
            self._note_params(run.inp, record)

    def _note_params(self, inp: GenerationInput, record: RequestRecord) -> None:
        """A client's request (or one sequence of a fan-out) ended: a finished lone request's parameters are
        observed now, a sequence's output counts towards its fan-out's (observed when the fan-out ends)."""
        fan_out = self._fan_outs.get(inp.request_id)
        if fan_out is not None:
            fan_out.on_sequence_ended(record)
        elif record.finish_reason is not None:
            self._observe_params(RequestParamsRecord(1, inp.sampling_params.max_tokens, record.num_output_tokens))

    def _observe_params(self, params: RequestParamsRecord | None) -> None:
        """Hand a finished client request's parameters (None: it did not finish) to the params observer."""
        if params is None or self.params_observer is None:
            return
        try:
            self.params_observer(params)
        except Exception:  # metrics must never break a request's cleanup
            logger.exception("the request params observer failed")

    def _observe(self, record: RequestRecord) -> None:
        """Hand an ended request's (or internal step's) record to the observer."""
        if self.observer is None:
            return
        try:
            self.observer(record)
        except Exception:  # metrics must never break a request's cleanup
            logger.exception("[%s] the request observer failed", quote_for_log(record.request_id))

    def _end_attempt(self, run: RequestRun) -> None:
        """Release the attempt's worker claims and stream; abort what its workers still hold."""
        request_id = run.worker_request_id
        self._runs.pop(request_id, None)
        self.dispatcher.close(request_id)
        for assignment in run.assignments:
            assignment.pool.release(assignment)
        if not run.worker_finished:
            if run.prefill is not None:
                self._abort_in_background(run.prefill.client, request_id)
            if run.decode is not None:  # on its stream, after the request itself
                self.dispatcher.abort(run.decode.client.worker_id, request_id)
        run.prefill = run.decode = None
        run.active_worker_id = run.relay_worker_id = None

    def _abort_in_background(self, client: WorkerAPI, request_id: str) -> None:
        self._in_background(self._abort(client, request_id))

    def _in_background(self, coroutine: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, client: WorkerAPI, request_id: str) -> None:
        try:
            await client.abort(request_id)
        except Exception as error:
            logger.warning("[%s] abort on %s failed: %s", request_id, client.worker_id, error)


def _error_code(error: BaseException, deadline: float | None) -> str:
    """The gRPC status code name a request ends with when `error` ends it; `deadline`: the request's
    (time.monotonic()), None if it has none."""
    if isinstance(error, RouterError):
        return error.code
    if isinstance(error, InvalidRequestError):
        return "INVALID_ARGUMENT"
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        # A gRPC call's deadline is the request's, and gRPC cancels the call by its own timer, which
        # may run before the request's: closed once its deadline passed, it ran out of time.
        ran_out = deadline is not None and time.monotonic() >= deadline - DEADLINE_CLOCK_SLACK_S
        return "DEADLINE_EXCEEDED" if ran_out else "CANCELLED"
    return "INTERNAL"


DEADLINE_CLOCK_SLACK_S = 0.01
"""How early a cancellation may come and still be the deadline's: grpc's Python API states a call's time remaining
from its deadline on the wall clock (time.time()), while its timer cancels the call on the monotonic clock, so the
request's monotonic deadline (api_common.grpc_deadline) can sit a few milliseconds after the cancellation that
enforces it (a suite run here once recorded a 0.5 s deadline as CANCELLED)."""
