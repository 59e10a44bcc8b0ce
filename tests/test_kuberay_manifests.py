"""deploy/kuberay: the manifests validate offline, agree with each other and with the repo, and the
validator rejects broken ones; the image's build file keeps the project's pins; the head
container's entry script starts Ray, then the router, and stops both in order.

- Core objects: `kubernetes-validate` (strict) against fixed Kubernetes versions.
- RayCluster: jsonschema against the openAPIV3Schema of the KubeRay CRD copied into
  deploy/kuberay/crds/ (the same file as ../shared/kuberay/ when that is present).
- PodMonitor: the structural check in deploy/kuberay/validate.py (no schema offline).
- The ConfigMap's cluster config: `parse_cluster_config`.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.util
import io
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from splitserve.common.config import EngineConfig
from splitserve.deploy.cluster_config import parse_cluster_config

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO / "deploy" / "kuberay"
SHARED_CRD = REPO.parent / "shared" / "kuberay" / "ray.io_rayclusters.yaml"
HEAD_SCRIPT = KUBERAY / "splitserve-ray-head.sh"
DOCKERFILE = KUBERAY / "Dockerfile"


def _load_validator():
    spec = importlib.util.spec_from_file_location("kuberay_validate", KUBERAY / "validate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


kv = _load_validator()


@pytest.fixture(scope="module")
def manifests() -> list:
    return kv.load_manifests()


def _docs(manifests: list) -> dict[str, dict]:
    return {m.kind: m.doc for m in manifests}


def _pin(name: str) -> str:
    """The exact version of `name` CI tests (constraints.txt)."""
    lines = (REPO / "constraints.txt").read_text(encoding="utf-8").splitlines()
    return next(line.split("==")[1] for line in lines if line.split("==")[0] == name)


# ---- the shipped manifests --------------------------------------------------------------------


def test_shipped_manifests_have_no_problems(manifests):
    assert kv.validate(manifests) == []
    assert [f"{m.kind}/{m.name}" for m in manifests] == [
        "Namespace/splitserve", "ConfigMap/splitserve-config", "RayCluster/splitserve", "Service/splitserve",
        "PodMonitor/splitserve", "PrometheusRule/splitserve"]


@pytest.mark.parametrize("version", kv.KUBERNETES_VERSIONS)
def test_core_objects_pass_kubernetes_validate(manifests, version):
    core = [m for m in manifests if m.group == ""]
    assert [m.kind for m in core] == ["Namespace", "ConfigMap", "Service"]
    for manifest in core:
        assert kubernetes_validate.validate(dict(manifest.doc), version, strict=True) == version


def test_raycluster_matches_the_kuberay_crd_schema(manifests):
    crd = yaml.load((KUBERAY / "crds" / "ray.io_rayclusters.yaml").read_text(encoding="utf-8"),
                    Loader=yaml.CSafeLoader)
    schema = next(v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == "v1")
    cluster = _docs(manifests)["RayCluster"]
    assert cluster["apiVersion"] == "ray.io/v1"
    jsonschema.Draft7Validator(schema).validate(cluster)
    broken = copy.deepcopy(cluster)
    broken["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "16"
    with pytest.raises(jsonschema.ValidationError, match="'16' is not of type 'integer'"):
        jsonschema.Draft7Validator(schema).validate(broken)


def test_pod_templates_pass_kubernetes_validate_strictly(manifests):
    templates = list(kv.pod_templates(_docs(manifests)["RayCluster"]))
    assert [field for field, _ in templates] == ["spec.headGroupSpec.template", "spec.workerGroupSpecs[0].template",
                                                 "spec.workerGroupSpecs[1].template"]
    for _, template in templates:
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        for version in kv.KUBERNETES_VERSIONS:
            kubernetes_validate.validate(wrapped, version, strict=True)


def test_crd_copy_is_the_shared_kuberay_crd():
    copied = (KUBERAY / "crds" / "ray.io_rayclusters.yaml").read_bytes()
    digest = hashlib.sha256(copied).hexdigest()
    assert digest in (KUBERAY / "crds" / "README.md").read_text(encoding="utf-8")
    if not SHARED_CRD.exists():
        pytest.skip(f"{SHARED_CRD} is not present")
    assert copied == SHARED_CRD.read_bytes()


def test_configmap_cluster_config_parses_for_a_gpu_cluster(manifests):
    config = parse_cluster_config(_docs(manifests)["ConfigMap"]["data"]["cluster.yaml"])
    assert (config.model, config.mode, config.ray_address, config.kv_transfer_backend) == (
        "/models/model", "disaggregated", "auto", "nixl")
    assert (config.router.host, config.router.grpc_port, config.router.http_port, config.router.metrics_port) == (
        "0.0.0.0", 50051, 8000, 9400)
    for pool, fraction in ((config.prefill, 0.3), (config.decode, 0.85)):
        assert (pool.replicas, pool.resources.num_cpus, pool.resources.num_gpus) == (2, 4.0, 1.0)
        assert (pool.engine.device, pool.engine.dtype, pool.engine.kv_cache_memory_fraction) == (
            "cuda", "bfloat16", fraction)


def test_head_runs_ray_and_the_router_with_grpc_health_probes(manifests):
    head = _docs(manifests)["RayCluster"]["spec"]["headGroupSpec"]
    container = head["template"]["spec"]["containers"][0]
    assert head["template"]["metadata"]["annotations"] == {"ray.io/overwrite-container-cmd": "true"}
    assert container["command"] == ["/usr/bin/tini", "--", "/usr/local/bin/splitserve-ray-head"]
    assert container["args"] == ["--config", "/etc/splitserve/cluster.yaml"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "gcs-server": 6379, "dashboard": 8265, "grpc": 50051, "http": 8000, "router-metrics": 9400}
    assert [container[k]["grpc"] for k in ("startupProbe", "readinessProbe", "livenessProbe")] == [
        {"port": 50051, "service": "splitserve.v1.Generation"}, {"port": 50051, "service": "splitserve.v1.Generation"},
        {"port": 50051}]


def test_worker_groups_get_gpus_and_kuberays_generated_command(manifests):
    groups = _docs(manifests)["RayCluster"]["spec"]["workerGroupSpecs"]
    assert [g["groupName"] for g in groups] == ["prefill", "decode"]
    for group in groups:
        container = group["template"]["spec"]["containers"][0]
        assert "command" not in container and "args" not in container
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"


def test_raycluster_ray_version_is_the_pinned_ray(manifests):
    assert _docs(manifests)["RayCluster"]["spec"]["rayVersion"] == _pin("ray")


def test_pod_monitor_labels_match_the_prometheus_rules_and_scrape_config(manifests):
    endpoint = _docs(manifests)["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    alerts = (REPO / "deploy" / "prometheus" / "rules" / "splitserve-alerts.yml").read_text(encoding="utf-8")
    assert re.findall(r'up\{job="([^"]+)"\}', alerts) == [kv.PROMETHEUS_JOB]
    assert endpoint["relabelings"] == [
        {"targetLabel": "job", "replacement": kv.PROMETHEUS_JOB},
        {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_cluster"], "targetLabel": "cluster"},
        {"sourceLabels": ["__meta_kubernetes_pod_label_splitserve_io_model"], "targetLabel": "model"}]
    scrape = yaml.safe_load((REPO / "deploy" / "prometheus" / "kuberay-scrape.yml").read_text(encoding="utf-8"))
    relabels = scrape["scrape_configs"][0]["relabel_configs"]
    assert {"source_labels": ["__meta_kubernetes_pod_label_ray_io_cluster"], "target_label": "cluster"} in relabels
    assert {"source_labels": ["__meta_kubernetes_pod_label_splitserve_io_model"], "target_label": "model"} in relabels
    assert relabels[0] == {"source_labels": ["__meta_kubernetes_pod_label_splitserve_io_component",
                                             "__meta_kubernetes_pod_container_port_name"],
                           "regex": f"router;{endpoint['port']}", "action": "keep"}


def test_kustomization_lists_every_manifest():
    listed = {path.name for path in kv.kustomization_resources()}
    on_disk = {path.name for path in KUBERAY.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_build_sets_namespace_and_image():
    done = subprocess.run(["kubectl", "kustomize", str(KUBERAY)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    built = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    namespaced = [d for d in built if d["kind"] != "Namespace"]
    assert {d["metadata"].get("namespace") for d in namespaced} == {"splitserve"}
    cluster = next(d for d in built if d["kind"] == "RayCluster")
    images = [t["spec"]["containers"][0]["image"] for _, t in kv.pod_templates(cluster)]
    assert images == ["registry.example.com/splitserve:0.1.0"] * 3


def _kustomize(directory: Path) -> list[dict]:
    done = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def _built_raycluster(directory: Path) -> dict:
    return next(d for d in _kustomize(directory) if d["kind"] == "RayCluster")


def test_every_ray_pod_has_a_memory_backed_dev_shm(manifests):
    head, workers = kv.ray_pods(_manifest(manifests, "RayCluster"))
    for pod in [head, *(pod for pod, _ in workers.values())]:
        mount_path, volume = pod.mount_for("/dev/shm")
        assert (mount_path, volume["emptyDir"]["medium"]) == ("/dev/shm", "Memory"), pod.field


def _manifest(manifests, kind: str):
    return next(m for m in manifests if m.kind == kind)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_values_file_holds_the_pools_and_raycluster_yaml_matches_it():
    """kustomize applies values.yaml unchanged: the built RayCluster is raycluster.yaml itself (so
    the validator, which reads the files, checks what is applied), and values.yaml is not applied."""
    built = _kustomize(KUBERAY)
    assert "PoolValues" not in {doc["kind"] for doc in built}
    raw = yaml.safe_load((KUBERAY / "raycluster.yaml").read_text(encoding="utf-8"))
    cluster = next(d for d in built if d["kind"] == "RayCluster")
    cluster["metadata"].pop("namespace")
    for _, template in kv.pod_templates(cluster):
        template["spec"]["containers"][0]["image"] = "splitserve"
    assert cluster == raw


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_changing_values_yaml_resizes_the_pools(tmp_path):
    copy_dir = shutil.copytree(KUBERAY, tmp_path / "kuberay", ignore=shutil.ignore_patterns("crds"))
    values_path = copy_dir / "values.yaml"
    values = yaml.safe_load(values_path.read_text(encoding="utf-8"))
    values["spec"]["head"].update(cpu="2", memory="8Gi", shm="1Gi")
    values["spec"]["prefill"].update(replicas=3, cpu="16", memory="128Gi", gpus="2", shm="32Gi")
    values["spec"]["decode"].update(replicas=5, cpu="6", memory="48Gi", gpus="4", shm="8Gi")
    values_path.write_text(yaml.safe_dump(values))
    cluster = _built_raycluster(copy_dir)
    head, workers = kv.ray_pods(kv.Manifest(values_path, cluster))
    seen = {"head": (head, None), **workers}
    for name, (pod, replicas) in seen.items():
        wanted = values["spec"][name]
        resources = pod.container["resources"]
        shm = next(v for v in pod.spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
        gpus = {kind: resources[kind].get("nvidia.com/gpu") for kind in ("requests", "limits")}
        assert (replicas, resources["requests"]["cpu"], resources["limits"]["cpu"], resources["requests"]["memory"],
                resources["limits"]["memory"], gpus, shm) == (
            wanted.get("replicas"), wanted["cpu"], wanted["cpu"], wanted["memory"], wanted["memory"],
            {"requests": wanted.get("gpus"), "limits": wanted.get("gpus")}, wanted["shm"]), name


# ---- the validator rejects broken manifests ---------------------------------------------------


def _config(docs: dict, old: str, new: str) -> None:
    text = docs["ConfigMap"]["data"]["cluster.yaml"]
    assert old in text
    docs["ConfigMap"]["data"]["cluster.yaml"] = text.replace(old, new, 1)


def _head(docs: dict) -> dict:
    return docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


RC = "raycluster.yaml: RayCluster/splitserve"
BROKEN: dict[str, tuple[Callable[[dict], None], list[str]]] = {
    "misspelled container field": (
        lambda d: _head(d).update(livenesProbe={"grpc": {"port": 50051}}),
        [f"{RC}: spec.headGroupSpec.template.spec.containers[0]: Additional properties are not allowed "
         f"('livenesProbe' was unexpected) (Kubernetes {v})" for v in kv.KUBERNETES_VERSIONS]),
    "named port in a gRPC probe": (
        lambda d: _head(d)["livenessProbe"]["grpc"].update(port="grpc"),
        [f"{RC}: spec.headGroupSpec.template.spec.containers[0].livenessProbe.grpc.port: 'grpc' is not of type "
         f"'integer'{suffix}" for suffix in ("", *(f" (Kubernetes {v})" for v in kv.KUBERNETES_VERSIONS))]),
    "CRD enum": (
        lambda d: d["RayCluster"]["spec"]["authOptions"].update(mode="tokens"),
        [f"{RC}: spec.authOptions.mode: 'tokens' is not one of ['disabled', 'token']"]),
    "CRD required field": (
        lambda d: d["RayCluster"]["spec"]["workerGroupSpecs"][1].pop("maxReplicas"),
        [f"{RC}: spec.workerGroupSpecs[1]: 'maxReplicas' is a required property"]),
    "unknown ConfigMap field": (
        lambda d: d["ConfigMap"].update(date={}),
        [f"configmap.yaml: ConfigMap/splitserve-config: (object): Additional properties are not allowed "
         f"('date' was unexpected) (Kubernetes {v})" for v in kv.KUBERNETES_VERSIONS]),
    "Service port as a word": (
        lambda d: d["Service"]["spec"]["ports"][0].update(port="50051"),
        [f"service.yaml: Service/splitserve: spec.ports[0].port: '50051' is not of type 'integer' (Kubernetes {v})"
         for v in kv.KUBERNETES_VERSIONS]),
    "invalid name": (
        lambda d: d["Service"]["metadata"].update(name="Split_Serve"),
        ["service.yaml: Service/Split_Serve: metadata.name: must be a lowercase DNS subdomain, got 'Split_Serve'"]),
    "PodMonitor without selector": (
        lambda d: d["PodMonitor"]["spec"].pop("selector"),
        ["podmonitor.yaml: PodMonitor/splitserve: spec.selector: required, with matchLabels or matchExpressions "
         "(an empty selector selects every pod)"]),
    "PodMonitor interval": (
        lambda d: d["PodMonitor"]["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"),
        ["podmonitor.yaml: PodMonitor/splitserve: spec.podMetricsEndpoints[0].interval: must be a Prometheus "
         "duration like 15s, got '15 seconds'"]),
    "PodMonitor on Ray's metrics port": (
        lambda d: d["PodMonitor"]["spec"]["podMetricsEndpoints"][0].update(port="metrics"),
        ["podmonitor.yaml: PodMonitor/splitserve: spec.podMetricsEndpoints[0].port: 'metrics' must name the head's "
         "router metrics port (9400), got None"]),
    "Service selecting worker pods": (
        lambda d: d["Service"]["spec"].update(selector={"ray.io/cluster": "splitserve"}),
        ["service.yaml: Service/splitserve: spec.selector: {'ray.io/cluster': 'splitserve'} also selects worker pods "
         "(spec.workerGroupSpecs[0], spec.workerGroupSpecs[1])"]),
    "unknown config key": (
        lambda d: _config(d, "max_num_seqs: 16", "max_num_seq: 16"),
        ["configmap.yaml: ConfigMap/splitserve-config: data.cluster.yaml: prefill.engine.max_num_seq: unknown key "
         f"(known: {', '.join(sorted(field.name for field in dataclasses.fields(EngineConfig)))})"]),
    "router on loopback": (
        lambda d: _config(d, "host: 0.0.0.0", "host: 127.0.0.1"),
        [f"{RC}: cluster config: router.host: 127.0.0.1 is unreachable from the Service and the probes; use 0.0.0.0"]),
    "private Ray": (  # its one node cannot be in both worker groups
        lambda d: _config(d, "ray_address: auto", "ray_address: null"),
        ["configmap.yaml: ConfigMap/splitserve-config: data.cluster.yaml: decode.resources.node_labels: cannot "
         "differ from prefill's on ['ray.io/node-group'] when ray_address is null (a local Ray is one node)"]),
    "private Ray, unpinned pools": (
        lambda d: (_config(d, "ray_address: auto", "ray_address: null"),
                   _config(d, "    node_labels: ray.io/node-group=prefill\n", ""),
                   _config(d, "    node_labels: ray.io/node-group=decode\n", "")),
        [f"{RC}: cluster config: ray_address: must be `auto` (join the RayCluster); null starts a private Ray in the "
         "head pod"]
        + [f"{RC}: cluster config: {pool}: resources.node_labels must select its worker group "
           f"(ray.io/node-group={pool}), got None: else Ray may place its actors on another group's pods"
           for pool in ("prefill", "decode")]),
    "more actors than GPUs": (
        lambda d: _config(d, "replicas: 2", "replicas: 3"),
        [f"{RC}: cluster config: prefill: 3 actors x (4 CPU, 1 GPU) do not fit worker group prefill: "
         "2 pods x (8 CPU, 1 GPU)"]),
    "pool not pinned to its group": (
        lambda d: _config(d, "node_labels: ray.io/node-group=decode", "node_labels: ray.io/node-group=prefill"),
        [f"{RC}: cluster config: decode: resources.node_labels must select its worker group "
         "(ray.io/node-group=decode), got 'ray.io/node-group=prefill': else Ray may place its actors on another "
         "group's pods"]),
    "grpc port moved": (
        lambda d: _config(d, "grpc_port: 50051", "grpc_port: 50052"),
        [f"{RC}: cluster config: router port 50052 needs a head container port named grpc with containerPort 50052, "
         "got 50051"]
        + [f"{RC}: cluster config: {probe}: needs a gRPC health check on router.grpc_port 50052, got "
           f"{{'grpc': {{'port': 50051{svc}}}, {timing}}}" for probe, svc, timing in (
               ("startupProbe", ", 'service': 'splitserve.v1.Generation'",
                "'periodSeconds': 10, 'timeoutSeconds': 5, 'failureThreshold': 180"),
               ("readinessProbe", ", 'service': 'splitserve.v1.Generation'",
                "'periodSeconds': 5, 'timeoutSeconds': 3, 'failureThreshold': 3"),
               ("livenessProbe", "", "'periodSeconds': 15, 'timeoutSeconds': 5, 'failureThreshold': 4"))]),
    "HTTP port moved": (
        lambda d: _config(d, "http_port: 8000", "http_port: 8080"),
        [f"{RC}: cluster config: router port 8080 needs a head container port named http with containerPort 8080, "
         "got 8000"]),
    "model not mounted on decode pods": (
        lambda d: d["RayCluster"]["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0].pop(
            "volumeMounts"),
        [f"{RC}: spec.workerGroupSpecs[1]: the Ray container needs /dev/shm on an emptyDir volume with medium: "
         "Memory (Kubernetes' default is 64 MB), got None",
         f"{RC}: cluster config: model /models/model is on no volume mounted in spec.workerGroupSpecs[1]"]),
    "head without the overwrite annotation": (
        lambda d: d["RayCluster"]["spec"]["headGroupSpec"]["template"]["metadata"].pop("annotations"),
        [f"{RC}: spec.headGroupSpec.template.metadata.annotations: needs ray.io/overwrite-container-cmd: \"true\" "
         "(else KubeRay wraps the command in its own `ray start`)"]),
    "two images": (
        lambda d: d["RayCluster"]["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0].update(
            image="splitserve:old"),
        [f"{RC}: every Ray container must run the same image (Ray, torch and the model path must match), got "
         "{'spec.headGroupSpec': 'splitserve', 'spec.workerGroupSpecs[0]': 'splitserve:old', "
         "'spec.workerGroupSpecs[1]': 'splitserve'}"]),
    "PodMonitor without the job label": (
        lambda d: d["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["relabelings"].pop(0),
        ["podmonitor.yaml: PodMonitor/splitserve: spec.podMetricsEndpoints[0].relabelings: must set job to "
         "'splitserve' (the alerts' up{job=...}), got []"]),
    "decode pods without /dev/shm": (
        lambda d: d["RayCluster"]["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0][
            "volumeMounts"].pop(1),
        [f"{RC}: spec.workerGroupSpecs[1]: the Ray container needs /dev/shm on an emptyDir volume with medium: "
         "Memory (Kubernetes' default is 64 MB), got None"]),
    "PrometheusRule rule without expr, with both record and alert": (
        lambda d: d["PrometheusRule"]["spec"]["groups"][0]["rules"][0].update(alert="X", expr=""),
        ["prometheusrule.yaml: PrometheusRule/splitserve: spec.groups[0].rules[0].(rule): needs exactly one of "
         "record and alert",
         "prometheusrule.yaml: PrometheusRule/splitserve: spec.groups[0].rules[0].expr: required PromQL string"]),
}


@pytest.mark.parametrize("case", BROKEN)
def test_validator_rejects_a_broken_manifest(manifests, case):
    mutate, expected = BROKEN[case]
    broken = [kv.Manifest(m.path, copy.deepcopy(m.doc)) for m in manifests]
    mutate(_docs(broken))
    assert kv.validate(broken) == expected


def test_validator_command_line_fails_on_a_broken_file(tmp_path, capsys):
    for path in kv.kustomization_resources():
        shutil.copy(path, tmp_path / path.name)
    files = [tmp_path / p.name for p in kv.kustomization_resources()]
    assert kv.main([str(f) for f in files]) == 0
    service = tmp_path / "service.yaml"
    service.write_text(service.read_text(encoding="utf-8").replace("targetPort: grpc\n", "targetPort: grpcc\n"))
    capsys.readouterr()
    assert kv.main([str(f) for f in files]) == 1
    assert capsys.readouterr().out == (
        "service.yaml: Service/splitserve: spec.ports[0].targetPort: 'grpcc' is not a port of the head's Ray "
        "container\n")


# ---- the image's build file ----------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text(encoding="utf-8"))
    lines = [line.strip() for line in text.splitlines()]
    return [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]


def test_dockerfile_keeps_the_projects_pins_and_runs_as_a_user():
    instructions = _dockerfile_instructions()
    args = dict(a.split("=", 1) for op, a in instructions if op == "ARG" and "=" in a)
    assert args["PYTHON_IMAGE"] == "python:3.11-slim-bookworm"
    assert args["TORCH_VERSION"] == _pin("torch")
    assert args["RAY_VERSION"] == _pin("ray")
    assert [a for op, a in instructions if op == "FROM"] == ["${PYTHON_IMAGE} AS wheel", "${PYTHON_IMAGE}"]
    assert [a for op, a in instructions if op == "USER"] == ["1000:1000"]
    assert [op for op, _ in instructions][-1] == "CMD" and "ENTRYPOINT" not in dict(instructions)
    runs = " ".join(a for op, a in instructions if op == "RUN")
    assert 'pip install "torch==${TORCH_VERSION}"' in runs
    assert 'pip install -c /tmp/constraints.txt "ray[default]==${RAY_VERSION}"' in runs
    assert "useradd --uid 1000 --gid 1000" in runs


def test_dockerfile_copies_every_package_folder_and_the_head_script():
    package_dirs = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"][
        "package-dir"].values()
    top_level = {d.split("/")[0] for d in package_dirs}
    copies = [a.split() for op, a in _dockerfile_instructions() if op == "COPY" and not a.startswith("--from")]
    copied = {src.rstrip("/") for *sources, _ in copies for src in sources}
    assert top_level | {"pyproject.toml", "README.md", "constraints.txt", "deploy/kuberay/splitserve-ray-head.sh"} == copied
    assert all((REPO / path).exists() for path in copied)
    assert os.access(HEAD_SCRIPT, os.X_OK)


# ---- the head container's entry script -----------------------------------------------------------

FAKE_RAY = """#!/usr/bin/env bash
# `ray start ... --block` runs until SIGTERM (or until $STATE/kill-ray appears, then exits 7;
# it gives up after 30 s so a failed test leaves nothing behind); `ray health-check` passes once
# the fake GCS is up.
case "$1" in
  start)
    echo "ray $*" >> "$STATE/log"
    if [[ -n "${FAKE_RAY_FAIL:-}" ]]; then exit 5; fi
    trap 'echo ray-stopped >> "$STATE/log"; exit 0' TERM
    touch "$STATE/gcs"
    for _ in $(seq 600); do [[ -e "$STATE/kill-ray" ]] && break; sleep 0.05; done
    echo ray-died >> "$STATE/log"; exit 7;;
  health-check)
    for _ in $(seq 50); do [[ -e "$STATE/gcs" ]] && exit 0; sleep 0.01; done; exit 1;;
