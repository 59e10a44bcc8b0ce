"""Every Grafana panel's query, evaluated by a real Prometheus (Debian package, on 127.0.0.1)
that scrapes a real local cluster after a short load, returns data with plausible values.

The load runs in two halves with a scrape between them, so every counter series, including
those that first appear with a request (labelled by reason, phase or worker pair), grows while
Prometheus watches: rate() of each is > 0. Ranges per target live in deploy/grafana/panels.yaml.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from urllib.error import HTTPError
from urllib.parse import urlencode
from urllib.request import ProxyHandler, build_opener

import grpc
import pytest
import yaml

from splitserve.proto.splitserve.v1 import generation_pb2 as pb
from splitserve.testing.local_cluster import running_cluster, tiny_cluster_config
from tests.factories import stream_tokens
from tests.test_prometheus_rules import ALERTS, PROMETHEUS_DIR, RECORDING_RULES, ValueRange, dashboard_exprs, panels

pytestmark = pytest.mark.slow

SHARED_PREFIX = list(range(100, 132))
"""Four full blocks of 8 tokens at the start of every prompt: prefix cache hits after the first."""
REQUESTS_PER_HALF = 8
_LOOPBACK = build_opener(ProxyHandler({}))
"""An HTTP client that ignores proxy settings: Prometheus is on 127.0.0.1."""


class PrometheusApi:
    def __init__(self, url: str) -> None:
        self.url = url

    def ready(self) -> bool:
        try:
            with _LOOPBACK.open(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def get(self, path: str, **params: str) -> dict | list:
        try:
            with _LOOPBACK.open(f"{self.url}{path}?{urlencode(params)}", timeout=10) as response:
                body = json.load(response)
        except HTTPError as error:  # a bad query: Prometheus says why
            raise AssertionError(f"{path} {params}: {error.read().decode()}") from error
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """The instant vector of expr now: [{"metric": {...}, "value": [time, "text"]}, ...]."""
        return self.get("/api/v1/query", query=expr)["result"]

    def scalar(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None


def _wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up after {timeout_s} s waiting for {what}"
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _prometheus_config(metrics_port: int) -> dict:
    """deploy/prometheus/prometheus.yml, scraping the test cluster and evaluating rules every second."""
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text(encoding="utf-8"))
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    static["targets"] = [f"127.0.0.1:{metrics_port}"]
    return config


@contextmanager
def running_prometheus(server: str, config: dict, work_dir: Path) -> Iterator[PrometheusApi]:
    """A Prometheus on 127.0.0.1 with its storage in work_dir, stopped afterwards."""
    config_path, log_path = work_dir / "prometheus.yml", work_dir / "prometheus.log"
    config_path.write_text(yaml.safe_dump(config))
    port = _free_port()
    with log_path.open("w") as log:
        process = subprocess.Popen([server, f"--config.file={config_path}", f"--storage.tsdb.path={work_dir / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                   stdout=log, stderr=subprocess.STDOUT)
    api = PrometheusApi(f"http://127.0.0.1:{port}")

    def ready() -> bool:
        assert process.poll() is None, f"Prometheus exited with status {process.returncode}"
        return api.ready()

    try:
        _wait_until(ready, 30, "Prometheus to start")
        yield api
    except BaseException:
        print(f"Prometheus log:\n{log_path.read_text()}")
        raise
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _request(index: int, ttft_slo_s: float | None = None) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=f"load-{index}",
                                 token_ids=pb.TokenIds(ids=SHARED_PREFIX + [200 + index] * 3),
                                 sampling=pb.SamplingParams(temperature=0.0, max_tokens=2 + index % 7, ignore_eos=True))
    if ttft_slo_s is not None:
        request.ttft_slo_s = ttft_slo_s
    return request


def _run_clean(port: int, first_index: int) -> None:
    """REQUESTS_PER_HALF greedy requests, 4 at a time, that all succeed."""
    indices = range(first_index, first_index + REQUESTS_PER_HALF)
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda i: stream_tokens(port, _request(i)), indices))
    assert [len(tokens) for tokens, _, _ in outputs] == [2 + i % 7 for i in indices]


def _run_half(port: int, first_index: int) -> None:
    """REQUESTS_PER_HALF greedy requests, 4 at a time, every other one with its own (generous)
    TTFT SLO, then one that admission control must reject."""
    indices = range(first_index, first_index + REQUESTS_PER_HALF)
    with ThreadPoolExecutor(4) as pool:
        outputs = list(pool.map(lambda i: stream_tokens(port, _request(i, 30.0 if i % 2 else None)), indices))
    assert [len(tokens) for tokens, _, _ in outputs] == [2 + i % 7 for i in indices]
    with pytest.raises(grpc.RpcError) as error:
        stream_tokens(port, _request(first_index + REQUESTS_PER_HALF, ttft_slo_s=1e-9))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def _wait_for_scraped_totals(api: PrometheusApi, finished: int, rejected: int) -> None:
    _wait_until(lambda: (api.scalar("sum(splitserve_request_success_total)"),
                         api.scalar("sum(splitserve_admission_rejections_total)")) == (finished, rejected),
                30, f"a scrape showing {finished} finished and {rejected} rejected requests")


def _target_problem(api: PrometheusApi, target: dict, expr: str) -> str | None:
    """`expr`: the target's query as its dashboard sends it."""
    series = api.query(expr)
    if not series:
        return "no data"
    allowed = ValueRange.parse(target["range"])
    outside = [(s["metric"], s["value"][1]) for s in series if float(s["value"][1]) not in allowed]
    return f"outside {target['range']}: {outside}" if outside else None


