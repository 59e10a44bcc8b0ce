"""Token-budget scheduler: exact chunks, budgets, admission order and preemption victims."""

from __future__ import annotations

import dataclasses

from tests.factories import assert_pool_idle, chunk_summary, make_request, make_scheduler, run_fake_step
from splitserve.engine.request import RequestStatus


def test_chunked_prefill_splits_prompt_across_steps():
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", list(range(23))))
    assert chunk_summary(run_fake_step(scheduler)) == [("a", 0, 10, False)]
    assert chunk_summary(run_fake_step(scheduler)) == [("a", 10, 10, False)]
    assert chunk_summary(run_fake_step(scheduler)) == [("a", 20, 3, True)]
    assert chunk_summary(run_fake_step(scheduler)) == [("a", 23, 1, True)]
    assert scheduler.requests["a"].output_token_ids == [7, 7]


def test_decode_first_then_prefill_shares_the_budget():
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=10)
    scheduler.add_request(make_request("a", list(range(6))))
    scheduler.add_request(make_request("b", list(range(100, 106))))
    # a takes 6, b gets the remaining 4 of its 6 prompt tokens.
    assert chunk_summary(run_fake_step(scheduler)) == [("a", 0, 6, True), ("b", 0, 4, False)]
    scheduler.add_request(make_request("c", list(range(200, 220))))
    # Running first in admission order: a decodes (1), b finishes its prompt (2), c gets 7.
    assert chunk_summary(run_fake_step(scheduler)) == [("a", 6, 1, True), ("b", 4, 2, True), ("c", 0, 7, False)]
    output = run_fake_step(scheduler)
    assert output.num_batched_tokens == 10
    assert chunk_summary(output) == [("a", 7, 1, True), ("b", 6, 1, True), ("c", 7, 8, False)]


def test_chunk_positions_and_block_tables():
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=5)
    scheduler.add_request(make_request("a", list(range(10, 19))))
    first = run_fake_step(scheduler).chunks[0]
    assert (first.token_ids, first.block_table) == ((10, 11, 12, 13, 14), (0, 1))
    second = run_fake_step(scheduler).chunks[0]
    assert (second.token_ids, second.start_position, second.block_table) == ((15, 16, 17, 18), 5, (0, 1, 2))


def test_without_chunking_a_big_prompt_waits_and_blocks_later_ones():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=12, max_model_len=12,
                               enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", list(range(8))))
    scheduler.add_request(make_request("b", list(range(100, 110))))
    scheduler.add_request(make_request("c", [1]))
    assert chunk_summary(run_fake_step(scheduler)) == [("a", 0, 8, True)]  # b (10) does not fit in 4
    assert chunk_summary(run_fake_step(scheduler)) == [("a", 8, 1, True), ("b", 0, 10, True), ("c", 0, 1, True)]


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=2)
    for name in "abc":
        scheduler.add_request(make_request(name, [1, 2, 3]))
    assert [c.request_id for c in run_fake_step(scheduler).chunks] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    scheduler.finish("a", RequestStatus.FINISHED_STOPPED)
    assert [c.request_id for c in run_fake_step(scheduler).chunks] == ["b", "c"]


