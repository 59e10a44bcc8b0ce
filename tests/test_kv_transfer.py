"""KV transfer: connector state machines and the in-process backend (exact bytes, states, leases,
block generations, clock skew).

The pool factories at the top are shared with test_kv_transfer_nixl.py.
"""

from __future__ import annotations

import importlib.util
import uuid
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.common.kv_transfer_types import KVLayout, TransferParams
from splitserve.kv_transfer import (BACKENDS, ConsumerConnector, ConsumerStats, InProcessBackend,
                                    InvalidTransitionError, KVLayoutMismatchError, KVTransferError, LeaseState,
                                    ProducerConnector, ProducerStats, PullOutcome, PullStatus, ReleasedLease,
                                    make_backend, nixl_module)
from splitserve.kv_transfer.connector import PULL_TIMEOUT_ERROR, RECLAIMED_ERROR, _Lease, _Pull
from tests.factories import FakeClock, assert_blocks_pulled, empty_pool, make_pool

# ---- shared factories ------------------------------------------------------------------------
TINY_LAYOUT = KVLayout(model_id="tiny-llama", dtype="float32", block_size=4, num_layers=3, num_kv_heads=2,
                       head_dim=8, hash_seed=0)


# ---- fixtures --------------------------------------------------------------------------------
@dataclass
class Side:
    backend: InProcessBackend
    layers: list[torch.Tensor]


@pytest.fixture
def make_side():
    made: list[InProcessBackend] = []

    def make(role: str, pool: list[torch.Tensor], layout: KVLayout = TINY_LAYOUT, defer: bool = False) -> Side:
        backend = InProcessBackend(f"{role}-{uuid.uuid4().hex[:8]}", defer_completion=defer)
        backend.register_kv_pool(pool, layout)
        made.append(backend)
        return Side(backend, pool)

    yield make
    for backend in made:
        backend.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


@pytest.fixture
def producer(make_side) -> Side:
    return make_side("prefill", make_pool(TINY_LAYOUT, 10, offset=1e7))


@pytest.fixture
def consumer(make_side, producer) -> Side:
    side = make_side("decode", empty_pool(TINY_LAYOUT, 8), defer=False)
    side.backend.add_peer(producer.backend.metadata())
    return side


@pytest.fixture
def deferred_consumer(make_side, producer) -> Side:
    """A consumer whose pulls stay PENDING until complete_pending_pulls()."""
    side = make_side("decode", empty_pool(TINY_LAYOUT, 8), defer=True)
    side.backend.add_peer(producer.backend.metadata())
    return side


BLOCK_BYTES = TINY_LAYOUT.num_layers * TINY_LAYOUT.bytes_per_block_per_layer  # 3 * 2*4*2*8*4 = 768
REMOTE_IDS = (7, 2, 9, 4)
LOCAL_IDS = (5, 0, 3, 1)


# ---- in-process backend: bytes -----------------------------------------------------------------
def test_pull_copies_scattered_blocks_byte_for_byte(producer, consumer, clock):
    source = [layer.clone() for layer in producer.layers]
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    params = leases.hold("req-1", REMOTE_IDS, num_tokens=15)

    assert pulls.start(params, LOCAL_IDS) is PullStatus.DONE
    assert_blocks_pulled(consumer.layers, LOCAL_IDS, producer.layers, REMOTE_IDS)
    assert all(torch.equal(a, b) for a, b in zip(producer.layers, source)), "a pull must not modify the source"


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_scattered_block_mapping_is_exact(data):
    num_remote, num_local = 12, 9
    count = data.draw(st.integers(1, num_local), label="count")
    remote_ids = tuple(data.draw(st.permutations(range(num_remote)), label="remote")[:count])
    local_ids = tuple(data.draw(st.permutations(range(num_local)), label="local")[:count])
    producer = InProcessBackend(f"prefill-{uuid.uuid4().hex[:8]}")
    consumer = InProcessBackend(f"decode-{uuid.uuid4().hex[:8]}")
    try:
        remote, local = make_pool(TINY_LAYOUT, num_remote, offset=1e7), empty_pool(TINY_LAYOUT, num_local)
        producer.register_kv_pool(remote, TINY_LAYOUT)
        consumer.register_kv_pool(local, TINY_LAYOUT)
        consumer.add_peer(producer.metadata())
        producer.bump_generations(remote_ids[:1])
        params = TransferParams("r", producer.agent_name, remote_ids, 1, TINY_LAYOUT, 30.0, (1,) + (0,) * (count - 1))
        consumer.start_pull(params, local_ids)
        assert_blocks_pulled(local, local_ids, remote, remote_ids)
        assert producer.take_notifications() == []  # the data READ notifies nobody
        consumer.start_check(params, local_ids)
        assert consumer.checked_generations(local_ids) == params.block_generations
        assert producer.take_notifications() == ["r"]
    finally:
        producer.close()
        consumer.close()


