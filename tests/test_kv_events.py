"""KV events and load reports: the numbered event log, the engine's reports, the workers' `report()`."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from splitserve.common.block_hash import BlockHasher
from splitserve.common.config import EngineConfig
from splitserve.common.kv_events import BlocksRemoved, BlocksStored, KVEventBatch, KVSnapshot, LoadReport
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.worker_messages import DecodeRequest, PrefillRequest
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.kv_event_log import KVEventLog
from splitserve.engine.step_costs import StepCosts
from splitserve.testing.in_process_cluster import make_decode_worker, make_prefill_worker
from tests.factories import RouterOutputs, engine_token_ids, make_block_manager, make_request

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def replay(batches) -> set[int]:
    """What a router's index holds after applying `batches` to an empty cache."""
    hashes: set[int] = set()
    for batch in batches:
        for event in batch.events:
            if isinstance(event, BlocksStored):
                hashes.update(event.block_hashes)
            else:
                hashes.difference_update(event.block_hashes)
    return hashes


# ---- the log ---------------------------------------------------------------------------------
A, B, C = BlocksStored((1, 2), None), BlocksRemoved((2,)), BlocksStored((3,), 1)


def test_batches_are_numbered_from_one_and_empty_steps_make_none():
    log = KVEventLog()
    assert (log.seq, log.append([])) == (0, None)
    first, second = log.append([A]), log.append([B, C])
    assert (first, second) == (KVEventBatch(log.epoch, 1, (A,)), KVEventBatch(log.epoch, 2, (B, C)))
    assert log.seq == 2 and len(log.epoch) == 32 and KVEventLog().epoch != log.epoch


def test_a_cursor_in_the_epoch_continues():
    log = KVEventLog()
    first, second = log.append([A]), log.append([B, C])
    no_snapshot = lambda: pytest.fail("a continuable cursor takes no snapshot")  # noqa: E731
    assert log.since(log.epoch, 0, no_snapshot) == ((first, second), None)
    assert log.since(log.epoch, 1, no_snapshot) == ((second,), None)
    assert log.since(log.epoch, 2, no_snapshot) == ((), None)


def test_uncontinuable_cursors_get_a_snapshot_at_the_current_seq():
    log = KVEventLog(max_batches=2)
    for events in ([A], [B], [C]):
        log.append(events)
    snapshot = KVSnapshot(log.epoch, 3, frozenset({1, 3}))
    hashes = lambda: frozenset({1, 3})  # noqa: E731
    assert log.since(None, 0, hashes) == ((), snapshot)  # never synced
    assert log.since("another-epoch", 3, hashes) == ((), snapshot)  # the worker restarted
    assert log.since(log.epoch, 0, hashes) == ((), snapshot)  # batch 1 is no longer retained
    assert log.since(log.epoch, 4, hashes) == ((), snapshot)  # ahead of the log
    assert log.since(log.epoch, -1, hashes) == ((), snapshot)
    assert [b.seq for b in log.since(log.epoch, 1, hashes)[0]] == [2, 3]  # oldest retained is 2


def test_a_new_log_continues_only_from_zero():
    log = KVEventLog()
    assert log.since(log.epoch, 0, frozenset) == ((), None)
    assert log.since(None, 0, frozenset) == ((), KVSnapshot(log.epoch, 0, frozenset()))
    with pytest.raises(ValueError, match="max_batches"):
        KVEventLog(max_batches=0)


def test_block_manager_events_replayed_from_zero_equal_the_snapshot():
    manager, log = make_block_manager(num_blocks=4, block_size=4), KVEventLog()
    for request_id, prompt in (("a", list(range(9))), ("b", list(range(8)) + [40, 41, 42, 43]),
                               ("c", list(range(100, 113)))):
        request = make_request(request_id, prompt)
        match = manager.match_prefix(request)
        manager.allocate(request, len(prompt) - match.num_tokens, match)
        request.num_computed_tokens = len(prompt)
        manager.cache_full_blocks(request)
        manager.free(request_id)
        log.append(manager.take_events())
    batches, _ = log.since(log.epoch, 0, manager.cached_block_hashes)
    assert [type(e) for b in batches for e in b.events] == [BlocksStored, BlocksStored, BlocksRemoved, BlocksStored]
    _, snapshot = log.since(None, 0, manager.cached_block_hashes)
    assert snapshot == KVSnapshot(log.epoch, 3, frozenset(replay(batches)))
    assert snapshot.block_hashes == frozenset(request.block_hashes)  # c's 4 blocks evicted all of a's and b's


