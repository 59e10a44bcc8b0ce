"""Token-budget scheduler: decode first, then chunked prefill, preemption by recompute.

Each request carries `num_computed_tokens` chasing `num_tokens`. One `schedule()` hands
out at most `max_num_batched_tokens` tokens: first to running requests in admission order
(a decode needs 1 token, an unfinished prefill its remaining prompt), then to waiting
requests in the order of the scheduling policy (engine/request_queue.py: arrival order under
fcfs; (priority, arrival) under priority). When a running request finds no free block, a victim
is preempted, until the request fits or is itself the victim (then nothing after it in the
batch is scheduled this step): under fcfs the most recently admitted running request, under
priority the running request with the largest (priority, arrival_index) (vLLM v1's rule), which
may be one already scheduled this step (its chunk is dropped and its tokens go back to the
budget). A victim's blocks are freed and it recomputes from scratch (usually hitting its own
just-freed blocks in the prefix cache); it waits at the head of the queue under fcfs, at its
(priority, arrival) place under priority. A step that preempted admits nothing new.

A decoding request with draft tokens (speculative decoding) gets 1 + k tokens: its last token
and the k drafts, trimmed to the budget left; the drafts' KV counts only when the engine's
verification accepts them (`accept_draft_tokens`), and their blocks beyond that are returned.

Requests whose prompt KV comes from another worker (consumer role) wait outside both
queues in WAITING_FOR_REMOTE_KV with their blocks allocated; once the pull completes they
join `ready` (ordered like the waiting queue: completion order under fcfs) and are admitted
ahead of waiting prompts (they only need decode steps).

With LoRA (max_loras set), the running batch holds requests of at most max_loras distinct adapters (the base
model is no adapter): a ready or waiting request of another adapter waits at the head of its queue until a
running request of one of them finishes, as a request waits for blocks (the queue's order is kept).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from splitserve.engine.block_manager import NO_PREFIX, BlockManager
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.request_queue import RequestQueue


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool
    policy: str = "fcfs"
    """EngineConfig.scheduling_policy: fcfs or priority."""
    max_loras: int | None = None
    """With LoRA: most distinct adapters in the running batch (so in a step); None: no adapters are served."""


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request whose KV is computed this step.

    Positions are start_position .. start_position + len(token_ids) - 1.
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    block_table: tuple[int, ...]
    samples: bool
    """True when the chunk reaches the end of the known tokens, so a next token is sampled."""
    num_spec_tokens: int = 0
    """Draft tokens at the end of token_ids (a speculating decode: the last known token, then
    these): their KV is written, but it counts only once the verification accepts them, and a
    next token is sampled at each of the last 1 + num_spec_tokens positions."""
    scores_prompt: bool = False
    """The request wants its prompt's logprobs (Request.scores_prompt): the forward returns the logits
    of every token of the chunk, not only the sampling row (never together with draft tokens)."""
    lora_name: str | None = None
    """The LoRA adapter whose deltas the chunk's rows get (Request.lora_name); None: the base model."""
    pools: bool = False
    """A pooling request's prompt chunk (Request.pooling): it samples nothing (samples is False), and the engine
    pools its tokens' final hidden states."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.start_position + len(self.token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """Logit rows this chunk produces: 0 (a prefill chunk short of the end), 1, or 1 + drafts."""
        return 1 + self.num_spec_tokens if self.samples else 0

    @property
    def num_logit_rows(self) -> int:
        """Logit rows the forward returns for this chunk: every token's when it scores the prompt (the
        sampling row, if any, last), else num_sampled_rows."""
        return self.num_tokens if self.scores_prompt else self.num_sampled_rows


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted_request_ids: tuple[str, ...]

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def priority_order(request: Request) -> tuple[int, int]:
    """The priority policy's order: lower priority values first, ties by arrival."""
    return request.priority, request.arrival_index


