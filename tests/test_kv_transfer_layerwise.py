"""Layer-wise KV transfer at the connector level: a pull READs each layer only after it was announced,
and ends with the same bytes, outcome, notification and lease as a whole-request pull.

In-process backend here (exact READ ranges recorded); NIXL (UCX) in the last section.
"""

from __future__ import annotations

import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitserve.common.kv_transfer_types import LayerAnnouncement
from splitserve.kv_transfer import (ConsumerConnector, InProcessBackend, InvalidTransitionError, LeaseState,
                                    ProducerConnector, PullOutcome, PullStatus, ReleasedLease, make_backend)
from splitserve.kv_transfer.base import pull_layers
from splitserve.kv_transfer.connector import PULL_TIMEOUT_ERROR, RECLAIMED_ERROR
from tests.factories import FakeClock, assert_blocks_pulled, empty_pool, make_pool, requires_nixl
from tests.test_kv_transfer import BLOCK_BYTES, LOCAL_IDS, REMOTE_IDS, TINY_LAYOUT

NUM_LAYERS = TINY_LAYOUT.num_layers  # 3


class RecordingBackend(InProcessBackend):
    """Records the layers of every data READ it posts, with the layers announced at that moment."""

    def __init__(self, agent_name: str, announced: set[int], defer_completion: bool = False) -> None:
        super().__init__(agent_name, defer_completion=defer_completion)
        self.announced = announced
        self.reads: list[tuple[range, frozenset[int]]] = []

    def start_pull(self, params, local_block_ids, layers=None):
        self.reads.append((pull_layers(layers, NUM_LAYERS), frozenset(self.announced)))
        return super().start_pull(params, local_block_ids, layers)


@pytest.fixture
def sides():
    """(producer backend, its pool, consumer backend, its pool, the set the test adds announced layers to)."""
    announced: set[int] = set()
    producer = InProcessBackend(f"prefill-{uuid.uuid4().hex[:8]}")
    consumer = RecordingBackend(f"decode-{uuid.uuid4().hex[:8]}", announced)
    remote, local = make_pool(TINY_LAYOUT, 10, offset=1e7), empty_pool(TINY_LAYOUT, 8)
    producer.register_kv_pool(remote, TINY_LAYOUT)
    consumer.register_kv_pool(local, TINY_LAYOUT)
    consumer.add_peer(producer.metadata())
    yield producer, remote, consumer, local, announced
    producer.close()
    consumer.close()


def _layers_equal(local, remote, layers) -> list[bool]:
    """Per layer: whether local block LOCAL_IDS[i] equals remote block REMOTE_IDS[i] for every i."""
    return [torch.equal(local[layer][list(LOCAL_IDS)], remote[layer][list(REMOTE_IDS)]) for layer in layers]


# ---- backends: a layer range is a slice of the whole READ ---------------------------------------
def test_layer_range_reads_compose_to_the_whole_read(sides):
    producer, remote, consumer, local, _ = sides
    params = ProducerConnector(producer, TINY_LAYOUT, 30.0).hold("r", REMOTE_IDS, 15)
    consumer.start_pull(params, LOCAL_IDS, range(1, 3))
    assert _layers_equal(local, remote, range(NUM_LAYERS)) == [False, True, True]
    assert local[0].count_nonzero().item() == 0
    consumer.start_pull(params, LOCAL_IDS, range(0, 1))
    assert_blocks_pulled(local, LOCAL_IDS, remote, REMOTE_IDS)


@pytest.mark.parametrize("layers", [range(0), range(2, 1), range(0, 4), range(-1, 2), range(0, 3, 2)])
def test_a_read_covers_consecutive_layers_inside_the_pool(layers):
    with pytest.raises(ValueError, match="non-empty range of consecutive layers in \\[0, 3\\)"):
        pull_layers(layers, NUM_LAYERS)


# ---- consumer: reads follow announcements ---------------------------------------------------------
def test_layerwise_pull_reads_each_layer_once_announced_then_checks(sides):
    producer, remote, consumer, local, announced = sides
    clock = FakeClock(100.0)
    leases = ProducerConnector(producer, TINY_LAYOUT, 30.0, clock=clock)
    pulls = ConsumerConnector(consumer, clock=clock)
    params = leases.hold("r", REMOTE_IDS, 15, layerwise=True)

    assert pulls.start(params, LOCAL_IDS, layerwise=True) is PullStatus.AWAITING_LAYER
    assert consumer.reads == [] and local[0].count_nonzero().item() == 0
    for layer in range(NUM_LAYERS):
        announced.add(layer)
        clock.now += 1.0
        assert pulls.announce(leases.announce("r", layer))
        assert _layers_equal(local, remote, range(NUM_LAYERS)) == [i <= layer for i in range(NUM_LAYERS)]
        assert producer.take_notifications() == ([] if layer < NUM_LAYERS - 1 else ["r"])
    assert consumer.reads == [(range(layer, layer + 1), frozenset(range(layer + 1))) for layer in range(NUM_LAYERS)]
    assert pulls.poll() == [PullOutcome("r", PullStatus.DONE, None, 4 * BLOCK_BYTES, 3.0)]
    assert_blocks_pulled(local, LOCAL_IDS, remote, REMOTE_IDS)


