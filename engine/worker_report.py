"""A worker's answer to a router's report poll (shared by the prefill and decode workers).

The engine's state is read on its EngineLoop thread only; the caller's event loop just awaits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from splitserve.common.kv_events import WorkerCounters, WorkerReport
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.engine_loop import EngineLoop

def worker_counters(engine: EngineCore, kv_leases_expired: int) -> WorkerCounters:
    """Engine thread: the cumulative counters (plain attribute reads: cheap enough for every poll)."""
    scheduler = engine.scheduler
    counters = WorkerCounters(engine.num_prompt_tokens, engine.num_generation_tokens, scheduler.prefix_cache_queries,
                              scheduler.prefix_cache_hits, scheduler.num_preemptions, kv_leases_expired)
    if engine.speculator is None:
        return counters
    spec = engine.speculator.stats()
    return replace(counters, spec_decode_num_drafts=spec.num_drafts, spec_decode_num_draft_tokens=spec.num_draft_tokens,
                   spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
                   spec_decode_num_accepted_tokens_per_pos=spec.num_accepted_tokens_per_pos)


def build_report(engine: EngineCore, worker_id: str, epoch: str | None, after_seq: int,
                 kv_leases_expired: int = 0) -> WorkerReport:
    """Engine thread: the load, the counters and the KV events after the cursor (or a snapshot),
    taken together."""
    batches, snapshot = engine.kv_report(epoch, after_seq)
    return WorkerReport(worker_id, engine.epoch, engine.load_report(), batches, snapshot,
                        worker_counters(engine, kv_leases_expired))


async def wait_for_report(loop: EngineLoop, worker_id: str, epoch: str | None, after_seq: int,
                          max_wait_s: float, kv_leases_expired: Callable[[], int] = lambda: 0) -> WorkerReport:
    """At once when there are KV events after the cursor or it needs a snapshot; otherwise the
    report once new events are logged, or after `max_wait_s` the current load with
    no events. `kv_leases_expired()` (a producer's lease count) is read on the engine thread."""
    def build(engine: EngineCore) -> WorkerReport:
        return build_report(engine, worker_id, epoch, after_seq, kv_leases_expired())

    report = await loop.run(build)
    if report.kv_events or report.snapshot is not None or max_wait_s <= 0:
        return report
    await loop.wait_until(lambda engine: engine.has_kv_events_after(after_seq), max_wait_s)
    return await loop.run(build)