# ---- producer leases -------------------------------------------------------------------------
def test_hold_returns_exact_transfer_params(producer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    producer.backend.bump_generations((2, 4))
    producer.backend.bump_generations((4,))
    params = leases.hold("req-1", [7, 2, 9, 4], num_tokens=13)
    assert params == TransferParams("req-1", producer.backend.agent_name, (7, 2, 9, 4), 13, TINY_LAYOUT, 30.0,
                                    (0, 1, 0, 2))
    assert leases.stats() == ProducerStats(num_held=1, num_pulled=0, num_expired=0, num_released=0,
                                           num_late_notifications=0)


def test_pulled_lease_is_released_once(producer, consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)

    assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.PULLED)]
    assert leases.poll() == []
    assert leases.stats() == ProducerStats(0, 1, 0, 0, 0)


def test_lease_expires_strictly_after_deadline(producer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    leases.hold("req-1", (3,), 2)
    clock.now = 130.0
    assert leases.poll() == []
    clock.now = 130.001
    assert leases.poll() == [ReleasedLease("req-1", (3,), LeaseState.EXPIRED)]
    assert leases.stats() == ProducerStats(0, 0, 1, 0, 0)


def test_notification_taken_before_expiry_counts_as_pulled(producer, consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    pulled = leases.hold("pulled", (1, 2), 5)
    leases.hold("idle", (3,), 4)
    clock.now = 129.0
    pulls.start(pulled, (6, 7))
    clock.now = 500.0  # the producer polls late: both deadlines passed
    assert leases.poll() == [ReleasedLease("pulled", (1, 2), LeaseState.PULLED),
                             ReleasedLease("idle", (3,), LeaseState.EXPIRED)]


def test_release_frees_and_later_notification_is_late(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", (4, 5), 8), (0, 1))
    assert leases.release("req-1") is True
    assert leases.release("req-1") is False
    assert leases.release("never-held") is False
    deferred_consumer.backend.complete_pending_pulls()  # the data READ lands after the cancel
    assert pulls.poll() == []  # the check READ is posted
    deferred_consumer.backend.complete_pending_pulls()

    assert leases.poll() == []
    assert leases.stats() == ProducerStats(0, 0, 0, 1, 1)
    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED, RECLAIMED_ERROR, 0, 0.0)]


def test_dropped_notification_leaves_lease_to_expire(producer, consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    consumer.backend.drop_next_notifications()
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)

    assert [outcome.state for outcome in pulls.poll()] == [PullStatus.DONE]
    assert leases.poll() == []
    clock.now = 131.0
    assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.EXPIRED)]


def test_hold_rejects_blocks_that_do_not_cover_the_tokens(producer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    with pytest.raises(ValueError, match="2 blocks of 4 tokens cannot hold 9 tokens"):
        leases.hold("req-1", (1, 2), 9)
    with pytest.raises(ValueError, match="0 blocks of 4 tokens cannot hold 1 tokens"):
        leases.hold("req-1", (), 1)
    with pytest.raises(ValueError, match="lease_ttl_s must be > 0"):
        ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=0.0)
    assert leases.stats().num_held == 0


# ---- consumer pulls --------------------------------------------------------------------------
def test_outcome_is_exact_and_reported_once(producer, consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    assert pulls.status("req-1") is PullStatus.DONE

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.DONE, None, 4 * BLOCK_BYTES, 0.0)]
    assert pulls.poll() == []
    assert pulls.status("req-1") is None
    assert pulls.stats() == ConsumerStats(num_pulling=0, num_done=1, num_failed=0, num_aborted=0,
                                          bytes_pulled=4 * BLOCK_BYTES)