def test_out_of_order_announcements_wait_for_the_gap_below(sides):
    producer, remote, consumer, local, announced = sides
    leases = ProducerConnector(producer, TINY_LAYOUT, 30.0)
    pulls = ConsumerConnector(consumer)
    params = leases.hold("r", REMOTE_IDS, 15, layerwise=True)
    pulls.start(params, LOCAL_IDS, layerwise=True)
    for layer, ready in ((2, [False, False, False]), (0, [True, False, False]), (1, [True, True, True])):
        announced.add(layer)
        assert pulls.announce(LayerAnnouncement("r", producer.agent_name, layer))
        assert _layers_equal(local, remote, range(NUM_LAYERS)) == ready
    assert consumer.reads == [(range(0, 1), frozenset({0, 2})), (range(1, 3), frozenset({0, 1, 2}))]
    assert [outcome.state for outcome in pulls.poll()] == [PullStatus.DONE]


@settings(max_examples=40, deadline=None)
@given(order=st.permutations(range(NUM_LAYERS)), completions=st.lists(st.booleans(), min_size=3, max_size=3))
def test_no_layer_is_ever_read_before_it_and_all_below_it_are_announced(order, completions):
    """Any announcement order, READs completing late or at once: every READ covers announced layers
    only (the connector's invariant), the READs tile the layers in order, and the bytes are exact."""
    announced: set[int] = set()
    producer = InProcessBackend(f"prefill-{uuid.uuid4().hex[:8]}")
    consumer = RecordingBackend(f"decode-{uuid.uuid4().hex[:8]}", announced, defer_completion=True)
    remote, local = make_pool(TINY_LAYOUT, 10, offset=1e7), empty_pool(TINY_LAYOUT, 8)
    try:
        producer.register_kv_pool(remote, TINY_LAYOUT)
        consumer.register_kv_pool(local, TINY_LAYOUT)
        consumer.add_peer(producer.metadata())
        pulls = ConsumerConnector(consumer)
        pulls.start(ProducerConnector(producer, TINY_LAYOUT, 30.0).hold("r", REMOTE_IDS, 15, layerwise=True),
                    LOCAL_IDS, layerwise=True)
        for layer, complete_now in zip(order, completions):
            announced.add(layer)
            pulls.announce(LayerAnnouncement("r", producer.agent_name, layer))
            if complete_now:
                consumer.complete_pending_pulls()
                pulls.poll()
        outcomes = []
        while not outcomes:
            consumer.complete_pending_pulls()
            outcomes = pulls.poll()
        assert [outcome.state for outcome in outcomes] == [PullStatus.DONE]
        for layers, announced_then in consumer.reads:
            assert set(range(layers.stop)) <= announced_then, (layers, announced_then)
        assert [layer for layers, _ in consumer.reads for layer in layers] == list(range(NUM_LAYERS))
        assert_blocks_pulled(local, LOCAL_IDS, remote, REMOTE_IDS)
    finally:
        producer.close()
        consumer.close()


def test_the_connector_refuses_to_read_an_unannounced_layer(sides):
    """The invariant is asserted where the READ is posted, whatever drives the state machine."""
    producer, _, consumer, local, _ = sides
    pulls = ConsumerConnector(consumer)
    params = ProducerConnector(producer, TINY_LAYOUT, 30.0).hold("r", REMOTE_IDS, 15, layerwise=True)
    pulls.start(params, LOCAL_IDS, layerwise=True)
    pulls.announce(LayerAnnouncement("r", producer.agent_name, 0))
    pull = pulls._pulls["r"]
    with pytest.raises(InvalidTransitionError, match=r"'r': READ of layers \[1, 2\) with \[0, 1\) read and "
                                                     r"\[0, 1\) announced"):
        pulls._read_layers(pull, range(1, 2), 0.0)
    assert consumer.reads == [(range(0, 1), frozenset())]
    assert local[1].count_nonzero().item() == 0


