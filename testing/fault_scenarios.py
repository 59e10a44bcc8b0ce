"""The fault matrix (issue 6): scenarios that stop requests in exact states or inject transfer
faults, each returning a typed outcome (codes, outputs, what the workers still hold).

A scenario drives one cluster from the router's side, as the gRPC and HTTP servers do (a task
per client stream consuming Orchestrator.generate), and holds a request in a state with hooks,
never by sleeping and hoping:
- `EngineLoop.set_step_gate` stops a worker's engine before a step while a request is queued,
  part-prefilled or decoding; calls (aborts) still run;
- a client stream that stops reading after its first chunk holds the request between the prefill
  worker's answer and the decode worker's submit: the prompt's KV waits under its lease;
- `InProcessBackend.defer_completions` keeps a decode worker's pull in flight until the scenario
  completes it (the READ landing), or until the decode worker gives up after the lease's TTL.
Faults: the in-process backend's `fail_next_pulls` / `drop_next_notifications`, short leases,
`remove_peer` during a pull, a worker's shutdown; on Ray, `ray.kill` and the NIXL backend's
`drop_next_notifications`.

After the streams end the runner waits for the cluster to settle and records what each live
worker still holds by its own accounting (`stats()`: requests, leases, transfers, KV blocks not
in the free list, where a cached-but-free prefix block counts as free) and what the router still
counts in flight: anything left is a leak. Every stream's end (a finish, or a status code and
message) is compared with the router's RequestRecord of it, and its tokens with an undisturbed
greedy run of the same prompt.

To add a scenario: write `async def drive(harness)` (open streams with `harness.open`, inject
the fault, await the streams' ends) and list a `Scenario` with its `Expected` outcome in
IN_PROCESS_SCENARIOS (an InProcessCluster per scenario) or RAY_SCENARIOS (one LocalCluster of Ray
actors shared in order). bench/fault_matrix.py runs them and regenerates docs/reliability.md;
tests/test_faults.py and tests/test_faults_nixl.py assert every expectation.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import functools
import json
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from splitserve.common.errors import InvalidRequestError
from splitserve.common.stats import RequestRecord
from splitserve.common.worker_messages import WorkerStats
from splitserve.decode_worker.worker import DecodeWorker
from splitserve.engine.engine_core import EngineCore
from splitserve.engine.engine_loop import EngineLoop
from splitserve.kv_transfer import InProcessBackend
from splitserve.kv_transfer.connector import PULL_TIMEOUT_ERROR, RECLAIMED_ERROR
from splitserve.prefill_worker.worker import PrefillWorker
from splitserve.router.api_types import GenerationInput, RouterError, StreamChunk
from splitserve.router.orchestrator import Orchestrator
from splitserve.testing.in_process_cluster import InProcessCluster
from splitserve.testing.workloads import GreedyCase, mixed_workload

OK = "OK"
"""The 'code' of a stream that finished (finish reason stop or length)."""
CANCELLED = "CANCELLED"
HUNG = "HUNG"
"""The 'code' of a stream that had no end within STREAM_TIMEOUT_S (it is then cancelled)."""

STATE_TIMEOUT_S = 10.0
"""How long a driver waits for a request to reach the state it holds it in."""
STREAM_TIMEOUT_S = 20.0
"""How long the runner waits for all of a scenario's streams to end (then they end HUNG)."""
DRIVE_TIMEOUT_S = 60.0
"""How long a driver may take (then it counts as a failed check and its streams are cancelled)."""
SETTLE_TIMEOUT_S = 5.0
"""How long the workers get to release everything after the last stream ended."""
POLL_S = 0.005
DEADLINE_S = 0.75
"""Deadline scenarios: the request's deadline is this long after it is sent."""
SHORT_LEASE_S = 1.0
"""Leases that must outlast a normal pull but end within the scenario (dropped notification,
a READ that never lands)."""
EXPIRING_LEASE_S = 0.3
"""A lease the scenario lets expire before decode is asked to pull."""
RAY_LEASE_TTL_S = 2.0
"""The Ray cluster's router.lease_ttl_s (bounds how long a dead producer can hold up a pull)."""

SHORT = GreedyCase(tuple(range(3, 43)), max_tokens=16, ignore_eos=True)
"""40 prompt tokens (5 blocks of 8), 16 output tokens."""
LONG = GreedyCase(tuple(3 + (7 * i) % 500 for i in range(600)), max_tokens=8, ignore_eos=True)
"""600 prompt tokens: three prefill chunks under the in-process workers' 256-token budget."""
DECODE_HOLD_TOKENS = 3
"""Decoding holds stop the decode engine once a request has this many output tokens (of 16)."""


class StateNotReached(RuntimeError):
    """A driver waited STATE_TIMEOUT_S for a state the request never reached."""


# ---- outcomes -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class StreamEnd:
    """How one client stream ended."""

    code: str
    """OK, a gRPC status code name (CANCELLED, DEADLINE_EXCEEDED, INTERNAL, UNAVAILABLE, ...) or HUNG."""
    message: str
    """What the client is told with the status ('' for OK and CANCELLED)."""
    token_ids: tuple[int, ...]
    """Every token the client received."""


@dataclass(frozen=True)
class WorkerResidue:
    """What one live worker still holds after the cluster settled (all zero: nothing leaked)."""

    worker_id: str
    requests: int
    """Running + waiting requests in its engine."""
    owned_blocks: int
    """KV blocks not in its free list (a cached-but-free prefix block is in the free list)."""
    held_leases: int
    transfers: int
    """Requests waiting for blocks or pulling KV (decode workers)."""

    @classmethod
    def of(cls, worker_id: str, stats: WorkerStats) -> WorkerResidue:
        engine = stats.engine
        return cls(worker_id, engine.num_running + engine.num_waiting,
                   engine.num_kv_blocks - engine.num_free_kv_blocks, stats.num_held_leases, stats.num_transfers)

    @property
    def is_clean(self) -> bool:
        return self.requests == self.owned_blocks == self.held_leases == self.transfers == 0

    def describe(self) -> str:
        parts = [(self.requests, "requests"), (self.owned_blocks, "blocks"), (self.held_leases, "leases"),
                 (self.transfers, "transfers")]
        return f"{self.worker_id}: " + ", ".join(f"{count} {what}" for count, what in parts if count)


