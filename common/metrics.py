"""Every metric splitserve exports, defined once (torch-free, no prometheus_client here).

The router's metrics server builds its Prometheus collectors from these definitions; the
Prometheus rules, the Grafana dashboards and the tests refer to the same names. Names, meanings
and histogram buckets follow vLLM's well-known set with the `splitserve_` prefix, so dashboards
and people transfer. Counters are declared by their base name: Prometheus exposes them with a
`_total` suffix (`splitserve_prompt_tokens` -> `splitserve_prompt_tokens_total`).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "splitserve_"
COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""vLLM's time_to_first_token_seconds buckets."""
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
"""vLLM's inter_token_latency_seconds / time_per_output_token_seconds buckets."""
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
"""vLLM's e2e_request_latency_seconds (and queue/prefill/decode time) buckets."""
TOKEN_BUCKETS = tuple(mantissa * 10 ** exponent for exponent in range(6) for mantissa in (1, 2, 5))
"""vLLM's request_prompt_tokens / request_generation_tokens (and request_params_max_tokens,
request_max_num_generation_tokens) buckets: the 1-2-5 series (vLLM cuts it
at max_model_len; here it runs to 500000 so the definition stays static)."""
N_BUCKETS = (1, 2, 5, 10, 20)
"""vLLM's request_params_n buckets."""
LOOP_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""A healthy loop runs its heartbeat within a millisecond or two; 30 s is far past any timeout."""
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""KV pulls take from well under a millisecond (a few blocks over shared memory) to seconds."""

WORKER_LABELS = ("worker", "role")
"""role: prefill or decode."""
PAIR_LABELS = ("prefill_worker", "decode_worker")
TTFT_PHASES = ("router_queue", "prefill_queue", "prefill_compute", "transfer", "decode_queue")
"""Where a request's time to first token (and, for transfer and decode_queue, to its second
token, since the first streams from the prefill worker) is spent; label `phase`."""

