"""Issue 15: the simulator (planner/sim) against the real local cluster on the same trace.

1. Trace: a seeded steady Poisson trace (traces.make_trace "poisson", 4 requests/s for 60 s,
   CALIBRATION_WORKLOAD: prompts 64-512 tokens, outputs 32-128, no shared prefixes).
2. Real: the trace replayed on testing.local_cluster's tiny cluster (1 prefill + 1 decode worker,
   NIXL, `disaggregation: always`, the random serving model, CPU, 1 thread per worker): each
   request enters the router (Orchestrator.generate on its event loop; no gRPC front end and no
   client process on the 2 cores) at its arrival time with random token ids of its prompt length,
   greedy, ignore_eos, max_tokens = its output length. TTFT and TPOT come from the router's
   RequestRecords.
3. Simulated: the same trace under StaticPolicy(1, 1), with the decode worker's KV capacity as it
   reports it, KV transfer as a line fitted to bench/results/nixl_bandwidth.json, and a
   PerformanceProfile fitted (relative non-negative least squares, fit_profile) to one of three
   sets of step-time samples, each simulated and compared on its own:
   - offline: EngineCore in this process with each pool's EngineConfig: steps prefilling one fresh
     prompt at several lengths, decode-only steps at several batch sizes and prompt lengths. The
     device alone.
   - live-idle: probes through the running cluster's router, one shape at a time (measure_live):
     a lone prompt's TTFT, and the steady inter-token gap of a batch of equal requests. Adds what
     an offline step leaves out: routing, the Ray calls, the worker's loop and the stream back.
   - live-loaded: a second trace of the same workload (seed + 1, never the compared one) replayed
     first; samples from its records: each lone prompt's TTFT less its wait in the prefill
     worker's queue, and the inter-token gaps during which the batch did not change
     (decode_gap_samples), averaged per batch size and context bin (mean_by_shape). Adds what
     only concurrent load brings: the two workers, the router and Ray sharing 2 cores.
4. TTFT and TPOT p50 / p99 (nearest rank, as SimulationResult) real against simulated; a cell is
   within when |simulated / real - 1| <= 20%.

Writes bench/results/planner_calibration.json (the profiles and their samples, every cell,
per-request latencies, the TTFT phases, how busy the machine was in each part) and
planner_calibration.png (CDFs of TTFT and TPOT, real against each simulation). Run:
`.venv/bin/python bench/planner_calibration.py` (about 3 minutes on an idle 2-core machine;
--quick: 20 s traces, fewer probes, results in the temp directory).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from engine_throughput import Parts
from serving_common import ForeignCpu, bench_parser, non_negative_int, report_header, start_bench, warn_noisy_parts, write_report

from splitserve.common.validation import require
from splitserve.planner.core.perf_model import decode_features, nonnegative_quadratic, prefill_features
from splitserve.planner.core.types import PerformanceProfile
from splitserve.planner.sim.cluster import run_local, tpot_of
from splitserve.planner.sim.config import SimulatedCluster
from splitserve.planner.sim.policies import StaticPolicy
from splitserve.planner.samples import nearest_rank
from splitserve.planner.sim.traces import LengthDistribution, Trace, Workload, make_trace

RESULTS = Path(__file__).parent / "results"
NAME = "planner_calibration"
TOLERANCE = 0.20
"""A cell is within when simulated / real is in [1 - TOLERANCE, 1 + TOLERANCE]."""
QUANTILES = (0.5, 0.99)
CALIBRATION_WORKLOAD = Workload(prompt=LengthDistribution(192.0, 0.6, 64, 512),
                                output=LengthDistribution(64.0, 0.4, 32, 128))
LONE_WAIT_S = 0.002
"""A prompt the prefill worker started within this long after it came had the worker to itself."""
PROMPT_BIN = 64
"""Lone prompts under load are averaged per bin of this many prompt tokens (mean_by_length)."""
PROMPT_MIN_SAMPLES = 5
"""A prompt-length bin with fewer prompts than this is left out of the fit."""
GAP_CONTEXT_BIN = 256
"""Decode gaps are averaged per batch size and context bin of this many tokens (mean_by_shape)."""
GAP_MIN_SAMPLES = 20
"""A (batch, context bin) with fewer gaps than this is left out of the fit."""
OVERLAP_EDGES = (0.0, 0.1, 0.3, 1.0)
"""Buckets of a request's decode time shared with prefill compute (tpot_by_overlap)."""
FIRST_TOKEN_ID = 3
"""Random prompts use ids FIRST_TOKEN_ID..vocab-1 (0..2 are special tokens)."""
DECODE_KV_BLOCKS = 2048
"""The decode worker's KV pool (8-token blocks: 16,384 tokens, 64 MiB for the random serving model), 4x
tiny_cluster_config's, so that KV room never limits the batch here: the engine allocates blocks
as requests grow and preempts when full, the simulator reserves prompt + output up front; the two
differ exactly under KV pressure, which is not what this bench calibrates."""
PREFILL_LENGTHS = (32, 64, 128, 192, 256, 384, 512, 768)
DECODE_SHAPES = ((1, 64), (1, 256), (1, 512), (2, 128), (2, 512), (4, 64), (4, 256), (4, 512), (8, 128),
                 (8, 256), (16, 64), (16, 128))
