"""The router's Prometheus /metrics endpoint: the one module that imports prometheus_client.

Every collector is built from a definition in common.metrics.ALL_METRICS (names, help, labels,
buckets are never repeated here). Metrics come from two sources:

- per request (success/failure, latency histograms, KV transfers, SLO attainment, goodput):
  `observe()` takes each RequestRecord the orchestrator hands its observer when a request ends
  (an internal step's record counts only as a step and a KV pull); per finished client request (n, max_tokens,
  its longest sequence's tokens, however many sequences it ran): `observe_params()`;
Counters whose label values are known up front (request outcomes, routing reasons, rejection
reasons, TTFT phases) are exported at 0 for every value from the start, so a dashboard shows 0,
not "No data", for what has not happened yet (PromQL's rate() of a series that appears with its
first increment misses that increment, too).

- per worker (load gauges and cumulative counters from each worker's latest report, worker_up),
  routing outcomes (Orchestrator.routing_stats) and the router's event-loop lag
  (Orchestrator.loop_lag.stats()): read at scrape time by a collector.

Every sample carries the label `model_name` (the served model's name), as vLLM labels every series it
exports: vLLM's dashboards filter each query by `{model_name="$model_name"}` and its alerts group by it.

Workers run no HTTP server: their numbers travel in the reports the router already polls. The
HTTP server answers on its own threads, so the scrape-time collector reads the orchestrator's
state on the orchestrator's event loop (which owns it). Each RouterMetrics has its own
CollectorRegistry, so two routers (two test clusters) in one process never collide.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from operator import attrgetter
from typing import TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_asgi_app, start_http_server
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector, RestrictedRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from splitserve.common import metrics as m
from splitserve.common.metrics import COUNTER, GAUGE, HISTOGRAM, MetricDef
from splitserve.common.slo import SloConfig
from splitserve.common.stats import (FINISH_REASONS, LoopLagStats, PlannerStats, RequestParamsRecord, RequestRecord,
                                     RoutingStats, WorkerSnapshot)
from splitserve.router.orchestrator import Orchestrator

T = TypeVar("T")
SCRAPE_TIMEOUT_S = 5.0
"""Longest a scrape waits for the router's event loop to hand over a snapshot."""

_WORKER_GAUGES = ((m.NUM_REQUESTS_RUNNING, attrgetter("num_running")),
                  (m.NUM_REQUESTS_WAITING, attrgetter("num_waiting")),
                  (m.KV_CACHE_USAGE, attrgetter("kv_usage")),
                  (m.NUM_QUEUED_PREFILL_TOKENS, attrgetter("num_queued_prefill_tokens")))
"""Per-worker gauges and how each is read from a LoadReport."""
_WORKER_COUNTERS = ((m.PREFIX_CACHE_QUERIES, attrgetter("prefix_cache_queries")),
                    (m.PREFIX_CACHE_HITS, attrgetter("prefix_cache_hits")),
                    (m.NUM_PREEMPTIONS, attrgetter("num_preemptions")),
                    (m.PROMPT_TOKENS, attrgetter("prompt_tokens")),
                    (m.GENERATION_TOKENS, attrgetter("generation_tokens")),
                    (m.SPEC_DECODE_NUM_DRAFTS, attrgetter("spec_decode_num_drafts")),
                    (m.SPEC_DECODE_NUM_DRAFT_TOKENS, attrgetter("spec_decode_num_draft_tokens")),
                    (m.SPEC_DECODE_NUM_ACCEPTED_TOKENS, attrgetter("spec_decode_num_accepted_tokens")))
"""Per-worker counters and how each is read from WorkerCounters."""
SCRAPED = (*(d for d, _ in _WORKER_GAUGES), *(d for d, _ in _WORKER_COUNTERS), m.KV_LEASES_EXPIRED, m.WORKER_UP,
           m.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
           m.KV_CACHE_BYTES_PER_TOKEN, m.KV_CACHE_DTYPE_INFO, m.LORA_REQUESTS_INFO,
           m.ROUTING_DECISIONS, m.ADMISSION_REJECTIONS, m.EVENT_LOOP_LAG, m.PLANNER_REPLICAS, m.PLANNER_TARGET_REPLICAS,
           m.PLANNER_PREDICTED_SECONDS, m.PLANNER_DECISIONS, m.PLANNER_FAILED_STARTS, m.PLANNER_DEVICE_SECONDS)
"""Definitions read at scrape time; every other one is a live collector fed by observe()."""


