"""Real NIXL (UCX) on CPU: two agents in this process, plus a producer in a second process.

One process can hold several NIXL agents (they talk UCX shared memory), so most checks run
in-process; the cross-process test is the deployment shape (prefill and decode in different
Ray actors) and also covers a producer that dies.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
import uuid

import pytest
import torch

from splitserve.kv_transfer import nixl_module
from tests.factories import NIXL_MISSING, FakeClock, assert_blocks_pulled, empty_pool, make_pool

if nixl_module() is None:
    pytest.skip(NIXL_MISSING, allow_module_level=True)

from splitserve.common.kv_transfer_types import KVLayout, TransferParams  # noqa: E402
from splitserve.kv_transfer import (ConsumerConnector, KVLayoutMismatchError, KVTransferError,  # noqa: E402
                                    LeaseState, ProducerConnector, PullState, PullStatus, ReleasedLease,
                                    make_backend)
from splitserve.kv_transfer.connector import RECLAIMED_ERROR  # noqa: E402
from splitserve.kv_transfer.nixl_backend import ENV_DEFAULTS, NixlBackend, NixlConfig, _PoolInfo  # noqa: E402

LAYOUT = KVLayout(model_id="tiny-llama", dtype="float32", block_size=16, num_layers=4, num_kv_heads=2, head_dim=8,
                  hash_seed=0)
BLOCK_BYTES = LAYOUT.num_layers * LAYOUT.bytes_per_block_per_layer  # 4 * 2*16*2*8*4 = 16 KiB
REMOTE_IDS = (30, 3, 17, 8, 22)
LOCAL_IDS = (1, 19, 4, 12, 0)
NUM_REMOTE, NUM_LOCAL = 32, 24
PRODUCER_OFFSET = 1e7


def wait_for(condition, timeout_s: float = 5.0):
    """Poll `condition()` until it returns something truthy (NIXL progresses inside our calls)."""
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
    return result


def new_backend(role: str) -> NixlBackend:
    backend = make_backend("nixl", f"{role}-{uuid.uuid4().hex[:8]}")
    assert isinstance(backend, NixlBackend)
    return backend


@pytest.fixture(scope="module")
def producer():
    backend = new_backend("prefill")
    layers = make_pool(LAYOUT, NUM_REMOTE, offset=PRODUCER_OFFSET)
    backend.register_kv_pool(layers, LAYOUT)
    yield backend, layers
    backend.close()


@pytest.fixture
def make_producer(consumer):
    """A producer of this test only (its generations and bytes may be changed), known to `consumer`."""
    made: list[NixlBackend] = []

    def make() -> tuple[NixlBackend, list]:
        backend = new_backend("prefill")
        layers = make_pool(LAYOUT, NUM_REMOTE, offset=PRODUCER_OFFSET)
        backend.register_kv_pool(layers, LAYOUT)
        consumer[0].add_peer(backend.metadata())
        made.append(backend)
        return backend, layers

    yield make
    for backend in made:
        consumer[0].remove_peer(backend.agent_name)
        backend.close()


@pytest.fixture
def consumer(producer):
    backend = new_backend("decode")
    layers = empty_pool(LAYOUT, NUM_LOCAL)
    backend.register_kv_pool(layers, LAYOUT)
    backend.add_peer(producer[0].metadata())
    yield backend, layers
    backend.close()


def test_pull_scattered_blocks_across_layers_and_notify(producer, consumer):
    (producer_backend, remote), (consumer_backend, local) = producer, consumer
    leases = ProducerConnector(producer_backend, LAYOUT, lease_ttl_s=30.0)
    pulls = ConsumerConnector(consumer_backend)

    params = leases.hold("req-1", REMOTE_IDS, num_tokens=5 * 16 - 3)
    assert pulls.start(params, LOCAL_IDS) in (PullStatus.PULLING, PullStatus.DONE)
    [outcome] = wait_for(pulls.poll)
    assert (outcome.request_id, outcome.state, outcome.error, outcome.num_bytes) == (
        "req-1", PullStatus.DONE, None, 5 * BLOCK_BYTES)
    assert_blocks_pulled(local, LOCAL_IDS, remote, REMOTE_IDS)
    assert wait_for(leases.poll) == [ReleasedLease("req-1", REMOTE_IDS, LeaseState.PULLED)]


def read(backend: NixlBackend, handle) -> PullState:
    """Wait for one READ to settle, release it, return how it ended."""
    wait_for(lambda: backend.poll_pull(handle) is not PullState.PENDING)
    state = backend.poll_pull(handle)
    backend.release_pull(handle)
    return state


def test_backend_level_reads_and_notification(producer, consumer):
    (producer_backend, remote), (consumer_backend, local) = producer, consumer
    params = TransferParams("req-2", producer_backend.agent_name, (5, 6, 31), 40, LAYOUT, 30.0, (0, 0, 0))
    assert read(consumer_backend, consumer_backend.start_pull(params, (23, 2, 7))) is PullState.DONE
    assert_blocks_pulled(local, (23, 2, 7), remote, (5, 6, 31))
    time.sleep(0.05)
    assert producer_backend.take_notifications() == []  # the data READ notifies nobody

    assert read(consumer_backend, consumer_backend.start_check(params, (23, 2, 7))) is PullState.DONE
    assert consumer_backend.checked_generations((23, 2, 7)) == (0, 0, 0)
    assert wait_for(producer_backend.take_notifications) == ["req-2"]


def test_check_read_sees_the_producers_generations(make_producer, consumer):
    (producer_backend, _), (consumer_backend, _) = make_producer(), consumer
    producer_backend.bump_generations((3, 30))
    producer_backend.bump_generations((30,))
    params = TransferParams("req-g", producer_backend.agent_name, (30, 3, 17), 40, LAYOUT, 30.0, (0, 0, 0))
    assert producer_backend.generations(params.block_ids) == (2, 1, 0)
    assert read(consumer_backend, consumer_backend.start_check(params, (0, 9, 23))) is PullState.DONE
    assert consumer_backend.checked_generations((0, 9, 23)) == (2, 1, 0)
    assert consumer_backend.checked_generations((1, 2)) == (0, 0)  # scratch words of other blocks untouched


def test_dropped_notification_pulls_the_bytes_and_tells_the_producer_nothing(producer, consumer):
    (producer_backend, remote), (consumer_backend, local) = producer, consumer
    consumer_backend.drop_next_notifications(1)
    pulls = ConsumerConnector(consumer_backend)
    for request_id, remote_ids, local_ids in (("req-dropped", (4, 9), (5, 6)), ("req-told", (10,), (7,))):
        pulls.start(TransferParams(request_id, producer_backend.agent_name, remote_ids, 16 * len(remote_ids),
                                   LAYOUT, 30.0, (0,) * len(remote_ids)), local_ids)
        assert [o.state for o in wait_for(pulls.poll)] == [PullStatus.DONE]
    assert_blocks_pulled(local, (5, 6, 7), remote, (4, 9, 10))
    # Notifications arrive in order: once the second is here, the first was never sent.
    assert wait_for(producer_backend.take_notifications) == ["req-told"]


@pytest.mark.parametrize("reclaim", ["expiry", "release"])
def test_blocks_reclaimed_between_the_data_read_and_the_check_fail_the_pull(make_producer, consumer, monkeypatch,
                                                                             reclaim):
    """Ordered deterministically: the data READ completes, then the producer's lease ends (its
    clock jumps past the TTL, or it is released) and the blocks are overwritten, then the check
    READ is posted."""
    (producer_backend, remote), (consumer_backend, local) = make_producer(), consumer
    clock = FakeClock(100.0)
    leases = ProducerConnector(producer_backend, LAYOUT, lease_ttl_s=30.0, clock=clock)
    pulls = ConsumerConnector(consumer_backend)
    post_check = consumer_backend.start_check
    ended = []

    def reclaim_then_check(params, local_block_ids):
        assert_blocks_pulled(local, LOCAL_IDS, remote, REMOTE_IDS)  # the data READ completed, intact
        clock.now = 130.5
        ended.extend(leases.poll() if reclaim == "expiry" else [leases.release("req-r")])
        for layer in remote:
            layer[list(REMOTE_IDS)] = -1.0  # the producer's engine reuses the freed blocks
        return post_check(params, local_block_ids)

    monkeypatch.setattr(consumer_backend, "start_check", reclaim_then_check)
    pulls.start(leases.hold("req-r", REMOTE_IDS, 80), LOCAL_IDS)
    [outcome] = wait_for(pulls.poll)

    assert (outcome.request_id, outcome.state, outcome.error, outcome.num_bytes) == (
        "req-r", PullStatus.FAILED, RECLAIMED_ERROR, 0)
    assert ended == ([ReleasedLease("req-r", REMOTE_IDS, LeaseState.EXPIRED)] if reclaim == "expiry" else [True])
    assert consumer_backend.checked_generations(LOCAL_IDS) == (1,) * 5
    wait_for(lambda: leases.poll() == [] and leases.stats().num_late_notifications == 1)


def test_pull_of_an_expired_lease_fails_and_an_unexpired_one_succeeds_under_skew(make_producer, consumer):
    """Producer 10 s ahead of the consumer's real monotonic clock, or 10 s behind: neither matters."""
    producer_backend, remote = make_producer()
    consumer_backend, local = consumer
    pulls = ConsumerConnector(consumer_backend)
    for skew, request_id, local_ids in ((10.0, "ahead", (0, 1, 2, 3, 4)), (-10.0, "behind", (5, 6, 7, 8, 9))):
        leases = ProducerConnector(producer_backend, LAYOUT, lease_ttl_s=30.0,
                                   clock=lambda skew=skew: time.monotonic() + skew)
        pulls.start(leases.hold(request_id, REMOTE_IDS, 80), local_ids)
        [outcome] = wait_for(pulls.poll)
        assert (outcome.request_id, outcome.state, outcome.error) == (request_id, PullStatus.DONE, None)
        assert wait_for(leases.poll) == [ReleasedLease(request_id, REMOTE_IDS, LeaseState.PULLED)]

    clock = FakeClock(100.0)
    leases = ProducerConnector(producer_backend, LAYOUT, lease_ttl_s=30.0, clock=clock)
    params = leases.hold("expired", REMOTE_IDS, 80)
    clock.now = 130.25
    assert leases.poll() == [ReleasedLease("expired", REMOTE_IDS, LeaseState.EXPIRED)]
    pulls.start(params, (10, 11, 12, 13, 14))
    [outcome] = wait_for(pulls.poll)
    assert (outcome.request_id, outcome.state, outcome.error) == ("expired", PullStatus.FAILED, RECLAIMED_ERROR)
    assert producer_backend.generations(REMOTE_IDS) == (3,) * 5