esac
exit 64
"""
FAKE_SPLITSERVE = """#!/usr/bin/env bash
echo "splitserve $*" >> "$STATE/log"
if [[ -n "${FAKE_ROUTER_EXIT:-}" ]]; then exit "$FAKE_ROUTER_EXIT"; fi
trap 'echo router-stopped >> "$STATE/log"; exit 0' TERM
for _ in $(seq 600); do sleep 0.05; done
exit 70
"""
ROUTER_LINE = "splitserve serve --config /etc/splitserve/cluster.yaml"


def _start_head(tmp_path: Path, **env: str) -> tuple[subprocess.Popen, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("ray", FAKE_RAY), ("splitserve", FAKE_SPLITSERVE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    full_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STATE": str(tmp_path), "HOME": str(tmp_path),
                "KUBERAY_GEN_RAY_START_CMD": "ray start --head --num-cpus=0 --block", "RAY_PORT": "6379", **env}
    process = subprocess.Popen(["bash", str(HEAD_SCRIPT), "--config", "/etc/splitserve/cluster.yaml"],
                               env={k: v for k, v in full_env.items() if v is not None},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, tmp_path / "log"


def _log(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _wait_for(log: Path, line: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in _log(log):
        assert time.monotonic() < deadline, f"{line!r} never logged: {_log(log)}"
        time.sleep(0.02)


def _finish(process: subprocess.Popen, state: Path) -> tuple[int, str]:
    """The script's exit status and output; on a timeout, it and its fakes are ended."""
    try:
        output, _ = process.communicate(timeout=15)
        return process.returncode, output
    finally:
        if process.poll() is None:
            process.kill()
        (state / "kill-ray").touch()


