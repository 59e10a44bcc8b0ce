"""The router's metrics after scripted runs of known requests: exact counts, token totals,
histogram counts, SLO/goodput counters and KV bytes, scraped over HTTP from the /metrics endpoint
(in-process workers, in-process KV transfer)."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import re
import urllib.request

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.common import metrics as m
from splitserve.common.kv_events import LoraLoad, WorkerCounters
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.slo import SloConfig, SloOutcome
from splitserve.common.stats import KVTransferRecord, LoopLagStats, PlannerStats, RoutingStats, WorkerSnapshot
from splitserve.engine import LLM
from splitserve.router import admission, policy, tokenizer_pool
from splitserve.router.metrics_server import RouterMetrics
from splitserve.router.api_types import GenerationInput, RouterError
from splitserve.router.fanout import client_fan_out, sequence_inputs
from splitserve.router.records import refused_record
from splitserve.testing.in_process_cluster import InProcessCluster, make_prefill_worker
from tests.factories import MetricsSources, make_load_report, make_request_record

SLO = SloConfig(ttft_s=1000.0, tpot_s=1e-9)
"""Every finished request meets the TTFT target; only one with a single output token meets TPOT."""
MODEL_NAME = "tiny-llama"
"""The served model's name: the model_name label of every sample."""
BYTES_PER_BLOCK = 2 * 8 * 2 * 16 * 4 * 2
"""Tiny llama KV: (K, V) x block_size 8 x 2 KV heads x head_dim 16 x 4 bytes (fp32) x 2 layers."""
GREEDY = dict(temperature=0.0, ignore_eos=True)
PROMPTS = {"a": list(range(3, 23)), "b": list(range(100, 133)), "c": list(range(200, 241)),
           "d": list(range(300, 317)), "e": list(range(400, 420)), "f": list(range(450, 475))}
"""Distinct first blocks: no request finds another's prefix cached. Lengths 20, 33, 41, 17, 20, 25."""


def _stop_params(model_dir) -> tuple[SamplingParams, int]:
    """d's params: a stop string from the middle of its greedy text, and how many tokens it emits."""
    llm = LLM(model_dir, block_size=8, num_kv_blocks=256, dtype="float32", device="cpu")
    (full,) = llm.generate([PROMPTS["d"]], SamplingParams(max_tokens=20, **GREEDY))
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    params = SamplingParams(max_tokens=20, stop=(stop,), **GREEDY)
    (cut,) = llm.generate([PROMPTS["d"]], params)
    assert cut.finish_reason == "stop" and len(cut.token_ids) >= 3  # the stop is reached on the decode worker
    return params, len(cut.token_ids)


async def _script(cluster: InProcessCluster, stop_params: SamplingParams) -> None:
    """3 finished by length (one on the prefill worker), 1 stop string, 1 rejected, 1 cancelled."""
    for request_id, max_tokens in (("a", 5), ("b", 1), ("c", 8)):
        await cluster.generate(request_id, PROMPTS[request_id], SamplingParams(max_tokens=max_tokens, **GREEDY))
    await cluster.generate("d", PROMPTS["d"], stop_params)
    tight = GenerationInput("e", tuple(PROMPTS["e"]), SamplingParams(max_tokens=4, **GREEDY), ttft_slo_s=1e-9)
    with pytest.raises(RouterError, match="RESOURCE_EXHAUSTED"):
        await cluster.orchestrator.generate(tight).__anext__()
    stream = cluster.orchestrator.generate(GenerationInput("f", tuple(PROMPTS["f"]),
                                                           SamplingParams(max_tokens=50, **GREEDY)))
    await stream.__anext__()  # the first token (from the prefill worker), then the client goes away
    await stream.aclose()


PLANNER_STATS = PlannerStats(
    replicas=(("prefill", "routable", 1), ("prefill", "starting", 0), ("prefill", "draining", 0),
              ("decode", "routable", 2), ("decode", "starting", 1), ("decode", "draining", 1)),
    targets=(("prefill", 1), ("decode", 3)), predicted_ttft_p99_s=0.25, predicted_itl_p99_s=None,
    decisions=(("decode", "scale_up", 2), ("prefill", "hold", 5)), failed_starts=1, device_seconds=42.5)