@dataclass(frozen=True)
class ScenarioOutcome:
    name: str
    requests_sent: int
    codes: tuple[tuple[str, int], ...]
    """(code, streams) of every stream's end as its client saw it, sorted by code."""
    router_codes: tuple[tuple[str, int], ...]
    """The same from the router's RequestRecords (error_code, or OK when it finished)."""
    errors: tuple[str, ...]
    """Distinct messages of streams that ended with an error status, ids replaced by <id>, sorted."""
    outputs_equal_reference: int
    """Streams that finished with exactly the undisturbed run's tokens."""
    prefixes_of_reference: int
    """Streams that did not finish whose tokens are a prefix of the undisturbed run's."""
    kv_transfers_failed: int
    """Requests whose KV pull failed (from the router's records)."""
    lease_expiries: int
    """Leases the live prefill workers let expire (their cumulative counter)."""
    residue: tuple[WorkerResidue, ...]
    """Per live worker, after settling."""
    dead_workers: tuple[str, ...]
    """Workers the scenario killed (not settled: what they held died with them)."""
    router_in_flight: int
    """Requests the router still counted (in flight, or claimed on a worker) after settling."""
    settle_s: float
    """From the last stream's end until every live worker was idle (SETTLE_TIMEOUT_S at most)."""
    checks: tuple[tuple[str, bool], ...]
    """Invariants the scenario checked on the way (what, held)."""
    notes: tuple[str, ...]
    """Measurements worth reporting (e.g. how long after a kill the request ended)."""
    seconds: float

    @property
    def num_ok(self) -> int:
        return dict(self.codes).get(OK, 0)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScenarioOutcome:
        pairs = lambda items: tuple((code, count) for code, count in items)  # noqa: E731
        return cls(**{**data, "codes": pairs(data["codes"]), "router_codes": pairs(data["router_codes"]),
                      "errors": tuple(data["errors"]), "residue": tuple(WorkerResidue(**r) for r in data["residue"]),
                      "dead_workers": tuple(data["dead_workers"]), "checks": pairs(data["checks"]),
                      "notes": tuple(data["notes"])})


# ---- scenarios and expectations -----------------------------------------------------------------
@dataclass(frozen=True)
class Expected:
    codes: tuple[tuple[str, int], ...]
    """Every stream's end: (code, streams), sorted by code."""
    cause: str = ""
    """A phrase every error message must contain: the cause the client is told ('' = not checked)."""
    lease_expiries: int | None = 0
    """Leases the prefill workers let expire; None where a race decides it."""
    kv_transfers_failed: int | None = None
    """Requests whose pull failed; None = not checked."""


@dataclass(frozen=True)
class Scenario:
    name: str
    group: str
    """Section of docs/reliability.md: cancel, deadline, transfer fault, load, nixl."""
    summary: str
    """What happens, one line for docs/reliability.md."""
    drive: Callable[[Harness], Awaitable[None]]
    expected: Expected
    cases: tuple[GreedyCase, ...]
    """Every prompt the driver sends (their undisturbed outputs are computed first)."""
    transfer_failure_policy: str = "recompute"
    lease_ttl_s: float = 30.0
    num_prefill: int = 1
    """In-process workers of each pool (InProcessView.prefill / .decode are the first of each)."""
    num_decode: int = 1


def unmet_expectations(scenario: Scenario, outcome: ScenarioOutcome) -> tuple[str, ...]:
    """Every way the outcome differs from what the scenario expects (empty: as expected)."""
    expected = scenario.expected
    problems = []
    if outcome.codes != expected.codes:
        problems.append(f"stream ends {outcome.codes}, expected {expected.codes}")
    if outcome.router_codes != outcome.codes:
        problems.append(f"the router recorded {outcome.router_codes}, the clients saw {outcome.codes}")
    if expected.cause and not (outcome.errors and all(expected.cause in error for error in outcome.errors)):
        problems.append(f"error messages {outcome.errors} do not all name {expected.cause!r}")
    if outcome.outputs_equal_reference != outcome.num_ok:
        problems.append(f"{outcome.outputs_equal_reference} of {outcome.num_ok} finished streams equal the "
                        "undisturbed run")
    if outcome.prefixes_of_reference != outcome.requests_sent - outcome.num_ok:
        problems.append(f"{outcome.prefixes_of_reference} of {outcome.requests_sent - outcome.num_ok} unfinished "
                        "streams are a prefix of the undisturbed run")
    leaks = [residue.describe() for residue in outcome.residue if not residue.is_clean]
    if leaks or outcome.router_in_flight:
        problems.append(f"left after {outcome.settle_s:.1f} s: {leaks}, router in flight {outcome.router_in_flight}")
    for name in ("lease_expiries", "kv_transfers_failed"):
        if getattr(expected, name) is not None and getattr(outcome, name) != getattr(expected, name):
            problems.append(f"{name} {getattr(outcome, name)}, expected {getattr(expected, name)}")
    problems += [f"check failed: {what}" for what, held in outcome.checks if not held]
    return tuple(problems)


# ---- driving streams ----------------------------------------------------------------------------
class ClientStream:
    """One client's stream: a task consumes Orchestrator.generate as a server's handler does. With
    `pause_after`, it stops reading after that many chunks (unless the last was final) until
    resume(): the router then waits at its yield, before its next step."""

    def __init__(self, orchestrator: Orchestrator, inp: GenerationInput, case: GreedyCase,
                 pause_after: int | None) -> None:
        self.case = case
        self.chunks: list[StreamChunk] = []
        self.end: StreamEnd | None = None
        self.paused = asyncio.Event()
        self._resume = asyncio.Event()
        self._pause_after = pause_after
        self._hung = False
        self.task = asyncio.get_running_loop().create_task(self._consume(orchestrator, inp))

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(token for chunk in self.chunks for token in chunk.token_ids)

    @property
    def left_paused(self) -> bool:
        """Stopped reading and never resumed nor ended."""
        return self.paused.is_set() and not self._resume.is_set() and not self.task.done()

    def resume(self) -> None:
        self._resume.set()

    def cancel(self) -> None:
        """The client goes away (as a gRPC cancel does: the handler's task is cancelled)."""
        self.task.cancel()

    async def ended(self, timeout_s: float = STREAM_TIMEOUT_S) -> StreamEnd:
        """The stream's end; one with no end within timeout_s is cancelled and ends HUNG."""
        done, _ = await asyncio.wait({self.task}, timeout=timeout_s)
        if not done:
            self._hung = True
            self.task.cancel()
            await asyncio.wait({self.task})
        return self.end

    async def _consume(self, orchestrator: Orchestrator, inp: GenerationInput) -> None:
        code, message = OK, ""
        try:
            async with contextlib.aclosing(orchestrator.generate(inp)) as chunks:
                async for chunk in chunks:
                    self.chunks.append(chunk)
                    if len(self.chunks) == self._pause_after and chunk.finish_reason is None:
                        self.paused.set()
                        await self._resume.wait()
        except RouterError as error:
            code, message = error.code, error.message
        except InvalidRequestError as error:
            code, message = "INVALID_ARGUMENT", str(error)
        except asyncio.CancelledError:
            code = HUNG if self._hung else CANCELLED
        except Exception as error:  # a server would end the stream with INTERNAL
            code, message = "INTERNAL", f"unexpected {type(error).__name__}: {error}"
        self.end = StreamEnd(code, message, self.token_ids)


