"""Prometheus rules and scrape configs pass promtool (checks and rule unit tests); the Grafana
dashboards are generated from deploy/grafana/panels.yaml and current; every query names only
metrics of common/metrics.py or recording rules, and every metric and rule is used."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from splitserve.common.metrics import ALL_METRICS, COUNTER, HISTOGRAM, MetricDef

REPO = Path(__file__).resolve().parents[1]
PROMETHEUS_DIR = REPO / "deploy" / "prometheus"
RULE_FILES = (PROMETHEUS_DIR / "rules" / "splitserve-recording.yml", PROMETHEUS_DIR / "rules" / "splitserve-alerts.yml")
RULE_TESTS = (PROMETHEUS_DIR / "tests" / "alerts_test.yml", PROMETHEUS_DIR / "tests" / "recording_test.yml")
GRAFANA_DIR = REPO / "deploy" / "grafana"
PANELS = GRAFANA_DIR / "panels.yaml"


# ---- panels.yaml, shared with tests/test_prometheus_integration.py --------------------------
def panels() -> list[tuple[str, dict]]:
    """(dashboard uid, panel) for every panel of panels.yaml, in file order."""
    dashboards = yaml.safe_load(PANELS.read_text(encoding="utf-8"))["dashboards"]
    return [(dashboard["uid"], panel) for dashboard in dashboards for panel in dashboard["panels"]]


def dashboard_exprs() -> dict[tuple[str, str], list[str]]:
    """Each panel's queries as the generated dashboards send them with every variable at "All"
    (cluster and model match anything), by (dashboard uid, panel title)."""
    exprs = {}
    for path in sorted((GRAFANA_DIR / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        for panel in dashboard["panels"]:
            exprs[dashboard["uid"], panel["title"]] = [
                target["expr"].replace('"$cluster"', '".*"').replace('"$model"', '".*"') for target in panel["targets"]]
    return exprs


@dataclass(frozen=True)
class ValueRange:
    """A target's `range` in panels.yaml: an interval such as "[0, 1]" or "(0, inf)"."""

    low: float
    high: float
    low_closed: bool
    high_closed: bool

    _SYNTAX = re.compile(r"([\[(])\s*(-?inf|-?[\d.]+)\s*,\s*(-?inf|-?[\d.]+)\s*([\])])")

    @classmethod
    def parse(cls, text: str) -> ValueRange:
        match = cls._SYNTAX.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"not an interval like '[0, 1]' or '(0, inf)': {text!r}")
        opening, low, high, closing = match.groups()
        return cls(float(low), float(high), opening == "[", closing == "]")

    def __contains__(self, value: float) -> bool:  # NaN is in no range
        above = value >= self.low if self.low_closed else value > self.low
        below = value <= self.high if self.high_closed else value < self.high
        return above and below