def test_preemption_takes_the_latest_admitted_and_requeues_it_first():
    # 7 blocks of 4 tokens. a, b, c take 2 blocks each (8-token prompts); one block stays free.
    scheduler = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64)
    for name, base in (("a", 0), ("b", 100), ("c", 200)):
        scheduler.add_request(make_request(name, list(range(base, base + 8))))
    run_fake_step(scheduler)
    scheduler.add_request(make_request("d", [5]))
    # Each now needs a third block for its 9th token: a takes the free one, b preempts c,
    # and nothing waiting is admitted in a step that preempted.
    output = run_fake_step(scheduler)
    assert output.preempted_request_ids == ("c",)
    assert chunk_summary(output) == [("a", 8, 1, True), ("b", 8, 1, True)]
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]
    victim = scheduler.requests["c"]
    assert (victim.status, victim.num_computed_tokens, victim.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert scheduler.block_manager.block_table("c") == []
    # c's blocks were freed tail first, so b's third block is c's last block (5), not 4.
    assert scheduler.block_manager.block_table("b") == [2, 3, 5]
    assert scheduler.num_preemptions == 1


def test_a_request_that_cannot_fit_preempts_itself():
    # The engine never builds a pool smaller than max_model_len; the scheduler alone can.
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", list(range(8))))
    run_fake_step(scheduler)
    output = run_fake_step(scheduler)
    assert (output.preempted_request_ids, output.chunks) == (("a",), ())
    assert [r.request_id for r in scheduler.waiting] == ["a"]
    assert_pool_idle(scheduler.block_manager)


def test_preempted_request_recomputes_prompt_and_outputs_from_its_cached_blocks():
    scheduler = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    scheduler.add_request(make_request("a", list(range(8))))
    scheduler.add_request(make_request("b", list(range(100, 108))))
    run_fake_step(scheduler)  # both prefilled: 2 blocks each, 1 free
    run_fake_step(scheduler)  # a gets block 4 for token 9; b is preempted (no block for its 9th token)
    b = scheduler.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.output_token_ids == [7]
    scheduler.finish("a", RequestStatus.FINISHED_STOPPED)
    output = run_fake_step(scheduler)
    # b's two full prompt blocks are still cached: only the sampled token is recomputed.
    assert chunk_summary(output) == [("b", 8, 1, True)]
    assert b.num_cached_tokens == 0  # counted at first admission only
    assert scheduler.prefix_cache_hits == 8
    scheduler.finish("b", RequestStatus.FINISHED_LENGTH)
    assert_pool_idle(scheduler.block_manager)


def test_prefix_hits_are_counted_per_admitted_token():
    scheduler = make_scheduler(num_blocks=32, block_size=4)
    scheduler.add_request(make_request("a", list(range(10))))
    run_fake_step(scheduler)
    scheduler.add_request(make_request("b", list(range(9)) + [50]))
    output = run_fake_step(scheduler)
    assert chunk_summary(output) == [("a", 10, 1, True), ("b", 8, 2, True)]
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (20, 8)
    assert scheduler.requests["b"].num_cached_tokens == 8
    assert scheduler.block_manager.block_table("b")[:2] == scheduler.block_manager.block_table("a")[:2]


def test_finish_frees_blocks_in_any_state():
    scheduler = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    scheduler.add_request(make_request("running", list(range(6))))
    scheduler.add_request(make_request("waiting", list(range(6))))
    run_fake_step(scheduler)
    assert scheduler.finish("waiting", RequestStatus.FINISHED_ABORTED).status == RequestStatus.FINISHED_ABORTED
    assert scheduler.finish("running", RequestStatus.FINISHED_ABORTED) is not None
    assert scheduler.finish("running", RequestStatus.FINISHED_ABORTED) is None
    assert not scheduler.has_unfinished_requests()
    assert_pool_idle(scheduler.block_manager)


# ---- scheduling policies -------------------------------------------------------------------
def _waiting_ids(scheduler) -> list[str]:
    return [r.request_id for r in scheduler.waiting]


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=3, policy="priority")
    for name, priority in (("a", 0), ("b", -1), ("c", 1), ("d", -1)):
        scheduler.add_request(make_request(name, [1, 2, 3], priority=priority))
    assert _waiting_ids(scheduler) == ["b", "d", "a", "c"]
    assert [c.request_id for c in run_fake_step(scheduler).chunks] == ["b", "d", "a"]
    scheduler.add_request(make_request("e", [4, 5], priority=0))  # after c in arrival, before it in priority
    scheduler.finish("b", RequestStatus.FINISHED_STOPPED)
    assert [c.request_id for c in run_fake_step(scheduler).chunks] == ["d", "a", "e"]
    assert _waiting_ids(scheduler) == ["c"]


def test_fcfs_policy_keeps_arrival_order_whatever_the_priority():
    scheduler = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=3)
    for name, priority in (("a", 0), ("b", -1), ("c", 1), ("d", -1)):
        scheduler.add_request(make_request(name, [1, 2, 3], priority=priority))
    assert [c.request_id for c in run_fake_step(scheduler).chunks] == ["a", "b", "c"]
    assert _waiting_ids(scheduler) == ["d"]


