"""What the docs state that can drift from the code, checked against the code: docs/configuration.md's
flag table, reference defaults and example errors; `serve --help`'s stated defaults; the metric names,
labels and label values the docs give; the Prometheus alert and recording-rule tables; the access-log and
lora_requests_info example lines; and, in every doc, the flags of `splitserve <command>` lines, dotted
config keys, cluster-config YAML blocks and relative links. A new user runs these literally, so each
check reads the doc's own text, not a copy of it."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from splitserve.common import metrics as m
from splitserve.common.config import EngineConfig
from splitserve.deploy.cli import build_parser, serve_overrides
from splitserve.deploy.cluster_config import (DEFAULT_DECODE_ENGINE, DEFAULT_PREFILL_ENGINE, ClusterConfig,
                                              ClusterConfigError, apply_overrides, default_cluster_config,
                                              dump_cluster_config)
from splitserve.router.access_log import access_fields, text_line
from tests.factories import MetricsSources, make_load_report, make_request_record

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONFIGURATION = (DOCS / "configuration.md").read_text(encoding="utf-8")


def _table(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line starts with `header`, as cells (`\\|` kept as `|`)."""
    lines = text[text.index(header):].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        rows.append([cell.strip().replace("\\|", "|") for cell in cells])
    return rows


def _section(text: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of any level."""
    start = text.index(heading + "\n") + len(heading)
    following = re.search(r"^#{1,6} ", text[start:], re.M)
    return text[start:start + following.start()] if following else text[start:]


# ---- docs/configuration.md: the flag table ---------------------------------------------------------------------

SERVE = build_parser()._subparsers._group_actions[0].choices["serve"]
NOT_IN_THE_FLAG_TABLE = {"-h", "--help", "--config", "--set"}
"""Flags the table leaves to the numbered list above it (the file and --set layers) and argparse's help."""
FLAG_ROWS = _table(CONFIGURATION, "| flag | override |")


def _row_flags(cell: str) -> set[str]:
    """The flags a table cell's code spans name (`--kv-cache-memory BYTES` names --kv-cache-memory)."""
    return {flag for span in re.findall(r"`([^`]*)`", cell)
            for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", span)}


def test_the_flag_table_names_every_serve_flag_and_only_those():
    documented = set().union(*(_row_flags(row[0]) for row in FLAG_ROWS))
    parsed = {option for action in SERVE._actions for option in action.option_strings}
    assert sorted(documented - parsed) == []
    assert sorted(parsed - documented - NOT_IN_THE_FLAG_TABLE) == []


def _config_keys() -> set[str]:
    """Every dotted key of the cluster config, sections included (router.tls, router.tls.cert_file, ...)."""

    def walk(kind: type, prefix: str) -> set[str]:
        keys = set()
        for name, hint in typing.get_type_hints(kind).items():
            keys.add(prefix + name)
            for candidate in (hint, *typing.get_args(hint)):
                if dataclasses.is_dataclass(candidate):
                    keys |= walk(candidate, prefix + name + ".")
        return keys

    return walk(ClusterConfig, "")


CONFIG_KEYS = _config_keys()


def _documented_keys(cell: str) -> set[str]:
    """The config keys a table cell names: `{prefill,decode}.engine.x` is both pools', `.y` continues the previous
    key's section, `key: value` names key; backticked words that are no config key (values) are left out."""
    keys: set[str] = set()
    sections = [""]
    for token in re.findall(r"`([^`]*)`", cell):
        token = token.split(":")[0].strip()
        if token.startswith("."):
            names = [section + token[1:] for section in sections]
        else:
            pools = re.match(r"\{prefill,decode\}\.(.*)", token)
            names = [f"prefill.{pools[1]}", f"decode.{pools[1]}"] if pools else [token]
        known = [name for name in names if name in CONFIG_KEYS or name.endswith(".*")]
        if known:
            keys |= set(known)
            sections = [name.rpartition(".")[0] + "." if "." in name else "" for name in known]
    return keys


def _sample_argv(action) -> list[str]:
    """A command line that gives the flag a value its type takes, for serve_overrides."""
    flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, str(list(action.choices)[0])]
    samples = {"_json_strings": '["x"]', "_json_object": '{"temperature": 0.5}',
               "_speculative_json": '{"method": "ngram"}', "_pooler_json": '{"pooling_type": "MEAN"}',
               "--long-prefill-token-threshold": "0",
               "--tensor-parallel-size": "1", "--pipeline-parallel-size": "1"}
    kind = getattr(action.type, "__name__", "")
    return [flag, samples.get(kind, samples.get(flag, "2"))]


def _keys_set_by(argv: list[str]) -> set[str] | None:
    """The config keys a serve command line sets; None when argparse refuses it."""
    try:
        args = build_parser().parse_args(["serve", *argv])
    except SystemExit:
        return None
    return set(serve_overrides(args)) | ({"model"} if args.model or args.model_tag else set())


@pytest.mark.parametrize("row", FLAG_ROWS, ids=[row[0][:40] for row in FLAG_ROWS])
def test_each_flag_sets_the_keys_its_row_names(row):
    actions = {option: action for action in SERVE._actions for option in action.option_strings}
    flags = _row_flags(row[0])
    argvs = [_sample_argv(actions[flag]) for flag in sorted(flags)]
    if row[0].startswith("`MODEL`"):
        argvs.append(["/models/m"])
    results = [_keys_set_by(argv) for argv in argvs]
    if row[1].startswith("none: refused"):
        assert results == [None] * len(argvs)
        return
    set_keys = set().union(*results)
    expected = set() if row[1].startswith("none") else _documented_keys(row[1])
    wildcards = {key for key in expected if key.endswith(".*")}
    matched = {key for key in set_keys for wildcard in wildcards if key.startswith(wildcard[:-1])}
    assert set_keys - matched == expected - wildcards
    assert not wildcards or matched


# ---- docs/configuration.md: the reference tables ---------------------------------------------------------------

DEFAULTS = yaml.safe_load(dump_cluster_config(default_cluster_config("default")))
NO_VALUE = {"required", "", "see below", "per pool, above", "required in `tls`", "`null` each",
            "see [below](#planner)"}
"""Default cells that state no value: required keys and sections documented elsewhere."""
REFERENCE_TABLES = {"### Top level": ("",), "### `router`": ("router.",),
                    "### `prefill` and `decode`": ("prefill.", "decode."), "### `planner`": ("planner.",)}
"""Each reference table's heading and the prefixes its keys are under."""


def _lookup(tree: object, key: str) -> object:
    """The default at a dotted key; None inside a section that is null by default (router.tls)."""
    for part in key.split("."):
        tree = None if tree is None else tree[part]
    return tree


def _value(cell: str) -> object:
    """A table cell's value as YAML reads it (`null`, `30`, `["*"]`)."""
    value = yaml.safe_load(cell.strip().strip("`"))
    if isinstance(value, str) and re.fullmatch(r"[\d.]+e-?\d+", value):  # YAML 1.1 reads 5e-06 (no dot) as a string
        value = float(value)
    return value


def _reference_rows():
    """(prefix, keys, default cell) of each reference table row; `a.b`, `.c` is a.b and a.c."""
    for heading, prefixes in REFERENCE_TABLES.items():
        for row in _table(_section(CONFIGURATION, heading), "| key | default | meaning |"):
            names = [name.strip("` ") for name in row[0].split(",")]
            names = [names[0]] + [names[0].rpartition(".")[0] + name if name.startswith(".") else name
                                  for name in names[1:]]
            for prefix in prefixes:
                yield prefix, names, row[1]


def test_the_reference_tables_give_every_key_its_default():
    wrong, seen = [], set()
    for prefix, names, default in _reference_rows():
        seen |= {prefix + name for name in names}
        if default in NO_VALUE:
            continue
        values = [_value(cell) for cell in default.split(", ")] if len(names) > 1 else [_value(default)]
        for name, value in zip(names, values, strict=True):
            actual = _lookup(DEFAULTS, prefix + name.removesuffix(".*"))
            if actual != value:
                wrong.append((prefix + name, value, actual))
    assert wrong == []
    # the engine's fields (listed below the pool table) and the planner's profile (a paragraph) aside
    leaves = {key for key in _leaf_keys(DEFAULTS) if ".engine." not in key and ".profile." not in key
              and ".overrides." not in key}
    assert sorted(leaves - seen) == []


def _leaf_keys(tree: dict, prefix: str = "") -> set[str]:
    """The dotted keys of a config's settings (not its sections)."""
    keys = set()
    for name, value in tree.items():
        keys |= _leaf_keys(value, prefix + name + ".") if isinstance(value, dict) else {prefix + name}
    return keys


def test_the_engine_fields_paragraph_names_every_engine_field():
    paragraph = CONFIGURATION[CONFIGURATION.index("`engine` fields:"):CONFIGURATION.index("### `planner`")]
    named = set(re.findall(r"`(\w+)`", paragraph))
    assert sorted(field.name for field in dataclasses.fields(EngineConfig) if field.name not in named) == []


def test_the_planner_profile_paragraph_gives_each_field_its_default():
    paragraph = CONFIGURATION[CONFIGURATION.index("`profile` fields"):CONFIGURATION.index("## Rules checked")]
    documented = {name: float(value) for name, value in re.findall(r"`(\w+)` \(([\d.]+)\)", paragraph)}
    assert documented == {name: float(value) for name, value in DEFAULTS["planner"]["profile"].items()}


def test_the_pool_defaults_table_is_the_pools_defaults():
    sizes = {"256 MiB": 256 << 20, "2 GiB": 2 << 30}
    for setting, prefill, decode, _ in _table(CONFIGURATION, "| setting | prefill | decode | engine default |")[:3]:
        name = setting.strip("`")
        assert (getattr(DEFAULT_PREFILL_ENGINE, name), getattr(DEFAULT_DECODE_ENGINE, name)) == (
            sizes.get(prefill, prefill if not prefill.isdigit() else int(prefill)),
            sizes.get(decode, decode if not decode.isdigit() else int(decode)))


ERROR_EXAMPLES = {
    "decode.engine.max_num_seqs: must be >= 1, got 0": {"decode.engine.max_num_seqs": 0},
    "prefill.engin: unknown key": {"prefill.engin.block_size": 16},
    "router.grpc_port: must be an integer, got '50051'": {"router.grpc_port": "50051"},
    "prefill.replicas: must be 0 in colocated mode": {"mode": "colocated", "prefill.replicas": 1},
    "decode.engine.block_size: must equal": {"decode.engine.block_size": 32},
}
"""Each example error line of "Rules checked when loading", by its start, and the overrides that make it."""


def test_the_example_errors_are_the_errors_those_configs_get():
    block = CONFIGURATION[CONFIGURATION.index("naming the full path of the offending key:"):]
    start = block.index("```\n") + 4
    lines = block[start:block.index("\n```", start)].splitlines()
    makers = [next(overrides for prefix, overrides in ERROR_EXAMPLES.items() if line.startswith(prefix))
              for line in lines]
    assert makers == list(ERROR_EXAMPLES.values())
    for line, overrides in zip(lines, makers, strict=True):
        with pytest.raises(ClusterConfigError) as error:
            apply_overrides(default_cluster_config("default"), overrides)
        assert str(error.value) == line


# ---- metrics: names and labels the docs state --------------------------------------------------------------------

EXPOSED = {definition.exposed_name: definition for definition in m.ALL_METRICS}
SERIES = set(EXPOSED) | {name + suffix for name, definition in EXPOSED.items() if definition.kind == m.HISTOGRAM
                         for suffix in ("_bucket", "_sum", "_count")}
PROSE = [ROOT / "README.md", ROOT / "deploy" / "README.md", ROOT / "bench" / "README.md", *sorted(DOCS.glob("*.md"))]


def test_every_metric_name_in_the_docs_is_one_the_router_exports():
    unknown = set()
    for path in PROSE:
        text = path.read_text(encoding="utf-8")
        # recording rules (level:metric:operations) and the C++ ops' namespace are not series
        for match in re.finditer(r"(?<![\w:])splitserve_[a-z0-9_]*[a-z0-9](?![\w:])", text):
            if match[0] not in SERIES and match[0] != "splitserve_cpu":
                unknown.add((path.name, match[0]))
    assert sorted(unknown) == []


def _named_metrics(line: str) -> set[str]:
    """The metrics a line names; after a full name, `_x` shortens one that shares its first word
    (`splitserve_prefix_cache_queries_total`, `_hits_total`)."""
    names, first = set(), None
    for name in re.findall(r"`(splitserve_\w+|_[a-z]\w*)", line):
        if name.startswith("splitserve_"):
            first = name
            names.add(name)
        elif first is not None:
            names.add(_expand(first, name))
    return names


def test_every_metric_is_documented():
    text = (DOCS / "observability.md").read_text(encoding="utf-8") + (DOCS / "planner.md").read_text(encoding="utf-8")
    named = set().union(*(_named_metrics(line) for line in text.splitlines()))
    assert [name for name in EXPOSED if name not in named] == []


def test_the_labels_the_docs_give_are_the_metrics_labels():
    stated = {}
    for path in (DOCS / "observability.md", DOCS / "planner.md", ROOT / "README.md"):
        for name, labels in re.findall(r"`(splitserve_\w+)\{([a-z_,]+)\}", path.read_text(encoding="utf-8")):
            stated[name] = set(labels.split(","))
    assert {name: set(EXPOSED[name].labels) for name in stated} == stated


def test_the_per_worker_table_lists_worker_metrics():
    observability = (DOCS / "observability.md").read_text(encoding="utf-8")
    rows = _table(observability[observability.index("Per worker (labels"):], "| metric | type | meaning |")
    for row in rows:
        for name in _named_metrics(row[0]):
            definition = EXPOSED[name]
            expected = ("worker",) if "label `worker`" in row[2] else m.WORKER_LABELS
            assert definition.labels[:len(expected)] == expected, name
            assert row[1] == definition.kind, name


def _expand(first: str, short: str) -> str:
    """`_hits_total` after `splitserve_prefix_cache_queries_total` is `splitserve_prefix_cache_hits_total`: the short
    name replaces the fewest trailing words of the full one that make a series."""
    cuts = [index for index, char in enumerate(first) if char == "_" and index > len("splitserve")]
    expanded = [name for name in (*(first[:index] + short for index in reversed(cuts)), first + short)  # or `_sum`
                if name in SERIES]
    assert expanded, (first, short)
    return expanded[0]


# ---- Prometheus rules and alerts ---------------------------------------------------------------------------------

def _rules(kind: str) -> set[str]:
    names = set()
    for path in (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"):
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]:
            names |= {rule[kind] for rule in group["rules"] if kind in rule}
    return names


PROMETHEUS_GRAFANA = (DOCS / "prometheus_grafana.md").read_text(encoding="utf-8")


def test_the_alert_table_is_every_alert():
    documented = {row[0].strip("`") for row in _table(PROMETHEUS_GRAFANA, "| alert | fires when | severity |")}
    assert documented == _rules("alert")


def _brace_expansions(name: str) -> set[str]:
    group = re.search(r"\{([^}]*)\}", name)
    if group is None:
        return {name}
    return set().union(*(_brace_expansions(name[:group.start()] + option + name[group.end():])
                         for option in group[1].split(",")))


def test_the_recording_rule_table_is_every_recording_rule():
    documented = set()
    for row in _table(PROMETHEUS_GRAFANA, "| rule | meaning |"):
        for name in re.findall(r"`([^`]+)`", row[0]):
            documented |= _brace_expansions(name.split("{quantile")[0])
    # `<histogram>`: what its row names, "TTFT, ITL, TPOT, e2e latency (KV transfer: p50/p99)"
    histograms = ("splitserve_time_to_first_token_seconds", "splitserve_inter_token_latency_seconds",
                  "splitserve_time_per_output_token_seconds", "splitserve_e2e_request_latency_seconds",
                  "splitserve_kv_transfer_seconds")
    documented = {name.replace("<histogram>", histogram) for name in documented for histogram in histograms}
    assert documented == _rules("record")


# ---- the access log --------------------------------------------------------------------------------------------

def test_the_observability_access_log_example_is_a_line_the_router_writes():
    observability = (DOCS / "observability.md").read_text(encoding="utf-8")
    example = re.search(r"INFO splitserve\.access: (request .*)", observability)[1]
    record = make_request_record(
        "r-17", finish_reason="length", num_prompt_tokens=128, num_cached_tokens=96, num_output_tokens=64,
        ttft_s=0.0212, inter_token_latencies=(0.0061,) * 63, e2e_s=0.4057, prefill_worker="prefill-0",
        decode_worker="decode-1", num_migrations=0)
    assert text_line(access_fields(record)) == example
    assert 'request "<id>" status="OK" finish_reason="stop" prompt_tokens=' in CONFIGURATION


# ---- every doc: commands, config keys, links ---------------------------------------------------------------------

COMMANDS = build_parser()._subparsers._group_actions[0].choices


def _command_lines(text: str) -> list[str]:
    """Lines of code blocks and inline code spans that run `splitserve <command>` (continuations joined)."""
    spans = re.findall(r"```\w*\n(.*?)```", text, re.S) + re.findall(r"`(splitserve [^`]+)`", text)
    return [line for span in spans for line in span.replace("\\\n", " ").splitlines() if "splitserve " in line]


def test_every_flag_a_documented_command_gives_is_one_of_that_command():
    unknown = []
    for path in PROSE:
        for line in _command_lines(path.read_text(encoding="utf-8")):
            command = re.search(r"splitserve ([a-z-]+)\b(.*)", line)
            if command is None or command[1] not in COMMANDS:
                continue
            options = {option for action in COMMANDS[command[1]]._actions for option in action.option_strings}
            arguments = command[2] if command[1] == "serve" else command[2].split("#")[0]  # `# comment` after a command
            unknown += [(path.name, command[1], flag) for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", arguments)
                        if flag not in options]
    assert unknown == []


def test_every_dotted_config_key_the_docs_name_exists():
    engine_fields = {field.name for field in dataclasses.fields(EngineConfig)}
    unknown = set()
    for path in PROSE:
        text = path.read_text(encoding="utf-8")
        keys = re.findall(r"`((?:router|prefill|decode|planner)\.[a-z_.]*[a-z_])", text)
        for key in keys + re.findall(r"--set ([a-z_.]*[a-z_])=", text):
            pool_engine = re.match(r"(?:prefill|decode)\.engine\.(\w+)", key)
            known = (pool_engine[1] in engine_fields if pool_engine
                     else key in CONFIG_KEYS or f"planner.{key}" in CONFIG_KEYS)  # the planner table's own keys
            if not known:
                unknown.add((path.name, key))
    assert sorted(unknown) == []


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_relative_link_and_anchor_resolves():
    pages = [*PROSE, *sorted((ROOT / "deploy").rglob("*.md"))]
    outside_code = {path.resolve(): re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
                    for path in pages}
    anchors = {path: {_anchor(heading) for heading in re.findall(r"^#+ (.*)$", text, re.M)}
               for path, text in outside_code.items()}
    broken = []
    for path, text in outside_code.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors.get(linked, set())):
                broken.append((path.name, target))
    assert broken == []