def test_layout_mismatch_is_refused_before_nixl_sees_the_peer(producer):
    other = KVLayout("tiny-llama", "float32", 16, 4, 4, 8, 0)
    backend = new_backend("decode")
    try:
        backend.register_kv_pool(empty_pool(other, 4), other)
        with pytest.raises(KVLayoutMismatchError, match=r"\(ours != theirs\): num_kv_heads: 4 != 2$"):
            backend.add_peer(producer[0].metadata())
        assert backend.has_peer(producer[0].agent_name) is False
    finally:
        backend.close()


def test_a_peer_in_gpu_memory_is_refused_by_a_host_memory_agent(producer, consumer):
    """NIXL on CPU cannot register VRAM; a peer that says it did (its layout's memory_kind) is refused before
    NIXL loads its metadata."""
    (producer_backend, _), (consumer_backend, _) = producer, consumer
    consumer_backend.remove_peer(producer_backend.agent_name)
    metadata = producer_backend.metadata()
    vram = dataclasses.replace(metadata, layout=dataclasses.replace(metadata.layout, memory_kind="VRAM"))
    with pytest.raises(KVLayoutMismatchError, match=r"\(ours != theirs\): memory_kind: 'DRAM' != 'VRAM'$"):
        consumer_backend.add_peer(vram)
    assert consumer_backend.has_peer(producer_backend.agent_name) is False