# ---- names used by PromQL expressions --------------------------------------------------------
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_SELECTORS_AND_RANGES = re.compile(r"\{[^}]*\}|\[[^\]]*\]")
_GROUPINGS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_CALLS = re.compile(r"\b[a-z_]+\s*\(")
_NAMES = re.compile(r"(?<![\w.:])[a-zA-Z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def metric_names(expr: str) -> set[str]:
    """Metric and recording-rule names an expression reads (label names, functions, keywords,
    strings and durations removed)."""
    text = _SELECTORS_AND_RANGES.sub(" ", _STRINGS.sub(" ", expr))
    text = _CALLS.sub(" ", _GROUPINGS.sub(" ", text))
    return {name for name in _NAMES.findall(text) if name.lower() not in _KEYWORDS}


def exposed_names(definition: MetricDef) -> set[str]:
    """The series names a scrape shows for one definition."""
    if definition.kind == HISTOGRAM:
        return {definition.name + suffix for suffix in ("_bucket", "_sum", "_count")}
    return {definition.name + "_total" if definition.kind == COUNTER else definition.name}


def _rules(path: Path) -> list[dict]:
    return [rule for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"] for rule in group["rules"]]


RECORDING_RULES = _rules(RULE_FILES[0])
ALERTS = _rules(RULE_FILES[1])
RECORDED = {rule["record"] for rule in RECORDING_RULES}
EXPORTED = set().union(*map(exposed_names, ALL_METRICS))
PANEL_EXPRS = [target["expr"] for _, panel in panels() for target in panel["targets"]]


def test_metric_names_finds_metrics_and_rules_only():
    expr = ('histogram_quantile(0.99, sum by (cluster, le) (rate(a_bucket{phase="x", le=~"1e-9"}[1m])))'
            ' / ignoring(quantile) (b:c:rate5m offset 5m > 0) or on() vector(1e-9) * 14.4 and bool d')
    assert metric_names(expr) == {"a_bucket", "b:c:rate5m", "d"}


# ---- promtool ----------------------------------------------------------------------------
def _promtool(prometheus_bin, *args: str) -> str:
    done = subprocess.run([prometheus_bin.promtool, *args], capture_output=True, text=True, cwd=PROMETHEUS_DIR,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_rules_pass_promtool_check(prometheus_bin):
    output = _promtool(prometheus_bin, "check", "rules", *map(str, RULE_FILES))
    assert f"SUCCESS: {len(RECORDING_RULES)} rules found" in output
    assert f"SUCCESS: {len(ALERTS)} rules found" in output


def test_rule_unit_tests_pass(prometheus_bin):
    output = _promtool(prometheus_bin, "test", "rules", *map(str, RULE_TESTS))
    assert output.count("SUCCESS") == len(RULE_TESTS), output


def _unit_tests(path: Path) -> list[dict]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))["tests"]


def test_every_alert_and_recording_rule_has_a_unit_test():
    tested_alerts = {case["alertname"] for test in _unit_tests(RULE_TESTS[0]) for case in test["alert_rule_test"]}
    assert tested_alerts == {rule["alert"] for rule in ALERTS}
    # A rule is covered when a unit test evaluates it, or a covered rule reads it.
    covered = {case["expr"] for test in _unit_tests(RULE_TESTS[1]) for case in test["promql_expr_test"]}
    for rule in reversed(RECORDING_RULES):  # a rule reads only rules above it
        if rule["record"] in covered:
            covered |= metric_names(rule["expr"])
    assert RECORDED <= covered, sorted(RECORDED - covered)


def test_scrape_configs_pass_promtool_check(prometheus_bin, tmp_path):
    assert "SUCCESS: prometheus.yml is valid" in _promtool(prometheus_bin, "check", "config", "prometheus.yml")
    # Debian's Prometheus is built without Kubernetes discovery: check the KubeRay config with a
    # static target in its place (its relabeling, rule files and the rest are checked as they are).
    config = yaml.safe_load((PROMETHEUS_DIR / "kuberay-scrape.yml").read_text(encoding="utf-8"))
    (job,) = config["scrape_configs"]
    assert [sd["role"] for sd in job.pop("kubernetes_sd_configs")] == ["pod"]
    job["static_configs"] = [{"targets": ["10.0.0.1:9400"]}]
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    (tmp_path / "kuberay.yml").write_text(yaml.safe_dump(config))
    assert "SUCCESS" in _promtool(prometheus_bin, "check", "config", str(tmp_path / "kuberay.yml"))
    for name in ("prometheus.yml", "kuberay-scrape.yml"):
        config = yaml.safe_load((PROMETHEUS_DIR / name).read_text(encoding="utf-8"))
        assert [PROMETHEUS_DIR / path for path in config["rule_files"]] == list(RULE_FILES), name
        assert [job["job_name"] for job in config["scrape_configs"]] == ["splitserve"], name  # alerts use it


# ---- the Prometheus Operator's PrometheusRule -------------------------------------------------
PROMETHEUS_RULE = REPO / "deploy" / "kuberay" / "prometheusrule.yaml"


def test_prometheus_rule_object_is_current(tmp_path):
    out = tmp_path / "prometheusrule.yaml"
    done = subprocess.run([sys.executable, str(PROMETHEUS_DIR / "build_prometheusrule.py"), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == PROMETHEUS_RULE.read_bytes(), \
        "deploy/kuberay/prometheusrule.yaml is stale: run `.venv/bin/python deploy/prometheus/build_prometheusrule.py`"


def test_prometheus_rule_object_holds_exactly_the_rule_files(prometheus_bin, tmp_path):
    """Its groups are the rule files' groups, in order, and pass promtool as a rule file."""
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text(encoding="utf-8"))
    assert (rule["apiVersion"], rule["kind"], rule["metadata"]["name"]) == (
        "monitoring.coreos.com/v1", "PrometheusRule", "splitserve")
    groups = [group for path in RULE_FILES for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]]
    assert rule["spec"]["groups"] == groups
    extracted = tmp_path / "groups.yml"
    extracted.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    assert f"SUCCESS: {len(RECORDING_RULES) + len(ALERTS)} rules found" in _promtool(
        prometheus_bin, "check", "rules", str(extracted))


# ---- names -------------------------------------------------------------------------------
@pytest.mark.parametrize("source", ["panels", "recording rules", "alerts"])
def test_every_query_names_only_exported_metrics_or_recording_rules(source):
    exprs = {"panels": PANEL_EXPRS, "recording rules": [rule["expr"] for rule in RECORDING_RULES],
             "alerts": [rule["expr"] for rule in ALERTS]}[source]
    known = EXPORTED | RECORDED | {"up"}  # up: Prometheus' own per-target series
    unknown = {name: expr for expr in exprs for name in metric_names(expr) - known}
    assert not unknown, unknown


def test_every_metric_is_on_a_dashboard_or_in_a_rule():
    used = set().union(*map(metric_names, PANEL_EXPRS + [rule["expr"] for rule in RECORDING_RULES + ALERTS]))
    unused = [definition.name for definition in ALL_METRICS if not exposed_names(definition) & used]
    assert not unused


def test_every_recording_rule_is_read_by_a_panel_an_alert_or_a_rule():
    readers = PANEL_EXPRS + [rule["expr"] for rule in RECORDING_RULES + ALERTS]
    assert RECORDED <= set().union(*map(metric_names, readers))


# ---- Grafana -----------------------------------------------------------------------------
def _json_files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in directory.glob("*.json")}