def _quantile_problem(api: PrometheusApi, panel: dict, exprs: list[str]) -> str | None:
    """The panel's quantile targets are ordered (p50 <= p90 <= p99) for each label set."""
    by_quantile = sorted((target["quantile"], expr) for target, expr in zip(panel["targets"], exprs)
                         if "quantile" in target)
    values = [(q, {_labels(s): float(s["value"][1]) for s in api.query(expr)}) for q, expr in by_quantile]
    for (low_q, low), (high_q, high) in pairwise(values):
        if low.keys() != high.keys():
            return f"p{low_q} and p{high_q} have different series: {sorted(low)} vs {sorted(high)}"
        disordered = {labels: (low[labels], high[labels]) for labels in low if low[labels] > high[labels]}
        if disordered:
            return f"p{low_q} > p{high_q}: {disordered}"
    return None


def _labels(series: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in series["metric"].items() if k not in ("__name__", "quantile")))


def _panel_problems(api: PrometheusApi) -> dict[str, str]:
    problems, sent = {}, dashboard_exprs()
    for uid, panel in panels():
        exprs = sent[uid, panel["title"]]
        for target, expr in zip(panel["targets"], exprs):
            if (problem := _target_problem(api, target, expr)) is not None:
                problems[f"{uid} / {panel['title']} / {expr}"] = problem
        if (problem := _quantile_problem(api, panel, exprs)) is not None:
            problems[f"{uid} / {panel['title']}"] = problem
    return problems


def _queries_without_data(api: PrometheusApi) -> list[str]:
    """Every dashboard query that returns no series ("No data" on its panel)."""
    return [f"{uid} / {title} / {expr}" for (uid, title), exprs in dashboard_exprs().items() for expr in exprs
            if not api.query(expr)]


def test_every_panel_query_returns_plausible_data(prometheus_bin, tiny_llama_dir, tmp_path):
    # The planner runs (its panels need data) but may not change the pools: 1 to 1 workers each. LoRA is on (no
    # adapters: base-model requests) so the LoRA panel's workers report.
    config = tiny_cluster_config(tiny_llama_dir, prefill=1, decode=1, **{
        "router.metrics_port": 0, "router.slo.ttft_s": 30.0, "router.slo.tpot_s": 10.0, "planner.enabled": True,
        "planner.tick_s": 0.5, "planner.prefill.max_replicas": 1, "planner.decode.max_replicas": 1,
        "prefill.engine.enable_lora": True, "decode.engine.enable_lora": True})
    with running_cluster(config) as (cluster, _), \
            running_prometheus(prometheus_bin.server, _prometheus_config(cluster.metrics_port), tmp_path) as api:
        _wait_until(lambda: api.scalar('up{job="splitserve"}') == 1, 30, "the first scrape of the router")
        # A cluster that saw no error yet: every panel shows a value (0 where nothing happened), never "No data".
        _run_clean(cluster.port, 100)
        _wait_for_scraped_totals(api, REQUESTS_PER_HALF, 0)
        missing, deadline = _queries_without_data(api), time.monotonic() + 15  # rules lag a scrape by one evaluation
        while missing and time.monotonic() < deadline:
            time.sleep(0.5)
            missing = _queries_without_data(api)
        assert not missing, "No data:\n" + "\n".join(missing)
        _run_half(cluster.port, 0)
        _wait_for_scraped_totals(api, 2 * REQUESTS_PER_HALF, 1)
        _run_half(cluster.port, REQUESTS_PER_HALF + 1)
        _wait_for_scraped_totals(api, 3 * REQUESTS_PER_HALF, 2)
        problems = _panel_problems(api)
        deadline = time.monotonic() + 15  # recording rules see the last scrape one evaluation later
        while problems and time.monotonic() < deadline:
            time.sleep(0.5)
            problems = _panel_problems(api)
        assert not problems, "\n".join(f"{where}: {problem}" for where, problem in problems.items())
        rules = [rule for group in api.get("/api/v1/rules")["groups"] for rule in group["rules"]]
        assert len(rules) == len(RECORDING_RULES) + len(ALERTS)
        assert all(rule["health"] == "ok" for rule in rules), \
            [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"]