def test_every_cluster_config_yaml_block_in_the_docs_loads():
    """Each ```yaml block of README.md and docs/ is a cluster config (or a part of one, under model: default); the TLS
    example names files under /etc that only its reader has, which loading checks, naming the first."""
    from splitserve.deploy.cluster_config import parse_cluster_config

    outcomes = []
    for path in PROSE:
        if path.parent.name == "deploy":  # Kubernetes manifests, validated by deploy/kuberay/validate.py
            continue
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            text = block if "model" in yaml.safe_load(block) else "model: default\n" + block
            try:
                parse_cluster_config(text)
                outcomes.append("ok")
            except ClusterConfigError as error:
                outcomes.append(str(error))
    assert sorted(set(outcomes)) == ["ok", "router.tls.cert_file: must name an existing file, got "
                                           "'/etc/splitserve/tls/server.crt'"]
    assert outcomes.count("ok") == 4


@pytest.mark.parametrize("metric, values", [
    ("splitserve_request_failure_total{code}", m.FAILURE_CODES),
    ("splitserve_admission_rejections_total{reason}", m.REJECTION_REASONS),
    ("splitserve_routing_decisions_total{reason}", m.ROUTING_REASONS),
    ("splitserve_request_success_total{finished_reason}", ("stop", "length")),
])
def test_the_label_values_observability_lists_are_the_exported_ones(metric, values):
    """The router exports these counters at 0 for every known label value, so the doc's list is what a scrape shows."""
    observability = (DOCS / "observability.md").read_text(encoding="utf-8")
    [row] = [row for row in _table(observability, "| metric | type | observed for |") if row[0] == f"`{metric}`"]
    listed = [value for value in re.findall(r"`([A-Za-z_]+)`", row[2]) if value in values or value.isupper()
              or value.islower() and "_" in value or value in ("stop", "length")]
    assert sorted(set(listed)) == sorted(values)


