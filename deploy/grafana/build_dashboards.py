"""Generate the Grafana dashboards from panels.yaml (the one way to make them).

Usage: `.venv/bin/python deploy/grafana/build_dashboards.py [--out DIR]`

Writes one `<uid>.json` per dashboard of panels.yaml into DIR (default: deploy/grafana/dashboards,
where they are checked in and where provisioning/dashboards/splitserve.yml points Grafana) and
removes any other `.json` there. Panels are laid out left to right, top to bottom, in file order.
The output is a pure function of panels.yaml: tests/test_prometheus_rules.py rebuilds into a
temporary directory and requires byte-identical files.

Every dashboard imports into any Grafana: it declares its Prometheus as an `__inputs` entry
(DS_PROMETHEUS, which the import dialog asks for) that sets the `datasource` variable every panel
and query uses; provisioned (provisioning/), the variable falls back to the default Prometheus.
The `cluster` and `model` variables (the labels the scrape config sets; "All" by default) filter
every selector of every query: `scoped()` adds the matchers, so panels.yaml stays plain PromQL.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

GRAFANA_DIR = Path(__file__).resolve().parent
PANELS = GRAFANA_DIR / "panels.yaml"
DASHBOARDS_DIR = GRAFANA_DIR / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
"""Every panel's and query's datasource: the `datasource` variable."""
DATASOURCE_INPUT = "DS_PROMETHEUS"
"""The `__inputs` entry a UI import asks for; it becomes the datasource variable's value."""
SCOPE = 'cluster=~"$cluster",model=~"$model"'
"""The matchers scoped() adds to every selector: the dashboard's cluster and model variables."""
_SELECTOR = re.compile(r'(?<![\w:"])([a-zA-Z_]\w*:[\w:]*|splitserve_\w+)(\{[^}]*\})?')
"""A metric (splitserve_*) or recording rule (level:metric:operations) and its matchers, if any."""
GRID_COLUMNS = 24
PANEL_HEIGHTS = {"timeseries": 8, "stat": 4}
"""Grid rows per panel type."""
DASHBOARD_KEYS = {"uid", "title", "description", "panels"}
PANEL_KEYS = {"title", "description", "unit", "type", "width", "stack", "no_value", "targets"}
TARGET_KEYS = {"expr", "legend", "range", "quantile", "target_line"}
"""range and quantile are read by the tests only (see panels.yaml)."""


def load_dashboards(path: Path = PANELS) -> list[dict]:
    """The dashboards of panels.yaml; raises ValueError naming any unknown or missing key."""
    dashboards = yaml.safe_load(path.read_text(encoding="utf-8"))["dashboards"]
    for dashboard in dashboards:
        _check_keys(dashboard, DASHBOARD_KEYS, {"uid", "title", "panels"}, dashboard.get("uid"))
        for panel in dashboard["panels"]:
            where = f"{dashboard['uid']} / {panel.get('title')}"
            _check_keys(panel, PANEL_KEYS, {"title", "unit", "targets"}, where)
            if panel.get("type", "timeseries") not in PANEL_HEIGHTS:
                raise ValueError(f"{where}: type must be one of {sorted(PANEL_HEIGHTS)}")
            for target in panel["targets"]:
                _check_keys(target, TARGET_KEYS, {"expr", "range"}, where)
    return dashboards


def _check_keys(item: dict, allowed: set[str], required: set[str], where: str | None) -> None:
    if unknown := set(item) - allowed:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    if missing := required - set(item):
        raise ValueError(f"{where}: missing keys {sorted(missing)}")


def scoped(expr: str) -> str:
    """expr with the cluster and model matchers on every metric and recording-rule selector."""
    def scope(match: re.Match) -> str:
        name, matchers = match[1], (match[2] or "{}")[1:-1].strip()
        return f"{name}{{{SCOPE}{',' + matchers if matchers else ''}}}"
    return _SELECTOR.sub(scope, expr)


def _inputs() -> list[dict]:
    return [{"name": DATASOURCE_INPUT, "label": "Prometheus", "description": "The Prometheus that scrapes splitserve "
             "(with deploy/prometheus/rules loaded)", "type": "datasource", "pluginId": "prometheus",
             "pluginName": "Prometheus"}]


