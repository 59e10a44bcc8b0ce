"""Offline checks of the KubeRay manifests in this folder; run them before `kubectl apply -k`.

Usage: `.venv/bin/python deploy/kuberay/validate.py [FILE ...]` (default: the resources listed in
kustomization.yaml; `-`: a YAML stream on stdin, e.g. `kubectl kustomize deploy/kuberay-several-routers
| .venv/bin/python deploy/kuberay/validate.py -`). Prints one line per problem (file, object, field,
reason); exits 1 if any.

1. Core Kubernetes objects (Namespace, ConfigMap, Service) are validated against the OpenAPI
   schemas bundled by `kubernetes-validate`, in strict mode (an unknown field is an error), for
   each version in KUBERNETES_VERSIONS. Nothing is sent to a cluster.
2. ray.io objects are validated against the openAPIV3Schema of their CRD in crds/ (the KubeRay
   operator's own CRDs). Those schemas accept unknown fields (the API server silently prunes
   them), so each pod template inside is also validated strictly as a core PodTemplate, and the
   object's metadata as ObjectMeta.
3. monitoring.coreos.com PodMonitors and PrometheusRules get a structural check of the fields the
   Prometheus Operator reads (its CRDs are not available offline).
4. Once every object passes 1-3, the deployment as a whole: the cluster config the head runs with
   (the ConfigMap's file, parsed with `parse_cluster_config`, then the head container's
   `splitserve serve` arguments after --config, parsed as the CLI parses them) agrees with the
   RayCluster (ports, probes, volumes, GPUs and CPUs per pool, one image), a key set both in the file
   and in those arguments holds one value, and the Service and PodMonitor select the pods that serve
   the APIs and name their ports: the head's (router.replicas 1: the router runs in `splitserve
   serve` on the head), or those of the worker group `router` (router.replicas > 1: one router actor
   on each pod of that group, as many pods as routers; deploy/kuberay-several-routers builds it).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

KUBERAY_DIR = Path(__file__).resolve().parent
CRD_DIR = KUBERAY_DIR / "crds"
KUSTOMIZATION = KUBERAY_DIR / "kustomization.yaml"
KUBERNETES_VERSIONS = ("1.29", "1.37")
"""Oldest and newest Kubernetes the manifests are checked against (gRPC probes are GA since 1.27)."""
PROMETHEUS_JOB = "splitserve"
"""The `job` label deploy/prometheus/rules/*.yml expect on the router's series."""
HEAD_ENTRYPOINT = "/usr/local/bin/splitserve-ray-head"
OVERWRITE_CMD_ANNOTATION = "ray.io/overwrite-container-cmd"
POOLS = ("prefill", "decode")
"""Cluster config pools; each runs on the worker group of the same name."""
ROUTER_GROUP = "router"
"""The worker group whose pods run the router actors when router.replicas > 1 (one per pod)."""
SEVERAL_ROUTERS = "deploy/kuberay-several-routers"
"""The overlay that builds the router group from one count (its routers.yaml)."""
NODE_GROUP_LABEL = "ray.io/node-group"
"""The Ray node label holding a node's KubeRay worker group name."""
STDIN = Path("<stdin>")
"""The `path` of manifests read from standard input (validate.py -)."""
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
_ENDPOINT_KEYS = frozenset({
    "port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
    "honorTimestamps", "trackTimestampsStaleness", "metricRelabelings", "relabelings", "proxyUrl",
    "followRedirects", "enableHttp2", "filterRunning", "authorization", "basicAuth", "bearerTokenSecret",
    "oauth2", "tlsConfig", "noProxy", "proxyFromEnvironment", "proxyConnectHeader"})
"""PodMetricsEndpoint fields of the Prometheus Operator's monitoring.coreos.com/v1 API."""
_RELABEL_KEYS = frozenset({"sourceLabels", "separator", "targetLabel", "regex", "modulus", "replacement", "action"})
_RELABEL_ACTIONS = frozenset({"replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep",
                              "lowercase", "uppercase", "keepequal", "dropequal"})
_RELABEL_NEEDS_TARGET = frozenset({"replace", "hashmod", "lowercase", "uppercase", "keepequal", "dropequal"})


@dataclass(frozen=True)
class Manifest:
    """One YAML document of a manifest file."""

    path: Path
    doc: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return str(self.doc.get("kind", "?"))

    @property
    def name(self) -> str:
        return str((self.doc.get("metadata") or {}).get("name", "?"))

    @property
    def group(self) -> str:
        """API group: '' for the core group (apiVersion v1)."""
        api_version = str(self.doc.get("apiVersion", ""))
        return api_version.split("/")[0] if "/" in api_version else ""

    def where(self, field: str = "") -> str:
        return f"{self.path.name}: {self.kind}/{self.name}" + (f": {field}" if field else "")


# ---- loading ---------------------------------------------------------------------------------


def kustomization_resources() -> list[Path]:
    """The manifest files kustomization.yaml lists, in order."""
    data = yaml.safe_load(KUSTOMIZATION.read_text(encoding="utf-8"))
    return [KUBERAY_DIR / name for name in data["resources"]]


LOCAL_CONFIG = "config.kubernetes.io/local-config"
"""kustomize's annotation for an object it reads (values.yaml) but never outputs."""


def load_manifests(paths: Iterable[Path] | None = None) -> list[Manifest]:
    """Every non-empty YAML document of the files (default: kustomization.yaml's resources; `-`:
    standard input) that kustomize sends to the cluster (objects local to kustomize are skipped)."""
    manifests = []
    for path in kustomization_resources() if paths is None else paths:
        path = STDIN if str(path) == "-" else Path(path)
        text = sys.stdin.read() if path == STDIN else path.read_text(encoding="utf-8")
        for doc in yaml.safe_load_all(text):
            annotations = (doc or {}).get("metadata", {}).get("annotations") or {}
            if doc is not None and str(annotations.get(LOCAL_CONFIG, "")).lower() != "true":
                manifests.append(Manifest(Path(path), doc))
    return manifests


# ---- schemas ---------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def crd_schemas() -> dict[tuple[str, str, str], dict]:
    """(group, version, kind) -> openAPIV3Schema, from every CRD in crds/."""
    schemas = {}
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRD files are about 1 MB
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for crd in yaml.load_all(path.read_text(encoding="utf-8"), Loader=loader):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                schemas[spec["group"], version["name"], spec["names"]["kind"]] = version["schema"]["openAPIV3Schema"]
    return schemas


def _path_text(path: Iterable[Any]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "(object)"


def kubernetes_errors(doc: Mapping[str, Any], versions: Iterable[str] = KUBERNETES_VERSIONS) -> list[str]:
    """`field: reason` for a core object, strict, per Kubernetes version ([] when valid)."""
    errors = []
    for version in versions:
        try:
            kubernetes_validate.validate(dict(doc), version, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{_path_text(error.absolute_path)}: {error.message} (Kubernetes {version})")
        except kubernetes_validate.SchemaNotFoundError as error:
            errors.append(f"(object): {error.message}")
    return errors


def crd_errors(manifest: Manifest) -> list[str]:
    """`field: reason` against the object's CRD schema, plus strict checks of its metadata and pod templates."""
    api_version = str(manifest.doc.get("apiVersion", ""))
    schema = crd_schemas().get((manifest.group, api_version.split("/")[-1], manifest.kind))
    if schema is None:
        return [f"(object): no CRD for {manifest.kind} {api_version} in {CRD_DIR.name}/"]
    validator = jsonschema.Draft7Validator(schema)
    errors = [f"{_path_text(e.absolute_path)}: {e.message}"
              for e in sorted(validator.iter_errors(manifest.doc), key=lambda e: list(map(str, e.absolute_path)))]
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": manifest.doc.get("metadata", {})}
    errors += kubernetes_errors(meta)
    for field, template in pod_templates(manifest.doc):
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"}, "template": template}
        errors += [f"{field}.{e.removeprefix('template.')}" for e in kubernetes_errors(wrapped)]
    return errors


def pod_templates(doc: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(field path, pod template) of a RayCluster's head and worker groups."""
    spec = doc.get("spec") or {}
    yield "spec.headGroupSpec.template", (spec.get("headGroupSpec") or {}).get("template", {})
    for index, group in enumerate(spec.get("workerGroupSpecs") or []):
        yield f"spec.workerGroupSpecs[{index}].template", (group or {}).get("template", {})


def schema_errors(manifest: Manifest) -> list[str]:
    """Every schema problem of one object, located (file: Kind/name: field: reason)."""
    name = (manifest.doc.get("metadata") or {}).get("name")
    errors = [] if isinstance(name, str) and _DNS_SUBDOMAIN.match(name) else [
        f"metadata.name: must be a lowercase DNS subdomain, got {name!r}"]
    if manifest.group == "ray.io":
        errors += crd_errors(manifest)
    elif manifest.group == "monitoring.coreos.com" and manifest.kind == "PrometheusRule":
        errors += prometheus_rule_errors(manifest.doc)
    elif manifest.group == "monitoring.coreos.com":
        errors += pod_monitor_errors(manifest.doc)
    else:
        errors += kubernetes_errors(manifest.doc)
    return [manifest.where(error) for error in errors]


# ---- PrometheusRule --------------------------------------------------------------------------

_RULE_KEYS = frozenset({"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"})
"""Rule fields of the Prometheus Operator's monitoring.coreos.com/v1 PrometheusRule."""


def prometheus_rule_errors(doc: Mapping[str, Any]) -> list[str]:
    """The PrometheusRule fields the Prometheus Operator needs, checked by structure."""
    if doc.get("apiVersion") != "monitoring.coreos.com/v1":
        return [f"apiVersion: must be monitoring.coreos.com/v1, got {doc.get('apiVersion')!r}"]
    groups = (doc.get("spec") or {}).get("groups")
    if not isinstance(groups, list) or not groups:
        return ["spec.groups: required non-empty list"]
    errors = []
    for index, group in enumerate(groups):
        where = f"spec.groups[{index}]"
        if not isinstance(group, Mapping) or not isinstance(group.get("name"), str):
            errors.append(f"{where}.name: required string")
            continue
        rules = group.get("rules")
        if not isinstance(rules, list) or not rules:
            errors.append(f"{where}.rules: required non-empty list")
            continue
        for rule_index, rule in enumerate(rules):
            errors += [f"{where}.rules[{rule_index}].{e}" for e in _rule_errors(rule)]
    return errors


def _rule_errors(rule: Any) -> list[str]:
    if not isinstance(rule, Mapping):
        return ["(rule): must be a mapping"]
    errors = [f"{key}: unknown field" for key in rule if key not in _RULE_KEYS]
    if ("record" in rule) == ("alert" in rule):
        errors.append("(rule): needs exactly one of record and alert")
    if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
        errors.append("expr: required PromQL string")
    if "for" in rule and not (isinstance(rule["for"], str) and _DURATION.match(rule["for"])):
        errors.append(f"for: must be a Prometheus duration like 5m, got {rule['for']!r}")
    return errors


# ---- PodMonitor ------------------------------------------------------------------------------


def pod_monitor_errors(doc: Mapping[str, Any]) -> list[str]:
    """The PodMonitor fields the Prometheus Operator needs, checked by structure."""
    if doc.get("kind") != "PodMonitor" or doc.get("apiVersion") != "monitoring.coreos.com/v1":
        return [f"(object): only monitoring.coreos.com/v1 PodMonitor is checked, got {doc.get('apiVersion')} "
                f"{doc.get('kind')}"]
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        return ["spec: required mapping"]
    errors = _selector_errors(spec.get("selector"))
    endpoints = spec.get("podMetricsEndpoints")
    if not isinstance(endpoints, list) or not endpoints:
        return [*errors, "spec.podMetricsEndpoints: required non-empty list"]
    for index, endpoint in enumerate(endpoints):
        errors += [f"spec.podMetricsEndpoints[{index}].{e}" for e in _endpoint_errors(endpoint)]
    return errors


def _selector_errors(selector: Any) -> list[str]:
    if not isinstance(selector, Mapping) or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return ["spec.selector: required, with matchLabels or matchExpressions (an empty selector selects every pod)"]
    labels = selector.get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        return ["spec.selector.matchLabels: must map strings to strings"]
    return []


def _endpoint_errors(endpoint: Any) -> list[str]:
    if not isinstance(endpoint, Mapping):
        return ["(endpoint): must be a mapping"]
    errors = [f"{key}: unknown field" for key in endpoint if key not in _ENDPOINT_KEYS]
    if not isinstance(endpoint.get("port"), str) and not isinstance(endpoint.get("portNumber"), int):
        errors.append("port: required (the name of a container port), or portNumber")
    if not str(endpoint.get("path", "/metrics")).startswith("/"):
        errors.append(f"path: must start with '/', got {endpoint.get('path')!r}")
    for key in ("interval", "scrapeTimeout"):
        value = endpoint.get(key)
        if key in endpoint and not (isinstance(value, str) and value and _DURATION.match(value)):
            errors.append(f"{key}: must be a Prometheus duration like 15s, got {value!r}")
    if not errors and "interval" in endpoint and "scrapeTimeout" in endpoint and \
            _seconds(endpoint["scrapeTimeout"]) > _seconds(endpoint["interval"]):
        errors.append("scrapeTimeout: must not exceed interval")
    for index, relabel in enumerate(endpoint.get("relabelings") or []):
        errors += [f"relabelings[{index}].{e}" for e in _relabel_errors(relabel)]
    return errors


def _relabel_errors(relabel: Any) -> list[str]:
    if not isinstance(relabel, Mapping):
        return ["(relabeling): must be a mapping"]
    errors = [f"{key}: unknown field" for key in relabel if key not in _RELABEL_KEYS]
    action = str(relabel.get("action", "replace")).lower()
    if action not in _RELABEL_ACTIONS:
        errors.append(f"action: must be one of {sorted(_RELABEL_ACTIONS)}, got {relabel.get('action')!r}")
    if action in _RELABEL_NEEDS_TARGET and not isinstance(relabel.get("targetLabel"), str):
        errors.append(f"targetLabel: required for action {action}")
    sources = relabel.get("sourceLabels", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        errors.append("sourceLabels: must be a list of label names")
    return errors


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(ms|[smhdwy])", duration))


# ---- the deployment as a whole ---------------------------------------------------------------


@dataclass(frozen=True)
class RayPod:
    """A RayCluster pod template as KubeRay runs it: its labels and its Ray container (index 0)."""

    field: str
    labels: Mapping[str, str]
    spec: Mapping[str, Any]
    start_params: Mapping[str, str]

    @property
    def container(self) -> Mapping[str, Any]:
        return (self.spec.get("containers") or [{}])[0]

    def port(self, name: str) -> int | None:
        return next((p.get("containerPort") for p in self.container.get("ports") or [] if p.get("name") == name), None)

    def mount_for(self, path: str) -> tuple[str, Mapping[str, Any]] | None:
        """(mount path, volume) of the container's mount that holds `path` (the longest match)."""
        mounts = [m for m in self.container.get("volumeMounts") or []
                  if PurePosixPath(path).is_relative_to(PurePosixPath(m.get("mountPath", "/nowhere")))]
        if not mounts:
            return None
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        volume = next((v for v in self.spec.get("volumes") or [] if v.get("name") == mount.get("name")), {})
        return mount["mountPath"], volume

    def ray_resources(self) -> tuple[float, float]:
        """(CPUs, GPUs) the pod's Ray node offers: rayStartParams, else the container's limits (KubeRay's rule)."""
        limits = (self.container.get("resources") or {}).get("limits") or {}
        cpus = self.start_params.get("num-cpus", _quantity(limits.get("cpu", 0)))
        gpus = self.start_params.get("num-gpus", _quantity(limits.get("nvidia.com/gpu", 0)))
        return float(cpus), float(gpus)


def _quantity(value: Any) -> float:
    """A CPU/GPU quantity (4, "4", "500m") as KubeRay passes it to `ray start`: rounded up to an integer."""
    text = str(value)
    return float(math.ceil(float(text[:-1]) / 1000 if text.endswith("m") else float(text)))


def ray_pods(cluster: Manifest) -> tuple[RayPod, dict[str, tuple[RayPod, int]]]:
    """The head pod and {group name: (worker pod, replicas)}, with the labels KubeRay adds."""
    spec = cluster.doc.get("spec") or {}
    base = {"ray.io/cluster": cluster.name, "ray.io/is-ray-node": "yes"}
    head_spec = spec.get("headGroupSpec") or {}
    head = _ray_pod("spec.headGroupSpec", head_spec, {**base, "ray.io/node-type": "head", "ray.io/group": "headgroup"})
    workers = {}
    for index, group in enumerate(spec.get("workerGroupSpecs") or []):
        name = group.get("groupName", "")
        labels = {**base, "ray.io/node-type": "worker", "ray.io/group": name}
        workers[name] = (_ray_pod(f"spec.workerGroupSpecs[{index}]", group, labels), int(group.get("replicas", 0)))
    return head, workers


def _ray_pod(field: str, group: Mapping[str, Any], kuberay_labels: Mapping[str, str]) -> RayPod:
    template = group.get("template") or {}
    labels = {**((template.get("metadata") or {}).get("labels") or {}), **kuberay_labels}
    return RayPod(field, labels, template.get("spec") or {}, group.get("rayStartParams") or {})


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return bool(selector) and all(labels.get(key) == value for key, value in selector.items())


def deployment_errors(manifests: list[Manifest]) -> list[str]:
    """Cross-object problems: the config against the RayCluster, the Service and PodMonitor against the head."""
    clusters = [m for m in manifests if m.kind == "RayCluster"]
    if len(clusters) != 1:
        return [f"(deployment): expected one RayCluster, found {len(clusters)}"]
    cluster = clusters[0]
    head, workers = ray_pods(cluster)
    errors = _head_errors(cluster, head) + _image_errors(cluster, head, workers)
    errors += [cluster.where(e) for e in _shm_errors([head, *(pod for pod, _ in workers.values())])]
    config, config_errors = _cluster_config(cluster, head, manifests)
    errors += config_errors
    layout = _router_layout_error(workers, config)
    if layout is not None:  # every check below would report a consequence of it
        return errors + [cluster.where(f"cluster config: {layout}")]
    serving = serving_pod(head, workers, config)
    if config is not None:
        errors += _config_errors(cluster, head, workers, config, serving)
    others = [pod for pod in [head, *(pod for pod, _ in workers.values())] if pod is not serving]
    for manifest in manifests:
        if manifest.kind == "Service":
            errors += _service_errors(manifest, serving, others)
        elif manifest.kind == "PodMonitor":
            errors += _pod_monitor_target_errors(manifest, serving, others, config)
    return errors


def _shm_errors(pods: Iterable[RayPod]) -> list[str]:
    """Every Ray container needs a memory-backed /dev/shm: Kubernetes gives 64 MB, too little for
    Ray's object store, torch and UCX's shared-memory transport."""
    errors = []
    for pod in pods:
        found = pod.mount_for("/dev/shm")
        empty_dir = (found[1].get("emptyDir") or {}) if found and found[0] == "/dev/shm" else {}
        if empty_dir.get("medium") != "Memory":
            errors.append(f"{pod.field}: the Ray container needs /dev/shm on an emptyDir volume with medium: Memory "
                          f"(Kubernetes' default is 64 MB), got {found}")
    return errors


def _router_layout_error(workers: Mapping[str, tuple[RayPod, int]], config) -> str | None:
    """Where the routers run must match router.replicas: one router runs in the head's `splitserve
    serve`, several as actors on the router group's pods (deploy/kuberay-several-routers)."""
    if config is None:
        return None
    routers = config.router.replicas
    if routers > 1 and ROUTER_GROUP not in workers:
        return f"router.replicas {routers} needs a worker group named {ROUTER_GROUP} (one router per pod; " \
               f"{SEVERAL_ROUTERS} builds it)"
    if routers == 1 and ROUTER_GROUP in workers:
        return f"router.replicas is 1, so the router runs in the head's `splitserve serve`, but worker group " \
               f"{ROUTER_GROUP} has {workers[ROUTER_GROUP][1]} pods that would never serve: use router.replicas " \
               f">= 2 ({SEVERAL_ROUTERS}/routers.yaml), or the base deploy/kuberay for one router"
    return None


def serving_pod(head: RayPod, workers: Mapping[str, tuple[RayPod, int]], config) -> RayPod:
    """The pod that serves the APIs: the head with one router, else the router group's pod
    (_router_layout_error has checked that there is one); without a readable config, the router
    group's pod if there is that group."""
    several = ROUTER_GROUP in workers if config is None else config.router.replicas > 1
    return workers[ROUTER_GROUP][0] if several else head


def _pod_name(pod: RayPod) -> str:
    return "head" if pod.field == "spec.headGroupSpec" else f"{ROUTER_GROUP} group"


def _head_errors(cluster: Manifest, head: RayPod) -> list[str]:
    template = ((cluster.doc.get("spec") or {}).get("headGroupSpec") or {}).get("template") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    errors = []
    if HEAD_ENTRYPOINT not in head.container.get("command", []):
        errors.append(f"{head.field}: the Ray container's command must run {HEAD_ENTRYPOINT} (Ray head + router)")
    if str(annotations.get(OVERWRITE_CMD_ANNOTATION, "")).lower() != "true":
        errors.append(f"{head.field}.template.metadata.annotations: needs {OVERWRITE_CMD_ANNOTATION}: \"true\" "
                      "(else KubeRay wraps the command in its own `ray start`)")
    if str(head.start_params.get("num-cpus")) != "0":
        errors.append(f"{head.field}.rayStartParams.num-cpus: must be \"0\" so no worker actor lands on the head")
    return [cluster.where(e) for e in errors]


def _image_errors(cluster: Manifest, head: RayPod, workers: Mapping[str, tuple[RayPod, int]]) -> list[str]:
    images = {pod.field: pod.container.get("image") for pod in [head, *(pod for pod, _ in workers.values())]}
    if len(set(images.values())) == 1:
        return []
    return [cluster.where(f"every Ray container must run the same image (Ray, torch and the model path must match), "
                          f"got {images}")]


def _cluster_config(cluster: Manifest, head: RayPod, manifests: list[Manifest]):
    """(ClusterConfig or None, errors): the config `splitserve serve` runs with on the head: the file
    its `--config` names, read from its ConfigMap, then the rest of its arguments (which win)."""
    from splitserve.deploy.cluster_config import ClusterConfigError, apply_overrides, parse_cluster_config

    args = list(head.container.get("args") or [])
    if "--config" not in args[:-1]:
        return None, [cluster.where(f"{head.field}: the head container's args must pass --config FILE")]
    path = args[args.index("--config") + 1]
    found = head.mount_for(path)
    config_map = (found[1].get("configMap") or {}) if found else {}
    maps = {m.name: m for m in manifests if m.kind == "ConfigMap"}
    if not config_map or config_map.get("name") not in maps:
        return None, [cluster.where(f"{head.field}: --config {path} is not on a volume of a ConfigMap "
                                    "in these manifests")]
    source = maps[config_map["name"]]
    key = str(PurePosixPath(path).relative_to(found[0]))
    text = (source.doc.get("data") or {}).get(key)
    if text is None:
        return None, [source.where(f"data.{key}: missing (the head reads --config {path})")]
    try:
        config = parse_cluster_config(text)
    except ClusterConfigError as error:
        return None, [source.where(f"data.{key}: {error}")]
    try:
        overrides = serve_arguments(args)
        config = apply_overrides(config, overrides)
    except (ValueError, ClusterConfigError) as error:
        return None, [cluster.where(f"{head.field}: the head container's args {args}: {error}")]
    return config, [source.where(f"data.{key}: {e}") for e in _argument_conflicts(text, overrides)]


def serve_arguments(args: list[str]) -> dict[str, object]:
    """The config keys the head's `splitserve serve ARGS` sets on top of its --config file, parsed
    by the CLI's own parser; ValueError naming the problem when `splitserve serve` would refuse them."""
    from splitserve.deploy.cli import build_parser, serve_overrides

    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            parsed = build_parser().parse_args(["serve", *args])
    except SystemExit:
        raise ValueError(usage.getvalue().strip()) from None
    return serve_overrides(parsed)


_ABSENT = object()


def _argument_conflicts(text: str, overrides: Mapping[str, object]) -> list[str]:
    """A key both the file and the head's arguments set, to different values: the arguments win
    (deploy/kuberay-several-routers writes router.replicas there from routers.yaml), so the file's
    value is never used and misleads whoever reads it."""
    errors = []
    data = yaml.safe_load(text)
    for key, value in overrides.items():
        found: Any = data
        for part in key.split("."):
            found = found.get(part, _ABSENT) if isinstance(found, Mapping) else _ABSENT
        if found is not _ABSENT and found != value:
            errors.append(f"{key}: {found!r} here, but the head's `splitserve serve` arguments set {key}={value}, "
                          "which wins (the value the manifests use): remove it here or make the two agree")
    return errors


def _config_errors(cluster: Manifest, head: RayPod, workers: Mapping[str, tuple[RayPod, int]], config,
                   serving: RayPod) -> list[str]:
    errors = []
    if config.ray_address is None:
        errors.append("ray_address: must be `auto` (join the RayCluster); null starts a private Ray in the head pod")
    if config.router.host in LOOPBACK_HOSTS:
        errors.append(f"router.host: {config.router.host} is unreachable from the Service and the probes; use 0.0.0.0")
    errors += _port_errors(serving, config) + _probe_errors(serving, config)
    errors += _model_errors(head, workers, config) + _capacity_errors(workers, config)
    errors += _router_group_errors(workers, config)
    return [cluster.where(f"cluster config: {e}") for e in errors]


def _router_group_errors(workers: Mapping[str, tuple[RayPod, int]], config) -> list[str]:
    """router.replicas > 1: one router actor on each pod of the router group (two on one pod would
    share its metrics port), pinned there by node_labels, and no pod without one (it would never pass
    its probes: a startup probe that fails for 30 minutes restarts the pod, forever)."""
    router = config.router
    if router.replicas == 1:
        return []
    pod, replicas = workers[ROUTER_GROUP]
    errors = []
    if router.resources.label_selector.get(NODE_GROUP_LABEL) != ROUTER_GROUP:
        errors.append(f"router: resources.node_labels must select worker group {ROUTER_GROUP} "
                      f"({NODE_GROUP_LABEL}={ROUTER_GROUP}), got {router.resources.node_labels!r}")
    if _actors_per_pod(pod, router.resources) != 1:
        cpus, gpus = pod.ray_resources()
        errors.append(f"router: resources ({_shape(router.resources)}) must fit exactly one router per {ROUTER_GROUP} "
                      f"pod ({cpus:g} CPU, {gpus:g} GPU): routers on one pod would share its ports")
    if replicas != router.replicas:
        errors.append(f"router: {router.replicas} routers need exactly {router.replicas} pods of worker group "
                      f"{ROUTER_GROUP} (one router each), it has {replicas}")
    return errors


def _port_errors(head: RayPod, config) -> list[str]:
    wanted = {"grpc": config.router.grpc_port}
    if config.router.metrics_port is not None:
        wanted["router-metrics"] = config.router.metrics_port
    if config.router.http_port is not None:
        wanted["http"] = config.router.http_port
    return [f"router port {port} needs a {_pod_name(head)} container port named {name} with containerPort {port}, "
            f"got {head.port(name)}" for name, port in wanted.items() if head.port(name) != port]


def _probe_errors(head: RayPod, config) -> list[str]:
    from splitserve.router.server import SERVICE_NAME

    errors = []
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = (head.container.get(kind) or {}).get("grpc")
        if not grpc or grpc.get("port") != config.router.grpc_port:
            errors.append(f"{kind}: needs a gRPC health check on router.grpc_port {config.router.grpc_port}, "
                          f"got {head.container.get(kind)}")
        elif kind != "livenessProbe" and grpc.get("service") != SERVICE_NAME:
            errors.append(f"{kind}.grpc.service: must be {SERVICE_NAME} (SERVING once every worker is up)")
    return errors


def _model_errors(head: RayPod, workers: Mapping[str, tuple[RayPod, int]], config) -> list[str]:
    """The head resolves the model path and sends it to the workers: it must be the same volume in every pod."""
    if config.model == "default":
        return []  # package data of the installed wheel: the same path in every pod
    mounts = {pod.field: pod.mount_for(config.model) for pod in [head, *(pod for pod, _ in workers.values())]}
    missing = [field for field, mount in mounts.items() if mount is None]
    if missing:
        return [f"model {config.model} is on no volume mounted in {', '.join(missing)}"]
    if len({repr(sorted(mount[1].items())) + mount[0] for mount in mounts.values()}) != 1:
        return [f"model {config.model} must be the same volume at the same path in every pod, got {mounts}"]
    return []


def _capacity_errors(workers: Mapping[str, tuple[RayPod, int]], config) -> list[str]:
    """Each pool is pinned to the worker group of its name (Ray labels every node with its group
    as ray.io/node-group) and fits it."""
    pools = {name: getattr(config, name) for name in POOLS if getattr(config, name).replicas > 0}
    errors = []
    for name, pool in pools.items():
        if name not in workers:
            errors.append(f"{name}: {pool.replicas} actors but no worker group named {name}")
            continue
        if pool.resources.label_selector.get(NODE_GROUP_LABEL) != name:
            errors.append(f"{name}: resources.node_labels must select its worker group ({NODE_GROUP_LABEL}={name}), "
                          f"got {pool.resources.node_labels!r}: else Ray may place its actors on another group's pods")
        pod, replicas = workers[name]
        if replicas * _actors_per_pod(pod, pool.resources) < pool.replicas:
            cpus, gpus = pod.ray_resources()
            errors.append(f"{name}: {pool.replicas} actors x ({_shape(pool.resources)}) do not fit worker group "
                          f"{name}: {replicas} pods x ({cpus:g} CPU, {gpus:g} GPU)")
    return errors


def _actors_per_pod(pod: RayPod, resources) -> int:
    cpus, gpus = pod.ray_resources()
    fits = [math.floor(have / need + 1e-9) for have, need in ((cpus, resources.num_cpus), (gpus, resources.num_gpus))
            if need > 0]
    return min(fits) if fits else sys.maxsize


def _shape(resources) -> str:
    return f"{resources.num_cpus:g} CPU, {resources.num_gpus:g} GPU"


def _service_errors(service: Manifest, head: RayPod, others: list[RayPod]) -> list[str]:
    """`head`: the pod that serves the APIs (see serving_pod); `others`: every other pod."""
    selector = (service.doc.get("spec") or {}).get("selector") or {}
    errors = _target_selector_errors(selector, head, others, "spec.selector")
    for index, port in enumerate((service.doc.get("spec") or {}).get("ports") or []):
        target = port.get("targetPort", port.get("port"))
        named = isinstance(target, str) and head.port(target) is not None
        numbered = any(p.get("containerPort") == target for p in head.container.get("ports") or [])
        if not (named or numbered):
            errors.append(f"spec.ports[{index}].targetPort: {target!r} is not a port of the {_pod_name(head)}'s Ray "
                          "container")
    return [service.where(e) for e in errors]


def _target_selector_errors(selector: Mapping[str, str], head: RayPod, others: list[RayPod], field: str) -> list[str]:
    if not _selects(selector, head.labels):
        return [f"{field}: {dict(selector)} does not select the {_pod_name(head)} pod (labels {dict(head.labels)})"]
    chosen = [pod.field for pod in others if _selects(selector, pod.labels)]
    kind = "worker pods" if _pod_name(head) == "head" else "other pods"
    return [f"{field}: {dict(selector)} also selects {kind} ({', '.join(chosen)})"] if chosen else []


def _pod_monitor_target_errors(monitor: Manifest, head: RayPod, others: list[RayPod], config) -> list[str]:
    spec = monitor.doc.get("spec") or {}
    errors = _target_selector_errors((spec.get("selector") or {}).get("matchLabels") or {}, head, others,
                                     "spec.selector.matchLabels")
    for index, endpoint in enumerate(spec.get("podMetricsEndpoints") or []):
        field = f"spec.podMetricsEndpoints[{index}]"
        name = endpoint.get("port")
        port = head.port(name) if isinstance(name, str) else endpoint.get("portNumber")
        if config is not None and port != config.router.metrics_port:
            errors.append(f"{field}.port: {name!r} must name the {_pod_name(head)}'s router metrics port "
                          f"({config.router.metrics_port}), got {port}")
        jobs = [r.get("replacement") for r in endpoint.get("relabelings") or [] if r.get("targetLabel") == "job"]
        if jobs != [PROMETHEUS_JOB]:
            errors.append(f"{field}.relabelings: must set job to {PROMETHEUS_JOB!r} (the alerts' up{{job=...}}), "
                          f"got {jobs}")
    return [monitor.where(e) for e in errors]


# ---- entry point -----------------------------------------------------------------------------


def validate(manifests: list[Manifest]) -> list[str]:
    """Every problem of the manifests ([] when they are fine); cross-object checks run once every
    object passes its own schema checks (they read fields the schemas vouch for)."""
    errors = [error for manifest in manifests for error in schema_errors(manifest)]
    return errors or deployment_errors(manifests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="manifest files (default: kustomization.yaml's resources)")
    args = parser.parse_args(argv)
    manifests = load_manifests(args.files or None)
    errors = validate(manifests)
    for error in errors:
        print(error)
    kinds = ", ".join(f"{m.kind}/{m.name}" for m in manifests)
    print(f"{len(errors)} problem(s) in {len(manifests)} object(s): {kinds}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