def test_pending_pull_completes_on_poll(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    assert pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS) is PullStatus.PULLING
    assert pulls.poll() == []
    assert pulls.stats().num_pulling == 1

    clock.now = 101.0
    assert deferred_consumer.backend.complete_pending_pulls() == 1  # the data READ
    assert pulls.poll() == []
    assert pulls.status("req-1") is PullStatus.VERIFYING
    assert producer.backend.take_notifications() == []

    clock.now = 102.5
    assert deferred_consumer.backend.complete_pending_pulls() == 1  # the check READ
    assert pulls.poll() == [PullOutcome("req-1", PullStatus.DONE, None, 4 * BLOCK_BYTES, 2.5)]
    assert_blocks_pulled(deferred_consumer.layers, LOCAL_IDS, producer.layers, REMOTE_IDS)
    assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.PULLED)]


def test_pull_landing_after_the_producer_expired_the_lease_fails(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    clock.now = 130.25
    assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.EXPIRED)]
    deferred_consumer.backend.defer_completions(False)
    deferred_consumer.backend.complete_pending_pulls()  # bytes arrive, but after the producer's expiry

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED, RECLAIMED_ERROR, 0, 30.25)]
    assert leases.poll() == []
    assert leases.stats() == ProducerStats(0, 0, 1, 0, 1)  # the check READ's notification came late
    assert pulls.stats() == ConsumerStats(0, 0, 1, 0, 0)


def test_late_pull_is_done_while_the_producer_has_not_reclaimed(producer, deferred_consumer, clock):
    """The consumer's clock alone never fails a pull that completed: only the generations do."""
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    clock.now = 129.0
    deferred_consumer.backend.defer_completions(False)
    deferred_consumer.backend.complete_pending_pulls()
    clock.now = 131.0  # past the TTL on both clocks; the producer has not polled yet

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.DONE, None, 4 * BLOCK_BYTES, 31.0)]
    assert_blocks_pulled(deferred_consumer.layers, LOCAL_IDS, producer.layers, REMOTE_IDS)
    assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.PULLED)]


def test_pending_pull_past_the_lease_is_abandoned(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    clock.now = 130.0
    assert pulls.poll() == []
    clock.now = 130.5

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED,
                                        "the pull did not complete within the lease's 30 s TTL (measured on the "
                                        "consumer's clock)", 0, 30.5)]
    assert deferred_consumer.backend.complete_pending_pulls() == 0  # released: it can no longer write
    assert_blocks_pulled(deferred_consumer.layers, (), producer.layers, ())


def test_pending_check_past_the_lease_is_abandoned(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    deferred_consumer.backend.complete_pending_pulls()
    assert pulls.poll() == []
    clock.now = 130.5

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED, PULL_TIMEOUT_ERROR.format(ttl=30.0), 0, 30.5)]
    assert deferred_consumer.backend.complete_pending_pulls() == 0
    assert producer.backend.take_notifications() == []  # the check READ never ran: no notification


def test_pull_started_after_the_producer_expired_the_lease_fails(producer, consumer, clock):
    """What the old wall-clock refusal caught at start() the generation check catches now."""
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    params = leases.hold("req-1", REMOTE_IDS, 16)
    clock.now = 130.25
    assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.EXPIRED)]

    assert pulls.start(params, LOCAL_IDS) is PullStatus.FAILED
    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED, RECLAIMED_ERROR, 0, 0.0)]
    assert leases.poll() == []
    assert leases.stats().num_late_notifications == 1


def test_unknown_producer_fails_cleanly(consumer, clock):
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    params = TransferParams("req-1", "prefill-gone", (1,), 3, TINY_LAYOUT, 30.0, (0,))

    assert pulls.start(params, (2,)) is PullStatus.FAILED
    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED,
                                        "unknown producer 'prefill-gone': no handshake, or it was removed", 0, 0.0)]
    with pytest.raises(KVTransferError, match="unknown peer 'prefill-gone'"):
        consumer.backend.start_pull(params, (2,))