"""(batch, prompt tokens of each request) of the measured decode steps (offline and live-idle)."""


@dataclass(frozen=True)
class Sizes:
    """How much of each part runs (--quick shrinks it)."""

    duration_s: float
    rate: float
    """Requests per second of the trace."""
    prefill_repeats: int
    """Steps timed per prefill length (offline) or probes per length (live)."""
    decode_steps: int
    """Decode steps timed per shape (offline; the live-idle probes generate twice as many tokens)."""


FULL = Sizes(duration_s=60.0, rate=4.0, prefill_repeats=5, decode_steps=24)
QUICK = Sizes(duration_s=20.0, rate=4.0, prefill_repeats=2, decode_steps=12)


# ---- measured samples and the fit (pure) ---------------------------------------------------
@dataclass(frozen=True)
class PrefillSample:
    """One prefill step that computed `tokens` prompt tokens (or the median or mean of several)."""

    tokens: int
    seconds: float


@dataclass(frozen=True)
class DecodeSample:
    """One decode-only step over `batch` requests whose contexts (prompt + tokens generated so far)
    total `context_tokens` (or the median or mean of several)."""

    batch: int
    context_tokens: int
    seconds: float


def relative_nnls(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """argmin over c >= 0 of sum_i ((features[i] . c - seconds[i]) / seconds[i])^2: features [n, k],
    seconds [n] (> 0) -> c [k]. Relative, because step times span two orders of magnitude and a plain
    fit would give up the short steps' accuracy for the long ones'; non-negative, as
    PerformanceProfile requires. Exact for noiseless samples of non-negative coefficients."""
    require(len(seconds) >= features.shape[1] and bool(np.all(seconds > 0)), "need >= k samples, all > 0 s")
    weighted = features / seconds[:, None]
    scales = np.abs(weighted).max(axis=0)
    require(bool(np.all(scales > 0)), "every feature must be non-zero somewhere")
    normalised = weighted / scales
    solution = nonnegative_quadratic(normalised.T @ normalised, normalised.T @ np.ones(len(seconds)))
    return solution / scales


def fit_profile(prefill: Sequence[PrefillSample], decode: Sequence[DecodeSample], max_batch_size: int,
                prefill_token_budget: int) -> PerformanceProfile:
    """The profile whose formulas (PerformanceProfile's docstring) best fit the samples."""
    p0, p1, p2 = relative_nnls(prefill_features([s.tokens for s in prefill]),
                               np.array([s.seconds for s in prefill], dtype=float))
    d0, d1, d2 = relative_nnls(decode_features([s.batch for s in decode], [s.context_tokens for s in decode]),
                               np.array([s.seconds for s in decode], dtype=float))
    return PerformanceProfile(float(p0), float(p1), float(p2), float(d0), float(d1), float(d2), max_batch_size,
                              prefill_token_budget)


def fit_transfer(rows: Sequence[dict]) -> tuple[float, float]:
    """(latency seconds, bytes per second) of a line through nixl_bandwidth.json's rows
    (num_bytes, nixl_s), fitted like the step times."""
    features = np.array([[1.0, row["num_bytes"]] for row in rows])
    latency, seconds_per_byte = relative_nnls(features, np.array([row["nixl_s"] for row in rows], dtype=float))
    require(seconds_per_byte > 0, "the transfer rows show no cost per byte")
    return float(latency), float(1.0 / seconds_per_byte)


# ---- the trace and its requests (pure) ------------------------------------------------------
@dataclass(frozen=True)
class ReplayRequest:
    """One trace request as sent to the router."""

    request_id: str
    arrival_s: float
    token_ids: tuple[int, ...]
    max_tokens: int


def calibration_trace(sizes: Sizes, seed: int) -> Trace:
    return make_trace("poisson", sizes.rate, sizes.duration_s, seed, CALIBRATION_WORKLOAD)


def replay_requests(trace: Trace, vocab_size: int, seed: int, prefix: str = "cal",
                    attempt: int = 0) -> tuple[ReplayRequest, ...]:
    """Request i of the trace: id {prefix}-{attempt}-{i}, its arrival, prompt_tokens[i] random ids
    (seeded by (seed, attempt): a repeated replay brings fresh prompts, so the prefill worker's
    prefix cache never serves one; no two prompts share a prefix block but by chance) and
    max_tokens = output_tokens[i]."""
    require(not np.any(trace.shared_tokens), "the calibration trace has no shared prefixes")
    rng = np.random.default_rng([seed, attempt])
    return tuple(ReplayRequest(f"{prefix}-{attempt}-{i:04d}", float(trace.arrival_s[i]),
                               tuple(rng.integers(FIRST_TOKEN_ID, vocab_size, int(trace.prompt_tokens[i])).tolist()),
                               int(trace.output_tokens[i])) for i in range(len(trace)))


# ---- comparison (pure) ----------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    """One quantile of one latency, real against simulated."""

    metric: str
    """ttft or tpot."""
    quantile: float
    real_s: float
    simulated_s: float

    @property
    def ratio(self) -> float:
        """simulated / real."""
        return self.simulated_s / self.real_s

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE

    def to_json(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "within": self.within}


def cells(metric: str, real: np.ndarray, simulated: np.ndarray) -> list[Cell]:
    """QUANTILES of both samples (nearest rank, as SimulationResult's summaries)."""
    real, simulated = np.sort(real), np.sort(simulated)
    return [Cell(metric, q, nearest_rank(real, q), nearest_rank(simulated, q)) for q in QUANTILES]


def record_latencies(records: dict, requests: Sequence[ReplayRequest]) -> tuple[np.ndarray, np.ndarray]:
    """(TTFT [n], TPOT [n]) in trace order from the router's records (request_id -> RequestRecord);
    every request must have finished with exactly its max_tokens."""
    ttft, tpot = [], []
    for request in requests:
        record = records[request.request_id]
        require(record.finish_reason == "length" and record.num_output_tokens == request.max_tokens,
                f"{request.request_id} ended {record.finish_reason or record.error_code} after "
                f"{record.num_output_tokens} of {request.max_tokens} tokens")
        ttft.append(record.ttft_s)
        tpot.append(record.tpot_s)
    return np.array(ttft), np.array(tpot)


# ---- step samples from a replay under load (pure) --------------------------------------------
@dataclass(frozen=True, eq=False)
class Stream:
    """One request's output tokens as the router streamed them."""

    prompt_tokens: int
    token_s: np.ndarray
    """float64 [output tokens]: when each reached the router, on the replay's clock (token 0 is the
    first token, from the prefill worker; the others come from decode steps)."""


def stream_of(record, sent_s: float) -> Stream:
    """The record's tokens on the replay's clock (the request entered the router at sent_s)."""
    gaps = np.asarray(record.inter_token_latencies, dtype=float)
    return Stream(record.num_prompt_tokens, sent_s + record.ttft_s + np.concatenate([[0.0], np.cumsum(gaps)]))


def mean_by_length(samples: Sequence[PrefillSample]) -> list[PrefillSample]:
    """One sample per prompt-length bin of PROMPT_BIN tokens with at least PROMPT_MIN_SAMPLES
    prompts: their mean length (rounded) and mean seconds. The mean, because that is what a queue
    and a lone prompt's TTFT follow; a relative fit to the single prompts (their times vary with
    what else runs) would lean to the fast ones."""
    groups: dict[int, list[PrefillSample]] = {}
    for sample in samples:
        groups.setdefault(sample.tokens // PROMPT_BIN, []).append(sample)
    return [PrefillSample(round(statistics.fmean(s.tokens for s in group)), statistics.fmean(s.seconds for s in group))
            for _, group in sorted(groups.items()) if len(group) >= PROMPT_MIN_SAMPLES]


def loaded_prefill_samples(records: Sequence) -> list[PrefillSample]:
    """Per request whose prompt the prefill worker started within LONE_WAIT_S (so its step ran it
    alone, barring a simultaneous arrival): its TTFT less that wait, i.e. the router's share
    (routing, the Ray calls) and the compute, as the idle probes measure them but under load."""
    samples = []
    for record in records:
        wait = dict(record.ttft_breakdown).get("prefill_queue", math.inf)
        if wait < LONE_WAIT_S:
            samples.append(PrefillSample(record.num_prompt_tokens, record.ttft_s - wait))
    return samples


@dataclass(frozen=True)
class Gap:
    """One inter-token gap of a stream, between its tokens k - 1 and k, k >= 2 (gap 1 also holds
    the KV handoff). A stream is in the batch over [token_s[1], token_s[-1]] (its first decode
    step's token to its last)."""

    seconds: float
    steady: bool
    """No stream joined or left the batch during the gap."""
    batch: int
    """Streams whose span holds the whole gap."""
    context_tokens: int
    """Their prompts plus their tokens out at the gap's start (as the simulator counts context)."""


def decode_gaps(streams: Sequence[Stream]) -> list[Gap]:
    """Every gap k >= 2 of every stream with 3 or more tokens (zero gaps left out: tokens that came
    in one message with the first token)."""
    decoding = [s for s in streams if len(s.token_s) >= 3]
    starts = np.array([s.token_s[1] for s in decoding])
    ends = np.array([s.token_s[-1] for s in decoding])
    gaps = []
    for stream in decoding:
        for a, b in zip(stream.token_s[1:-1], stream.token_s[2:]):
            if b <= a:
                continue
            steady = not (np.any((starts > a) & (starts < b)) or np.any((ends > a) & (ends < b)))
            active = np.flatnonzero((starts <= a) & (ends >= b))
            context = sum(decoding[j].prompt_tokens + int(np.searchsorted(decoding[j].token_s, a, side="right"))
                          for j in active)
            gaps.append(Gap(float(b - a), steady, len(active), context))
    return gaps


def decode_gap_samples(streams: Sequence[Stream]) -> list[DecodeSample]:
    """A sample per steady gap: a step whose batch and context are known."""
    return [DecodeSample(g.batch, g.context_tokens, g.seconds) for g in decode_gaps(streams) if g.steady]


def gap_breakdown(streams: Sequence[Stream]) -> dict[str, float]:
    """Where the streams' decode time (first token -> last) went: the handoff gap (token 0 -> 1:
    the KV pull, the decode worker's admission, its first step), steady gaps, and gaps during which
    another stream joined or left the batch (admitting a request and pulling its KV stalls every
    running request's step, which the simulator does not model). Means and shares of the total."""
    handoff = [float(s.token_s[1] - s.token_s[0]) for s in streams if len(s.token_s) >= 2]
    gaps = decode_gaps(streams)
    steady = [g.seconds for g in gaps if g.steady]
    changing = [g.seconds for g in gaps if not g.steady]
    total = sum(handoff) + sum(steady) + sum(changing)
    return {"handoff_mean_s": statistics.fmean(handoff), "steady_mean_s": statistics.fmean(steady),
            "changing_mean_s": statistics.fmean(changing), "steady_gaps": len(steady), "changing_gaps": len(changing),
            "handoff_share": sum(handoff) / total, "steady_share": sum(steady) / total,
            "changing_share": sum(changing) / total}


def mean_by_shape(samples: Sequence[DecodeSample]) -> list[DecodeSample]:
    """One sample per (batch, context // GAP_CONTEXT_BIN) with at least GAP_MIN_SAMPLES gaps: their
    mean context (rounded) and mean seconds. The mean, because a TPOT is a sum of gaps; and not
    each gap, because a busy router loop can read two steps' tokens back to back (one long gap,
    one near 0), and a relative fit would take the near-0 ones at face value."""
    groups: dict[tuple[int, int], list[DecodeSample]] = {}
    for sample in samples:
        groups.setdefault((sample.batch, sample.context_tokens // GAP_CONTEXT_BIN), []).append(sample)
    return [DecodeSample(batch, round(statistics.fmean(s.context_tokens for s in group)),
                         statistics.fmean(s.seconds for s in group))
            for (batch, _), group in sorted(groups.items()) if len(group) >= GAP_MIN_SAMPLES]


def prefill_overlap(records: Sequence, streams: Sequence[Stream]) -> np.ndarray:
    """Per request (records[i] streamed as streams[i]), the fraction of its decode (first token ->
    last) during which the prefill worker computed a prompt: each prompt's prefill_s ending at its
    first token (its return trip, a few ms, taken as 0). On 2 shared cores a prefill slows the
    decode worker's steps, which the simulator's separate devices never see."""
    busy = [(s.token_s[0] - r.prefill_s, s.token_s[0]) for r, s in zip(records, streams) if r.prefill_s is not None]
    fractions = []
    for stream in streams:
        lo, hi = stream.token_s[0], stream.token_s[-1]
        covered = sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in busy)
        fractions.append(min(1.0, covered / (hi - lo)) if hi > lo else 0.0)
    return np.array(fractions)


def tpot_by_overlap(overlap: np.ndarray, real_tpot: np.ndarray, simulated_tpot: np.ndarray) -> list[dict]:
    """Median real and simulated TPOT of the requests in each OVERLAP_EDGES bucket of prefill
    overlap ([lo, hi), the last one closed); empty buckets left out."""
    rows = []
    for lo, hi in zip(OVERLAP_EDGES, OVERLAP_EDGES[1:]):
        inside = (overlap >= lo) & ((overlap < hi) | (hi == OVERLAP_EDGES[-1]))
        if inside.any():
            rows.append({"overlap": [lo, hi], "requests": int(inside.sum()),
                         "real_median_s": float(np.median(real_tpot[inside])),
                         "simulated_median_s": float(np.median(simulated_tpot[inside]))})
    return rows


# ---- offline step times (EngineCore in this process) ---------------------------------------
def random_ids(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_TOKEN_ID, vocab_size, length).tolist()


def timed_step(engine) -> float:
    started = time.perf_counter()
    engine.step()
    return time.perf_counter() - started


def drain(engine) -> None:
    """Abort whatever the engine still runs and step until it has nothing left."""
    for request_id in list(engine.scheduler.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()


def measure_prefill(engine, sizes: Sizes, vocab_size: int, rng: np.random.Generator) -> list[PrefillSample]:
    """Per length, the median of prefill_repeats steps each computing one fresh prompt alone (a
    whole step: schedule, forward, sample); lengths interleaved so that drift hits them all."""
    from splitserve.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seconds: dict[int, list[float]] = {length: [] for length in PREFILL_LENGTHS}
    for repeat in range(sizes.prefill_repeats):
        for length in PREFILL_LENGTHS:
            engine.add_request(f"prefill-{length}-{repeat}", random_ids(rng, length, vocab_size), params)
            seconds[length].append(timed_step(engine))
            drain(engine)
    return [PrefillSample(length, statistics.median(values)) for length, values in seconds.items()]


def decode_shape(engine, batch: int, prompt: int, steps: int, vocab_size: int,
                 rng: np.random.Generator) -> DecodeSample:
    """`batch` fresh prompts of `prompt` tokens are prefilled (untimed), then `steps` decode-only
    steps are timed: their median duration at their mean context."""
    from splitserve.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"decode-{batch}-{prompt}-{index}", random_ids(rng, prompt, vocab_size), params)
    requests = engine.scheduler.requests.values()
    while not all(r.num_output_tokens >= 1 for r in requests):
        engine.step()
    contexts, seconds = [], []
    for _ in range(steps):
        contexts.append(sum(r.num_tokens for r in requests))
        seconds.append(timed_step(engine))
    drain(engine)
    return DecodeSample(batch, round(statistics.fmean(contexts)), statistics.median(seconds))


@dataclass(frozen=True)
class Samples:
    """One profile's measurements."""

    prefill: tuple[PrefillSample, ...]
    decode: tuple[DecodeSample, ...]

    def fit(self, max_batch_size: int, prefill_token_budget: int) -> PerformanceProfile:
        return fit_profile(self.prefill, self.decode, max_batch_size, prefill_token_budget)

    def to_json(self) -> dict:
        return {"prefill": [asdict(s) for s in self.prefill], "decode": [asdict(s) for s in self.decode]}


def measure_offline(model_dir: Path, cluster_config, sizes: Sizes, vocab_size: int,
                    seed: int) -> tuple[Samples, int]:
    """Both roles' samples, each on an EngineCore with its pool's EngineConfig (after a warm-up),
    and the KV bytes of one token (the simulator's transfer size)."""
    from splitserve.engine.engine_core import EngineCore

    rng = np.random.default_rng([seed, 1])
    prefill_engine = EngineCore(model_dir, cluster_config.prefill.engine)
    spec = prefill_engine.kv_cache.spec
    measure_prefill(prefill_engine, QUICK, vocab_size, rng)  # warm-up
    prefill = measure_prefill(prefill_engine, sizes, vocab_size, rng)
    del prefill_engine
    decode_engine = EngineCore(model_dir, cluster_config.decode.engine)
    decode_shape(decode_engine, 2, 64, 8, vocab_size, rng)  # warm-up
    decode = [decode_shape(decode_engine, batch, prompt, sizes.decode_steps, vocab_size, rng)
              for batch, prompt in DECODE_SHAPES]
    return Samples(tuple(prefill), tuple(decode)), spec.bytes_per_token


# ---- the real cluster ------------------------------------------------------------------------
class RecordCollector:
    """Every RequestRecord the router hands its observer, by request id (the cluster's own
    observers still get each one)."""

    def __init__(self, orchestrator) -> None:
        self.records: dict = {}
        self._previous = orchestrator.observer
        orchestrator.observer = self._observe

    def _observe(self, record) -> None:
        self.records[record.request_id] = record
        if self._previous is not None:
            self._previous(record)


async def send(orchestrator, request: ReplayRequest) -> None:
    """One request through the router to its end (its RequestRecord then reaches the observers)."""
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.router.api_types import GenerationInput

    params = SamplingParams(temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True)
    async for _ in orchestrator.generate(GenerationInput(request.request_id, request.token_ids, params)):
        pass


async def replay(orchestrator, requests: Sequence[ReplayRequest]) -> list[float]:
    """Send each request at its arrival time (from now) and wait for all; how late each was sent."""
    origin = time.monotonic()

    async def at_arrival(request: ReplayRequest) -> float:
        await asyncio.sleep(max(0.0, request.arrival_s - (time.monotonic() - origin)))
        late = time.monotonic() - origin - request.arrival_s
        await send(orchestrator, request)
        return late

    return list(await asyncio.gather(*(at_arrival(r) for r in requests)))


async def probe_decode(orchestrator, batch: int, prompt: int, output: int, vocab_size: int,
                       rng: np.random.Generator) -> list[ReplayRequest]:
    """`batch` requests of `prompt` tokens and `output` outputs sent together."""
    requests = [ReplayRequest(f"probe-decode-{batch}-{prompt}-{i}", 0.0,
                              tuple(random_ids(rng, prompt, vocab_size)), output) for i in range(batch)]
    await asyncio.gather(*(send(orchestrator, r) for r in requests))
    return requests


def steady_gap_s(records: Sequence) -> float:
    """The median inter-token gap over the middle half of every record's tokens (the batch is
    whole there: every request has joined and none has finished)."""
    gaps = []
    for record in records:
        latencies = record.inter_token_latencies
        gaps += latencies[len(latencies) // 4: 3 * len(latencies) // 4]
    return statistics.median(gaps)


def measure_live(orchestrator, loop, collector: RecordCollector, sizes: Sizes, vocab_size: int,
                 seed: int) -> tuple[Samples, dict[int, float]]:
    """Probes through the router, one shape at a time, every time as the router sees it (so the
    routing, the Ray calls, the worker's loop and the stream back are in it). Prefill: a lone
    prompt per probe (max_tokens 1); a sample is its TTFT, the median over prefill_repeats probes.
    Decode: per shape, `batch` equal requests sent together; a sample is their steady gap (the
    per-token period) at the mean context of the middle of their decode. Also returned: the
    median prefill compute of each length on the prefill worker's own clock (first scheduled step
    -> first token), to tell the worker's share of a probe's TTFT from the router's."""
    rng = np.random.default_rng([seed, 2])
    ttft: dict[int, list[float]] = {length: [] for length in PREFILL_LENGTHS}
    compute: dict[int, list[float]] = {length: [] for length in PREFILL_LENGTHS}
    for repeat in range(sizes.prefill_repeats):
        for length in PREFILL_LENGTHS:
            request = ReplayRequest(f"probe-prefill-{length}-{repeat}", 0.0,
                                    tuple(random_ids(rng, length, vocab_size)), 1)
            loop.run(send(orchestrator, request))
            record = collector.records[request.request_id]
            ttft[length].append(record.ttft_s)
            compute[length].append(record.prefill_s)
    output = 2 * sizes.decode_steps
    decode = []
    for batch, prompt in DECODE_SHAPES:
        requests = loop.run(probe_decode(orchestrator, batch, prompt, output, vocab_size, rng))
        gap = steady_gap_s([collector.records[r.request_id] for r in requests])
        decode.append(DecodeSample(batch, batch * (prompt + output // 2), gap))
    prefill = tuple(PrefillSample(length, statistics.median(values)) for length, values in ttft.items())
    return Samples(prefill, tuple(decode)), {length: statistics.median(values) for length, values in compute.items()}


def warm_up(orchestrator, loop, vocab_size: int, seed: int) -> None:
    """A few requests first: the NIXL handshake, the first pull and each worker's first steps."""
    rng = np.random.default_rng([seed, 3])
    requests = [ReplayRequest(f"warmup-{i}", 0.1 * i, tuple(random_ids(rng, 128, vocab_size)), 16) for i in range(4)]
    loop.run(replay(orchestrator, requests))


@dataclass(frozen=True)
class RealRun:
    """What the cluster part measured."""

    idle: Samples
    """The live probes' samples (measure_live)."""
    idle_prefill_compute_s: dict[int, float]
    """Median prefill compute of each probe length on the prefill worker's clock."""
    loaded: Samples
    """Samples from the replay of the fitting trace (loaded_prefill_samples, decode_gap_samples)."""
    compared: tuple[ReplayRequest, ...]
    """The compared trace's requests as sent in the attempt kept."""
    lateness_s: tuple[float, ...]
    """How late each of them was sent."""
    records: dict
    """request_id -> RequestRecord of every request the router ended (probes and every replay)."""
    kv_tokens: int
    """The decode worker's KV capacity in tokens, as it reports it."""
    reports: dict
    """Each worker's latest load report (its own moving averages of step costs), as JSON."""


def measure_loaded(records: dict, requests: Sequence[ReplayRequest], lateness_s: Sequence[float]) -> Samples:
    """The fitting trace's samples (every request entered the router at its arrival + lateness):
    lone prompts averaged by length, steady decode gaps averaged by shape."""
    ended = [records[r.request_id] for r in requests]
    streams = [stream_of(record, r.arrival_s + late) for record, r, late in zip(ended, requests, lateness_s)]
    return Samples(tuple(mean_by_length(loaded_prefill_samples(ended))),
                   tuple(mean_by_shape(decode_gap_samples(streams))))


def replayer(loop, orchestrator, trace: Trace, vocab_size: int, seed: int,
             prefix: str) -> Callable[[], tuple[tuple[ReplayRequest, ...], list[float]]]:
    """One replay of the trace per call (fresh prompts each attempt): (its requests, their lateness)."""
    attempts = itertools.count()

    def attempt() -> tuple[tuple[ReplayRequest, ...], list[float]]:
        requests = replay_requests(trace, vocab_size, seed, prefix, next(attempts))
        return requests, loop.run(replay(orchestrator, requests), timeout_s=trace.duration_s + 300)
    return attempt


def run_cluster(config, traces: tuple[Trace, Trace], sizes: Sizes, vocab_size: int, seed: int,
                parts: Parts) -> RealRun:
    """Start the cluster, warm it up, probe it idle, replay the fitting trace, then the compared one
    (traces: (fitting, compared)); each part runs again while others took the machine (Parts)."""
    from serving_common import Cluster

    fitting_trace, compared_trace = traces
    with Cluster(config) as (cluster, loop):
        orchestrator = cluster.orchestrator
        collector = RecordCollector(orchestrator)
        warm_up(orchestrator, loop, vocab_size, seed)
        idle, compute = parts.run("live_idle_probes",
                                  lambda: measure_live(orchestrator, loop, collector, sizes, vocab_size, seed))
        fitting, fitting_lateness = parts.run(
            "replay_fitting_trace", replayer(loop, orchestrator, fitting_trace, vocab_size, seed + 1, "fit"))
        compared, lateness = parts.run(
            "replay_compared_trace", replayer(loop, orchestrator, compared_trace, vocab_size, seed, "cal"))
        snapshots = orchestrator.worker_snapshots()
    (decode,) = [s for s in snapshots if s.role == "decode"]
    return RealRun(idle, compute, measure_loaded(collector.records, fitting, fitting_lateness), compared,
                   tuple(lateness), collector.records, decode.load.num_kv_blocks * config.decode.engine.block_size,
                   {s.worker_id: asdict(s.load) for s in snapshots})


def phase_medians(records: Sequence) -> dict[str, float]:
    """Median seconds of each TTFT phase (common.metrics.TTFT_PHASES) over the records."""
    phases: dict[str, list[float]] = {}
    for record in records:
        for name, seconds in record.ttft_breakdown:
            phases.setdefault(name, []).append(seconds)
    return {name: statistics.median(values) for name, values in phases.items()}


# ---- simulation ------------------------------------------------------------------------------
def sim_config(profile: PerformanceProfile, kv_tokens: int, kv_bytes_per_token: int,
               transfer: tuple[float, float]) -> SimulatedCluster:
    """1 prefill + 1 decode replica for the whole run (ticks only observe; targets are irrelevant)."""
    latency_s, bytes_per_s = transfer
    return SimulatedCluster(profile=profile, initial_prefill=1, initial_decode=1, scale_up_s=0.0,
                         decode_kv_tokens=kv_tokens, prefix_cache_groups=0, kv_bytes_per_token=kv_bytes_per_token,
                         transfer_bytes_per_s=bytes_per_s, transfer_latency_s=latency_s)


def simulated_latencies(config: SimulatedCluster, trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(TTFT [n], TPOT [n]) of every request of the trace under StaticPolicy(1, 1). run_local, not
    simulate: the SimulationResult keeps quantiles only, the simulator's request table has them all."""
    simulator, run = run_local(config, trace, StaticPolicy(1, 1), "static")
    require(run.result.finished == len(trace), f"the simulation finished {run.result.finished} of {len(trace)}")
    first, finish = np.array(simulator.requests.first_token_s), np.array(simulator.requests.finish_s)
    return first - trace.arrival_s, tpot_of(first, finish, trace.output_tokens)


# ---- report ------------------------------------------------------------------------------------
def print_table(comparisons: dict[str, list[Cell]]) -> None:
    print(f"\n{'profile':12s} {'metric':6s} {'q':4s} {'real ms':>9s} {'sim ms':>9s} {'sim/real':>9s}  within 20%")
    for profile, rows in comparisons.items():
        for cell in rows:
            print(f"{profile:12s} {cell.metric:6s} p{round(100 * cell.quantile):<3d} {1e3 * cell.real_s:9.2f} "
                  f"{1e3 * cell.simulated_s:9.2f} {cell.ratio:9.2f}  {'yes' if cell.within else 'NO'}")


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    latencies = report["latencies_ms"]
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, metric in zip(axes, ("ttft", "tpot")):
        for label, style in (("real", "k-"), ("offline", "C0--"), ("live-idle", "C1--"), ("live-loaded", "C2--")):
            values = np.sort(latencies[label][metric])
            axis.plot(values, np.arange(1, len(values) + 1) / len(values), style,
                      label="real cluster" if label == "real" else f"simulated ({label} profile)")
        axis.set_xlabel(f"{metric.upper()} (ms)" + (", log scale" if metric == "ttft" else ""))
        axis.set_ylabel("fraction of requests")
        if metric == "ttft":  # 64..512-token prompts: TTFTs span an order of magnitude
            axis.set_xscale("log")
        axis.grid(alpha=0.3)
        axis.legend(loc="best", fontsize="small")
    trace = report["trace"]
    figure.suptitle(f"Simulator vs local cluster (1P+1D, random serving model): {trace['requests']} requests, "
                    f"Poisson {trace['rate']:.2g}/s over {trace['duration_s']:g} s")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def compare(config, trace: Trace, profiles: dict[str, Samples], real: RealRun, kv_bytes_per_token: int,
            transfer: tuple[float, float], report: dict) -> dict[str, list[Cell]]:
    """Fit each profile, simulate the trace with it, compare with the real run; latencies and
    profiles go into the report."""
    budget, max_batch = config.prefill.engine.max_num_batched_tokens, config.decode.engine.max_num_seqs
    real_ttft, real_tpot = record_latencies(real.records, real.compared)
    latencies = {"real": {"ttft": real_ttft, "tpot": real_tpot}}
    comparisons = {}
    for name, samples in profiles.items():
        profile = samples.fit(max_batch, budget)
        config_sim = sim_config(profile, real.kv_tokens, kv_bytes_per_token, transfer)
        ttft, tpot = simulated_latencies(config_sim, trace)
        latencies[name] = {"ttft": ttft, "tpot": tpot}
        comparisons[name] = [*cells("ttft", real_ttft, ttft), *cells("tpot", real_tpot, tpot)]
        report["profiles"][name] = {"profile": asdict(profile), "samples": samples.to_json()}
    report["sim_config"] = {k: v for k, v in asdict(config_sim).items() if k != "profile"}
    report["latencies_ms"] = {label: {metric: (1e3 * values).tolist() for metric, values in pair.items()}
                              for label, pair in latencies.items()}
    report["cells"] = {name: [c.to_json() for c in rows] for name, rows in comparisons.items()}
    return comparisons


def describe_real(trace: Trace, real: RealRun, transfer: tuple[float, float], report: dict) -> None:
    """The trace, the cluster's state and the real run's breakdown (where the time went)."""
    records = [real.records[r.request_id] for r in real.compared]
    report["trace"] = {"requests": len(trace), "rate": trace.mean_rate(), "duration_s": trace.duration_s,
                       "workload": asdict(CALIBRATION_WORKLOAD),
                       "prompt_tokens_mean": float(trace.prompt_tokens.mean()),
                       "output_tokens_mean": float(trace.output_tokens.mean())}
    report["decode_kv_tokens"] = real.kv_tokens
    report["worker_reports"] = real.reports
    report["transfer"] = {"latency_s": transfer[0], "bytes_per_s": transfer[1], "source": "nixl_bandwidth.json",
                          "live_pull_median_s": statistics.median(r.kv_transfer.seconds for r in records)}
    report["ttft_phase_medians_s"] = phase_medians(records)
    streams = [stream_of(record, r.arrival_s + late)
               for record, r, late in zip(records, real.compared, real.lateness_s)]
    report["decode_time_breakdown"] = gap_breakdown(streams)
    report["prefill_overlap"] = prefill_overlap(records, streams).tolist()
    report["idle_probe_prefill_compute_s"] = real.idle_prefill_compute_s
    report["send_lateness_s"] = {"median": statistics.median(real.lateness_s), "max": max(real.lateness_s)}


def main() -> None:
    parser = bench_parser(__doc__, "20 s traces and fewer probes, no retry; results in the temp directory", RESULTS)
    parser.add_argument("--max-retries", type=non_negative_int, default=2,
                        help="runs of a part again while other processes took > 5%% of the machine (default 2)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    start_bench()
    from splitserve.testing.local_cluster import tiny_cluster_config
    from splitserve.testing.tiny_models import RANDOM_SERVING_SPEC, cached_tiny_model

    model_dir = cached_tiny_model(RANDOM_SERVING_SPEC)  # the random model its recorded results were measured with
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    config = tiny_cluster_config(model_dir, **{"decode.engine.num_kv_blocks": DECODE_KV_BLOCKS})
    trace = calibration_trace(sizes, args.seed)
    report = report_header("bench/planner_calibration.py", args)
    report.update({"model": str(model_dir), "prefill_engine": asdict(config.prefill.engine),
                   "decode_engine": asdict(config.decode.engine), "profiles": {}})
    foreign = ForeignCpu()
    parts = Parts(report, foreign, args.quick, args.max_retries)
    offline, kv_bytes_per_token = parts.run(
        "offline_profile", lambda: measure_offline(model_dir, config, sizes, vocab_size, args.seed))
    real = run_cluster(config, (calibration_trace(sizes, args.seed + 1), trace), sizes, vocab_size, args.seed, parts)
    foreign.stop()
    transfer = fit_transfer(json.loads((RESULTS / "nixl_bandwidth.json").read_text())["rows"])
    describe_real(trace, real, transfer, report)
    profiles = {"offline": offline, "live-idle": real.idle, "live-loaded": real.loaded}
    comparisons = compare(config, trace, profiles, real, kv_bytes_per_token, transfer, report)
    print_table(comparisons)
    print("\nTTFT phase medians (ms): " + ", ".join(f"{k} {1e3 * v:.2f}"
                                                    for k, v in report["ttft_phase_medians_s"].items()))
    print("decode time: " + ", ".join(f"{k} {v:.4g}" for k, v in report["decode_time_breakdown"].items()))
    tpot_s = [np.array(report["latencies_ms"][label]["tpot"]) / 1e3 for label in ("real", "live-loaded")]
    report["tpot_by_prefill_overlap"] = tpot_by_overlap(np.array(report["prefill_overlap"]), *tpot_s)
    for row in report["tpot_by_prefill_overlap"]:
        print(f"prefill overlap {row['overlap']}: {row['requests']} requests, TPOT median real "
              f"{1e3 * row['real_median_s']:.2f} ms, simulated (live-loaded) {1e3 * row['simulated_median_s']:.2f} ms")
    warn_noisy_parts({name: load for name, load in report["load"].items()
                      if isinstance(load, dict) and load.get("kept")})
    out_dir = write_report(report, NAME, args, RESULTS, plot)
    print(f"\nwrote {out_dir / NAME}.json and .png")


if __name__ == "__main__":
    main()