"""What a planner reports at the scrape (predicted ITL unknown: no series for it)."""


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    """Every sample by name and labels, its model_name label (on every sample, checked here) left out."""
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert {s.labels.get("model_name") for s in samples} == {MODEL_NAME}
    return {(s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")): s.value for s in samples}


def _value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _http_get(port: int, query: str = "") -> tuple[str, str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics{query}", timeout=10) as response:
        return response.headers["Content-Type"], response.read().decode()


async def _reports_caught_up(cluster: InProcessCluster) -> dict[str, WorkerCounters]:
    """Wait until the router's view of each worker (its latest report) matches its engine now:
    reports lag up to a poll behind."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while True:
        engines = {w.worker_id: (await w.stats()).engine for w in [*cluster.prefill_workers, *cluster.decode_workers]}
        views = {s.worker_id: s for s in cluster.orchestrator.worker_snapshots()}
        if all(_matches(views[worker_id], engine) for worker_id, engine in engines.items()):
            return {worker_id: view.counters for worker_id, view in views.items()}
        assert loop.time() < deadline, f"reports never caught up: {views} vs {engines}"
        await asyncio.sleep(0.02)


def _matches(view: WorkerSnapshot, engine) -> bool:
    load, counters = view.load, view.counters
    return load is not None and (
        (load.num_running, load.num_free_kv_blocks, counters.prompt_tokens, counters.generation_tokens)
        == (engine.num_running, engine.num_free_kv_blocks, engine.num_prompt_tokens, engine.num_generation_tokens))


@pytest.fixture(scope="module")
def scripted(tiny_llama_dir):
    """(records, HTTP content type, scraped samples, the same registry read in-process, decode gen tokens, d's length)."""
    stop_params, d_tokens = _stop_params(tiny_llama_dir)
    records = []
    metrics = RouterMetrics(SLO, MODEL_NAME)

    def observe(record):
        records.append(record)
        metrics.observe(record)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, slo=SLO, observer=observe) as cluster:
            metrics.watch(cluster.orchestrator)
            metrics.watch_planner(lambda: PLANNER_STATS)
            port = metrics.serve("127.0.0.1", 0)
            try:
                await _script(cluster, stop_params)
                await cluster.wait_idle()
                counters = await _reports_caught_up(cluster)
                content_type, text = await asyncio.to_thread(_http_get, port)
            finally:
                await asyncio.to_thread(metrics.stop)
            return content_type, text, generate_latest(metrics.registry).decode(), counters

    content_type, text, local_text, counters = asyncio.run(scenario())
    return records, content_type, _samples(text), _samples(local_text), counters, d_tokens


def test_the_endpoint_serves_every_defined_metric_with_its_buckets(scripted):
    _, content_type, samples, _, _, _ = scripted
    assert content_type.startswith("text/plain; version=")
    names = {name for name, _ in samples}
    for definition in m.ALL_METRICS:
        if definition.kind == m.HISTOGRAM:
            buckets = {float(dict(labels)["le"]) for name, labels in samples if name == definition.name + "_bucket"}
            assert buckets == {*definition.buckets, float("inf")}, definition.name
        # No pull failed in this run, no worker speculates, none has LoRA enabled: no series yet.
        elif definition not in (m.KV_TRANSFER_FAILURES, m.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS,
                                m.LORA_REQUESTS_INFO):
            assert definition.exposed_name in names, definition.name


def test_the_planners_state_is_exported_as_it_reports_it(scripted):
    _, _, s, _, _, _ = scripted
    assert [_value(s, "splitserve_planner_replicas", pool="decode", state=state)
            for state in ("routable", "starting", "draining")] == [2, 1, 1]
    assert _value(s, "splitserve_planner_target_replicas", pool="decode") == 3
    assert _value(s, "splitserve_planner_predicted_seconds", metric="ttft_p99") == 0.25
    assert not [key for key in s if key[0] == "splitserve_planner_predicted_seconds" and ("metric", "itl_p99") in key[1]]
    assert _value(s, "splitserve_planner_decisions_total", pool="prefill", reason="hold") == 5
    assert _value(s, "splitserve_planner_failed_starts_total") == 1
    assert _value(s, "splitserve_planner_device_seconds_total") == 42.5


def test_requests_by_outcome_and_routing(scripted):
    _, _, s, _, _, _ = scripted
    assert _value(s, "splitserve_request_success_total", finished_reason="length") == 3
    assert _value(s, "splitserve_request_success_total", finished_reason="stop") == 1
    assert _value(s, "splitserve_request_failure_total", code="RESOURCE_EXHAUSTED") == 1
    assert _value(s, "splitserve_request_failure_total", code="CANCELLED") == 1
    assert _value(s, "splitserve_admission_rejections_total", reason="ttft_slo") == 1
    assert _value(s, "splitserve_routing_decisions_total", reason="load") == 5  # a, b, c, d, f
    assert _counts(s, "splitserve_routing_decisions_total", "reason") == {
        "cache_hit": 0, "load": 5, "local_prefill": 0, "round_robin": 0}


def _counts(samples: dict, name: str, label: str) -> dict[str, float]:
    return {dict(key[1])[label]: value for key, value in samples.items() if key[0] == name}


def test_known_label_values_are_exported_at_zero(scripted):
    """What did not happen reads 0 (a dashboard shows 0, not "No data")."""
    _, _, s, _, _, _ = scripted
    assert _counts(s, "splitserve_request_failure_total", "code") == {
        "CANCELLED": 1, "INVALID_ARGUMENT": 0, "RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 0, "DEADLINE_EXCEEDED": 0,
        "NOT_FOUND": 0, "INTERNAL": 0, "ABORTED": 0}
    assert _counts(s, "splitserve_admission_rejections_total", "reason") == {
        "too_many_requests": 0, "tokenizer_busy": 0, "ttft_slo": 1, "no_kv_capacity": 0, "queue_full": 0}
    assert _counts(s, "splitserve_ttft_breakdown_seconds_count", "phase") == {
        "router_queue": 5, "prefill_queue": 5, "prefill_compute": 5, "transfer": 3, "decode_queue": 3}


def test_the_known_reasons_are_every_reason_the_router_counts():
    """common/metrics.py's lists against the router's own constants and policy's literals."""
    source = inspect.getsource(policy)
    assert set(re.findall(r'Rejection\("(\w+)"', source)) | {admission.TOO_MANY_REQUESTS, tokenizer_pool.BUSY_REASON} \
        == set(m.REJECTION_REASONS)
    assert [reason for reason in m.ROUTING_REASONS if f'"{reason}"' not in source] == []


def test_latency_histogram_counts(scripted):
    _, _, s, _, _, d_tokens = scripted
    assert _value(s, "splitserve_time_to_first_token_seconds_count") == 5  # every request that got a token
    # One gap per output token after the first: a 4, b 0, c 7, d d_tokens - 1, f (cancelled after 1) 0.
    assert _value(s, "splitserve_inter_token_latency_seconds_count") == 10 + d_tokens
    assert _value(s, "splitserve_time_per_output_token_seconds_count") == 3  # finished with >= 2 tokens: a, c, d
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert _value(s, f"splitserve_{name}_count") == 4, name  # finished requests only
    assert _value(s, "splitserve_request_prompt_tokens_sum") == 20 + 33 + 41 + 17
    assert _value(s, "splitserve_request_generation_tokens_sum") == 5 + 1 + 8 + d_tokens
    phases = {phase: _value(s, "splitserve_ttft_breakdown_seconds_count", phase=phase) for phase in m.TTFT_PHASES}
    # b finished on the prefill worker and f was cancelled there: only a, c, d moved KV and decoded.
    assert phases == {"router_queue": 5, "prefill_queue": 5, "prefill_compute": 5, "transfer": 3, "decode_queue": 3}


def test_kv_transfer_bytes_and_time_per_worker_pair(scripted):
    _, _, s, _, _, _ = scripted
    pair = dict(prefill_worker="prefill-0", decode_worker="decode-0")
    # a: 20 prompt tokens = 3 blocks, c: 41 = 6 blocks, d: 17 = 3 blocks.
    assert _value(s, "splitserve_kv_transfer_bytes_total", **pair) == 12 * BYTES_PER_BLOCK == 49152
    assert _value(s, "splitserve_kv_transfer_seconds_count", **pair) == 3
    assert _value(s, "splitserve_kv_transfer_failures_total", **pair) is None


def test_slo_attainment_and_goodput(scripted):
    _, _, s, _, _, _ = scripted
    # Counted: a, b, c, d (finished) and e (rejected: failed, meets nothing); not f (cancelled).
    assert _value(s, "splitserve_slo_requests_total") == 5
    assert _value(s, "splitserve_slo_ttft_met_requests_total") == 4
    assert _value(s, "splitserve_slo_tpot_met_requests_total") == 1  # b: one output token has no TPOT
    assert _value(s, "splitserve_slo_met_requests_total") == 1
    assert _value(s, "splitserve_goodput_tokens_total") == 1
    assert _value(s, "splitserve_slo_target_seconds", slo="ttft") == 1000.0
    assert _value(s, "splitserve_slo_target_seconds", slo="tpot") == 1e-9


def test_worker_metrics_come_from_their_reports(scripted):
    _, _, s, _, counters, _ = scripted
    prefill, decode = dict(worker="prefill-0", role="prefill"), dict(worker="decode-0", role="decode")
    assert _value(s, "splitserve_worker_up", **prefill) == _value(s, "splitserve_worker_up", **decode) == 1
    prompts = 20 + 33 + 41 + 17 + 25  # a, b, c, d, f were prefilled; e was rejected
    assert counters["prefill-0"] == WorkerCounters(prompt_tokens=prompts, generation_tokens=5,
                                                   prefix_cache_queries=prompts, prefix_cache_hits=0,
                                                   num_preemptions=0, kv_leases_expired=0)
    assert _value(s, "splitserve_prompt_tokens_total", **prefill) == prompts
    assert _value(s, "splitserve_generation_tokens_total", **prefill) == 5  # each prefill samples one token
    assert _value(s, "splitserve_prefix_cache_queries_total", **prefill) == prompts
    assert _value(s, "splitserve_prefix_cache_hits_total", **prefill) == 0
    assert _value(s, "splitserve_kv_leases_expired_total", worker="prefill-0") == 0
    assert _value(s, "splitserve_kv_leases_expired_total", worker="decode-0") is None  # decode holds no leases
    # Pulled prompts are not the decode worker's prompt tokens; its generation count includes what
    # it decoded past d's stop string before the router's abort reached it, so compare with its engine.
    assert _value(s, "splitserve_prompt_tokens_total", **decode) == 0
    assert _value(s, "splitserve_generation_tokens_total", **decode) == counters["decode-0"].generation_tokens
    for worker in (prefill, decode):
        for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                      "num_queued_prefill_tokens"):
            assert _value(s, f"splitserve_{gauge}", **worker) == 0, (worker, gauge)
        # the tiny fp32 Llama: 2 layers x (keys, values) x 2 KV heads x 16 dims x 4 bytes
        assert _value(s, "splitserve_kv_cache_bytes_per_token", **worker) == 2 * 2 * 2 * 16 * 4
        assert _value(s, "splitserve_kv_cache_dtype_info", kv_cache_dtype="float32", **worker) == 1


def test_http_and_in_process_scrapes_agree(scripted):
    """Except the event-loop lag: the heartbeat goes on between the two scrapes."""
    _, _, http, local, _, _ = scripted

    def settled(samples):
        return {key: value for key, value in samples.items() if not key[0].startswith(m.EVENT_LOOP_LAG.name)}

    assert settled(http) == settled(local)


def test_request_records_on_every_path(scripted):
    records, _, _, _, _, d_tokens = scripted
    by_id = {record.request_id: record for record in records}
    assert [r.request_id for r in records] == ["a", "b", "c", "d", "e", "f"]
    a, b, e, f = by_id["a"], by_id["b"], by_id["e"], by_id["f"]
    assert (a.finish_reason, a.error_code, a.routing_reason, a.num_output_tokens) == ("length", None, "load", 5)
    assert len(a.inter_token_latencies) == 4
    assert sum(a.inter_token_latencies) == pytest.approx(a.decode_s)  # finished on its last token's chunk
    assert [phase for phase, _ in a.ttft_breakdown] == list(m.TTFT_PHASES)
    assert a.kv_transfer.num_bytes == 3 * BYTES_PER_BLOCK and not a.kv_transfer.failed
    assert sum(s for p, s in a.ttft_breakdown[:3]) == pytest.approx(a.ttft_s, abs=0.005)
    assert (b.kv_transfer, b.slo, b.tpot_s) == (None, SloOutcome(True, True), None)
    assert (e.error_code, e.rejection_reason, e.routing_reason, e.ttft_s, e.prefill_worker) == (
        "RESOURCE_EXHAUSTED", "ttft_slo", None, None, None)
    assert e.slo == SloOutcome(False, False)
    assert (f.error_code, f.num_output_tokens, f.slo, f.kv_transfer) == ("CANCELLED", 1, None, None)
    assert [phase for phase, _ in f.ttft_breakdown] == ["router_queue", "prefill_queue", "prefill_compute"]
    assert by_id["d"].num_output_tokens == d_tokens and by_id["d"].finish_reason == "stop"


@pytest.mark.parametrize("policy, outcome", [("recompute", ("length", None)), ("fail", (None, "INTERNAL"))])
def test_a_failed_pull_counts_a_transfer_failure(tiny_llama_dir, policy, outcome):
    records, metrics = [], RouterMetrics(SloConfig(), MODEL_NAME)

    def observe(record):
        records.append(record)
        metrics.observe(record)

    async def scenario():
        async with InProcessCluster(tiny_llama_dir, transfer_failure_policy=policy, observer=observe) as cluster:
            metrics.watch(cluster.orchestrator)
            cluster.decode_workers[0]._backend.fail_next_pulls(1)
            try:
                await cluster.generate("a", PROMPTS["a"], SamplingParams(max_tokens=4, **GREEDY))
            except RouterError:
                pass
            await cluster.wait_idle()
            counters = await _reports_caught_up(cluster)
            return counters, _samples(generate_latest(metrics.registry).decode())

    counters, s = asyncio.run(scenario())
    (record,) = records
    pair = dict(prefill_worker="prefill-0", decode_worker="decode-0")
    assert (record.finish_reason, record.error_code) == outcome
    assert record.kv_transfer.failed and record.kv_transfer.num_bytes == 0
    assert _value(s, "splitserve_kv_transfer_failures_total", **pair) == 1
    assert _value(s, "splitserve_kv_transfer_bytes_total", **pair) is None
    assert _value(s, "splitserve_kv_transfer_seconds_count", **pair) is None
    assert _value(s, "splitserve_request_failure_total", code="INTERNAL") == (1 if policy == "fail" else 0)
    assert "transfer" not in dict(record.ttft_breakdown)
    assert counters["prefill-0"].kv_leases_expired == 0  # the router released the lease (30 s TTL)
    # Recomputing makes the pulled prompt the decode worker's own prompt tokens.
    assert counters["decode-0"].prompt_tokens == (20 if policy == "recompute" else 0)


def test_an_expired_lease_is_counted_in_the_prefill_workers_report(tiny_llama_dir):
    from splitserve.common.worker_messages import PrefillRequest

    worker = make_prefill_worker(tiny_llama_dir, lease_ttl_s=1e-3)

    async def scenario():
        before = (await worker.report(None, 0, 0.0)).counters
        result = await worker.prefill(PrefillRequest("a", tuple(PROMPTS["a"]), SamplingParams(max_tokens=4)))
        while (await worker.stats()).num_held_leases:  # nobody pulls: the lease expires
            await asyncio.sleep(0.005)
        return before, result, (await worker.report(None, 0, 0.0)).counters

    try:
        before, result, after = asyncio.run(scenario())
    finally:
        worker.shutdown()
    assert result.transfer is not None and result.queue_s >= 0 and result.compute_s > 0
    assert (before.kv_leases_expired, after.kv_leases_expired) == (0, 1)
    assert (after.prompt_tokens, after.generation_tokens, after.prefix_cache_queries) == (20, 1, 20)


def test_a_silent_worker_is_down_and_exports_nothing_else():
    counters = WorkerCounters(10, 2, 10, 4, 1, 3)
    workers = (WorkerSnapshot("prefill-0", "prefill", make_load_report(num_running=2, num_waiting=1,
                                                                     num_queued_prefill_tokens=7, num_kv_blocks=64,
                                                                     num_free_kv_blocks=48), counters),
               WorkerSnapshot("decode-0", "decode", None, None))
    metrics = RouterMetrics(SloConfig(), MODEL_NAME)

    async def scrape():
        metrics.watch(MetricsSources(workers, RoutingStats((("cache_hit", 2), ("load", 1)), (("queue_full", 4),)), lag))
        return _samples(generate_latest(metrics.registry).decode())

    # 5 beats: 3 within 1 ms, one of 0.2 s, one of 12 s (a stalled loop)
    cumulative = (3, 3, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 5)
    lag = LoopLagStats(m.LOOP_LAG_BUCKETS, cumulative, 5, 12.2015)
    s = asyncio.run(scrape())
    assert [_value(s, m.EVENT_LOOP_LAG.name + "_bucket", le=repr(bound)) for bound in m.LOOP_LAG_BUCKETS] == list(
        cumulative)
    assert [_value(s, m.EVENT_LOOP_LAG.name + suffix, **labels) for suffix, labels in (
        ("_bucket", {"le": "+Inf"}), ("_count", {}), ("_sum", {}))] == [5, 5, 12.2015]
    prefill = dict(worker="prefill-0", role="prefill")
    assert _value(s, "splitserve_worker_up", **prefill) == 1
    assert _value(s, "splitserve_worker_up", worker="decode-0", role="decode") == 0
    assert [_value(s, f"splitserve_{name}", **prefill) for name in (
        "num_requests_running", "num_requests_waiting", "num_queued_prefill_tokens", "kv_cache_usage_perc",
        "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
        "num_preemptions_total")] == [2, 1, 7, 0.25, 10, 2, 10, 4, 1]
    assert _value(s, "splitserve_kv_leases_expired_total", worker="prefill-0") == 3
    assert not [key for key in s if dict(key[1]).get("worker") == "decode-0" and key[0] != "splitserve_worker_up"]
    assert _value(s, "splitserve_routing_decisions_total", reason="cache_hit") == 2
    assert _value(s, "splitserve_admission_rejections_total", reason="queue_full") == 4
    assert _value(s, "splitserve_slo_target_seconds", slo="ttft") is None  # no target configured


def test_lora_requests_info_labels_each_lora_workers_adapters():
    """vLLM's lora_requests_info per worker with LoRA enabled: names comma-joined (empty: none), max_lora as
    text, value 1; a worker without LoRA exports none."""
    counters = WorkerCounters(0, 0, 0, 0, 0, 0)
    workers = (WorkerSnapshot("prefill-0", "prefill", dataclasses.replace(
                   make_load_report(), lora=LoraLoad(2, running=("poet", "sql"), waiting=("sql",))), counters),
               WorkerSnapshot("decode-0", "decode", dataclasses.replace(
                   make_load_report(), lora=LoraLoad(2, running=(), waiting=())), counters),
               WorkerSnapshot("decode-1", "decode", make_load_report(), counters))
    metrics = RouterMetrics(SloConfig(), MODEL_NAME)

    async def scrape():
        metrics.watch(MetricsSources(workers, RoutingStats((), ()), LoopLagStats(m.LOOP_LAG_BUCKETS,
                                                                            (0,) * len(m.LOOP_LAG_BUCKETS), 0, 0.0)))
        return _samples(generate_latest(metrics.registry).decode())

    info = {labels: value for (name, labels), value in asyncio.run(scrape()).items()
            if name == "splitserve_lora_requests_info"}
    assert info == {
        frozenset(dict(worker="prefill-0", role="prefill", running_lora_adapters="poet,sql",
                       waiting_lora_adapters="sql", max_lora="2").items()): 1,
        frozenset(dict(worker="decode-0", role="decode", running_lora_adapters="", waiting_lora_adapters="",
                       max_lora="2").items()): 1}


def test_two_routers_in_one_process_keep_their_own_registries():
    first, second = RouterMetrics(SloConfig(ttft_s=1.0), MODEL_NAME), RouterMetrics(SloConfig(ttft_s=2.0), MODEL_NAME)
    assert _value(_samples(generate_latest(first.registry).decode()), "splitserve_slo_target_seconds", slo="ttft") == 1.0
    assert _value(_samples(generate_latest(second.registry).decode()), "splitserve_slo_target_seconds",
                  slo="ttft") == 2.0


def test_an_internal_step_counts_as_a_step_and_a_pull_only():
    """A beam's step request is not a client's request: no request counter, histogram or SLO counter moves, and
    its move off a lost worker counts on its client's request; its KV pull (worker-side work that happened) counts."""
    metrics = RouterMetrics(SLO, MODEL_NAME)
    before = _samples(generate_latest(metrics.registry).decode())
    pull = KVTransferRecord("prefill-0", "decode-0", 0.002, 4096)
    metrics.observe(make_request_record("r-beam-1-0", step_of="r", kv_transfer=pull, num_migrations=1,
                                        ttft_breakdown=(("prefill_queue", 0.001),)))
    after = _samples(generate_latest(metrics.registry).decode())
    changed = {key: value - before.get(key, 0.0) for key, value in after.items()
               if not key[0].endswith("_created") and value != before.get(key, 0.0)}
    pair = frozenset({("prefill_worker", "prefill-0"), ("decode_worker", "decode-0")})
    assert changed == {
        ("splitserve_internal_step_requests_total", frozenset()): 1,
        ("splitserve_kv_transfer_bytes_total", pair): 4096, ("splitserve_kv_transfer_seconds_count", pair): 1,
        ("splitserve_kv_transfer_seconds_sum", pair): 0.002,
        **{("splitserve_kv_transfer_seconds_bucket", pair | {("le", le)}): 1
           for le in ("0.0025", "0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5", "5.0", "10.0",
                      "+Inf")}}


def test_a_refused_fan_out_is_recorded_as_a_refused_request_and_counts_once():
    """A fan-out refused before its sequences ran (router/records.py refused_record): no token, worker or phase;
    one failure by its code and one SLO miss, nothing else."""
    record = refused_record("r", 12, "RESOURCE_EXHAUSTED", "too_many_requests", SLO, 0.002)
    assert record == make_request_record(
        "r", finish_reason=None, error_code="RESOURCE_EXHAUSTED", routing_reason=None,
        rejection_reason="too_many_requests", prefill_worker=None, decode_worker=None, num_prompt_tokens=12,
        num_output_tokens=0, ttft_s=None, e2e_s=0.002, slo=SloOutcome(False, False))
    metrics = RouterMetrics(SLO, MODEL_NAME)
    before = _samples(generate_latest(metrics.registry).decode())
    metrics.observe(record)
    after = _samples(generate_latest(metrics.registry).decode())
    changed = {key: value - before.get(key, 0.0) for key, value in after.items()
               if not key[0].endswith("_created") and value != before.get(key, 0.0)}
    assert changed == {("splitserve_request_failure_total", frozenset({("code", "RESOURCE_EXHAUSTED")})): 1,
                       ("splitserve_slo_requests_total", frozenset()): 1}


def test_request_params_are_observed_once_per_finished_client_request(tiny_llama_dir):
    """A lone request (max_tokens 7) and an n=3 fan-out (max_tokens 4) count one observation each in vLLM's
    request_params_n, request_params_max_tokens and request_max_num_generation_tokens (its longest sequence's
    tokens), where request_success counts each sequence."""
    metrics = RouterMetrics(SLO, MODEL_NAME)

    async def scenario() -> str:
        async with InProcessCluster(tiny_llama_dir, slo=SLO, observer=metrics.observe) as cluster:
            orchestrator = cluster.orchestrator
            metrics.watch(orchestrator)
            await cluster.generate("lone", PROMPTS["a"], SamplingParams(max_tokens=7, **GREEDY))
            base = GenerationInput("fan", tuple(PROMPTS["c"]), SamplingParams(max_tokens=4, **GREEDY))
            inputs = sequence_inputs(base, [base.prompt_token_ids], 3)
            ids = orchestrator.new_request_id("fan", len(inputs))
            chunks = [item async for item in client_fan_out(orchestrator, ids, inputs, 3, orchestrator.admit(), 3)]
            assert [sum(len(item.chunk.token_ids) for item in chunks if item.index == index)
                    for index in range(3)] == [4, 4, 4]
            await cluster.wait_idle()
        return generate_latest(metrics.registry).decode()

    s = _samples(asyncio.run(scenario()))
    assert _value(s, "splitserve_request_success_total", finished_reason="length") == 4  # each sequence
    assert [(_value(s, f"splitserve_{name}_count"), _value(s, f"splitserve_{name}_sum"))
            for name in ("request_params_n", "request_params_max_tokens", "request_max_num_generation_tokens")] == [
        (2, 1 + 3), (2, 7 + 4), (2, 7 + 4)]
    assert [_value(s, "splitserve_request_params_n_bucket", le=le) for le in ("1.0", "2.0", "5.0", "+Inf")] == [
        1, 1, 2, 2]
    assert [_value(s, "splitserve_request_max_num_generation_tokens_bucket", le=le)
            for le in ("2.0", "5.0", "10.0")] == [0, 1, 2]
    assert _value(s, "splitserve_request_params_max_tokens_bucket", le="5.0") == 1


VLLM_DASHBOARD_SERIES = (
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count",
    "prompt_tokens_total", "generation_tokens_total", "time_per_output_token_seconds_bucket",
    "time_per_output_token_seconds_sum", "time_per_output_token_seconds_count", "num_requests_running",
    "num_requests_waiting", "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum",
    "time_to_first_token_seconds_count", "kv_cache_usage_perc", "request_prompt_tokens_bucket",
    "request_generation_tokens_bucket", "request_success_total", "request_queue_time_seconds_sum",
    "request_queue_time_seconds_bucket", "request_prefill_time_seconds_sum", "request_prefill_time_seconds_bucket",
    "request_decode_time_seconds_sum", "request_decode_time_seconds_bucket", "inter_token_latency_seconds_bucket",
    "inter_token_latency_seconds_sum", "inter_token_latency_seconds_count", "prefix_cache_hits_total",
    "prefix_cache_queries_total", "num_preemptions_total", "request_params_n_bucket", "request_params_max_tokens_bucket",
    "request_max_num_generation_tokens_bucket")
"""The series vLLM's example Grafana dashboards and alert rules (examples/online_serving/prometheus_grafana)
query that splitserve has, as `vllm:<name>`; every query selects `{model_name="$model_name"}` (the dashboards'
variable is `label_values(model_name)`) or groups `by (le, model_name)`. docs/observability.md lists the rest."""


def test_vllms_dashboard_queries_select_every_series_by_model_name():
    counters = WorkerCounters(10, 2, 10, 4, 1, 3)
    workers = (WorkerSnapshot("prefill-0", "prefill", make_load_report(num_running=2), counters),)
    metrics = RouterMetrics(SloConfig(), MODEL_NAME)
    metrics.observe(make_request_record("r", num_output_tokens=3, inter_token_latencies=(0.02, 0.03), e2e_s=0.06,
                                        queue_s=0.001, prefill_s=0.009, decode_s=0.05))
    lag = LoopLagStats(m.LOOP_LAG_BUCKETS, (0,) * len(m.LOOP_LAG_BUCKETS), 0, 0.0)

    async def scrape() -> tuple[str, str]:
        metrics.watch(MetricsSources(workers, RoutingStats((), ()), lag))
        port = metrics.serve("127.0.0.1", 0)
        try:
            _, restricted = await asyncio.to_thread(_http_get, port, "?name[]=splitserve_num_requests_running")
            return generate_latest(metrics.registry).decode(), restricted
        finally:
            await asyncio.to_thread(metrics.stop)

    text, restricted = asyncio.run(scrape())
    series = {(s.name, frozenset(s.labels.items())): s.value
              for family in text_string_to_metric_families(text) for s in family.samples}
    selected = {name for name, labels in series if ("model_name", MODEL_NAME) in labels}
    assert [name for name in VLLM_DASHBOARD_SERIES if m.PREFIX + name not in selected] == []
    model = {"model_name": MODEL_NAME}
    assert series[("splitserve_request_success_total", frozenset({**model, "finished_reason": "length"}.items()))] == 1
    assert series[("splitserve_request_success_total", frozenset({**model, "finished_reason": "stop"}.items()))] == 0
    assert series[("splitserve_num_requests_running",
                   frozenset({**model, "worker": "prefill-0", "role": "prefill"}.items()))] == 2
    assert series[("splitserve_inter_token_latency_seconds_count", frozenset(model.items()))] == 2
    assert series[("splitserve_e2e_request_latency_seconds_bucket", frozenset({**model, "le": "0.3"}.items()))] == 1
    assert [(s.name, s.labels, s.value) for family in text_string_to_metric_families(restricted)
            for s in family.samples] == [
        ("splitserve_num_requests_running", {**model, "worker": "prefill-0", "role": "prefill"}, 2.0)]