# ---- step costs ------------------------------------------------------------------------------
def test_step_costs_are_moving_averages_of_prefill_heavy_and_decode_only_steps():
    costs = StepCosts()
    costs.record(num_prefill_tokens=32, num_batched_tokens=40, seconds=0.4)
    assert (costs.prefill_s_per_token, costs.decode_step_s) == (pytest.approx(0.01), None)
    costs.record(64, 64, 1.28)  # 0.02 s/token: 0.01 + 0.2 * (0.02 - 0.01)
    costs.record(31, 35, 9.0)  # too few prompt tokens: not sampled
    assert (costs.prefill_s_per_token, costs.decode_step_s) == (pytest.approx(0.012), None)
    costs.record(0, 4, 0.5)
    costs.record(0, 4, 1.0)
    assert (costs.prefill_s_per_token, costs.decode_step_s) == (pytest.approx(0.012), pytest.approx(0.6))


# ---- the engine ------------------------------------------------------------------------------
SMALL_POOL = EngineConfig(block_size=8, num_kv_blocks=8, max_model_len=64, max_num_batched_tokens=64,
                          dtype="float32", device="cpu")


def test_engine_batches_replay_to_its_prefix_cache(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, SMALL_POOL)
    prompt_a = list(range(3, 23))  # 20 tokens: blocks 0-2
    prompt_b = prompt_a[:16] + [100, 101, 102, 103, 104]  # shares 2 blocks; admitted with a, so duplicates
    engine.add_request("a", prompt_a, GREEDY)
    engine.add_request("b", prompt_b, GREEDY)
    outputs = engine_token_ids(engine)
    hasher = BlockHasher(SMALL_POOL.block_size, SMALL_POOL.hash_seed)
    # KV exists for every token but the last sampled one: 24 tokens (3 blocks) of each.
    a = hasher.hash_prefix(prompt_a + outputs["a"][:-1])
    b = hasher.hash_prefix(prompt_b + outputs["b"][:-1])
    batches, snapshot = engine.kv_report(engine.epoch, 0)
    assert snapshot is None
    # b's 3rd block completes one decode step before a's (its prompt is one token longer).
    assert [e for batch in batches for e in batch.events] == [
        BlocksStored((a[0], a[1]), None), BlocksStored((b[2],), a[1]), BlocksStored((a[2],), a[1])]
    assert [batch.seq for batch in batches] == [1, 2, 3]  # steps 2 and 3 stored nothing: no batch
    assert replay(batches) == engine.block_manager.cached_block_hashes() == {a[0], a[1], a[2], b[2]}


def test_events_between_steps_are_reported_without_a_step(tiny_llama_dir):
    engine = EngineCore(tiny_llama_dir, SMALL_POOL)
    prompt = list(range(3, 23))
    engine.add_request("a", prompt, GREEDY)
    outputs = engine_token_ids(engine)
    hashes = BlockHasher(SMALL_POOL.block_size, SMALL_POOL.hash_seed).hash_prefix(prompt + outputs["a"][:-1])
    seq = engine.kv_report(None, 0)[1].seq
    # A pulled request needs 6 of the 8 blocks: the free list [3..7, 2, 1, 0] gives up blocks 3-7 and 2.
    assert engine.add_remote_request("r", list(range(200, 240)), [5], GREEDY, 0, None) is not None
    batches, snapshot = engine.kv_report(engine.epoch, seq)
    assert snapshot is None
    assert batches == (KVEventBatch(engine.epoch, seq + 1, (BlocksRemoved((hashes[2],)),)),)
    _, snapshot = engine.kv_report(None, 0)
    assert snapshot == KVSnapshot(engine.epoch, seq + 1, frozenset(hashes[:2]))