class RouterMetrics:
    """The router's registry: live per-request collectors, the scrape-time collector, and the
    HTTP endpoint serving them."""

    def __init__(self, slo: SloConfig, model_name: str) -> None:
        """`slo`: the router's default targets, exported as splitserve_slo_target_seconds; `model_name`: the
        served model's name (its first served_model_name), the `model_name` label of every sample."""
        self.model_name = model_name
        self.registry = _ModelNamedRegistry(model_name)
        self._live = {d.name: _live_collector(d, self.registry) for d in m.ALL_METRICS if d not in SCRAPED}
        for definition, values in ((m.REQUEST_FAILURE, m.FAILURE_CODES), (m.REQUEST_SUCCESS, FINISH_REASONS),
                                   (m.TTFT_BREAKDOWN, m.TTFT_PHASES)):
            for value in values:
                self._get(definition).labels(value)  # the child exists (at 0) from now on
        for name, target in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s)):
            if target is not None:
                self._get(m.SLO_TARGET).labels(name).set(target)
        self._http: tuple[WSGIServer, threading.Thread] | None = None

    def watch(self, orchestrator: Orchestrator) -> None:
        """Export the orchestrator's workers and routing outcomes, and observe its finished client requests'
        parameters; call on its event loop."""
        self.registry.register(_ClusterCollector(orchestrator, asyncio.get_running_loop()))
        orchestrator.params_observer = self.observe_params

    def watch_planner(self, read: Callable[[], PlannerStats]) -> None:
        """Export the planner's state, read() at scrape time on the calling event loop."""
        self.registry.register(_PlannerCollector(read, asyncio.get_running_loop()))

    # ---- per request -------------------------------------------------------------------
    def observe(self, record: RequestRecord) -> None:
        """Count one ended request (the Orchestrator's observer; runs on its event loop). An internal step
        (record.step_of) is not a request: it counts as a step, and its KV pull as a pull."""
        if record.step_of is not None:
            self._get(m.INTERNAL_STEP_REQUESTS).inc()
            self._observe_transfer(record)
            return
        if record.finish_reason is None:
            self._get(m.REQUEST_FAILURE).labels(record.error_code).inc()
        else:
            self._get(m.REQUEST_SUCCESS).labels(record.finish_reason).inc()
            self._observe_finished(record)
        if record.num_migrations:
            self._get(m.REQUEST_MIGRATIONS).inc(record.num_migrations)
        self._observe_tokens(record)
        self._observe_transfer(record)
        self._observe_slo(record)

    def observe_params(self, params: RequestParamsRecord) -> None:
        """Count one finished client request's parameters (the Orchestrator's params observer): once per client
        request, where observe() counts each of its sequences."""
        self._get(m.REQUEST_PARAMS_N).observe(params.n)
        if params.max_tokens is not None:
            self._get(m.REQUEST_PARAMS_MAX_TOKENS).observe(params.max_tokens)
        self._get(m.REQUEST_MAX_NUM_GENERATION_TOKENS).observe(params.max_num_generation_tokens)

    def _observe_finished(self, record: RequestRecord) -> None:
        """Whole-request histograms: finished requests only, so each _count = request_success."""
        self._get(m.E2E_REQUEST_LATENCY).observe(record.e2e_s)
        self._get(m.REQUEST_PROMPT_TOKENS).observe(record.num_prompt_tokens)
        self._get(m.REQUEST_GENERATION_TOKENS).observe(record.num_output_tokens)
        for definition, value in ((m.REQUEST_QUEUE_TIME, record.queue_s), (m.REQUEST_PREFILL_TIME, record.prefill_s),
                                  (m.REQUEST_DECODE_TIME, record.decode_s), (m.TIME_PER_OUTPUT_TOKEN, record.tpot_s)):
            if value is not None:  # TPOT needs two output tokens
                self._get(definition).observe(value)

    def _observe_tokens(self, record: RequestRecord) -> None:
        """Per-token latencies, as they happened, whatever way the request ended (as vLLM does)."""
        if record.ttft_s is not None:
            self._get(m.TIME_TO_FIRST_TOKEN).observe(record.ttft_s)
        itl = self._get(m.INTER_TOKEN_LATENCY)
        for gap_s in record.inter_token_latencies:
            itl.observe(gap_s)
        breakdown = self._get(m.TTFT_BREAKDOWN)
        for phase, seconds in record.ttft_breakdown:
            breakdown.labels(phase).observe(seconds)

    def _observe_transfer(self, record: RequestRecord) -> None:
        transfer = record.kv_transfer
        if transfer is None:
            return
        pair = (transfer.prefill_worker, transfer.decode_worker)
        if transfer.failed:
            self._get(m.KV_TRANSFER_FAILURES).labels(*pair).inc()
            return
        self._get(m.KV_TRANSFER_TIME).labels(*pair).observe(transfer.seconds)
        self._get(m.KV_TRANSFER_BYTES).labels(*pair).inc(transfer.num_bytes)

    def _observe_slo(self, record: RequestRecord) -> None:
        outcome = record.slo
        if outcome is None:
            return
        self._get(m.SLO_REQUESTS).inc()
        for definition, met in ((m.SLO_TTFT_MET, outcome.ttft_met), (m.SLO_TPOT_MET, outcome.tpot_met),
                                (m.SLO_BOTH_MET, outcome.both_met)):
            if met:
                self._get(definition).inc()
        if outcome.both_met:
            self._get(m.GOODPUT_TOKENS).inc(record.num_output_tokens)

    def _get(self, definition: MetricDef) -> MetricWrapperBase:
        return self._live[definition.name]

    # ---- the HTTP endpoint -------------------------------------------------------------
    def serve(self, host: str, port: int) -> int:
        """Serve GET /metrics on host:port from a daemon thread; returns the bound port (port 0
        picks a free one)."""
        if self._http is not None:
            raise RuntimeError("the metrics endpoint is already serving")
        self._http = start_http_server(port, host, self.registry)
        return self._http[0].server_port

    def asgi_app(self) -> Callable[..., Awaitable[None]]:
        """The same exposition as an ASGI app, which the router's HTTP API serves on /metrics."""
        return make_asgi_app(self.registry)

    def stop(self) -> None:
        """Stop serving (blocks up to the server's 0.5 s poll interval: call it off the event loop)."""
        if self._http is None:
            return
        server, thread = self._http
        self._http = None
        server.shutdown()
        server.server_close()
        thread.join(SCRAPE_TIMEOUT_S)