def test_head_script_sigterm_stops_the_router_then_ray(tmp_path):
    process, log = _start_head(tmp_path)
    _wait_for(log, ROUTER_LINE)
    process.send_signal(signal.SIGTERM)
    assert _finish(process, tmp_path)[0] == 0
    assert _log(log) == ["ray start --head --num-cpus=0 --block", ROUTER_LINE, "router-stopped", "ray-stopped"]


def test_head_script_exits_with_the_routers_status_and_stops_ray(tmp_path):
    process, log = _start_head(tmp_path, FAKE_ROUTER_EXIT="3")
    assert _finish(process, tmp_path)[0] == 3
    assert _log(log) == ["ray start --head --num-cpus=0 --block", ROUTER_LINE, "ray-stopped"]


def test_head_script_stops_the_router_when_ray_dies(tmp_path):
    process, log = _start_head(tmp_path)
    _wait_for(log, ROUTER_LINE)
    (tmp_path / "kill-ray").touch()
    assert _finish(process, tmp_path)[0] == 1
    assert _log(log) == ["ray start --head --num-cpus=0 --block", ROUTER_LINE, "ray-died", "router-stopped"]


def test_head_script_never_starts_the_router_without_a_gcs(tmp_path):
    process, log = _start_head(tmp_path, FAKE_RAY_FAIL="1")
    status, output = _finish(process, tmp_path)
    assert status == 1
    assert _log(log) == ["ray start --head --num-cpus=0 --block"]
    assert "the Ray head exited (status 5) before its GCS at 127.0.0.1:6379 answered" in output