class Scheduler:
    """Owns the waiting queue and the running batch."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: RequestQueue[Request] = RequestQueue(config.policy, priority_order)
        self.ready: RequestQueue[Request] = RequestQueue(config.policy, priority_order)
        """Remote-KV requests whose pull completed (fcfs: in completion order)."""
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def add_remote(self, request: Request) -> None:
        """Track a consumer-role request whose blocks the caller allocated; nothing is scheduled yet."""
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request

    def remote_kv_ready(self, request_id: str) -> None:
        """The pull filled the request's blocks: its whole prompt now has KV."""
        request = self.requests[request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        self.block_manager.cache_full_blocks(request)
        self.ready.push(request)

    def remote_kv_failed(self, request_id: str) -> None:
        """The pull failed: free the blocks and recompute the prompt locally, first in line (priority:
        at its place)."""
        request = self.requests[request_id]
        self.block_manager.free(request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.waiting.push_front(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        """False when every unfinished request waits for remote KV (a step would do nothing)."""
        return bool(self.waiting or self.running or self.ready)

    # ---- schedule ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        """Tokens per scheduled request, in scheduling order (a preempted victim's entry is dropped)."""
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 1 and request.spec_token_ids:
                del request.spec_token_ids[budget - 1:]  # drafts past the budget are dropped
                num_new += len(request.spec_token_ids)
            num_preempted = len(preempted)
            if not self._allocate_or_preempt(request, num_new, scheduled, preempted):
                break  # the request preempted itself: nothing after it runs this step (vLLM's rule)
            if len(preempted) > num_preempted:  # a victim scheduled before it (priority) moved it up, freed tokens
                index = self.running.index(request)
                budget = self.config.max_num_batched_tokens - sum(scheduled.values())
            scheduled[request] = num_new
            budget -= num_new
            index += 1
        if not preempted:
            budget = self._admit_ready(budget, scheduled)
            budget = self._admit_waiting(budget, scheduled)
        chunks = tuple(self._make_chunk(request, num_new) for request, num_new in scheduled.items())
        return SchedulerOutput(chunks, tuple(r.request_id for r in preempted))

    def _allocate_or_preempt(self, request: Request, num_new: int, scheduled: dict[Request, int],
                             preempted: list[Request]) -> bool:
        """Allocate for `request`, preempting victims until it fits; a victim already scheduled this
        step loses its entry in `scheduled`. Returns False when `request` itself was preempted."""
        while self.block_manager.allocate(request, num_new) is None:
            victim = self._preemption_victim()
            self.running.remove(victim)
            scheduled.pop(victim, None)
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preemption_victim(self) -> Request:
        """fcfs: the most recently admitted running request; priority: the running request with the
        largest (priority, arrival_index), vLLM v1's rule."""
        if self.config.policy == "priority":
            return max(self.running, key=priority_order)
        return self.running[-1]

    def _admit_ready(self, budget: int, scheduled: dict[Request, int]) -> int:
        while self.ready and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.ready.peek()
            num_new = request.num_tokens - request.num_computed_tokens
            if not self._adapter_fits(request) or num_new > budget or self.block_manager.allocate(
                    request, num_new) is None:
                break
            self.ready.pop()
            self._start_running(request)
            scheduled[request] = num_new
            budget -= num_new
        return budget

    def _admit_waiting(self, budget: int, scheduled: dict[Request, int]) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if not self._adapter_fits(request):
                break
            # A request scoring its prompt (or pooling over positions a hit would skip) computes every position
            # (vLLM's skip_reading_prefix_cache).
            reads_cache = request.num_computed_tokens == 0 and request.reads_prefix_cache
            prefix = self.block_manager.match_prefix(request) if reads_cache else NO_PREFIX
            num_new = request.num_tokens - request.num_computed_tokens - prefix.num_tokens
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if self.block_manager.allocate(request, num_new, prefix) is None:
                break
            self.waiting.pop()
            self._record_admission(request, prefix.num_tokens)
            request.num_computed_tokens += prefix.num_tokens
            self._start_running(request)
            scheduled[request] = num_new
            budget -= num_new
        return budget

    def _adapter_fits(self, request: Request) -> bool:
        """Whether admitting `request` keeps the running batch within max_loras distinct adapters."""
        if request.lora_name is None:
            return True
        running = {r.lora_name for r in self.running if r.lora_name is not None}
        return request.lora_name in running or len(running) < self.config.max_loras

    def _start_running(self, request: Request) -> None:
        """Admit into the running batch; the first admission stamps first_scheduled_at (once per
        request, so the clock is read per admission, never per step)."""
        if request.first_scheduled_at is None:
            request.first_scheduled_at = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _record_admission(self, request: Request, num_cached: int) -> None:
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_cached
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_cached

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request.request_id)
        request.spec_token_ids.clear()
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def _make_chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        if not request.spec_token_ids:
            return ScheduledChunk(request.request_id, tuple(request.all_token_ids[start:start + num_new]), start,
                                  tuple(self.block_manager.block_table(request.request_id)),
                                  samples=start + num_new == request.num_tokens and request.pooling is None,
                                  scores_prompt=request.scores_prompt, lora_name=request.lora_name,
                                  pools=request.pooling is not None)
        num_spec = max(0, start + num_new - request.num_tokens)  # only a decode (num_new = 1 + drafts) has some
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=(tuple(request.all_token_ids[start : start + num_new - num_spec])
                       + tuple(request.spec_token_ids[:num_spec])),
            start_position=start,
            block_table=tuple(self.block_manager.block_table(request.request_id)),
            samples=start + num_new - num_spec == request.num_tokens,
            num_spec_tokens=num_spec,
            lora_name=request.lora_name,
        )

    # ---- after the forward pass ----------------------------------------------------------
    def advance(self, output: SchedulerOutput) -> None:
        """Record that every scheduled chunk's KV now exists (draft tokens' KV only once accepted)."""
        for chunk in output.chunks:
            request = self.requests[chunk.request_id]
            request.num_computed_tokens += chunk.num_tokens - chunk.num_spec_tokens
            if chunk.num_spec_tokens:
                request.spec_token_ids.clear()
            self.block_manager.cache_full_blocks(request)

    def accept_draft_tokens(self, request: Request, num_accepted: int) -> None:
        """After verification appended the request's output tokens: the first `num_accepted` drafts
        (now output tokens) have KV. The rejected drafts' slots are rolled back: the blocks past the
        computed tokens are returned, so no block holding a rejected token is ever hashed or kept."""
        request.num_computed_tokens += num_accepted
        self.block_manager.cache_full_blocks(request)
        self.block_manager.truncate(request.request_id, request.num_computed_tokens)

    def finish(self, request_id: str, status: RequestStatus, keep_blocks: bool = False) -> Request | None:
        """Remove a request in any state and free its blocks at once (unless the caller keeps
        them: then they stay allocated under the request id until block_manager.free)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for queue in (self.running, self.waiting, self.ready):
            if request in queue:
                queue.remove(request)
                break
        if not keep_blocks:
            self.block_manager.free(request_id)
        request.status = status
        return request