def _templating() -> dict:
    """The datasource, cluster and model variables (cluster and model: multi-select, All by default)."""
    datasource = {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
                  "current": {"text": f"${{{DATASOURCE_INPUT}}}", "value": f"${{{DATASOURCE_INPUT}}}"},
                  "hide": 0, "refresh": 1, "regex": "", "options": []}
    return {"list": [datasource, _label_variable("cluster", "splitserve_worker_up"),
                     _label_variable("model", 'splitserve_worker_up{cluster=~"$cluster"}')]}


def _label_variable(label: str, series: str) -> dict:
    query = f"label_values({series}, {label})"
    return {"name": label, "label": label, "type": "query", "datasource": DATASOURCE,
            "query": {"query": query, "refId": f"{label}-values"}, "definition": query, "refresh": 2,
            "includeAll": True, "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"},
            "hide": 0, "sort": 1, "regex": "", "options": []}


def build_dashboard(dashboard: dict) -> dict:
    """Grafana's dashboard JSON model (schema 39) for one entry of panels.yaml."""
    return {
        "__inputs": _inputs(),
        "__requires": [{"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"}],
        "uid": dashboard["uid"],
        "title": dashboard["title"],
        "description": dashboard.get("description", ""),
        "tags": ["splitserve"],
        "links": [{"type": "dashboards", "tags": ["splitserve"], "asDropdown": True, "title": "splitserve"}],
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "schemaVersion": 39,
        "templating": _templating(),
        "panels": [_panel(index + 1, panel, grid_pos) for index, (panel, grid_pos)
                   in enumerate(zip(dashboard["panels"], _layout(dashboard["panels"])))],
    }


def _layout(panels: list[dict]) -> list[dict]:
    """gridPos of each panel: left to right, a new row when the next one does not fit."""
    positions, x, y, row_height = [], 0, 0, 0
    for panel in panels:
        width, height = panel.get("width", 12), PANEL_HEIGHTS[panel.get("type", "timeseries")]
        if x + width > GRID_COLUMNS:
            x, y, row_height = 0, y + row_height, 0
        positions.append({"h": height, "w": width, "x": x, "y": y})
        x, row_height = x + width, max(row_height, height)
    return positions


def _panel(panel_id: int, panel: dict, grid_pos: dict) -> dict:
    kind = panel.get("type", "timeseries")
    ref_ids = [chr(ord("A") + index) for index in range(len(panel["targets"]))]
    return {
        "id": panel_id,
        "type": kind,
        "title": panel["title"],
        "description": panel.get("description", ""),
        "datasource": DATASOURCE,
        "gridPos": grid_pos,
        "fieldConfig": {"defaults": _field_defaults(panel, kind), "overrides": [
            _target_line_override(ref_id) for ref_id, target in zip(ref_ids, panel["targets"])
            if target.get("target_line")]},
        "options": _options(kind),
        "targets": [{"refId": ref_id, "datasource": DATASOURCE, "expr": scoped(target["expr"].strip()),
                     "legendFormat": target.get("legend", "")}
                    for ref_id, target in zip(ref_ids, panel["targets"])],
    }


def _field_defaults(panel: dict, kind: str) -> dict:
    defaults = {"unit": panel["unit"]}
    if "no_value" in panel:
        defaults["noValue"] = panel["no_value"]
    if kind == "timeseries":
        stacking = "normal" if panel.get("stack") else "none"
        defaults["custom"] = {"stacking": {"mode": stacking, "group": "A"}, "fillOpacity": 10 if stacking == "none"
                              else 60, "showPoints": "never"}
    return defaults


def _target_line_override(ref_id: str) -> dict:
    """An SLO target: a dashed red line."""
    return {"matcher": {"id": "byFrameRefID", "options": ref_id},
            "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
                           {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                           {"id": "custom.fillOpacity", "value": 0}]}


def _options(kind: str) -> dict:
    if kind == "stat":
        return {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    return {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"}}


def build(out_dir: Path = DASHBOARDS_DIR, panels: Path = PANELS) -> list[Path]:
    """Write every dashboard into out_dir, remove other .json there; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for dashboard in load_dashboards(panels):
        path = out_dir / f"{dashboard['uid']}.json"
        path.write_text(json.dumps(build_dashboard(dashboard), indent=2) + "\n", encoding="utf-8")
        written.append(path)
    for stale in set(out_dir.glob("*.json")) - set(written):
        stale.unlink()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, default=DASHBOARDS_DIR,
                        help="output directory (default: deploy/grafana/dashboards)")
    args = parser.parse_args(argv)
    for path in build(args.out.resolve()):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