def test_head_script_needs_kuberays_generated_command(tmp_path):
    process, log = _start_head(tmp_path, KUBERAY_GEN_RAY_START_CMD=None)
    status, output = _finish(process, tmp_path)
    assert (status, _log(log)) == (2, [])
    assert "KUBERAY_GEN_RAY_START_CMD is not set" in output


# ---- several routers: deploy/kuberay-several-routers (deploy/README.md, "Several routers") ---------

SEVERAL = REPO / "deploy" / "kuberay-several-routers"
ROUTER_ARGS = ["--config", "/etc/splitserve/cluster.yaml", "--set", "router.replicas=2", "--set",
               "router.resources.num_cpus=4", "--set", "router.resources.node_labels=ray.io/node-group=router"]


def _apply_json_patch(doc: dict, operations: list[dict]) -> None:
    """The add / replace / remove operations of a JSON patch (RFC 6902) that the overlay uses."""
    for operation in operations:
        *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if operation["op"] == "remove":
            del target[last]
        elif isinstance(target, list) and last == "-":
            target.append(copy.deepcopy(operation["value"]))
        else:
            target[int(last) if isinstance(target, list) else last] = copy.deepcopy(operation["value"])


def with_router_group(docs: dict, routers: int = 2, pods: int = 2, router_cpus: str = "4") -> None:
    """The overlay applied to the shipped manifests without kustomize: its RayCluster patch, with
    routers.yaml's replicas written as the head's --set router.replicas=`routers` and the router
    group's `pods`, its cpu as --set router.resources.num_cpus=`router_cpus` (one router per 4-CPU
    pod when they agree). test_several_routers_overlay_builds_what_the_tests_validate holds it to
    the kustomize build."""
    operations = yaml.safe_load((SEVERAL / "raycluster-patch.yaml").read_text(encoding="utf-8"))
    _apply_json_patch(docs["RayCluster"], operations)
    spec = docs["RayCluster"]["spec"]
    args = spec["headGroupSpec"]["template"]["spec"]["containers"][0]["args"]
    args[3], args[5] = f"router.replicas={routers}", f"router.resources.num_cpus={router_cpus}"
    spec["workerGroupSpecs"][-1]["replicas"] = pods