def test_load_report_counts_queued_prompt_tokens_and_step_costs(tiny_llama_dir):
    config = EngineConfig(block_size=8, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=32, dtype="float32",
                          device="cpu")
    engine = EngineCore(tiny_llama_dir, config)
    engine.add_request("a", list(range(3, 23)), GREEDY)  # 20 tokens
    engine.add_request("b", list(range(100, 130)), GREEDY)  # 30 tokens
    assert engine.load_report() == LoadReport(num_running=0, num_waiting=2, num_queued_prefill_tokens=50,
                                              num_kv_blocks=64, num_free_kv_blocks=64, prefill_s_per_token=None,
                                              decode_step_s=None)
    engine.step()  # a's 20 prompt tokens and 12 of b's: 32 prompt tokens, 3 + 2 blocks
    load = engine.load_report()
    assert load.prefill_s_per_token > 0
    assert load == LoadReport(2, 0, 18, 64, 59, load.prefill_s_per_token, None)
    engine.add_remote_request("r", list(range(300, 310)), [5], GREEDY, 0, None)  # 2 blocks, its KV is pulled
    assert engine.load_report() == dataclasses.replace(load, num_waiting=1, num_free_kv_blocks=57)
    engine.step()  # a decodes, b finishes its prompt (2 more blocks): 18 prompt tokens, not a prefill sample
    assert engine.load_report() == LoadReport(2, 1, 0, 64, 55, load.prefill_s_per_token, None)
    engine.step()  # decodes only
    decode_step_s = engine.load_report().decode_step_s
    assert decode_step_s > 0 and engine.load_report().prefill_s_per_token == load.prefill_s_per_token


# ---- the workers -----------------------------------------------------------------------------
PROMPT = tuple(range(3, 60))  # 57 tokens: 7 full blocks of 8
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


async def _serve(worker, request_id: str) -> None:
    """Run PROMPT through a prefill worker, or through a decode worker's local prefill."""
    if hasattr(worker, "prefill"):
        await worker.prefill(PrefillRequest(request_id, PROMPT, ONE_TOKEN))
        return
    outputs = await RouterOutputs.open(worker, "router-0")
    try:
        outputs.submit(DecodeRequest(request_id, "router-0", PROMPT, (), ONE_TOKEN, 0, None, None))
        async with asyncio.timeout(60):
            while not any(d.finish_reason for d in await outputs.next()):
                pass
    finally:
        outputs.close()


@pytest.mark.parametrize("make_worker", [make_prefill_worker, make_decode_worker], ids=["prefill", "decode"])
def test_worker_report_snapshot_then_the_prompts_block_hashes(tiny_llama_dir, make_worker):
    async def scenario():
        worker = make_worker(tiny_llama_dir)
        try:
            config = worker.engine.config
            hashes = tuple(BlockHasher(config.block_size, config.hash_seed).hash_prefix(PROMPT))
            first = await worker.report(None, 0, 0.1)
            epoch = first.epoch
            assert (first.worker_id, epoch, first.kv_events) == (worker.worker_id, worker.engine.epoch, ())
            assert first.snapshot == KVSnapshot(epoch, 0, frozenset())
            assert first.load == LoadReport(0, 0, 0, 256, 256, None, None)
            assert (await worker.info()).max_num_seqs == config.max_num_seqs == 128
            await _serve(worker, "a")
            report = await worker.report(epoch, 0, 0.1)
            assert report.snapshot is None
            assert report.kv_events == (KVEventBatch(epoch, 1, (BlocksStored(hashes, None),)),)
            assert report.load.prefill_s_per_token > 0 and report.load.num_running == report.load.num_waiting == 0
            quiet = await worker.report(epoch, 1, 0.05)
            assert (quiet.kv_events, quiet.snapshot) == ((), None)
            resync = await worker.report("an-old-epoch", 1, 0.1)
            assert (resync.kv_events, resync.snapshot) == ((), KVSnapshot(epoch, 1, frozenset(hashes)))
        finally:
            worker.shutdown()

    asyncio.run(scenario())


def test_a_waiting_report_returns_when_events_arrive(tiny_llama_dir):
    async def scenario():
        worker = make_prefill_worker(tiny_llama_dir)
        try:
            first = await worker.report(None, 0, 0)
            waiting = asyncio.ensure_future(worker.report(first.epoch, first.snapshot.seq, 60.0))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # nothing new: it waits
            await _serve(worker, "a")
            report = await asyncio.wait_for(waiting, 30)  # well before its 60 s
            assert [batch.seq for batch in report.kv_events] == [1]
            assert replay(report.kv_events) == worker.engine.block_manager.cached_block_hashes()
        finally:
            worker.shutdown()

    asyncio.run(scenario())