class _ModelNamedRegistry(CollectorRegistry):
    """A registry whose every sample carries `model_name`, added at collection time so that no definition,
    collector or observe() call repeats it (it is one value per router). The scrape-time collectors declare no
    names up front, so `GET /metrics?name[]=...` finds their families only with support_collectors_without_names."""

    def __init__(self, model_name: str) -> None:
        super().__init__(support_collectors_without_names=True)
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        return _with_model_name(super().collect(), self._model_name)

    def restricted_registry(self, names: Iterable[str]) -> _ModelNamedView:
        """What `GET /metrics?name[]=...` serves: the same label on the chosen families."""
        return _ModelNamedView(super().restricted_registry(names), self._model_name)


class _ModelNamedView:
    """A restricted registry (prometheus_client collects those from the collectors directly) with `model_name`."""

    def __init__(self, restricted: RestrictedRegistry, model_name: str) -> None:
        self._restricted = restricted
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        return _with_model_name(self._restricted.collect(), self._model_name)


def _with_model_name(metrics: Iterable[Metric], model_name: str) -> Iterator[Metric]:
    """Each metric with `model_name` added to its samples (each collect() builds fresh Metric objects)."""
    for metric in metrics:
        metric.samples = [sample._replace(labels={"model_name": model_name, **sample.labels})
                          for sample in metric.samples]
        yield metric


def _live_collector(definition: MetricDef, registry: CollectorRegistry) -> MetricWrapperBase:
    args = (definition.name, definition.documentation, definition.labels)
    if definition.kind == COUNTER:
        return Counter(*args, registry=registry)
    if definition.kind == GAUGE:
        return Gauge(*args, registry=registry)
    if definition.kind == HISTOGRAM:
        return Histogram(*args, registry=registry, buckets=definition.buckets)
    raise ValueError(f"{definition.name}: unknown kind {definition.kind!r}")