def _variant(manifests: list, change: Callable[[dict], None]) -> list:
    variant = [kv.Manifest(m.path, copy.deepcopy(m.doc)) for m in manifests]
    change(_docs(variant))
    return variant


def test_several_routers_on_a_router_group_behind_one_service_validate(manifests):
    variant = _variant(manifests, with_router_group)
    assert kv.validate(variant) == []
    docs = _docs(variant)
    head = docs["RayCluster"]["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["args"] == ROUTER_ARGS
    assert kv.serve_arguments(head["args"][2:]) == {
        "router.replicas": 2, "router.resources.num_cpus": 4,
        "router.resources.node_labels": "ray.io/node-group=router"}
    assert "replicas" not in yaml.safe_load(docs["ConfigMap"]["data"]["cluster.yaml"])["router"]
    # The Service and PodMonitor are the base's: they select the router pods in both layouts.
    selector = {"ray.io/cluster": "splitserve", "splitserve.io/component": "router"}
    assert (docs["Service"]["spec"]["selector"], docs["PodMonitor"]["spec"]["selector"]["matchLabels"]) == (
        selector, selector)
    group = docs["RayCluster"]["spec"]["workerGroupSpecs"][2]
    container = group["template"]["spec"]["containers"][0]
    assert (group["groupName"], group["replicas"], container["resources"]) == (
        "router", 2, {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"cpu": "4", "memory": "16Gi"}})
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 50051, "http": 8000, "router-metrics": 9400}


