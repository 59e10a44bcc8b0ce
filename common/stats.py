"""Stats dataclasses returned by cores; servers turn them into metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine's scheduler and KV pool (cumulative counters since start)."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    """Blocks with no owner, including cached-free ones that still hold a reusable prefix."""
    num_cached_free_kv_blocks: int
    """Free blocks that still carry a block hash (evictable prefix cache)."""
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits: int
    """Prompt tokens found in the prefix cache."""
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_generation_tokens: int

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks owned by requests, in [0, 1]."""
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass(frozen=True)
class RoutingStats:
    """A router's routing outcomes since start (cumulative counts, sorted by name)."""

    decisions: tuple[tuple[str, int], ...]
    """(reason, requests): cache_hit, load, local_prefill, round_robin."""
    rejections: tuple[tuple[str, int], ...]
    """(reason, requests) rejected by admission control: ttft_slo, queue_full, no_kv_capacity."""
