"""The engine's mutable view of one request (owned by the scheduler)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from splitserve.common.block_hash import BlockHash
from splitserve.common.errors import InvalidRequestError
from splitserve.common.pooling import ResolvedPooling
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.token_logprobs import TokenLogprobs


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    """Consumer role: blocks allocated, prompt KV being pulled from a prefill worker."""
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_PREFILLED = "prefilled"
    """Producer role: the prompt's KV is computed and its blocks are held for a transfer."""

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_PREFILLED)


@dataclass(eq=False)
class Request:
    """Invariant: 0 <= num_computed_tokens <= num_tokens; KV exists for the first
    num_computed_tokens of all_token_ids; the last sampled token never has KV yet."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_index: int
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    """Prompt followed by every sampled token; appended to, never rebuilt."""
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first admission (-1 until admitted)."""
    block_hashes: list[BlockHash] = field(default_factory=list)
    """Chained hashes of the full blocks of all_token_ids computed so far."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    """With sampling_params.prompt_logprobs: entry p is prompt token p's (None for p = 0, and for
    positions not computed yet); written by position, so a chunk recomputed after a preemption
    overwrites its entries with the same values instead of appending."""
    stop_reason: int | str | None = None
    error: InvalidRequestError | None = None
    """Why the engine itself ended the request (FINISHED_ABORTED): what the client asked cannot be
    served (its grammar refused the sampled token); None for an abort from outside."""
    num_preemptions: int = 0
    hold_kv_after_prefill: bool = False
    """Producer role: after the first sampled token, finish as PREFILLED and keep the blocks."""
    first_scheduled_at: float | None = None
    """time.monotonic() when the scheduler first put the request in the running batch (kept
    across preemptions); None until then. Splits a worker's queue time from its compute time."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens proposed to follow all_token_ids, verified by the next decode step (never
    part of all_token_ids, never hashed); empty when the request does not speculate."""
    priority: int = 0
    """vLLM's request priority: under the priority scheduling policy, lower values are admitted first
    and preempted last (ties by arrival_index); always 0 under fcfs."""
    cache_salt: str | None = None
    """Salts the prefix cache (vLLM's cache_salt): block_hashes start from the salted root, so the
    request shares cached blocks only with requests of the same salt. None: unsalted."""
    lora_name: str | None = None
    """The LoRA adapter the request runs with (its LoRARequest's lora_name), None for the base model; its
    block_hashes start from the adapter's root (common/block_hash.py), so adapters never share KV blocks."""
    pooling: ResolvedPooling | None = None
    """A pooling (embedding) request: it runs its prompt's prefill, samples nothing and finishes with the pooled
    hidden state (EngineCore.add_pooling_request); None for a request that generates."""

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    @property
    def scores_prompt(self) -> bool:
        """Whether the prompt's logprobs are still to be computed: asked for, and the first output token
        (which delivers them) not sampled yet; a request recomputed after that does not score again."""
        return self.sampling_params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether its first admission may start after cached blocks: not when it scores its prompt (every
        position's logits) nor when its pooling needs positions a hit would skip (ResolvedPooling)."""
        return not self.scores_prompt and (self.pooling is None or self.pooling.reads_prefix_cache)

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None