class StepHold:
    """Holds one worker's engine before every step while `when(engine)` is true (evaluated on the
    engine thread, see EngineLoop.set_step_gate); `reached()` returns once it held a step."""

    def __init__(self, loop: EngineLoop, when: Callable[[EngineCore], bool]) -> None:
        self._loop = loop
        self._when = when
        self._reached = threading.Event()
        loop.set_step_gate(self._gate)

    def _gate(self, engine: EngineCore) -> bool:
        if self._when(engine):
            self._reached.set()
            return False
        return True

    async def reached(self) -> None:
        if not await asyncio.to_thread(self._reached.wait, STATE_TIMEOUT_S):
            raise StateNotReached(f"the engine was not held within {STATE_TIMEOUT_S} s")

    def release(self) -> None:
        self._loop.set_step_gate(None)


def unscheduled(engine: EngineCore) -> bool:
    """A request waits with nothing computed yet (queued)."""
    return any(r.num_computed_tokens == 0 for r in engine.scheduler.requests.values())


def part_prefilled(engine: EngineCore) -> bool:
    """A request has some but not all of its prompt computed (between two prefill chunks)."""
    return any(0 < r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values())


def decoding(engine: EngineCore) -> bool:
    """A request has DECODE_HOLD_TOKENS output tokens (the first came from the prefill worker)."""
    return any(r.num_output_tokens >= DECODE_HOLD_TOKENS for r in engine.scheduler.requests.values())


class ClusterView(Protocol):
    """What the runner needs from a cluster, in-process or on Ray."""

    orchestrator: Orchestrator
    dead: set[str]
    """Workers the scenario killed."""

    async def worker_stats(self) -> dict[str, WorkerStats]:
        """stats() of every live worker."""

    async def lease_expiries(self) -> int:
        """Leases the live prefill workers let expire since they started."""


class InProcessView:
    """An InProcessCluster; `prefill` and `decode` are the first worker of each pool."""

    def __init__(self, cluster: InProcessCluster) -> None:
        self.cluster = cluster
        self.orchestrator = cluster.orchestrator
        self.dead: set[str] = set()

    @property
    def prefill(self) -> PrefillWorker:
        return self.cluster.prefill_workers[0]

    @property
    def decode(self) -> DecodeWorker:
        return self.cluster.decode_workers[0]

    @property
    def decode_backend(self) -> InProcessBackend:
        backend = self.decode._backend
        assert isinstance(backend, InProcessBackend), backend
        return backend

    @staticmethod
    def engine_loop(worker: PrefillWorker | DecodeWorker) -> EngineLoop:
        return worker._loop

    @staticmethod
    async def on_engine_thread(worker: PrefillWorker | DecodeWorker, fn: Callable[[], Any]) -> Any:
        """fn() on the worker's engine thread (the only thread that drives its transfer backend)."""
        return await worker._loop.run(lambda engine: fn())

    def kill(self, worker: PrefillWorker | DecodeWorker) -> None:
        """The worker's process dies (InProcessCluster.kill): the router's calls to it fail as Ray's
        do for a dead actor, its engine stops, its transfer agent and pool are gone."""
        self.dead.add(worker.worker_id)
        self.cluster.kill(worker.worker_id)

    @staticmethod
    def skew_lease_clock(worker: PrefillWorker | DecodeWorker, seconds: float) -> None:
        """From now on the worker's lease clock (the producer's leases, the consumer's pulls) reads
        `seconds` off its monotonic clock: a step of the clock, as a skewed or resynced machine's."""
        connector = worker._leases if isinstance(worker, PrefillWorker) else worker._pulls
        connector._clock = lambda: time.monotonic() + seconds

    def _live(self) -> list[PrefillWorker | DecodeWorker]:
        return [w for w in [*self.cluster.prefill_workers, *self.cluster.decode_workers] if w.worker_id not in self.dead]

    async def worker_stats(self) -> dict[str, WorkerStats]:
        return {worker.worker_id: await worker.stats() for worker in self._live()}

    async def lease_expiries(self) -> int:
        reports = [await w.report(None, 0, 0.0) for w in self._live() if w in self.cluster.prefill_workers]
        return sum(report.counters.kv_leases_expired for report in reports)