def _a_then_b_and_c(policy: str, priorities: dict[str, int], num_blocks: int = 7):
    """Blocks of 4 tokens. a (a 7-token prompt) runs alone for a step, then b and c (8 tokens each) join it:
    the batch is [a, b, c] whatever their priorities (a was admitted first), they hold blocks [0, 1], [2, 3]
    and [4, 5], block 6 (if any) is free, and each needs a third block for its 9th token next step."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=64, policy=policy)
    scheduler.add_request(make_request("a", list(range(7)), priority=priorities["a"]))
    run_fake_step(scheduler)
    for name, base in (("b", 100), ("c", 200)):
        scheduler.add_request(make_request(name, list(range(base, base + 8)), priority=priorities[name]))
    run_fake_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a", "b", "c"]
    assert [scheduler.block_manager.block_table(name) for name in "abc"] == [[0, 1], [2, 3], [4, 5]]
    return scheduler


def test_priority_policy_preempts_the_largest_priority_even_if_already_scheduled():
    scheduler = _a_then_b_and_c("priority", {"a": 1, "b": 0, "c": 0})
    scheduler.add_request(make_request("d", [5], priority=0))
    scheduler.add_request(make_request("e", [6], priority=2))
    # a takes block 6; b finds none: the victim is a (priority 1), whose chunk this step is dropped.
    # a's blocks go back tail first (6, unhashed, to the front; 1 and 0, hashed, to the back): b gets 6, c gets 1.
    output = run_fake_step(scheduler)
    assert output.preempted_request_ids == ("a",)
    assert chunk_summary(output) == [("b", 8, 1, True), ("c", 8, 1, True)]
    assert [scheduler.block_manager.block_table(name) for name in "abc"] == [[], [2, 3, 6], [4, 5, 1]]
    # The victim waits at its (priority, arrival) place, not at the head: d (priority 0) before it.
    assert _waiting_ids(scheduler) == ["d", "a", "e"]
    victim = scheduler.requests["a"]
    assert (victim.status, victim.num_computed_tokens, victim.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)


def test_fcfs_policy_preempts_the_latest_admitted_whatever_the_priority():
    scheduler = _a_then_b_and_c("fcfs", {"a": 1, "b": 0, "c": 0})
    scheduler.add_request(make_request("d", [5], priority=0))
    output = run_fake_step(scheduler)
    assert output.preempted_request_ids == ("c",)
    assert chunk_summary(output) == [("a", 8, 1, True), ("b", 8, 1, True)]
    assert [scheduler.block_manager.block_table(name) for name in "abc"] == [[0, 1, 6], [2, 3, 5], []]
    assert _waiting_ids(scheduler) == ["c", "d"]


def test_a_scheduled_victim_gives_its_tokens_back_to_the_budget():
    # A budget of 2: a and b would use it all. a is preempted while b allocates, so its token goes
    # back, b moves up to a's place in the batch, and c (next in the batch, not skipped) runs too.
    scheduler = _a_then_b_and_c("priority", {"a": 1, "b": 0, "c": 0})
    scheduler.config = dataclasses.replace(scheduler.config, max_num_batched_tokens=2)
    output = run_fake_step(scheduler)
    assert output.preempted_request_ids == ("a",)
    assert chunk_summary(output) == [("b", 8, 1, True), ("c", 8, 1, True)]


def test_priority_policy_self_preemption_ends_the_running_pass():
    # No free block. a (priority 2, first in the batch) is the largest: finding no block, it preempts
    # itself, and b and c wait a step although a's freed blocks would now fit them (vLLM's rule).
    scheduler = _a_then_b_and_c("priority", {"a": 2, "b": 0, "c": 0}, num_blocks=6)
    output = run_fake_step(scheduler)
    assert (output.preempted_request_ids, output.chunks) == (("a",), ())
    assert [scheduler.block_manager.block_table(name) for name in "abc"] == [[], [2, 3], [4, 5]]
    # a's blocks went to the back tail first (1, 0): b takes 1, c takes 0; a (3 blocks) does not fit.
    output = run_fake_step(scheduler)
    assert chunk_summary(output) == [("b", 8, 1, True), ("c", 8, 1, True)]
    assert [scheduler.block_manager.block_table(name) for name in "bc"] == [[2, 3, 1], [4, 5, 0]]
    assert _waiting_ids(scheduler) == ["a"]


def test_priority_policy_orders_requests_whose_remote_kv_arrived():
    scheduler = make_scheduler(num_blocks=16, block_size=4, policy="priority")
    for name, priority in (("x", 1), ("y", 0)):
        request = make_request(name, list(range(8)), priority=priority)
        assert scheduler.block_manager.allocate(request, 9) is not None
        scheduler.add_remote(request)
        scheduler.remote_kv_ready(name)
    assert [r.request_id for r in scheduler.ready] == ["y", "x"]