ROUTING_REASONS = ("cache_hit", "load", "local_prefill", "round_robin")
"""Every routing decision's reason (router/policy.py); label `reason` of routing_decisions."""
REJECTION_REASONS = ("too_many_requests", "tokenizer_busy", "ttft_slo", "no_kv_capacity", "queue_full")
"""Every reason admission control counts (router/admission.py, router/tokenizer_pool.py, router/policy.py)."""
FAILURE_CODES = ("CANCELLED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                 "NOT_FOUND", "INTERNAL", "ABORTED")
"""Every status code a request can fail with (label `code` of request_failure)."""


@dataclass(frozen=True)
class MetricDef:
    name: str
    """Full name with the prefix; counters without the `_total` Prometheus adds."""
    kind: str
    """counter, gauge or histogram."""
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    """Histogram upper bounds (+Inf is implicit)."""

    @property
    def exposed_name(self) -> str:
        """The name a scrape shows (histograms add _bucket/_sum/_count to it)."""
        return self.name + "_total" if self.kind == COUNTER else self.name


def _counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> MetricDef:
    return MetricDef(PREFIX + name, COUNTER, documentation, labels)


def _gauge(name: str, documentation: str, labels: tuple[str, ...] = ()) -> MetricDef:
    return MetricDef(PREFIX + name, GAUGE, documentation, labels)


def _histogram(name: str, documentation: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> MetricDef:
    return MetricDef(PREFIX + name, HISTOGRAM, documentation, labels, buckets)


# ---- per worker (from the workers' reports, exported by the router) ----------------------
NUM_REQUESTS_RUNNING = _gauge("num_requests_running", "Requests in the worker's running batch.", WORKER_LABELS)
NUM_REQUESTS_WAITING = _gauge("num_requests_waiting", "Requests admitted to the worker and not yet running.",
                              WORKER_LABELS)
KV_CACHE_USAGE = _gauge("kv_cache_usage_perc", "Fraction of the worker's KV blocks owned by requests (0-1).",
                        WORKER_LABELS)
NUM_QUEUED_PREFILL_TOKENS = _gauge("num_queued_prefill_tokens", "Prompt tokens the worker still has to compute.",
                                   WORKER_LABELS)
PREFIX_CACHE_QUERIES = _counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                WORKER_LABELS)
PREFIX_CACHE_HITS = _counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", WORKER_LABELS)
NUM_PREEMPTIONS = _counter("num_preemptions", "Requests preempted (KV freed, recomputed later).", WORKER_LABELS)
PROMPT_TOKENS = _counter("prompt_tokens", "Prompt tokens computed by the worker's engine.", WORKER_LABELS)
GENERATION_TOKENS = _counter("generation_tokens", "Tokens generated by the worker's engine.", WORKER_LABELS)
SPEC_DECODE_NUM_DRAFTS = _counter("spec_decode_num_drafts", "Speculative verifications (one per speculating "
                                  "request per step).", WORKER_LABELS)
SPEC_DECODE_NUM_DRAFT_TOKENS = _counter("spec_decode_num_draft_tokens", "Draft tokens verified.", WORKER_LABELS)
SPEC_DECODE_NUM_ACCEPTED_TOKENS = _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", WORKER_LABELS)
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = _counter(
    "spec_decode_num_accepted_tokens_per_pos", "Verifications that accepted the draft at this position (0-based).",
    (*WORKER_LABELS, "position"))
KV_LEASES_EXPIRED = _counter("kv_leases_expired", "Prefill KV leases that expired before decode pulled them.",
                             ("worker",))
KV_CACHE_BYTES_PER_TOKEN = _gauge("kv_cache_bytes_per_token", "Bytes of one token's KV in the worker's pool (all "
                                  "layers, keys and values, a quantized pool's scales included).", WORKER_LABELS)
KV_CACHE_DTYPE_INFO = _gauge("kv_cache_dtype_info", "1 per worker, labelled with what its KV pool stores: float32, "
                             "bfloat16, or int8 / fp8_e4m3 codes.", (*WORKER_LABELS, "kv_cache_dtype"))
LORA_REQUESTS_INFO = _gauge(
    "lora_requests_info", "1 per worker with LoRA enabled (vLLM's lora_requests_info), labelled with the adapters of "
    "its running and of its waiting requests (names sorted, comma-joined; empty: none) and its max_loras.",
    (*WORKER_LABELS, "running_lora_adapters", "waiting_lora_adapters", "max_lora"))
WORKER_UP = _gauge("worker_up", "1 while the worker answers the router's report polls, else 0.", WORKER_LABELS)

# ---- per request (measured at the router) -------------------------------------------------
REQUEST_SUCCESS = _counter("request_success", "Requests that finished with a finish reason (stop, length).",
                           ("finished_reason",))
REQUEST_FAILURE = _counter("request_failure", "Requests that ended with an error status or a client cancel.",
                           ("code",))
ADMISSION_REJECTIONS = _counter("admission_rejections", "Requests rejected by admission control.", ("reason",))
ROUTING_DECISIONS = _counter("routing_decisions", "Routing decisions by outcome (cache_hit, load, local_prefill, "
                                                  "round_robin).", ("reason",))
INTERNAL_STEP_REQUESTS = _counter("internal_step_requests", "Requests the router ran as internal steps of a client's "
                                  "request (each live beam at each beam search step): not counted as requests.")
TIME_TO_FIRST_TOKEN = _histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
INTER_TOKEN_LATENCY = _histogram("inter_token_latency_seconds", "Time between consecutive output tokens.",
                                 ITL_BUCKETS)
TIME_PER_OUTPUT_TOKEN = _histogram("time_per_output_token_seconds",
                                   "Per request: (e2e - TTFT) / (output tokens - 1).", ITL_BUCKETS)
E2E_REQUEST_LATENCY = _histogram("e2e_request_latency_seconds", "Router arrival to last token.",
                                 REQUEST_LATENCY_BUCKETS)
REQUEST_QUEUE_TIME = _histogram("request_queue_time_seconds", "Router arrival to the prefill being scheduled.",
                                REQUEST_LATENCY_BUCKETS)
REQUEST_PREFILL_TIME = _histogram("request_prefill_time_seconds", "Prefill compute, first scheduled chunk to "
                                                                  "first token.", REQUEST_LATENCY_BUCKETS)
REQUEST_DECODE_TIME = _histogram("request_decode_time_seconds", "First token to last token.",
                                 REQUEST_LATENCY_BUCKETS)
REQUEST_PROMPT_TOKENS = _histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                   TOKEN_BUCKETS)
REQUEST_GENERATION_TOKENS = _histogram("request_generation_tokens", "Output tokens of each finished request.",
                                       TOKEN_BUCKETS)