def test_unknown_and_removed_peers_fail_cleanly(producer, consumer):
    (producer_backend, remote), (consumer_backend, local) = producer, consumer
    pulls = ConsumerConnector(consumer_backend)
    ghost = TransferParams("req-3", "prefill-ghost", (1,), 1, LAYOUT, 30.0, (0,))
    with pytest.raises(KVTransferError, match="unknown peer 'prefill-ghost'"):
        consumer_backend.start_pull(ghost, (1,))

    consumer_backend.remove_peer(producer_backend.agent_name)
    removed = TransferParams("req-4", producer_backend.agent_name, (1,), 1, LAYOUT, 30.0, (0,))
    assert pulls.start(removed, (1,)) is PullStatus.FAILED
    assert pulls.poll()[0].error == (f"unknown producer {producer_backend.agent_name!r}: no handshake, "
                                     "or it was removed")

    consumer_backend.add_peer(producer_backend.metadata())  # a fresh handshake works again
    assert pulls.start(TransferParams("req-5", producer_backend.agent_name, (9,), 1, LAYOUT, 30.0, (0,)),
                       (3,)) in (PullStatus.PULLING, PullStatus.VERIFYING, PullStatus.DONE)
    assert [o.state for o in wait_for(pulls.poll)] == [PullStatus.DONE]
    assert_blocks_pulled(local, (3,), remote, (9,))
    assert "req-5" in wait_for(producer_backend.take_notifications)