def test_cluster_config_value_agreeing_with_the_head_arguments_passes(manifests):
    variant = _variant(manifests, lambda d: (with_router_group(d), _config(d, "router:\n", "router:\n  replicas: 2\n")))
    assert kv.validate(variant) == []


ROUTER_GROUP_BROKEN: dict[str, tuple[Callable[[dict], None], list[str]]] = {
    "fewer router pods than routers": (
        lambda d: with_router_group(d, routers=3),
        [f"{RC}: cluster config: router: 3 routers need exactly 3 pods of worker group router (one router each), "
         "it has 2"]),
    "more router pods than routers": (
        lambda d: with_router_group(d, pods=3),
        [f"{RC}: cluster config: router: 2 routers need exactly 2 pods of worker group router (one router each), "
         "it has 3"]),
    "two routers on one pod": (
        lambda d: with_router_group(d, router_cpus="2"),
        [f"{RC}: cluster config: router: resources (2 CPU, 0 GPU) must fit exactly one router per router pod "
         "(4 CPU, 0 GPU): routers on one pod would share its ports"]),
    "no router group": (
        lambda d: (with_router_group(d), d["RayCluster"]["spec"]["workerGroupSpecs"].pop()),
        [f"{RC}: cluster config: router.replicas 2 needs a worker group named router (one router per pod; "
         "deploy/kuberay-several-routers builds it)"]),
    "several routers in the file, base manifests": (
        lambda d: _config(d, "router:\n", "router:\n  replicas: 2\n"),
        [f"{RC}: cluster config: router.replicas 2 needs a worker group named router (one router per pod; "
         "deploy/kuberay-several-routers builds it)"]),
    "file disagrees with the head's arguments": (
        lambda d: (with_router_group(d), _config(d, "router:\n", "router:\n  replicas: 3\n")),
        ["configmap.yaml: ConfigMap/splitserve-config: data.cluster.yaml: router.replicas: 3 here, but the head's "
         "`splitserve serve` arguments set router.replicas=2, which wins (the value the manifests use): remove it "
         "here or make the two agree"]),
    "one router with a router group": (
        lambda d: with_router_group(d, routers=1, pods=1),
        [f"{RC}: cluster config: router.replicas is 1, so the router runs in the head's `splitserve serve`, but "
         "worker group router has 1 pods that would never serve: use router.replicas >= 2 "
         "(deploy/kuberay-several-routers/routers.yaml), or the base deploy/kuberay for one router"]),
    "a head argument splitserve serve refuses": (
        lambda d: (with_router_group(d), _head(d)["args"].__setitem__(3, "router.replicas")),
        [f"{RC}: spec.headGroupSpec: the head container's args "
         f"{[*ROUTER_ARGS[:3], 'router.replicas', *ROUTER_ARGS[4:]]}: --set 'router.replicas': expected KEY=VALUE"]),
    "an invalid router count": (
        lambda d: with_router_group(d, routers=0),
        [f"{RC}: spec.headGroupSpec: the head container's args "
         f"{[*ROUTER_ARGS[:3], 'router.replicas=0', *ROUTER_ARGS[4:]]}: router.replicas: must be >= 1, got 0"]),
    "Service still on the head": (
        lambda d: (with_router_group(d), d["Service"]["spec"].update(
            selector={"ray.io/cluster": "splitserve", "ray.io/node-type": "head"})),
        ["service.yaml: Service/splitserve: spec.selector: {'ray.io/cluster': 'splitserve', 'ray.io/node-type': "
         "'head'} does not select the router group pod (labels {'app.kubernetes.io/name': 'splitserve', "
         "'splitserve.io/component': 'router', 'splitserve.io/model': 'model', 'ray.io/cluster': 'splitserve', "
         "'ray.io/is-ray-node': 'yes', 'ray.io/node-type': 'worker', 'ray.io/group': 'router'})"]),
}