def test_the_ttft_phase_table_is_every_phase():
    observability = (DOCS / "observability.md").read_text(encoding="utf-8")
    rows = _table(observability, "| phase | remote prefill | local prefill (decode worker prefills) |")
    assert sorted(row[0].strip("`") for row in rows) == sorted(m.TTFT_PHASES)


def test_the_lora_metrics_example_is_a_line_a_scrape_shows():
    import asyncio

    from prometheus_client import generate_latest

    from splitserve.common.kv_events import LoraLoad, WorkerCounters
    from splitserve.common.slo import SloConfig
    from splitserve.common.stats import LoopLagStats, RoutingStats, WorkerSnapshot
    from splitserve.router.metrics_server import RouterMetrics

    example = re.search(r"^splitserve_lora_requests_info\{.*$", (DOCS / "lora.md").read_text(encoding="utf-8"), re.M)[0]
    load = dataclasses.replace(make_load_report(), lora=LoraLoad(2, running=("poet", "sql"), waiting=()))
    workers = (WorkerSnapshot("decode-0", "decode", load, WorkerCounters(0, 0, 0, 0, 0, 0)),)
    metrics = RouterMetrics(SloConfig(), "MODEL")

    async def scrape() -> str:
        metrics.watch(MetricsSources(workers, RoutingStats((), ()),
                                 LoopLagStats(m.LOOP_LAG_BUCKETS, (0,) * len(m.LOOP_LAG_BUCKETS), 0, 0.0)))
        return generate_latest(metrics.registry).decode()

    assert example in asyncio.run(scrape()).splitlines()


def test_the_defaults_serve_help_states_are_the_configs():
    """`splitserve serve --help` states a flag's default as `(default VALUE...`: it must be the default config's."""
    stated = []
    for action in SERVE._actions:
        match = re.search(r"\(default ([^\s;:)]+)", action.help or "")
        if match is None or not action.option_strings:
            continue
        keys = _keys_set_by(_sample_argv(action)) - {"model"}
        value = _value(match[1].strip("'"))
        stated += [(key, value, _lookup(DEFAULTS, key)) for key in sorted(keys)]
    assert [(key, value) for key, value, default in stated if value != default] == []
    assert len(stated) >= 15  # every flag with a stated default was checked