def test_closed_producer_fails_cleanly(producer, consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    params = leases.hold("req-1", REMOTE_IDS, 16)
    producer.backend.close()

    assert pulls.start(params, LOCAL_IDS) is PullStatus.FAILED
    assert pulls.poll()[0].error == f"peer {producer.backend.agent_name!r} has closed"


def test_backend_failure_is_reported_with_its_reason(producer, consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    consumer.backend.fail_next_pulls()

    assert pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS) is PullStatus.FAILED
    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED,
                                        "injected failure (InProcessBackend.fail_next_pulls)", 0, 0.0)]
    assert leases.poll() == []  # no notification: the lease runs to its deadline
    assert_blocks_pulled(consumer.layers, (), producer.layers, ())
    assert pulls.start(leases.hold("req-2", (1,), 1), (2,)) is PullStatus.DONE  # one failure only


def test_remote_block_out_of_range_fails_local_one_raises(producer, consumer, clock):
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    params = TransferParams("req-1", producer.backend.agent_name, (3, 10), 5, TINY_LAYOUT, 30.0, (0, 0))

    assert pulls.start(params, (0, 1)) is PullStatus.FAILED
    assert pulls.poll()[0].error == "req-1: remote block ids (3, 10) outside the producer's pool [0, 10)"
    with pytest.raises(ValueError, match=r"local block ids \(0, 8\) outside \[0, 8\)"):
        pulls.start(TransferParams("req-2", producer.backend.agent_name, (3, 4), 5, TINY_LAYOUT, 30.0, (0, 0)), (0, 8))
    assert pulls.status("req-2") is None
    with pytest.raises(ValueError, match="1 local blocks for 2 remote blocks"):
        pulls.start(TransferParams("req-3", producer.backend.agent_name, (3, 4), 5, TINY_LAYOUT, 30.0, (0, 0)), (0,))
    assert pulls.stats() == ConsumerStats(0, 0, 1, 0, 0)


def test_abort_releases_a_pending_pull_without_outcome(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)

    assert pulls.abort("req-1") is True
    assert pulls.abort("req-1") is False
    assert deferred_consumer.backend.complete_pending_pulls() == 0
    assert pulls.poll() == []
    assert_blocks_pulled(deferred_consumer.layers, (), producer.layers, ())
    assert pulls.stats() == ConsumerStats(0, 0, 0, 1, 0)


def test_removing_the_peer_fails_its_pending_pull(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    name = producer.backend.agent_name
    deferred_consumer.backend.remove_peer(name)

    assert deferred_consumer.backend.has_peer(name) is False
    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED,
                                        f"peer {name!r} was removed while the pull was in flight", 0, 0.0)]
    assert deferred_consumer.backend.complete_pending_pulls() == 0
    assert pulls.start(leases.hold("req-2", (1,), 1), (2,)) is PullStatus.FAILED


def test_outcomes_come_in_start_order(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    for index, request_id in enumerate(("a", "b", "c")):
        pulls.start(leases.hold(request_id, (index,), 4), (index,))
    deferred_consumer.backend.fail_next_pulls()
    deferred_consumer.backend.complete_pending_pulls()
    deferred_consumer.backend.defer_completions(False)  # the check READs land inside poll()

    assert [(o.request_id, o.state) for o in pulls.poll()] == [
        ("a", PullStatus.FAILED), ("b", PullStatus.DONE), ("c", PullStatus.DONE)]
    assert [lease.request_id for lease in leases.poll()] == ["b", "c"]


# ---- block generations: the producer bumps before it frees ---------------------------------------
@pytest.mark.parametrize("end", ["pulled", "expired", "freed"])
def test_every_lease_end_bumps_its_blocks_before_it_is_reported(producer, consumer, clock, end):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    producer.backend.bump_generations((9,))
    params = leases.hold("req-1", REMOTE_IDS, 16)
    assert params.block_generations == (0, 0, 1, 0)
    assert producer.backend.generations(REMOTE_IDS) == (0, 0, 1, 0)  # hold() bumps nothing

    if end == "pulled":
        pulls.start(params, LOCAL_IDS)
        assert producer.backend.generations(REMOTE_IDS) == (0, 0, 1, 0)  # a pull bumps nothing either
        assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.PULLED)]
    elif end == "expired":
        clock.now = 130.5
        assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.EXPIRED)]
    else:
        assert leases.release("req-1") is True
    # What poll()/release() hand the worker, the worker frees: the bump is already visible then.
    assert producer.backend.generations(REMOTE_IDS) == (1, 1, 2, 1)
    assert producer.backend.generations((0, 1, 3, 5, 6, 8)) == (0,) * 6

    assert leases.hold("req-1", REMOTE_IDS, 16).block_generations == (1, 1, 2, 1)  # the next lease sees them
    assert leases.release("req-1") is True
    assert producer.backend.generations(REMOTE_IDS) == (2, 2, 3, 2)  # only ever grows: no ABA


