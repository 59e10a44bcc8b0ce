"""planner/observe.py and planner/ray_adapter.py: what the planner sees of a live cluster, and
how its decisions become started and drained workers (a fake cluster, a stepping clock)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.kv_events import LoadReport
from splitserve.common.stats import KVTransferRecord, RequestRecord, WorkerSnapshot
from splitserve.planner.core.types import Decision, LengthHistogram, PlannerConfig, PoolTarget, Prediction, Role
from splitserve.planner.observe import PoolMembers, TrafficWindow, percentile
from splitserve.planner.samples import gap_cv2
from splitserve.planner.ray_adapter import RayPlanner
from tests.factories import make_request_record


def _record(request_id: str, e2e_s: float, ttft_s: float | None, prompt: int = 100, cached: int = 0,
            output: int = 11, prefill_worker: str | None = "prefill-0", queue_s: float | None = 0.01,
            transfer_s: float | None = None, routing_reason: str = "load") -> RequestRecord:
    finished = ttft_s is not None
    gaps = (((e2e_s - ttft_s) / (output - 1),) * (output - 1)) if finished else ()
    return make_request_record(
        request_id, finish_reason="length" if finished else None, error_code=None if finished else "RESOURCE_EXHAUSTED",
        routing_reason=routing_reason if finished else None, rejection_reason=None if finished else "ttft_slo",
        prefill_worker=prefill_worker, num_prompt_tokens=prompt, num_cached_tokens=cached,
        num_output_tokens=output if finished else 0, ttft_s=ttft_s, inter_token_latencies=gaps, e2e_s=e2e_s,
        queue_s=queue_s,
        kv_transfer=None if transfer_s is None else KVTransferRecord("prefill-0", "decode-0", transfer_s, 4096))


def _load(num_running: int, num_waiting: int, free_blocks: int, prefill_s_per_token=None, decode_step_s=None):
    return LoadReport(num_running, num_waiting, 0, 100, free_blocks, prefill_s_per_token, decode_step_s)


def test_helpers_are_exact():
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.99) == 5.0
    assert percentile([], 0.5) is None
    assert gap_cv2([0.0, 1.0, 2.0, 3.0]) == 0.0  # evenly spaced: no variation
    assert gap_cv2([0.0, 1.0, 3.0]) == pytest.approx(((1 - 1.5) ** 2 + (2 - 1.5) ** 2) / 2 / 1.5**2)
    assert gap_cv2([0.0, 1.0]) == 1.0


def test_a_window_of_records_and_reports_becomes_an_exact_observation():
    window = TrafficWindow(ttft_s=0.5, itl_s=0.05, block_size=16)
    # Ended at 95..99 s: arrivals at 94.0, 94.5, 97.0, 98.5 and one rejected at 99.0.
    window.record(95.0, _record("a", 1.0, 0.2, prompt=100, cached=50, transfer_s=0.004))
    window.record(96.0, _record("b", 1.5, 0.8, prompt=200, output=21, transfer_s=0.002))  # TTFT missed
    window.record(98.0, _record("c", 1.0, 0.1, prompt=100, output=11, prefill_worker=None,
                                routing_reason="local_prefill", queue_s=0.03))
    window.record(99.5, _record("d", 1.0, 0.3, prompt=300, output=101))  # TPOT 0.007: met
    window.record(99.0, _record("e", 0.0, None))
    window.record(99.2, make_request_record("d-beam-0-0", step_of="d"))  # a beam search's step: not a request
    snapshots = (WorkerSnapshot("prefill-0", "prefill", _load(0, 2, 90, prefill_s_per_token=0.001), None),
                 WorkerSnapshot("decode-0", "decode", _load(4, 1, 60, decode_step_s=0.02), None),
                 WorkerSnapshot("decode-1", "decode", None, None))
    members = {Role.PREFILL: PoolMembers(1), Role.DECODE: PoolMembers(2, starting=1)}
    observation = window.observation(100.0, 10.0, in_flight=3, snapshots=snapshots, members=members, scale_up_s=7.0)
    assert observation.arrival_rate == (5 + 3 - 0) / 10.0
    assert observation.prompt_lengths == LengthHistogram((100, 200, 300), (3, 1, 1))  # e was rejected, not absent
    assert observation.output_lengths == LengthHistogram((11, 21, 101), (2, 1, 1))
    assert observation.prefix_hit_rate == 50 / 800
    assert observation.transfer_s_p50 == 0.002
    assert observation.ttft_attainment == 3 / 5  # b missed, e (rejected) missed
    assert observation.itl_attainment == 2 / 5  # TPOT a 0.08, b 0.035, c 0.09, d 0.007 (target 0.05); e none
    assert observation.local_prefill_share == 1 / 4  # e was never routed
    assert observation.scale_up_s == 7.0
    assert observation.prefill.replicas == 1 and observation.prefill.queue_depth == 2
    assert observation.prefill.queue_time_p50_s == 0.01
    assert (observation.decode.replicas, observation.decode.starting) == (2, 1)
    assert (observation.decode.queue_depth, observation.decode.running_requests) == (1, 4)
    assert observation.decode.queue_time_p99_s == 0.03
    assert observation.decode.kv_usage == 0.4 and observation.decode.kv_capacity_tokens == 1600
    uncached = round((50 + 200 + 100 + 300 + 100) / 5)
    assert [(s.num_tokens, s.seconds) for s in observation.prefill_steps] == [(uncached, 0.001 * uncached)]
    assert [(s.batch_size, s.context_tokens, s.seconds) for s in observation.decode_steps] == [(4, 40 * 16, 0.02)]
    # The next window forgets what ended before it and counts arrivals from the new in-flight baseline.
    later = window.observation(109.0, 10.0, in_flight=1, snapshots=(), members=members, scale_up_s=None)
    assert later.arrival_rate == (2 + 1 - 3) / 10.0
    assert later.prompt_lengths == LengthHistogram((100, 300), (1, 1))


class FakeCluster:
    """Pools of worker ids; starts and stops finish when the test opens their gates."""

    def __init__(self, prefill: int, decode: int) -> None:
        self.pools = {Role.PREFILL: [f"prefill-{i}" for i in range(prefill)],
                      Role.DECODE: [f"decode-{i}" for i in range(decode)]}
        self.next_index = {Role.PREFILL: prefill, Role.DECODE: decode}
        self.requests: dict[str, int] = {}
        self.in_flight = 0
        self.start_gate, self.stop_gate = asyncio.Event(), asyncio.Event()
        self.fail_starts = False
        self.stopped: list[str] = []

    def workers(self, role: Role) -> list[str]:
        return list(self.pools[role])

    def requests_on(self, worker_id: str) -> int:
        return self.requests.get(worker_id, 0)

    def num_in_flight(self) -> int:
        return self.in_flight

    def snapshots(self):
        return ()

    def worker_bundle(self, role: Role) -> dict[str, float]:
        return {"CPU": 1.0} if role is Role.PREFILL else {"CPU": 2.0}

    async def start_worker(self, role: Role) -> str:
        worker_id = f"{role.value}-{self.next_index[role]}"
        self.next_index[role] += 1
        await self.start_gate.wait()
        if self.fail_starts:
            raise RuntimeError("no node has the resources")
        self.pools[role].append(worker_id)
        return worker_id

    async def stop_worker(self, worker_id: str) -> None:
        role = Role.PREFILL if worker_id.startswith("prefill") else Role.DECODE
        self.pools[role].remove(worker_id)  # the router stops routing to it at once
        await self.stop_gate.wait()
        self.stopped.append(worker_id)


class Script:
    """A decision core that answers with the next (prefill, decode) targets."""

    def __init__(self, *targets: tuple[int, int]) -> None:
        self.targets = list(targets)
        self.observations = []

    def decide(self, observation) -> Decision:
        self.observations.append(observation)
        prefill, decode = self.targets.pop(0)
        return Decision(observation.now_s, PoolTarget(Role.PREFILL, prefill, 0, "hold: scripted"),
                        PoolTarget(Role.DECODE, decode, 0, "scale_up: scripted"), 0,
                        Prediction(prefill, decode, 0.1, 0.01, 0.99, 1.0))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def _planner(cluster: FakeCluster, script: Script, clock: Clock, asked: list) -> RayPlanner:
    return RayPlanner(PlannerConfig(tick_s=10.0), cluster, TrafficWindow(1.0, 0.05, 16), clock, asked.append,
                      script.decide)


def test_growing_starts_workers_once_and_measures_how_long_they_take():
    async def scenario():
        cluster, script, clock, asked = FakeCluster(1, 1), Script((1, 3), (1, 3), (1, 3)), Clock(), []
        planner = _planner(cluster, script, clock, asked)
        clock.now = 10.0
        planner.tick()
        await _settle()
        assert planner.members()[Role.DECODE] == PoolMembers(1, starting=2)
        clock.now = 20.0
        planner.tick()  # the two starting workers count: nothing more is asked for
        await _settle()
        assert planner.members()[Role.DECODE] == PoolMembers(1, starting=2)
        clock.now = 24.0
        cluster.start_gate.set()
        await _settle()
        assert cluster.pools[Role.DECODE] == ["decode-0", "decode-1", "decode-2"]
        assert planner.members()[Role.DECODE] == PoolMembers(3)
        clock.now = 30.0
        planner.tick()
        assert script.observations[-1].scale_up_s == 14.0
        assert script.observations[-1].decode.replicas == 3
        stats = planner.stats()
        assert stats.device_seconds == 10 * 2 + 10 * 4 + 10 * 4
        assert stats.targets == (("prefill", 1), ("decode", 3))
        assert stats.decisions == (("decode", "scale_up", 3), ("prefill", "hold", 3))
        assert asked == [[{"CPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 2.0}]] * 3
        await planner.stop()

    asyncio.run(scenario())


def test_shrinking_drains_the_least_loaded_workers_and_never_twice():
    async def scenario():
        cluster, script, clock, asked = FakeCluster(1, 4), Script((1, 1), (1, 1)), Clock(), []
        cluster.requests = {"decode-0": 5, "decode-1": 0, "decode-2": 2, "decode-3": 2}
        planner = _planner(cluster, script, clock, asked)
        planner.tick()
        await _settle()
        # Fewest requests first; a tie goes to the newest worker (decode-3 before decode-2).
        assert cluster.pools[Role.DECODE] == ["decode-0"]
        assert planner.members()[Role.DECODE] == PoolMembers(1, draining=3)
        planner.tick()
        await _settle()
        assert planner.members()[Role.DECODE] == PoolMembers(1, draining=3)
        cluster.stop_gate.set()
        await _settle()
        assert cluster.stopped == ["decode-1", "decode-3", "decode-2"]
        assert planner.members()[Role.DECODE] == PoolMembers(1)
        await planner.stop()

    asyncio.run(scenario())


def test_a_worker_that_does_not_start_is_counted_and_asked_for_again():
    async def scenario():
        cluster, script, clock, asked = FakeCluster(1, 1), Script((1, 2), (1, 2)), Clock(), []
        cluster.fail_starts = True
        cluster.start_gate.set()
        planner = _planner(cluster, script, clock, asked)
        planner.tick()
        await _settle()
        assert planner.stats().failed_starts == 1
        assert planner.members()[Role.DECODE] == PoolMembers(1)
        cluster.fail_starts = False
        planner.tick()
        await _settle()
        assert cluster.pools[Role.DECODE] == ["decode-0", "decode-2"]
        await planner.stop()

    asyncio.run(scenario())


def test_a_smaller_target_cancels_starts_before_it_drains_a_serving_worker():
    async def scenario():
        cluster, script, clock, asked = FakeCluster(1, 2), Script((1, 4), (1, 3), (1, 1)), Clock(), []
        planner = _planner(cluster, script, clock, asked)
        planner.tick()  # 2 -> 4: two starts
        await _settle()
        assert planner.members()[Role.DECODE] == PoolMembers(2, starting=2)
        planner.tick()  # 4 -> 3: the newer start is cancelled
        await _settle()
        assert planner.members()[Role.DECODE] == PoolMembers(2, starting=1)
        planner.tick()  # 3 -> 1: the other start is cancelled, then one serving worker drains
        await _settle()
        assert planner.members()[Role.DECODE] == PoolMembers(1, draining=1)
        cluster.start_gate.set()
        cluster.stop_gate.set()
        await _settle()
        assert (cluster.pools[Role.DECODE], cluster.stopped) == (["decode-0"], ["decode-1"])
        assert planner.stats().failed_starts == 0
        await planner.stop()

    asyncio.run(scenario())