class RayView:
    """A LocalCluster of Ray actors (NIXL transfers); worker ids are prefill-<i> / decode-<i>."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.orchestrator = cluster.orchestrator
        self.dead: set[str] = set()

    def actors(self) -> dict[str, Any]:
        return {**{f"prefill-{i}": a for i, a in enumerate(self.cluster.prefill_actors)},
                **{f"decode-{i}": a for i, a in enumerate(self.cluster.decode_actors)}}

    async def call_on(self, worker_id: str, fn: Callable[[Any], Any]) -> Any:
        """fn(worker) inside the actor (Ray's __ray_call__; fn must pickle by value, e.g. a lambda)."""
        return await self.actors()[worker_id].__ray_call__.remote(fn)

    async def kill(self, worker_id: str) -> None:
        """ray.kill the actor (its process dies) and wait until Ray reports it dead."""
        import ray
        from ray.exceptions import RayActorError

        actor = self.actors()[worker_id]
        self.dead.add(worker_id)
        ray.kill(actor, no_restart=True)
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                await actor.info.remote()
            except RayActorError:
                return
            await asyncio.sleep(POLL_S)
        raise StateNotReached(f"{worker_id} still answers {STATE_TIMEOUT_S} s after ray.kill")

    def _live(self) -> dict[str, Any]:
        return {worker_id: a for worker_id, a in self.actors().items() if worker_id not in self.dead}

    async def worker_stats(self) -> dict[str, WorkerStats]:
        live = self._live()
        return dict(zip(live, await asyncio.gather(*(a.stats.remote() for a in live.values()))))

    async def lease_expiries(self) -> int:
        prefill = [a for worker_id, a in self._live().items() if worker_id.startswith("prefill-")]
        reports = await asyncio.gather(*(a.report.remote(None, 0, 0.0) for a in prefill))
        return sum(report.counters.kv_leases_expired for report in reports)


class Harness:
    """What a scenario's driver works with: the cluster view, stream opening, holds, checks."""

    def __init__(self, view: ClusterView) -> None:
        self.view = view
        self.streams: list[ClientStream] = []
        self.checks: list[tuple[str, bool]] = []
        self.notes: list[str] = []
        self._holds: list[StepHold] = []

    def open(self, case: GreedyCase, deadline: float | None = None, pause_after: int | None = None) -> ClientStream:
        """Send a request; `deadline` is a time.monotonic() value."""
        inp = GenerationInput(f"fault-{len(self.streams)}", case.prompt_token_ids, case.params(), deadline)
        stream = ClientStream(self.view.orchestrator, inp, case, pause_after)
        self.streams.append(stream)
        return stream

    def check(self, what: str, held: bool) -> None:
        self.checks.append((what, bool(held)))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def hold_steps(self, worker: PrefillWorker | DecodeWorker, when: Callable[[EngineCore], bool]) -> StepHold:
        hold = StepHold(InProcessView.engine_loop(worker), when)
        self._holds.append(hold)
        return hold

    def release_holds(self) -> None:
        for hold in self._holds:
            hold.release()

    async def paused(self, stream: ClientStream) -> None:
        """Wait until the stream stopped reading (its first `pause_after` chunks arrived)."""
        try:
            async with asyncio.timeout(STATE_TIMEOUT_S):
                await stream.paused.wait()
        except TimeoutError:
            raise StateNotReached(f"the stream did not get its first chunks within {STATE_TIMEOUT_S} s") from None

    async def until(self, condition: Callable[[], Awaitable[bool]], what: str) -> None:
        """Poll an async condition until it holds (StateNotReached after STATE_TIMEOUT_S)."""
        deadline = time.monotonic() + STATE_TIMEOUT_S
        while not await condition():
            if time.monotonic() > deadline:
                raise StateNotReached(f"{what}: not reached within {STATE_TIMEOUT_S} s")
            await asyncio.sleep(POLL_S)

    async def stats(self, worker_id: str) -> WorkerStats:
        return (await self.view.worker_stats())[worker_id]


# ---- running a scenario -------------------------------------------------------------------------
class Reference:
    """Undisturbed greedy outputs: the prompts through one in-process LLM engine, batched
    (tests/test_faults.py holds it to Hugging Face on the scenarios' prompts)."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._tokens: dict[GreedyCase, tuple[int, ...]] = {}

    def prepare(self, cases: Sequence[GreedyCase]) -> None:
        from splitserve.engine import LLM

        missing = list(dict.fromkeys(case for case in cases if case not in self._tokens))
        if not missing:
            return
        llm = LLM(self.model_dir, block_size=8, num_kv_blocks=4096, dtype="float32", device="cpu")
        outputs = llm.generate([list(case.prompt_token_ids) for case in missing], [case.params() for case in missing])
        self._tokens.update((case, tuple(output.token_ids)) for case, output in zip(missing, outputs))

    def tokens(self, case: GreedyCase) -> tuple[int, ...]:
        return self._tokens[case]


async def run_in_process(scenario: Scenario, model_dir: Path, reference: Reference) -> ScenarioOutcome:
    """One scenario on a fresh InProcessCluster configured for it."""
    reference.prepare(scenario.cases)
    records: list[RequestRecord] = []
    async with InProcessCluster(model_dir, num_prefill=scenario.num_prefill, num_decode=scenario.num_decode,
                                lease_ttl_s=scenario.lease_ttl_s,
                                transfer_failure_policy=scenario.transfer_failure_policy,
                                observer=records.append) as cluster:
        return await run_on(InProcessView(cluster), scenario, reference, records)


async def run_on_ray(cluster, scenario: Scenario, reference: Reference) -> ScenarioOutcome:
    """One scenario on a running LocalCluster (run it on the cluster's event loop); the router's
    records reach the scenario as well as the cluster's own observer."""
    reference.prepare(scenario.cases)
    records: list[RequestRecord] = []
    orchestrator = cluster.orchestrator
    observer = orchestrator.observer

    def observe(record: RequestRecord) -> None:
        records.append(record)
        if observer is not None:
            observer(record)

    orchestrator.observer = observe
    try:
        return await run_on(RayView(cluster), scenario, reference, records)
    finally:
        orchestrator.observer = observer


async def run_on(view: ClusterView, scenario: Scenario, reference: Reference,
                 records: list[RequestRecord]) -> ScenarioOutcome:
    """Drive the scenario, end every stream, settle, and count."""
    started = time.monotonic()
    harness = Harness(view)
    try:
        async with asyncio.timeout(DRIVE_TIMEOUT_S):
            await scenario.drive(harness)
    except Exception as error:  # reported as a failed check, after the cluster is cleaned up
        harness.check(f"the driver finished (it raised {type(error).__name__}: {error})", False)
    harness.release_holds()
    streams_deadline = time.monotonic() + STREAM_TIMEOUT_S
    for stream in harness.streams:
        if stream.left_paused:
            harness.check("the driver left no stream paused", False)
            stream.cancel()
        await stream.ended(max(streams_deadline - time.monotonic(), 0.0))
    residue, in_flight, settle_s = await _settle(view)
    return _outcome(scenario, harness, reference, records, residue, in_flight, settle_s,
                    await view.lease_expiries(), time.monotonic() - started)


async def _settle(view: ClusterView) -> tuple[tuple[WorkerResidue, ...], int, float]:
    """Wait until every live worker is idle and the router counts nothing in flight, or
    SETTLE_TIMEOUT_S passed; returns what is left, the router's count and the seconds waited."""
    started = time.monotonic()
    while True:
        stats = await view.worker_stats()
        in_flight = _router_in_flight(view.orchestrator)
        waited = time.monotonic() - started
        if (in_flight == 0 and all(s.is_idle for s in stats.values())) or waited > SETTLE_TIMEOUT_S:
            return tuple(WorkerResidue.of(w, s) for w, s in sorted(stats.items())), in_flight, waited
        await asyncio.sleep(POLL_S)


def _router_in_flight(orchestrator: Orchestrator) -> int:
    pools = (orchestrator.prefill_pool, orchestrator.decode_pool)
    return orchestrator.num_in_flight + sum(pool.num_requests(w) for pool in pools for w in pool.clients)


_IDS = re.compile(r"\b[0-9a-f]{8,}\b")


def _outcome(scenario: Scenario, harness: Harness, reference: Reference, records: list[RequestRecord],
             residue: tuple[WorkerResidue, ...], in_flight: int, settle_s: float, lease_expiries: int,
             seconds: float) -> ScenarioOutcome:
    ends = [(stream.end, reference.tokens(stream.case)) for stream in harness.streams]
    codes = Counter(end.code for end, _ in ends)
    router_codes = Counter(record.error_code or OK for record in records)
    errors = {_IDS.sub("<id>", end.message) for end, _ in ends if end.code not in (OK, CANCELLED) and end.message}
    return ScenarioOutcome(
        scenario.name, len(ends), tuple(sorted(codes.items())), tuple(sorted(router_codes.items())),
        tuple(sorted(errors)),
        sum(end.code == OK and end.token_ids == expected for end, expected in ends),
        sum(end.code != OK and expected[:len(end.token_ids)] == end.token_ids for end, expected in ends),
        sum(record.kv_transfer is not None and record.kv_transfer.failed for record in records),
        lease_expiries, residue, tuple(sorted(harness.view.dead)), in_flight, round(settle_s, 3),
        tuple(harness.checks), tuple(harness.notes), round(seconds, 3))


# ---- holding a request in a state ---------------------------------------------------------------
class HoldState(abc.ABC):
    """A state a request is stopped in: `enter` sends it and returns once it is there (and stays);
    `leave` lets the cluster move on (after the stream ended)."""

    name: str
    what: str
    """'while ...' for summaries."""
    case: GreedyCase = SHORT

    @abc.abstractmethod
    async def enter(self, harness: Harness, deadline: float | None) -> ClientStream:
        """Send the request and return once it is in this state."""

    async def outlast(self, harness: Harness, stream: ClientStream, deadline: float) -> None:
        """Keep the request here until its deadline passed (the router's own timer ends it)."""

    async def leave(self, harness: Harness) -> None:
        """Nothing to undo by default."""


class QueuedAtPrefill(HoldState):
    name, what = "queued", "queued at the prefill worker (admitted, not yet scheduled)"

    async def enter(self, harness: Harness, deadline: float | None) -> ClientStream:
        self.hold = harness.hold_steps(harness.view.prefill, unscheduled)
        stream = harness.open(self.case, deadline)
        await self.hold.reached()
        harness.check("the prompt waited unscheduled in the prefill worker's queue",
                      (await harness.stats("prefill-0")).engine.num_waiting == 1)
        return stream

    async def leave(self, harness: Harness) -> None:
        self.hold.release()


class Prefilling(HoldState):
    name, what = "prefilling", "prefilling (first of three prefill chunks done)"
    case = LONG

    async def enter(self, harness: Harness, deadline: float | None) -> ClientStream:
        self.hold = harness.hold_steps(harness.view.prefill, part_prefilled)
        stream = harness.open(self.case, deadline)
        await self.hold.reached()
        return stream

    async def leave(self, harness: Harness) -> None:
        self.hold.release()


class HeldForTransfer(HoldState):
    name, what = "held", "its KV is held for transfer (prefill answered, decode not yet asked to pull)"

    async def enter(self, harness: Harness, deadline: float | None) -> ClientStream:
        stream = harness.open(self.case, deadline, pause_after=1)
        await harness.paused(stream)
        harness.check("the prefill worker held the prompt's KV under a lease",
                      (await harness.stats("prefill-0")).num_held_leases == 1)
        return stream

    async def outlast(self, harness: Harness, stream: ClientStream, deadline: float) -> None:
        # The router waits at its yield, where no timer runs: the deadline is seen on resuming.
        await asyncio.sleep(max(deadline - time.monotonic(), 0.0) + 0.01)
        stream.resume()


class Pulling(HoldState):
    name, what = "pulling", "the decode worker is pulling its KV (the READ in flight)"

    async def enter(self, harness: Harness, deadline: float | None) -> ClientStream:
        harness.view.decode_backend.defer_completions()
        stream = harness.open(self.case, deadline)
        await harness.until(lambda: _pull_started(harness), "the decode worker's pull started")
        return stream

    async def leave(self, harness: Harness) -> None:
        view = harness.view
        stats = await harness.stats("decode-0")
        harness.check("decode kept the pull's blocks while the READ could still write them",
                      stats.num_transfers == 1 and stats.engine.num_free_kv_blocks < stats.engine.num_kv_blocks)
        view.decode_backend.defer_completions(False)
        completed = await view.on_engine_thread(view.decode, view.decode_backend.complete_pending_pulls)
        harness.check("the READ landed after the request ended", completed == 1)


async def _pull_started(harness: Harness) -> bool:
    stats = await harness.stats("decode-0")
    return stats.num_transfers == 1 and stats.engine.num_free_kv_blocks < stats.engine.num_kv_blocks


class Decoding(HoldState):
    name, what = "decoding", f"decoding (after {DECODE_HOLD_TOKENS} of {SHORT.max_tokens} tokens)"

    async def enter(self, harness: Harness, deadline: float | None) -> ClientStream:
        self.hold = harness.hold_steps(harness.view.decode, decoding)
        stream = harness.open(self.case, deadline)
        await self.hold.reached()
        return stream

    async def leave(self, harness: Harness) -> None:
        self.hold.release()


HOLD_STATES: tuple[type[HoldState], ...] = (QueuedAtPrefill, Prefilling, HeldForTransfer, Pulling, Decoding)


async def cancel_in(state_class: type[HoldState], harness: Harness) -> None:
    state = state_class()
    stream = await state.enter(harness, None)
    stream.cancel()
    await stream.ended()
    await state.leave(harness)


async def deadline_in(state_class: type[HoldState], harness: Harness) -> None:
    state = state_class()
    deadline = time.monotonic() + DEADLINE_S
    stream = await state.enter(harness, deadline)
    harness.check("the request was held in the state before its deadline", time.monotonic() < deadline)
    await state.outlast(harness, stream, deadline)
    await stream.ended()
    await state.leave(harness)


# ---- transfer faults ----------------------------------------------------------------------------
async def notification_dropped(harness: Harness) -> None:
    harness.view.decode_backend.drop_next_notifications(1)
    await harness.open(SHORT).ended()


async def lease_expires_before_pull(harness: Harness) -> None:
    stream = harness.open(SHORT, pause_after=1)
    await harness.paused(stream)
    await harness.until(lambda: _no_lease_held(harness), "the prefill worker's lease expired")
    stream.resume()
    await stream.ended()


async def _no_lease_held(harness: Harness) -> bool:
    return (await harness.stats("prefill-0")).num_held_leases == 0


async def lease_expires_during_pull(harness: Harness) -> None:
    backend = harness.view.decode_backend
    backend.defer_completions()  # the READ never lands: only the decode worker's patience (the TTL) ends the pull
    await harness.open(SHORT).ended()
    backend.defer_completions(False)


async def pull_fails(harness: Harness) -> None:
    harness.view.decode_backend.fail_next_pulls(1)
    await harness.open(SHORT).ended()


async def peer_removed_during_pull(harness: Harness) -> None:
    view = harness.view
    view.decode_backend.defer_completions()
    stream = harness.open(SHORT)
    await harness.until(lambda: _pull_started(harness), "the decode worker's pull started")
    await view.decode.remove_peer((await view.prefill.info()).agent.agent_name)
    await stream.ended()
    view.decode_backend.defer_completions(False)


async def prefill_dies_holding_kv(harness: Harness, handshake_first: bool) -> None:
    """With handshake_first, an undisturbed request first makes the decode worker handshake with
    the prefill worker's agent, so the fault meets the pull, not the handshake."""
    if handshake_first:
        await harness.open(SHORT).ended()
    stream = harness.open(SHORT, pause_after=1)
    await harness.paused(stream)
    harness.view.kill(harness.view.prefill)
    stream.resume()
    await stream.ended()


# ---- clock skew: one side's lease clock steps by +-SKEW_S ----------------------------------------
SKEW_S = 10.0
SKEW_LEASE_S = 5.0
"""Shorter than SKEW_S: a step forward ends the lease (or the pull) on that side at once."""


async def skew_during_pull(harness: Harness, side: str, seconds: float) -> None:
    """While the data READ is in flight (its completion deferred), the producer's or the consumer's
    lease clock steps by `seconds`; then the READ lands."""
    view = harness.view
    view.decode_backend.defer_completions()
    stream = harness.open(SHORT)
    await harness.until(lambda: _pull_started(harness), "the decode worker's pull started")
    view.skew_lease_clock(view.prefill if side == "producer" else view.decode, seconds)
    if side == "producer":
        await harness.until(lambda: _no_lease_held(harness), "the lease ended on the producer's stepped clock")
        backend = view.decode_backend
        backend.defer_completions(False)
        # The data READ lands after its blocks were reclaimed; the check READ then sees new generations.
        await view.on_engine_thread(view.decode, backend.complete_pending_pulls)
        await stream.ended()
    else:
        await stream.ended()  # the consumer abandoned the pull and recomputed the prompt
        view.decode_backend.defer_completions(False)


async def skew_while_held(harness: Harness, side: str, seconds: float) -> None:
    """While the prompt's KV waits under its lease (decode not yet asked to pull), one side's lease
    clock steps back by `seconds`: that side only waits longer."""
    view = harness.view
    stream = harness.open(SHORT, pause_after=1)
    await harness.paused(stream)
    view.skew_lease_clock(view.prefill if side == "producer" else view.decode, seconds)
    stream.resume()
    await stream.ended()


def _skew_scenarios() -> list[Scenario]:
    ahead, behind = f"+{SKEW_S:g} s", f"-{SKEW_S:g} s"
    lease = f"the {SKEW_LEASE_S:g} s lease"
    return [
        Scenario("skew-producer-ahead-during-pull", "clock skew",
                 f"the producer's lease clock steps {ahead} while the READ is in flight: {lease} ends there and its "
                 "blocks' generations are bumped; the READ then lands and the generation check fails; recompute",
                 functools.partial(skew_during_pull, side="producer", seconds=SKEW_S),
                 Expected(_one(OK), lease_expiries=1, kv_transfers_failed=1), (SHORT,), lease_ttl_s=SKEW_LEASE_S),
        Scenario("skew-consumer-ahead-during-pull", "clock skew",
                 f"the consumer's lease clock steps {ahead} while the READ is in flight: it abandons the pull "
                 f"({lease}'s TTL is over on its clock); recompute",
                 functools.partial(skew_during_pull, side="consumer", seconds=SKEW_S),
                 Expected(_one(OK), lease_expiries=None, kv_transfers_failed=1), (SHORT,), lease_ttl_s=SKEW_LEASE_S),
        Scenario("skew-producer-behind-while-held", "clock skew",
                 f"the producer's lease clock steps {behind} while the KV is held: {lease} would only last longer; "
                 "the pull completes", functools.partial(skew_while_held, side="producer", seconds=-SKEW_S),
                 Expected(_one(OK), lease_expiries=0, kv_transfers_failed=0), (SHORT,), lease_ttl_s=SKEW_LEASE_S),
        Scenario("skew-consumer-behind-while-held", "clock skew",
                 f"the consumer's lease clock steps {behind} before it pulls: it would only wait longer; the pull "
                 "completes", functools.partial(skew_while_held, side="consumer", seconds=-SKEW_S),
                 Expected(_one(OK), lease_expiries=0, kv_transfers_failed=0), (SHORT,), lease_ttl_s=SKEW_LEASE_S),
    ]


# ---- worker loss: the request moves -------------------------------------------------------------
async def decode_dies_while_decoding(harness: Harness) -> None:
    """The request's decode worker (decode-0: the first request's tie goes to it) dies after
    DECODE_HOLD_TOKENS tokens; the router moves the stream to decode-1."""
    hold = harness.hold_steps(harness.view.decode, decoding)
    stream = harness.open(SHORT)
    await hold.reached()
    harness.view.kill(harness.view.decode)
    hold.release()
    await stream.ended()


async def prefill_dies_while_queued(harness: Harness) -> None:
    """The prompt waits on prefill-0 (the first request's tie goes to it) when it dies; the router
    hands the prompt to prefill-1."""
    hold = harness.hold_steps(harness.view.prefill, unscheduled)
    stream = harness.open(SHORT)
    await hold.reached()
    harness.view.kill(harness.view.prefill)
    hold.release()
    await stream.ended()


def _worker_loss_scenarios() -> list[Scenario]:
    return [
        Scenario("decode-dies-while-decoding", "worker loss",
                 f"the decode worker dies after {DECODE_HOLD_TOKENS} of {SHORT.max_tokens} tokens: the request moves "
                 "to the other decode worker, which recomputes prompt + streamed tokens",
                 decode_dies_while_decoding, Expected(_one(OK), lease_expiries=None), (SHORT,), num_decode=2),
        Scenario("prefill-dies-while-queued", "worker loss",
                 "the prefill worker dies with the prompt queued: the router sends it to the other prefill worker",
                 prefill_dies_while_queued, Expected(_one(OK), lease_expiries=None), (SHORT,), num_prefill=2),
    ]


# ---- a bounded load with random cancels ---------------------------------------------------------
LOAD_SEED = 6
LOAD_CONCURRENCY = 16
LOAD_CANCEL_FRACTION = 0.35
LOAD_MAX_CANCEL_DELAY_S = 0.25
LOAD_CASES = tuple(mixed_workload(512, num_requests=100, seed=LOAD_SEED, max_prompt=120, max_output=24))


@dataclass(frozen=True)
class CancelAt:
    """Cancel a stream `after_s` seconds after it is sent, or once `after_chunks` chunks arrived,
    whichever comes first; after_chunks < the request's output length, so it never finishes first."""

    after_s: float
    after_chunks: int


def cancel_plan(cases: Sequence[GreedyCase], seed: int) -> tuple[CancelAt | None, ...]:
    """A random choice of requests to cancel at random times: only requests whose length is fixed
    (ignore_eos, 2+ tokens), so which ones end CANCELLED does not depend on the model."""
    rng = random.Random(seed)
    plan = []
    for case in cases:
        eligible = case.ignore_eos and case.max_tokens >= 2
        chosen = rng.random() < LOAD_CANCEL_FRACTION
        timing = CancelAt(round(rng.uniform(0.0, LOAD_MAX_CANCEL_DELAY_S), 4), rng.randrange(1, max(case.max_tokens, 2)))
        plan.append(timing if eligible and chosen else None)
    return tuple(plan)


LOAD_PLAN = cancel_plan(LOAD_CASES, LOAD_SEED)
LOAD_CANCELS = sum(cancel is not None for cancel in LOAD_PLAN)


async def load_with_random_cancels(harness: Harness) -> None:
    slots = asyncio.Semaphore(LOAD_CONCURRENCY)
    await asyncio.gather(*(_load_request(harness, slots, case, cancel) for case, cancel in zip(LOAD_CASES, LOAD_PLAN)))


async def _load_request(harness: Harness, slots: asyncio.Semaphore, case: GreedyCase, cancel: CancelAt | None) -> None:
    async with slots:
        stream = harness.open(case, pause_after=cancel and cancel.after_chunks)
        if cancel is not None:
            paused = asyncio.ensure_future(stream.paused.wait())
            await asyncio.wait({paused, stream.task}, timeout=cancel.after_s, return_when=asyncio.FIRST_COMPLETED)
            paused.cancel()
            stream.cancel()
        await stream.ended()


# ---- NIXL on Ray --------------------------------------------------------------------------------
async def nixl_notification_dropped(harness: Harness) -> None:
    await harness.view.call_on("decode-0", lambda worker: worker._backend.drop_next_notifications(1))
    await harness.open(SHORT).ended()


async def nixl_prefill_killed_before_pull(harness: Harness) -> None:
    stream = harness.open(SHORT, pause_after=1)
    await harness.paused(stream)
    await harness.view.kill("prefill-0")
    killed_at = time.monotonic()
    stream.resume()
    await stream.ended()
    took_s = time.monotonic() - killed_at
    harness.note(f"the request ended {took_s:.2f} s after the kill")
    harness.check(f"the request ended within the lease TTL ({RAY_LEASE_TTL_S:g} s) + 2 s of the kill",
                  took_s < RAY_LEASE_TTL_S + 2.0)


# ---- the catalogue ------------------------------------------------------------------------------
def _one(code: str) -> tuple[tuple[str, int], ...]:
    return ((code, 1),)


def _state_scenarios() -> list[Scenario]:
    scenarios = []
    for state in HOLD_STATES:
        scenarios.append(Scenario(f"cancel-{state.name}", "cancel", f"the client cancels while {state.what}",
                                  functools.partial(cancel_in, state), Expected(_one(CANCELLED)), (state.case,)))
    for state in HOLD_STATES:
        scenarios.append(Scenario(f"deadline-{state.name}", "deadline",
                                  f"the {DEADLINE_S:g} s deadline passes while {state.what}",
                                  functools.partial(deadline_in, state), Expected(_one("DEADLINE_EXCEEDED")),
                                  (state.case,)))
    return scenarios


def _transfer_fault_scenarios() -> list[Scenario]:
    failed = "KV transfer failed: "
    scenarios = [Scenario("notification-dropped", "transfer fault",
                          f"the pull's completion notification is lost: the {SHORT_LEASE_S:g} s lease frees the "
                          "producer's blocks", notification_dropped, Expected(_one(OK), lease_expiries=1,
                                                                              kv_transfers_failed=0),
                          (SHORT,), lease_ttl_s=SHORT_LEASE_S)]
    faults = [
        ("lease-expired-before-pull", f"the {EXPIRING_LEASE_S:g} s lease expires before decode is asked to pull; "
         "the pull's generation check sees the reclaimed blocks",
         lease_expires_before_pull, f"{failed}{RECLAIMED_ERROR}", 1, EXPIRING_LEASE_S),
        ("lease-expired-during-pull", f"the READ never lands; decode abandons it after the lease's {SHORT_LEASE_S:g} s "
         "TTL on its own clock", lease_expires_during_pull,
         f"{failed}{PULL_TIMEOUT_ERROR.format(ttl=SHORT_LEASE_S)}", None, SHORT_LEASE_S),
        ("pull-failed", "the backend fails the pull", pull_fails, f"{failed}injected failure", 0, 30.0),
        ("peer-removed-during-pull", "decode drops the producer's agent while the READ is in flight",
         peer_removed_during_pull, "was removed while the pull was in flight", 0, 30.0),
    ]
    for name, summary, drive, cause, expiries, ttl in faults:
        scenarios.append(Scenario(f"{name}-recompute", "transfer fault", f"{summary}; policy recompute", drive,
                                  Expected(_one(OK), lease_expiries=expiries, kv_transfers_failed=1), (SHORT,),
                                  lease_ttl_s=ttl))
        scenarios.append(Scenario(f"{name}-fail", "transfer fault", f"{summary}; policy fail", drive,
                                  Expected(_one("INTERNAL"), cause, expiries, kv_transfers_failed=1), (SHORT,),
                                  "fail", ttl))
    dies = "the prefill worker dies (engine and transfer agent gone) while holding the KV"
    scenarios.append(Scenario("prefill-dies-holding-kv-recompute", "transfer fault",
                              f"{dies}, after an earlier request's handshake; policy recompute",
                              functools.partial(prefill_dies_holding_kv, handshake_first=True),
                              Expected(((OK, 2),), lease_expiries=None), (SHORT,)))
    scenarios.append(Scenario("prefill-dies-before-handshake-recompute", "transfer fault",
                              f"{dies}, before decode ever handshook with it; policy recompute",
                              functools.partial(prefill_dies_holding_kv, handshake_first=False),
                              Expected(_one(OK), lease_expiries=None), (SHORT,)))
    return scenarios


IN_PROCESS_SCENARIOS: tuple[Scenario, ...] = (
    *_state_scenarios(),
    *_transfer_fault_scenarios(),
    *_skew_scenarios(),
    *_worker_loss_scenarios(),
    Scenario("load-random-cancels", "load",
             f"{len(LOAD_CASES)} requests, {LOAD_CONCURRENCY} at a time (seed {LOAD_SEED}); {LOAD_CANCELS} cancelled "
             f"at a random time (0-{LOAD_MAX_CANCEL_DELAY_S:g} s) or after a random number of chunks",
             load_with_random_cancels,
             Expected(((CANCELLED, LOAD_CANCELS), (OK, len(LOAD_CASES) - LOAD_CANCELS)), lease_expiries=None),
             LOAD_CASES),
)

RAY_SCENARIOS: tuple[Scenario, ...] = (
    Scenario("nixl-notification-dropped", "nixl",
             f"the NIXL READ posts no notification: the {RAY_LEASE_TTL_S:g} s lease frees the producer's blocks",
             nixl_notification_dropped, Expected(_one(OK), lease_expiries=1, kv_transfers_failed=0), (SHORT,),
             lease_ttl_s=RAY_LEASE_TTL_S),
    Scenario("nixl-prefill-killed-before-pull", "nixl",
             "ray.kill of the prefill actor after its first token, before decode pulls; policy recompute",
             nixl_prefill_killed_before_pull, Expected(_one(OK), lease_expiries=None), (SHORT,),
             lease_ttl_s=RAY_LEASE_TTL_S),
)

ALL_SCENARIOS: tuple[Scenario, ...] = (*IN_PROCESS_SCENARIOS, *RAY_SCENARIOS)


def ray_cluster_config(model_dir: Path):
    """The one Ray cluster RAY_SCENARIOS share: 1 prefill + 1 decode actor, NIXL, short leases."""
    from splitserve.testing.local_cluster import tiny_cluster_config

    return tiny_cluster_config(model_dir, prefill=1, decode=1, **{"router.lease_ttl_s": RAY_LEASE_TTL_S})


# ---- the report (docs/reliability.md) -----------------------------------------------------------
REPO = Path(__file__).resolve().parents[1]
"""The source checkout (the editable install runs testing/ in place; bench/ and docs/ are not installed)."""
RESULTS_JSON = REPO / "bench" / "results" / "fault_matrix.json"
RELIABILITY_DOC = REPO / "docs" / "reliability.md"
BLOCK_BEGIN = "<!-- fault matrix: generated by bench/fault_matrix.py from bench/results/fault_matrix.json -->"
BLOCK_END = "<!-- end of fault matrix -->"
GROUPS = {
    "cancel": ("Cancellation in each state", "in-process"),
    "deadline": ("Deadline expiry in each state", "in-process"),
    "transfer fault": ("Transfer faults", "in-process"),
    "clock skew": ("Clock skew: one side's lease clock steps by 10 s", "in-process"),
    "worker loss": ("Worker loss: requests move", "in-process"),
    "load": ("Bounded load with random cancels", "in-process"),
    "nixl": ("NIXL between Ray actors", "ray"),
}
"""group -> (heading, where it runs)."""
SETUPS = {
    "in-process": "InProcessCluster: the router's orchestrator, 1 prefill + 1 decode worker (2 of the pool that "
                  "loses one in the worker-loss scenarios) and the in-process KV transfer backend in one process, a "
                  "fresh cluster per scenario",
    "ray": f"one LocalCluster: Ray on loopback, 1 prefill + 1 decode actor, KV pulled over NIXL (UCX), "
           f"router.lease_ttl_s {RAY_LEASE_TTL_S:g} s, the scenarios in order on it",
}


@dataclass(frozen=True)
class MatrixResult:
    """One scenario's last recorded run."""

    measured: str
    """Date of the run (YYYY-MM-DD)."""
    outcome: ScenarioOutcome


def load_results(path: Path = RESULTS_JSON) -> dict[str, MatrixResult]:
    """Scenario name -> its last result, in the file's order (empty when there is no file)."""
    if not path.exists():
        return {}
    entries = json.loads(path.read_text())["scenarios"]
    return {name: MatrixResult(entry["measured"], ScenarioOutcome.from_json(entry["outcome"]))
            for name, entry in entries.items()}


def save_results(results: Mapping[str, MatrixResult], path: Path = RESULTS_JSON) -> None:
    entries = {name: {"measured": result.measured, "outcome": result.outcome.to_json()}
               for name, result in results.items()}
    path.write_text(json.dumps({"scenarios": entries}, indent=1) + "\n")


def render_results(scenarios: Sequence[Scenario], results: Mapping[str, MatrixResult]) -> str:
    """The generated part of docs/reliability.md: a table per group, a row per scenario, then the
    checks and notes; KeyError for a scenario with no result."""
    lines = [BLOCK_BEGIN]
    for group, (heading, setup) in GROUPS.items():
        members = [scenario for scenario in scenarios if scenario.group == group]
        if not members:
            continue
        measured = max(results[scenario.name].measured for scenario in members)
        lines += ["", f"### {heading}", "", f"Measured {measured} on {SETUPS[setup]}.", "",
                  "| scenario | what happens | streams | ends | what the client is told | tokens vs undisturbed run "
                  "| pulls failed, leases expired | left after settling | settled in | as expected |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [_row(scenario, results[scenario.name].outcome) for scenario in members]
        lines += _details(members, results)
    return "\n".join([*lines, "", BLOCK_END])


def _row(scenario: Scenario, outcome: ScenarioOutcome) -> str:
    ends = ", ".join(f"{code} {count}" for code, count in outcome.codes)
    told = "; ".join(outcome.errors) or "-"
    unfinished = outcome.requests_sent - outcome.num_ok
    tokens = [f"{outcome.outputs_equal_reference}/{outcome.num_ok} equal"] if outcome.num_ok else []
    tokens += [f"{outcome.prefixes_of_reference}/{unfinished} prefixes"] if unfinished else []
    leaks = [residue.describe() for residue in outcome.residue if not residue.is_clean]
    leaks += [f"router: {outcome.router_in_flight} in flight"] if outcome.router_in_flight else []
    problems = unmet_expectations(scenario, outcome)
    verdict = "yes" if not problems else "**no**: " + "; ".join(problems)
    transfers = f"{outcome.kv_transfers_failed}, {outcome.lease_expiries}"
    cells = [f"`{scenario.name}`", scenario.summary, str(outcome.requests_sent), ends, told, ", ".join(tokens),
             transfers, "; ".join(leaks) or "nothing", f"{outcome.settle_s:.2f} s", verdict]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def _details(members: Sequence[Scenario], results: Mapping[str, MatrixResult]) -> list[str]:
    lines = []
    for scenario in members:
        outcome = results[scenario.name].outcome
        items = [f"{what} ({'held' if held else 'FAILED'})" for what, held in outcome.checks] + list(outcome.notes)
        if items:
            lines.append(f"- `{scenario.name}`: " + "; ".join(items) + ".")
    return ["", *lines] if lines else []


def results_block(path: Path = RELIABILITY_DOC) -> str:
    """The generated part of the doc as it is on disk."""
    text = path.read_text()
    start, end = text.index(BLOCK_BEGIN), text.index(BLOCK_END)
    return text[start:end + len(BLOCK_END)]


def write_results_block(block: str, path: Path = RELIABILITY_DOC) -> None:
    text = path.read_text()
    start, end = text.index(BLOCK_BEGIN), text.index(BLOCK_END)
    path.write_text(text[:start] + block + text[end + len(BLOCK_END):])