def test_shared_blocks_are_bumped_when_their_last_lease_ends(producer, deferred_consumer, clock):
    """Prefix-cached blocks are held by several leases; ending one must not fail the others' pulls."""
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    first = leases.hold("first", (7, 2, 9), 12)
    second = leases.hold("second", (7, 2, 4), 12)
    pulls.start(second, (0, 1, 2))
    deferred_consumer.backend.complete_pending_pulls()
    assert pulls.poll() == []
    assert leases.release("first") is True
    assert producer.backend.generations((7, 2, 9, 4)) == (0, 0, 1, 0)  # 7 and 2 are still held by "second"

    deferred_consumer.backend.complete_pending_pulls()
    assert pulls.poll() == [PullOutcome("second", PullStatus.DONE, None, 3 * BLOCK_BYTES, 0.0)]
    assert leases.poll() == [ReleasedLease("second", (7, 2, 4), LeaseState.PULLED)]
    assert producer.backend.generations((7, 2, 9, 4)) == (1, 1, 1, 1)
    assert first.block_generations == second.block_generations == (0, 0, 0)


# ---- reclaimed under a READ: the consumer never accepts the bytes -----------------------------------
def _reuse(layers: list[torch.Tensor], block_ids: tuple[int, ...]) -> None:
    """What the producer's engine does with freed blocks: write other KV into them."""
    for layer in layers:
        layer[list(block_ids)] = -1.0


@pytest.mark.parametrize("reclaim", ["release", "expiry"])
def test_blocks_reused_between_the_data_read_and_the_check_fail_the_pull(producer, deferred_consumer, clock,
                                                                          reclaim):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    clock.now = 129.0
    assert deferred_consumer.backend.complete_pending_pulls() == 1  # the data READ: intact bytes
    assert pulls.poll() == []
    assert pulls.status("req-1") is PullStatus.VERIFYING

    clock.now = 130.5
    if reclaim == "release":
        assert leases.release("req-1") is True
    else:
        assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.EXPIRED)]
    _reuse(producer.layers, REMOTE_IDS)
    assert deferred_consumer.backend.complete_pending_pulls() == 1  # the check READ

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED, RECLAIMED_ERROR, 0, 30.5)]
    assert pulls.stats() == ConsumerStats(0, 0, 1, 0, 0)
    assert leases.poll() == []  # its notification found no lease