def test_checked_in_dashboards_are_current(tmp_path):
    done = subprocess.run([sys.executable, str(GRAFANA_DIR / "build_dashboards.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    fresh, checked_in = _json_files(tmp_path), _json_files(GRAFANA_DIR / "dashboards")
    stale = sorted(name for name in fresh.keys() | checked_in.keys() if fresh.get(name) != checked_in.get(name))
    assert not stale, (f"dashboards are stale ({', '.join(stale)}): "
                       "run `.venv/bin/python deploy/grafana/build_dashboards.py`")
    assert sorted(fresh) == ["splitserve-decode.json", "splitserve-kv-transfer.json", "splitserve-planner.json",
                             "splitserve-prefill.json", "splitserve-routing.json", "splitserve-slo.json"]


def test_dashboards_import_anywhere_and_filter_by_cluster_and_model():
    """UI import: one `__inputs` datasource that sets the `datasource` variable, which every panel
    and query uses; `cluster` and `model` variables (All by default) in every selector."""
    (datasource,) = yaml.safe_load((GRAFANA_DIR / "provisioning/datasources/splitserve.yml").read_text())["datasources"]
    assert (datasource["type"], datasource["isDefault"]) == ("prometheus", True)  # the provisioned variable's pick
    for name, text in _json_files(GRAFANA_DIR / "dashboards").items():
        dashboard = json.loads(text)
        assert name == f"{dashboard['uid']}.json"
        assert [(i["name"], i["type"], i["pluginId"]) for i in dashboard["__inputs"]] == [
            ("DS_PROMETHEUS", "datasource", "prometheus")]
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert list(variables) == ["datasource", "cluster", "model"]
        assert (variables["datasource"]["type"], variables["datasource"]["query"],
                variables["datasource"]["current"]["value"]) == ("datasource", "prometheus", "${DS_PROMETHEUS}")
        for label in ("cluster", "model"):
            variable = variables[label]
            assert (variable["type"], variable["includeAll"], variable["allValue"], variable["datasource"]["uid"],
                    variable["definition"].startswith("label_values(splitserve_worker_up")) == (
                "query", True, ".*", "${datasource}", True)
        ids = [panel["id"] for panel in dashboard["panels"]]
        assert ids == list(range(1, len(ids) + 1)), name
        for panel in dashboard["panels"]:
            sources = [panel["datasource"], *(target["datasource"] for target in panel["targets"])]
            assert {(source["type"], source["uid"]) for source in sources} == {("prometheus", "${datasource}")}
            for target in panel["targets"]:
                _assert_every_selector_scoped(target["expr"])


_SELECTOR = re.compile(r'(?<![\w:"])([a-zA-Z_]\w*:[\w:]*|splitserve_\w+)(\{[^}]*\})?')


def _assert_every_selector_scoped(expr: str) -> None:
    selectors = _SELECTOR.findall(_STRINGS.sub(lambda m: m[0] if "$" in m[0] else '""', expr))
    assert selectors, expr
    for name, matchers in selectors:
        assert matchers.startswith('{cluster=~"$cluster",model=~"$model"'), (name, expr)


def test_scoped_adds_the_variables_to_every_selector():
    spec = importlib.util.spec_from_file_location("build_dashboards", GRAFANA_DIR / "build_dashboards.py")
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)  # a script, not a package module
    scoped = builder.scoped
    expr = ('sum by (cluster, le) (rate(a:b:c{le="1"}[1m])) / on (cluster) splitserve_x_total'
            ' or histogram_quantile(0.5, splitserve_y_bucket{})')
    assert scoped(expr) == (
        'sum by (cluster, le) (rate(a:b:c{cluster=~"$cluster",model=~"$model",le="1"}[1m])) / on (cluster) '
        'splitserve_x_total{cluster=~"$cluster",model=~"$model"} or histogram_quantile(0.5, '
        'splitserve_y_bucket{cluster=~"$cluster",model=~"$model"})')


def test_every_panel_target_has_a_valid_range_and_quantile():
    for uid, panel in panels():
        for target in panel["targets"]:
            ValueRange.parse(target["range"])
            assert 0 < target.get("quantile", 0.5) < 1, (uid, panel["title"])
        assert len({target["expr"] for target in panel["targets"]}) == len(panel["targets"]), (uid, panel["title"])


def test_value_range():
    closed, open_ = ValueRange.parse("[0, 1]"), ValueRange.parse("(0, inf)")
    assert [value in closed for value in (0.0, 1.0, -0.1, 1.1, float("nan"))] == [True, True, False, False, False]
    assert [value in open_ for value in (0.0, 1e-9, 1e300, float("inf"))] == [False, True, True, False]
    with pytest.raises(ValueError, match="not an interval"):
        ValueRange.parse("0..1")


def test_slo_panels_say_no_slo_set_instead_of_100_percent(prometheus_bin, tmp_path):
    """Every SLO panel's queries, by promtool against two clusters whose every request "met" its
    SLO: one with a default target (its value), one without (nothing: the panel's no_value)."""
    slo_panels = [panel for _, panel in panels() if panel.get("no_value") == "no SLO set"]
    assert [panel["title"] for panel in slo_panels] == [
        "SLO attainment, both targets (5m)", "Goodput (5m)", "Goodput tokens (5m)", "SLO attainment (5m)"]
    counters = ("slo_requests", "slo_ttft_met_requests", "slo_tpot_met_requests", "slo_met_requests", "goodput_tokens")
    series = [{"series": f'splitserve_{name}_total{{cluster="{cluster}"}}', "values": "0+60x10"}
              for cluster in ("set", "unset") for name in counters]
    series += [{"series": f'splitserve_slo_target_seconds{{cluster="set", slo="{slo}"}}', "values": "1x10"}
               for slo in ("ttft", "tpot")]
    cases = [{"expr": target["expr"], "eval_time": "10m",
              "exp_samples": [{"labels": _first_name(target["expr"]) + '{cluster="set"}', "value": 1.0}]}
             for panel in slo_panels for target in panel["targets"]]
    test_file = tmp_path / "slo_panels_test.yml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(RULE_FILES[0])], "evaluation_interval": "1m",
                                         "tests": [{"interval": "1m", "input_series": series,
                                                    "promql_expr_test": cases}]}))
    assert "SUCCESS" in _promtool(prometheus_bin, "test", "rules", str(test_file))


def _first_name(expr: str) -> str:
    return expr.split()[0]