def test_announcements_no_pull_waits_for_are_dropped_and_counted(sides):
    producer, _, consumer, local, _ = sides
    leases = ProducerConnector(producer, TINY_LAYOUT, 30.0)
    pulls = ConsumerConnector(consumer)
    layerwise = leases.hold("lw", REMOTE_IDS, 15, layerwise=True)
    whole = leases.hold("whole", (1,), 4)
    pulls.start(layerwise, LOCAL_IDS, layerwise=True)
    pulls.start(whole, (7,))
    assert not pulls.announce(LayerAnnouncement("unknown", producer.agent_name, 0))
    assert not pulls.announce(LayerAnnouncement("lw", "prefill-previous-incarnation", 0))
    assert not pulls.announce(LayerAnnouncement("whole", producer.agent_name, 0))
    assert pulls.announce(LayerAnnouncement("lw", producer.agent_name, 0))
    assert not pulls.announce(LayerAnnouncement("lw", producer.agent_name, 0))
    with pytest.raises(ValueError, match="layer 3 outside \\[0, 3\\)"):
        pulls.announce(LayerAnnouncement("lw", producer.agent_name, 3))
    assert pulls.stats().num_unmatched_announcements == 4
    assert [range_ for range_, _ in consumer.reads] == [range(0, 3), range(0, 1)]  # the whole pull, then layer 0
    assert local[1][list(LOCAL_IDS)].count_nonzero().item() == 0


def test_a_pull_whose_layers_stop_coming_fails_after_the_ttl(sides):
    producer, _, consumer, _, _ = sides
    clock = FakeClock(0.0)
    leases = ProducerConnector(producer, TINY_LAYOUT, 30.0, clock=clock)
    pulls = ConsumerConnector(consumer, clock=clock)
    pulls.start(leases.hold("r", REMOTE_IDS, 15, layerwise=True), LOCAL_IDS, layerwise=True)
    pulls.announce(leases.announce("r", 0))
    clock.now += 30.0
    assert pulls.poll() == [] and pulls.status("r") is PullStatus.AWAITING_LAYER
    clock.now += 0.5
    assert pulls.poll() == [PullOutcome("r", PullStatus.FAILED, PULL_TIMEOUT_ERROR.format(ttl=30.0), 0, 30.5)]
    assert [outcome.state for outcome in leases.poll()] == [LeaseState.EXPIRED]


def test_a_lease_released_mid_transfer_fails_the_pull_and_frees_both_sides(sides):
    """The producer cancels after layer 1 (it bumps the blocks' generations): whatever the consumer
    READs afterwards, its check fails, and an abort releases its side at once."""
    producer, _, consumer, _, _ = sides
    clock = FakeClock(5.0)
    leases = ProducerConnector(producer, TINY_LAYOUT, 30.0, clock=clock)
    pulls = ConsumerConnector(consumer, clock=clock)
    params = leases.hold("r", REMOTE_IDS, 15, layerwise=True)
    pulls.start(params, LOCAL_IDS, layerwise=True)
    pulls.announce(leases.announce("r", 0))
    pulls.announce(leases.announce("r", 1))
    assert leases.release("r")
    assert producer.generations(REMOTE_IDS) == (1, 1, 1, 1)
    with pytest.raises(InvalidTransitionError, match="no HELD lease to announce layer 2"):
        leases.announce("r", 2)
    clock.now += 1.0
    assert pulls.announce(LayerAnnouncement("r", producer.agent_name, 2))  # one still in flight at the release
    assert pulls.poll() == [PullOutcome("r", PullStatus.FAILED, RECLAIMED_ERROR, 0, 1.0)]
    assert leases.poll() == [] and leases.stats().num_late_notifications == 1
    assert leases.stats().num_held == 0 and pulls.stats().num_pulling == 0


def test_the_lease_ends_only_after_the_last_layers_check(sides):
    producer, _, consumer, _, _ = sides
    leases = ProducerConnector(producer, TINY_LAYOUT, 30.0)
    pulls = ConsumerConnector(consumer)
    pulls.start(leases.hold("r", REMOTE_IDS, 15, layerwise=True), LOCAL_IDS, layerwise=True)
    for layer in range(NUM_LAYERS - 1):
        pulls.announce(leases.announce("r", layer))
        assert leases.poll() == []
    pulls.announce(leases.announce("r", NUM_LAYERS - 1))
    assert leases.poll() == [ReleasedLease("r", REMOTE_IDS, LeaseState.PULLED)]
    assert producer.generations(REMOTE_IDS) == (1, 1, 1, 1)


def test_an_aborted_layerwise_pull_reads_nothing_more(sides):
    producer, _, consumer, local, _ = sides
    leases = ProducerConnector(producer, TINY_LAYOUT, 30.0)
    pulls = ConsumerConnector(consumer)
    pulls.start(leases.hold("r", REMOTE_IDS, 15, layerwise=True), LOCAL_IDS, layerwise=True)
    pulls.announce(leases.announce("r", 0))
    assert pulls.abort("r")
    assert not pulls.announce(leases.announce("r", 1))
    assert [range_ for range_, _ in consumer.reads] == [range(0, 1)]
    assert local[1].count_nonzero().item() == 0
    assert pulls.stats().num_aborted == 1 and pulls.poll() == []