@pytest.mark.parametrize("case", ROUTER_GROUP_BROKEN)
def test_validator_rejects_a_broken_router_group(manifests, case):
    mutate, expected = ROUTER_GROUP_BROKEN[case]
    assert kv.validate(_variant(manifests, mutate)) == expected


def _without_build_changes(cluster: dict) -> dict:
    """A built RayCluster as its files read: no namespace, the image placeholder in every pod."""
    cluster = copy.deepcopy(cluster)
    cluster["metadata"].pop("namespace")
    for _, template in kv.pod_templates(cluster):
        template["spec"]["containers"][0]["image"] = "splitserve"
    return cluster


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_several_routers_overlay_builds_what_the_tests_validate(manifests, monkeypatch, capsys):
    done = subprocess.run(["kubectl", "kustomize", str(SEVERAL)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    built = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert "RouterValues" not in {doc["kind"] for doc in built}
    variant = _docs(_variant(manifests, with_router_group))
    assert _without_build_changes(next(d for d in built if d["kind"] == "RayCluster")) == variant["RayCluster"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(done.stdout))
    assert kv.main(["-"]) == 0
    assert capsys.readouterr().err == (
        "0 problem(s) in 6 object(s): Namespace/splitserve, ConfigMap/splitserve-config, Service/splitserve, "
        "PodMonitor/splitserve, PrometheusRule/splitserve, RayCluster/splitserve\n")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_changing_routers_yaml_resizes_the_router_group_and_the_routers(tmp_path):
    for name in ("kuberay", "kuberay-several-routers"):
        shutil.copytree(REPO / "deploy" / name, tmp_path / name, ignore=shutil.ignore_patterns("crds"))
    values_path = tmp_path / "kuberay-several-routers" / "routers.yaml"
    values = yaml.safe_load(values_path.read_text(encoding="utf-8"))
    assert values["spec"] == {"replicas": 2, "cpu": "4", "memory": "16Gi", "shm": "4Gi"}
    values["spec"].update(replicas=3, cpu="6", memory="24Gi", shm="2Gi")
    values_path.write_text(yaml.safe_dump(values))
    built = _kustomize(tmp_path / "kuberay-several-routers")
    cluster = next(d for d in built if d["kind"] == "RayCluster")
    head, workers = kv.ray_pods(kv.Manifest(values_path, cluster))
    pod, replicas = workers["router"]
    shm = next(v for v in pod.spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
    assert (replicas, pod.container["resources"], shm) == (
        3, {"requests": {"cpu": "6", "memory": "24Gi"}, "limits": {"cpu": "6", "memory": "24Gi"}}, "2Gi")
    assert head.container["args"] == [*ROUTER_ARGS[:3], "router.replicas=3", "--set", "router.resources.num_cpus=6",
                                      *ROUTER_ARGS[6:]]
    assert (pod.labels["splitserve.io/model"], pod.container["image"]) == (
        "model", "registry.example.com/splitserve:0.1.0")
    assert kv.validate([kv.Manifest(kv.STDIN, doc) for doc in built]) == []