def test_out_of_range_remote_blocks_fail_before_nixl(producer, consumer):
    (producer_backend, _), (consumer_backend, _) = producer, consumer
    params = TransferParams("req-6", producer_backend.agent_name, (0, 32), 20, LAYOUT, 30.0, (0, 0))
    with pytest.raises(KVTransferError, match=r"remote block ids \(0, 32\) outside the producer's pool \[0, 32\)"):
        consumer_backend.start_pull(params, (0, 1))


def test_pool_metadata_round_trips_and_rejects_foreign_bytes():
    info = _PoolInfo("VRAM", 1, 32, 0x7E0000000000, (0x7F0000001000, 0x7F0000101000))
    assert _PoolInfo.unpack(info.pack(b"nixl-bytes")) == (info, b"nixl-bytes")
    assert info.descriptors(4096)[[0, 1, 32]].tolist() == [[0x7F0000001000, 4096, 1], [0x7F0000002000, 4096, 1],
                                                            [0x7F0000101000, 4096, 1]]
    assert info.generation_descriptors()[[0, 1, 31]].tolist() == [[0x7E0000000000, 8, 0], [0x7E0000000008, 8, 0],
                                                                   [0x7E00000000F8, 8, 0]]  # host memory
    with pytest.raises(KVTransferError, match="expected b'SSKV' v2"):
        _PoolInfo.unpack(b"NIXL" + bytes(40))
    with pytest.raises(ValueError, match="ucx_error_handling_mode must be 'none' or 'peer'"):
        NixlConfig(ucx_error_handling_mode="abort")


def test_closed_backend_refuses_calls():
    backend = new_backend("decode")
    backend.register_kv_pool(empty_pool(LAYOUT, 2), LAYOUT)
    backend.close()
    backend.close()
    with pytest.raises(KVTransferError, match="is closed"):
        backend.metadata()


# ---- a producer in another process ----------------------------------------------------------------
def _producer_process(conn) -> None:
    """Registers a pool, sends its metadata, then forwards notifications until told to stop or die."""
    backend = NixlBackend(f"prefill-{uuid.uuid4().hex[:8]}")
    backend.register_kv_pool(make_pool(LAYOUT, NUM_REMOTE, offset=PRODUCER_OFFSET), LAYOUT)
    conn.send(backend.metadata())
    notifications: list[str] = []
    while True:
        notifications += backend.take_notifications()
        if conn.poll(0.001):
            command = conn.recv()
            if command == "notifications":
                conn.send(notifications)
                notifications = []
            elif command == "die":
                import os
                os._exit(1)


def test_cross_process_pull_then_producer_death(consumer):
    consumer_backend, local = consumer
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_producer_process, args=(child,), daemon=True)
    process.start()
    try:
        assert parent.poll(60), "producer process did not start"
        metadata = parent.recv()
        consumer_backend.add_peer(metadata)
        pulls = ConsumerConnector(consumer_backend)
        pulls.start(TransferParams("req-7", metadata.agent_name, REMOTE_IDS, 80, LAYOUT, 30.0, (0,) * 5), LOCAL_IDS)
        [outcome] = wait_for(pulls.poll)
        assert (outcome.state, outcome.num_bytes) == (PullStatus.DONE, 5 * BLOCK_BYTES)
        assert_blocks_pulled(local, LOCAL_IDS, make_pool(LAYOUT, NUM_REMOTE, offset=PRODUCER_OFFSET), REMOTE_IDS)
        assert wait_for(lambda: parent.send("notifications") or parent.recv()) == ["req-7"]

        parent.send("die")
        process.join(10)
        pulls.start(TransferParams("req-8", metadata.agent_name, (1,), 1, LAYOUT, 30.0, (0,)), (2,))
        [outcome] = wait_for(pulls.poll)
        assert outcome.state is PullStatus.FAILED
        assert "NIXL_ERR_REMOTE_DISCONNECT" in outcome.error
        assert local[0][2].count_nonzero().item() == 0
    finally:
        process.kill()
        process.join()


def test_cuda_ipc_gets_are_turned_on_only_where_cuda_is():
    """A VRAM pull is all GETs, which UCX's cuda_ipc refuses without NVLink unless told; on a machine without
    CUDA the setting would only make UCX warn that it is unused."""
    assert ENV_DEFAULTS.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") == ("y" if torch.cuda.is_available() else None)