# ---- producer: announcements in forward order ------------------------------------------------------
def test_the_producer_announces_each_layer_once_in_order(sides):
    producer, *_ = sides
    leases = ProducerConnector(producer, TINY_LAYOUT, 30.0)
    leases.hold("lw", REMOTE_IDS, 15, layerwise=True)
    leases.hold("whole", (1,), 4)
    with pytest.raises(InvalidTransitionError, match="layer 1 announced after layers \\[0, 0\\) of 3"):
        leases.announce("lw", 1)
    assert [leases.announce("lw", layer) for layer in range(NUM_LAYERS)] == [
        LayerAnnouncement("lw", producer.agent_name, layer) for layer in range(NUM_LAYERS)]
    with pytest.raises(InvalidTransitionError, match="layer 3 announced after layers \\[0, 3\\) of 3"):
        leases.announce("lw", 3)
    with pytest.raises(InvalidTransitionError, match="layer 0 announced after layers \\[0, 3\\) of 3"):
        leases.announce("whole", 0)  # a whole-request hold has every layer written
    with pytest.raises(InvalidTransitionError, match="'nobody': no HELD lease"):
        leases.announce("nobody", 0)


# ---- NIXL (UCX) ------------------------------------------------------------------------------------
@requires_nixl
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_nixl_layerwise_pull_equals_the_whole_request_pull(order):
    producer, whole_side, layer_side = (make_backend("nixl", f"{role}-{uuid.uuid4().hex[:8]}")
                                        for role in ("prefill", "decode", "decode"))
    remote = make_pool(TINY_LAYOUT, 10, offset=1e7)
    whole_pool, layer_pool = empty_pool(TINY_LAYOUT, 8), empty_pool(TINY_LAYOUT, 8)
    try:
        producer.register_kv_pool(remote, TINY_LAYOUT)
        for backend, pool in ((whole_side, whole_pool), (layer_side, layer_pool)):
            backend.register_kv_pool(pool, TINY_LAYOUT)
            backend.add_peer(producer.metadata())
        leases = ProducerConnector(producer, TINY_LAYOUT, 30.0)
        whole, layered = ConsumerConnector(whole_side), ConsumerConnector(layer_side)
        whole.start(leases.hold("whole", REMOTE_IDS, 15), LOCAL_IDS)
        layered.start(leases.hold("lw", REMOTE_IDS, 15, layerwise=True), LOCAL_IDS, layerwise=True)
        for layer in order:
            layered.announce(LayerAnnouncement("lw", producer.agent_name, layer))
        outcomes = [_settle(whole), _settle(layered)]
        assert [(o.state, o.num_bytes) for o in outcomes] == [(PullStatus.DONE, 4 * BLOCK_BYTES)] * 2
        assert all(torch.equal(a, b) for a, b in zip(whole_pool, layer_pool))
        assert_blocks_pulled(layer_pool, LOCAL_IDS, remote, REMOTE_IDS)
        assert sorted(_settle_notifications(leases)) == ["lw", "whole"]
    finally:
        for backend in (whole_side, layer_side, producer):
            backend.close()


def _settle(pulls: ConsumerConnector) -> PullOutcome:
    for _ in range(10_000):
        outcomes = pulls.poll()
        if outcomes:
            return outcomes[0]
    raise AssertionError("the pull did not settle")


def _settle_notifications(leases: ProducerConnector) -> list[str]:
    ended: list[str] = []
    for _ in range(10_000):
        ended += [lease.request_id for lease in leases.poll()]
        if len(ended) == 2:
            return ended
    raise AssertionError(f"only {ended} were notified")



def test_a_layerwise_pull_from_an_unknown_producer_fails_at_start(sides):
    producer, _, consumer, _, _ = sides
    pulls = ConsumerConnector(consumer, clock=FakeClock(1.0))
    params = ProducerConnector(producer, TINY_LAYOUT, 30.0).hold("r", REMOTE_IDS, 15, layerwise=True)
    consumer.remove_peer(producer.agent_name)
    assert pulls.start(params, LOCAL_IDS, layerwise=True) is PullStatus.FAILED
    assert not pulls.announce(LayerAnnouncement("r", producer.agent_name, 0))
    [outcome] = pulls.poll()
    assert (outcome.state, outcome.error) == (
        PullStatus.FAILED, f"unknown producer {producer.agent_name!r}: no handshake, or it was removed")
    assert consumer.reads == []