class _LoopCollector(Collector):
    """A collector whose data lives on an event loop (the router's)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def _on_loop(self, read: Callable[[], T]) -> T:
        """read() on the event loop (directly when already on it)."""
        try:
            on_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            return read()

        async def call() -> T:
            return read()

        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(SCRAPE_TIMEOUT_S)


class _ClusterCollector(_LoopCollector):
    """Reads the workers' latest reports and the routing outcomes at scrape time."""

    def __init__(self, orchestrator: Orchestrator, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._orchestrator = orchestrator

    def collect(self) -> Iterator[Metric]:
        orchestrator = self._orchestrator
        workers, routing, loop_lag = self._on_loop(lambda: (orchestrator.worker_snapshots(),
                                                            orchestrator.routing_stats(), orchestrator.loop_lag.stats()))
        yield from _worker_families(workers)
        yield from _routing_families(routing)
        yield _loop_lag_family(loop_lag)


class _PlannerCollector(_LoopCollector):
    def __init__(self, read: Callable[[], PlannerStats], loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self._read = read

    def collect(self) -> Iterator[Metric]:
        stats = self._on_loop(self._read)
        yield _family(m.PLANNER_REPLICAS, stats.replicas)
        yield _family(m.PLANNER_TARGET_REPLICAS, stats.targets)
        predicted = (("ttft_p99", stats.predicted_ttft_p99_s), ("itl_p99", stats.predicted_itl_p99_s))
        yield _family(m.PLANNER_PREDICTED_SECONDS, ((name, value) for name, value in predicted if value is not None))
        yield _family(m.PLANNER_DECISIONS, stats.decisions)
        yield _family(m.PLANNER_FAILED_STARTS, [(stats.failed_starts,)])
        yield _family(m.PLANNER_DEVICE_SECONDS, [(stats.device_seconds,)])


def _worker_families(workers: Sequence[WorkerSnapshot]) -> Iterator[Metric]:
    """worker_up for every worker; gauges and counters of those answering their report polls
    (a restarted worker's counters start over from 0: rate() reads that as a counter reset)."""
    yield _family(m.WORKER_UP, ((w.worker_id, w.role, int(w.load is not None)) for w in workers))
    reporting = [w for w in workers if w.load is not None]
    for definition, read in _WORKER_GAUGES:
        yield _family(definition, ((w.worker_id, w.role, read(w.load)) for w in reporting))
    for definition, read in _WORKER_COUNTERS:
        yield _family(definition, ((w.worker_id, w.role, read(w.counters)) for w in reporting))
    yield _family(m.KV_LEASES_EXPIRED,
                  ((w.worker_id, w.counters.kv_leases_expired) for w in reporting if w.role == "prefill"))
    yield _family(m.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
                  ((w.worker_id, w.role, str(position), count) for w in reporting
                   for position, count in enumerate(w.counters.spec_decode_num_accepted_tokens_per_pos)))
    yield _family(m.LORA_REQUESTS_INFO, _lora_samples(reporting))
    known = [w for w in workers if w.layout is not None]
    yield _family(m.KV_CACHE_BYTES_PER_TOKEN, ((w.worker_id, w.role, w.layout.bytes_per_token) for w in known))
    yield _family(m.KV_CACHE_DTYPE_INFO, ((w.worker_id, w.role, w.layout.kv_cache_dtype, 1) for w in known))


def _lora_samples(reporting: Sequence[WorkerSnapshot]) -> Iterator[tuple[str, str, str, str, str, int]]:
    """lora_requests_info's (worker, role, running adapters, waiting adapters, max_lora, 1) of each worker with
    LoRA enabled, adapter names comma-joined as vLLM joins them."""
    for worker in reporting:
        lora = worker.load.lora
        if lora is not None:
            yield worker.worker_id, worker.role, ",".join(lora.running), ",".join(lora.waiting), str(lora.max_loras), 1


def _routing_families(routing: RoutingStats) -> Iterator[Metric]:
    yield _family(m.ROUTING_DECISIONS, _with_zeros(m.ROUTING_REASONS, routing.decisions))
    yield _family(m.ADMISSION_REJECTIONS, _with_zeros(m.REJECTION_REASONS, routing.rejections))


def _with_zeros(known: Sequence[str], counts: Iterable[tuple[str, int]]) -> list[tuple[str, int]]:
    """(reason, count) for every known reason (0 when it never happened) and any other counted."""
    merged = dict.fromkeys(known, 0)
    merged.update(counts)
    return sorted(merged.items())


def _loop_lag_family(stats: LoopLagStats) -> Metric:
    buckets = [(repr(bound), count) for bound, count in zip(stats.buckets, stats.bucket_counts)]
    return HistogramMetricFamily(m.EVENT_LOOP_LAG.name, m.EVENT_LOOP_LAG.documentation,
                                 buckets=[*buckets, ("+Inf", stats.count)], sum_value=stats.sum_s)


def _family(definition: MetricDef, samples: Iterable[tuple]) -> Metric:
    """A counter or gauge family; each sample is its label values followed by its value."""
    kind = CounterMetricFamily if definition.kind == COUNTER else GaugeMetricFamily
    family = kind(definition.name, definition.documentation, labels=definition.labels)
    for *labels, value in samples:
        family.add_metric(labels, value)
    return family