REQUEST_PARAMS_N = _histogram("request_params_n", "The n of each finished client request.", N_BUCKETS)
REQUEST_PARAMS_MAX_TOKENS = _histogram("request_params_max_tokens", "The max_tokens of each finished client "
                                       "request (as it ran: the client's or the default).", TOKEN_BUCKETS)
REQUEST_MAX_NUM_GENERATION_TOKENS = _histogram("request_max_num_generation_tokens", "Output tokens of each finished "
                                               "client request's longest sequence.", TOKEN_BUCKETS)
TTFT_BREAKDOWN = _histogram("ttft_breakdown_seconds", "Time of each phase between arrival and the first tokens "
                                                      "(see TTFT_PHASES).", TTFT_BUCKETS, ("phase",))

# ---- the router itself ---------------------------------------------------------------------
EVENT_LOOP_LAG = _histogram("event_loop_lag_seconds", "How late the router's event-loop heartbeat (due every "
                                                      "0.1 s) ran: time the loop was blocked.", LOOP_LAG_BUCKETS)

# ---- KV transfer (per worker pair, measured at the router) --------------------------------
KV_TRANSFER_TIME = _histogram("kv_transfer_seconds", "KV pull time on the decode worker.", TRANSFER_BUCKETS,
                              PAIR_LABELS)
KV_TRANSFER_BYTES = _counter("kv_transfer_bytes", "KV bytes pulled.", PAIR_LABELS)
KV_TRANSFER_FAILURES = _counter("kv_transfer_failures", "KV pulls that failed (recomputed or failed the request).",
                                PAIR_LABELS)

# ---- SLO accounting (DistServe goodput) ---------------------------------------------------
REQUEST_MIGRATIONS = _counter("request_migrations", "Times a request moved off a lost worker (re-prefilled "
                              "elsewhere with the tokens it had streamed).")
SLO_REQUESTS = _counter("slo_requests", "Finished requests evaluated against the SLO targets.")
SLO_TTFT_MET = _counter("slo_ttft_met_requests", "Finished requests that met their TTFT target.")
SLO_TPOT_MET = _counter("slo_tpot_met_requests", "Finished requests that met their TPOT target.")
SLO_BOTH_MET = _counter("slo_met_requests", "Finished requests that met both targets (goodput requests).")
GOODPUT_TOKENS = _counter("goodput_tokens", "Output tokens of requests that met both targets.")
SLO_TARGET = _gauge("slo_target_seconds", "The configured default SLO targets (for dashboards).", ("slo",))

PLANNER_REPLICAS = _gauge("planner_replicas", "Workers of each pool by state (routable, starting, draining).",
                          ("pool", "state"))
PLANNER_TARGET_REPLICAS = _gauge("planner_target_replicas", "The planner's last replica target per pool.", ("pool",))
PLANNER_PREDICTED_SECONDS = _gauge("planner_predicted_seconds", "The planner's forecast for its targets: ttft_p99 "
                                   "and itl_p99 (compare with the observed histograms).", ("metric",))
PLANNER_DECISIONS = _counter("planner_decisions", "Planner decisions per pool by kind (scale_up, scale_down, hold, "
                             "cooldown, at_max, at_min, bounded_step).", ("pool", "reason"))
PLANNER_FAILED_STARTS = _counter("planner_failed_starts", "Workers the planner asked for that did not start.")
PLANNER_DEVICE_SECONDS = _counter("planner_device_seconds", "Workers (any state) x seconds while the planner runs: "
                                  "with generation_tokens, the cost per 1,000 output tokens.")

ALL_METRICS = tuple(value for value in list(globals().values()) if isinstance(value, MetricDef))
"""Every definition, in declaration order."""
