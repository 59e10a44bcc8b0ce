"""KV transfer: connector state machines and the in-process backend (exact bytes, states, leases).

The pool factories at the top are shared with test_kv_transfer_nixl.py.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.common.kv_transfer_types import KVLayout, TransferParams
from splitserve.kv_transfer import (BACKENDS, ConsumerConnector, ConsumerStats, InProcessBackend,
                                    InvalidTransitionError, KVLayoutMismatchError, KVTransferError, LeaseState,
                                    ProducerConnector, ProducerStats, PullOutcome, PullStatus, ReleasedLease,
                                    make_backend)
from splitserve.kv_transfer.connector import _Lease, _Pull
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
        params = TransferParams("r", producer.agent_name, remote_ids, 1, TINY_LAYOUT, float("inf"))
        consumer.start_pull(params, local_ids)
        assert_blocks_pulled(local, local_ids, remote, remote_ids)
        assert producer.take_notifications() == ["r"]
    finally:
        producer.close()
        consumer.close()


# ---- producer leases -------------------------------------------------------------------------
def test_hold_returns_exact_transfer_params(producer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    params = leases.hold("req-1", [7, 2, 9, 4], num_tokens=13)
    assert params == TransferParams("req-1", producer.backend.agent_name, (7, 2, 9, 4), 13, TINY_LAYOUT, 130.0)
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
    deferred_consumer.backend.complete_pending_pulls()  # the pull lands after the cancel

    assert leases.poll() == []
    assert leases.stats() == ProducerStats(0, 0, 0, 1, 1)


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

    clock.now = 102.5
    deferred_consumer.backend.complete_pending_pulls()
    assert pulls.poll() == [PullOutcome("req-1", PullStatus.DONE, None, 4 * BLOCK_BYTES, 2.5)]
    assert_blocks_pulled(deferred_consumer.layers, LOCAL_IDS, producer.layers, REMOTE_IDS)


def test_pull_completed_after_the_lease_fails(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    clock.now = 131.0
    deferred_consumer.backend.complete_pending_pulls()  # bytes arrive, but after the deadline

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED, "lease expired before the pull completed",
                                        0, 31.0)]
    assert leases.poll() == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.PULLED)]
    assert pulls.stats() == ConsumerStats(0, 0, 1, 0, 0)


def test_pending_pull_past_the_lease_is_abandoned(producer, deferred_consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(deferred_consumer.backend, clock=clock)
    pulls.start(leases.hold("req-1", REMOTE_IDS, 16), LOCAL_IDS)
    clock.now = 130.5

    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED, "lease expired before the pull completed",
                                        0, 30.5)]
    assert deferred_consumer.backend.complete_pending_pulls() == 0  # released: it can no longer write
    assert_blocks_pulled(deferred_consumer.layers, (), producer.layers, ())


def test_start_refuses_a_lease_below_the_margin(producer, consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock, min_lease_margin_s=0.5)
    params = leases.hold("req-1", REMOTE_IDS, 16)
    clock.now = 129.75

    assert pulls.start(params, LOCAL_IDS) is PullStatus.FAILED
    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED,
                                        "lease has 0.250s left, less than the 0.500s margin a pull needs", 0, 0.0)]
    assert producer.backend.take_notifications() == []
    assert_blocks_pulled(consumer.layers, (), producer.layers, ())


def test_start_refuses_an_expired_lease_saying_so(producer, consumer, clock):
    leases = ProducerConnector(producer.backend, TINY_LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    params = leases.hold("req-1", REMOTE_IDS, 16)
    clock.now = 130.25

    assert pulls.start(params, LOCAL_IDS) is PullStatus.FAILED
    assert pulls.poll() == [PullOutcome("req-1", PullStatus.FAILED,
                                        "the lease expired 0.250s before the pull could start", 0, 0.0)]
    assert_blocks_pulled(consumer.layers, (), producer.layers, ())


def test_unknown_producer_fails_cleanly(consumer, clock):
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    params = TransferParams("req-1", "prefill-gone", (1,), 3, TINY_LAYOUT, 130.0)

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
    params = TransferParams("req-1", producer.backend.agent_name, (3, 10), 5, TINY_LAYOUT, 130.0)

    assert pulls.start(params, (0, 1)) is PullStatus.FAILED
    assert pulls.poll()[0].error == "req-1: remote block ids (3, 10) outside the producer's pool [0, 10)"
    with pytest.raises(ValueError, match=r"local block ids \(0, 8\) outside \[0, 8\)"):
        pulls.start(TransferParams("req-2", producer.backend.agent_name, (3, 4), 5, TINY_LAYOUT, 130.0), (0, 8))
    assert pulls.status("req-2") is None
    with pytest.raises(ValueError, match="1 local blocks for 2 remote blocks"):
        pulls.start(TransferParams("req-3", producer.backend.agent_name, (3, 4), 5, TINY_LAYOUT, 130.0), (0,))
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

    assert [(o.request_id, o.state) for o in pulls.poll()] == [
        ("a", PullStatus.FAILED), ("b", PullStatus.DONE), ("c", PullStatus.DONE)]
    assert [lease.request_id for lease in leases.poll()] == ["b", "c"]


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
        _Lease("r", (1,), 0.0, LeaseState.EXPIRED).advance(LeaseState.PULLED)
    with pytest.raises(InvalidTransitionError, match="no transition WAITING -> DONE"):
        _Pull(params, LOCAL_IDS, 0.0).advance(PullStatus.DONE, 1.0)
    with pytest.raises(InvalidTransitionError, match="no transition DONE -> PULLING"):
        _Pull(params, LOCAL_IDS, 0.0, status=PullStatus.DONE).advance(PullStatus.PULLING)


def test_layout_mismatch_names_every_field(make_side, producer):
    other = KVLayout(model_id="tiny-llama", dtype="float32", block_size=8, num_layers=3, num_kv_heads=2,
                     head_dim=8, hash_seed=7)
    side = make_side("decode", empty_pool(other, 4), layout=other)
    with pytest.raises(KVLayoutMismatchError) as refused:
        side.backend.add_peer(producer.backend.metadata())
    assert str(refused.value) == (f"refusing to pull from {producer.backend.agent_name!r}: KV layouts differ "
                                  "(ours != theirs): block_size: 8 != 4; hash_seed: 7 != 0")
    assert side.backend.has_peer(producer.backend.agent_name) is False


def test_pull_with_a_different_layout_than_the_handshake_fails(producer, consumer, clock):
    pulls = ConsumerConnector(consumer.backend, clock=clock)
    bf16 = KVLayout("tiny-llama", "bfloat16", 4, 3, 2, 8, 0)
    params = TransferParams("req-1", producer.backend.agent_name, (1,), 2, bf16, 130.0)

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