def test_blocks_reused_under_the_data_read_fail_the_pull(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    deferred_consumer.backend.defer_completions(False)
    pulls.start(leases.hold("ok", (1,), 4), (7,))  # an earlier pull's verified generation sits in scratch
    deferred_consumer.backend.defer_completions()
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    clock.now = 131.0
    assert [lease.request_id for lease in leases.poll()] == ["ok", "req-1"]
    _reuse(producer.layers, REMOTE_IDS)
    deferred_consumer.backend.defer_completions(False)
    deferred_consumer.backend.complete_pending_pulls()  # the READ copies the reused (wrong) bytes

    assert [(o.request_id, o.state, o.error) for o in pulls.poll()] == [
        ("ok", PullStatus.DONE, None), ("req-1", PullStatus.FAILED, RECLAIMED_ERROR)]
    assert all(torch.equal(layer[list(LOCAL_IDS)], torch.full_like(layer[list(LOCAL_IDS)], -1.0))
               for layer in deferred_consumer.layers)  # garbage landed, and the outcome says so


def test_abort_while_verifying_releases_the_check_read(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    deferred_consumer.backend.complete_pending_pulls()
    assert pulls.poll() == []

    assert pulls.abort("req-1") is True
    assert deferred_consumer.backend.complete_pending_pulls() == 0
    assert producer.backend.take_notifications() == []
    assert pulls.stats() == ConsumerStats(0, 0, 0, 1, 0)


# ---- clock skew: the two clocks are never compared --------------------------------------------------
SKEWS = [-10.0, 0.0, 10.0]
"""Producer clock minus consumer clock, in seconds (both run at the same rate)."""


def skewed(clock: FakeClock, offset: float):
    return lambda: clock.now + offset


@pytest.mark.parametrize("skew", SKEWS)
def test_pulls_succeed_under_skew_exactly_as_without(producer, deferred_consumer, clock, skew):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=skewed(clock, skew))
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    params = leases.hold("req-1", REMOTE_IDS, 16)
    assert params == TransferParams("req-1", producer.backend.agent_name, REMOTE_IDS, 16, TINY_LAYOUT, 30.0,
                                    (0, 0, 0, 0))  # no clock reading in it: identical under any skew
    clock.now = 120.0
    assert pulls.start(params, LOCAL_IDS) is PullStatus.PULLING
    clock.now = 129.5  # 29.5 s after hold() on both clocks
    deferred_consumer.backend.complete_pending_pulls()
    assert pulls.poll() == []
    deferred_consumer.backend.complete_pending_pulls()
    clock.now = 129.75

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.DONE, None, 4 * BLOCK_BYTES, 9.75)]
    assert_blocks_pulled(deferred_consumer.layers, LOCAL_IDS, producer.layers, REMOTE_IDS)
    assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.PULLED)]


@pytest.mark.parametrize("skew", SKEWS)
def test_expiry_is_decided_on_the_producers_clock_only(producer, deferred_consumer, clock, skew):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=skewed(clock, skew))
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    clock.now = 130.0
    assert leases.poll() == []  # exactly lease_ttl_s after hold() on the producer's clock
    assert pulls.poll() == []
    clock.now = 130.25
    assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.EXPIRED)]
    _reuse(producer.layers, REMOTE_IDS)
    deferred_consumer.backend.defer_completions(False)
    deferred_consumer.backend.complete_pending_pulls()  # the data READ lands before the consumer gives up

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED, RECLAIMED_ERROR, 0, 30.25)]


# ---- state machines and handshake --------------------------------------------------------------
def test_invalid_transitions_raise(producer, consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    params = leases.hold("req-1", REMOTE_IDS, 16)
    with pytest.raises(InvalidTransitionError, match="'req-1': no transition HELD -> HELD"):
        leases.hold("req-1", (1,), 1)
    pulls.start(params, LOCAL_IDS)
    with pytest.raises(InvalidTransitionError, match="'req-1' is already pulling"):
        pulls.start(params, LOCAL_IDS)
    with pytest.raises(InvalidTransitionError, match="no transition EXPIRED -> PULLED"):
        _Lease("r", (1,), 0.0, 3, LeaseState.EXPIRED).advance(LeaseState.PULLED)
    with pytest.raises(InvalidTransitionError, match="no transition WAITING -> DONE"):
        _Pull(params, LOCAL_IDS, 0.0, False, 3).advance(PullStatus.DONE, 1.0)
    with pytest.raises(InvalidTransitionError, match="no transition DONE -> PULLING"):
        _Pull(params, LOCAL_IDS, 0.0, False, 3, status=PullStatus.DONE).advance(PullStatus.PULLING)
    with pytest.raises(InvalidTransitionError, match="no transition PULLING -> DONE"):
        _Pull(params, LOCAL_IDS, 0.0, False, 3, status=PullStatus.PULLING).advance(PullStatus.DONE, 1.0)
    with pytest.raises(InvalidTransitionError, match="no transition WAITING -> VERIFYING"):
        _Pull(params, LOCAL_IDS, 0.0, False, 3).advance(PullStatus.VERIFYING)


def test_layout_mismatch_names_every_field(make_side, producer):
    other = KVLayout(model_id="tiny-llama", dtype="float32", block_size=8, num_layers=3, num_kv_heads=2,
                     head_dim=8, hash_seed=7)
    side = make_side("decode", empty_pool(other, 4), layout=other)
    with pytest.raises(KVLayoutMismatchError) as refused:
        side.backend.add_peer(producer.backend.metadata())
    assert str(refused.value) == (f"refusing to pull from {producer.backend.agent_name!r}: KV layouts differ "
                                  "(ours != theirs): block_size: 8 != 4; hash_seed: 7 != 0")
    assert side.backend.has_peer(producer.backend.agent_name) is False


def test_a_peer_in_another_kind_of_memory_is_refused_at_the_handshake(make_side, producer):
    """A GPU (VRAM) producer's metadata reaching a host-memory (DRAM) consumer: refused, naming the field."""
    side = make_side("decode", empty_pool(TINY_LAYOUT, 4))
    vram = producer.backend.metadata()
    vram = replace(vram, layout=replace(vram.layout, memory_kind="VRAM"))
    with pytest.raises(KVLayoutMismatchError, match=r"\(ours != theirs\): memory_kind: 'DRAM' != 'VRAM'$"):
        side.backend.add_peer(vram)
    assert side.backend.has_peer(producer.backend.agent_name) is False


def test_a_pool_must_live_where_its_layout_says():
    backend = InProcessBackend(f"decode-{uuid.uuid4().hex[:8]}")
    vram = replace(TINY_LAYOUT, memory_kind="VRAM")
    with pytest.raises(ValueError, match=r"KV pool is on cpu \(DRAM\), layout says VRAM"):
        backend.register_kv_pool(empty_pool(TINY_LAYOUT, 4), vram)
    with pytest.raises(ValueError, match="memory_kind must be one of"):
        replace(TINY_LAYOUT, memory_kind="HBM")


def test_pull_with_a_different_layout_than_the_handshake_fails(producer, consumer, clock):
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    bf16 = KVLayout("tiny-llama", "bfloat16", 4, 3, 2, 8, 0)
    params = TransferParams("req-1", producer.backend.agent_name, (1,), 2, bf16, 30.0, (0,))

    assert pulls.start(params, (0,)) is PullStatus.FAILED
    assert "dtype: 'float32' != 'bfloat16'" in pulls.poll()[0].error


def test_register_rejects_a_pool_that_does_not_match_its_layout():
    backend = InProcessBackend(f"decode-{uuid.uuid4().hex[:8]}")
    with pytest.raises(ValueError, match="KV pool has 2 layers, layout says 3"):
        backend.register_kv_pool(empty_pool(TINY_LAYOUT, 4)[:2], TINY_LAYOUT)
    with pytest.raises(ValueError, match=r"KV layer 0 has shape \(4, 2, 4, 2, 4\), expected \(4, 2, 4, 2, 8\)"):
        backend.register_kv_pool([torch.zeros(4, 2, 4, 2, 4)] * 3, TINY_LAYOUT)
    with pytest.raises(ValueError, match="KV layer 1 has dtype torch.float64, layout says float32"):
        backend.register_kv_pool([torch.zeros(4, 2, 4, 2, 8), torch.zeros(4, 2, 4, 2, 8, dtype=torch.float64),
                                  torch.zeros(4, 2, 4, 2, 8)], TINY_LAYOUT)
    with pytest.raises(ValueError, match="KV layer 0 is not contiguous"):
        backend.register_kv_pool([torch.zeros(8, 2, 4, 2, 8)[::2]] * 3, TINY_LAYOUT)
    with pytest.raises(KVTransferError, match="has no registered KV pool"):
        backend.metadata()


def test_make_backend():
    backend = make_backend("inprocess", f"decode-{uuid.uuid4().hex[:8]}")
    assert isinstance(backend, InProcessBackend)
    assert BACKENDS == ("nixl", "inprocess")
    with pytest.raises(ValueError, match="unknown transfer backend 'rdma': expected one of nixl, inprocess"):
        make_backend("rdma", "x")


def test_nixl_comes_from_the_meta_package_first_then_from_either_cuda_build(monkeypatch):
    installed: set[str] = set()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in installed else None)
    found = []
    for present in ((), ("nixl_cu13",), ("nixl_cu12", "nixl_cu13"), ("nixl", "nixl_cu12")):
        installed = set(present)
        found.append(nixl_module())
    assert found == [None, "nixl_cu13", "nixl_cu12", "nixl"]
